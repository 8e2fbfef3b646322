// Work handles and their chains (see work.h).
#include "dtrain/comm/work.h"

#include <algorithm>

#include "comm/group/work_executor.h"
#include "comm/trace/flight_recorder.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm {

namespace {
using Clock = std::chrono::steady_clock;
// How long past an op's own deadline wait() keeps waiting before it reports the op as stuck.
constexpr auto kWaitGrace = std::chrono::seconds(10);
}  // namespace

Work::Work(std::string what, Clock::time_point deadline, int rank, std::weak_ptr<WorkExecutor> executor)
    : what_(std::move(what)),
      deadline_(deadline),
      rank_(rank),
      executor_(std::move(executor)) {}

namespace {
thread_local bool t_move_on = false;  // an IssueAndMoveOn guard lives on this thread
}  // namespace

IssueAndMoveOn::IssueAndMoveOn() : outer_(t_move_on) { t_move_on = true; }
IssueAndMoveOn::~IssueAndMoveOn() { t_move_on = outer_; }
bool issuingAndMovingOn() { return t_move_on; }

void Work::wait() {
  try {
    // Re-read on every wake-up: a chain's deadline moves on when its next step is issued.
    waitUntil([this] { return deadline_ + kWaitGrace; },
              "is still running well past its deadline (the group's thread is stuck)");
  } catch (const TimeoutError& e) {
    // A stuck group's thread never reaches the op's own failure dump: dump here (once per process).
    if (!isCompleted()) trace::flight::dumpOnFailure(e.what());
    throw;
  }
}

void Work::wait(std::chrono::milliseconds timeout) {
  const auto until = Clock::now() + timeout;
  waitUntil([until] { return until; },
            fmt::format("did not complete within Work::wait's {}ms (it keeps running)", timeout.count()));
}

void Work::waitUntil(const std::function<Clock::time_point()>& until, const std::string& why) {
  if (auto ex = executor_.lock()) ex->help(*this);
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    const auto limit = until();
    if (cv_.wait_until(lk, limit, [&] { return done_ || until() != limit; })) {
      if (done_) break;
      continue;  // the limit moved
    }
    throw TimeoutError(fmt::format("[rank {}] {} {}", rank_, what_, why));
  }
  if (error_) std::rethrow_exception(error_);
}

bool Work::isCompleted() const {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}

Clock::time_point Work::finishedAt() const {
  std::lock_guard<std::mutex> g(mu_);
  return finished_at_;
}

void Work::finish(std::exception_ptr error) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard<std::mutex> g(mu_);
    // The first result wins: a second finish (a watchdog and a failing issuer racing for one op) must not
    // turn a failure into success, nor run the callbacks twice.
    if (done_) return;
    done_ = true;
    finished_at_ = Clock::now();
    error_ = std::move(error);
    callbacks.swap(on_complete_);
  }
  cv_.notify_all();
  // Outside the lock: a callback may start the next step of a chain, or complete another Work.
  for (auto& fn : callbacks) fn();
}

void Work::onComplete(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!done_) {
      on_complete_.push_back(std::move(fn));
      return;
    }
  }
  fn();
}

Clock::time_point Work::currentDeadline() const {
  std::lock_guard<std::mutex> g(mu_);
  return deadline_;
}

void Work::extendDeadline(Clock::time_point to) {
  std::lock_guard<std::mutex> g(mu_);
  deadline_ = std::max(deadline_, to);
}

WorkPtr Work::then(std::function<WorkPtr()> next, Post post) {
  const auto deadline = currentDeadline();
  auto chain = std::make_shared<Work>(what_ + " -> then", deadline, rank_, executor_);
  // then() usually follows the op's issue at once, so this is about the op's timeout.
  const auto timeout = std::max(Clock::duration::zero(), deadline - Clock::now());
  onComplete([this, chain, timeout, next = std::move(next), post = std::move(post)] {
    // This Work is complete (error_ no longer changes); the task may run after it is gone.
    std::exception_ptr error = error_;
    // The step may wait in `post`'s queue: give it that much time from now.
    chain->extendDeadline(Clock::now() + timeout);
    auto task = [chain, after = what_, error, next] { runStep(chain, after, error, next); };
    if (post) {
      post(std::move(task));
    } else {
      task();
    }
  });
  return chain;
}

void Work::runStep(const WorkPtr& chain, const std::string& after, std::exception_ptr error,
                   const std::function<WorkPtr()>& next) {
  if (error) {
    chain->finish(error);  // the failed op's error names it; later steps never run
    return;
  }
  WorkPtr step;
  try {
    step = next();
  } catch (const Error&) {
    chain->finish(std::current_exception());
    return;
  } catch (const std::exception& e) {
    chain->finish(std::make_exception_ptr(
        Error(fmt::format("[rank {}] the continuation after {} failed: {}", chain->rank_, after, e.what()))));
    return;
  } catch (...) {
    chain->finish(std::make_exception_ptr(
        Error(fmt::format("[rank {}] the continuation after {} failed (not a std::exception)", chain->rank_, after))));
    return;
  }
  if (!step) {
    chain->finish();
    return;
  }
  chain->extendDeadline(step->currentDeadline());
  Work* s = step.get();  // alive while its callbacks run
  step->onComplete([chain, s] { chain->finish(s->error_); });
}

}  // namespace dtrain::comm
