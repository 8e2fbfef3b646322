// Work handles (see work.h).
#include "dtrain/comm/work.h"

#include "dtrain/comm/error.h"

namespace dtrain::comm {

namespace {
// How long past an op's own deadline wait() keeps waiting before it reports the op as stuck.
constexpr auto kWaitGrace = std::chrono::seconds(10);
}  // namespace

void Work::wait() {
  waitUntil(deadline_ + kWaitGrace, "is still running well past its deadline (the group's thread is stuck)");
}

void Work::wait(std::chrono::milliseconds timeout) {
  waitUntil(std::chrono::steady_clock::now() + timeout,
            fmt::format("did not complete within Work::wait's {}ms (it keeps running)", timeout.count()));
}

void Work::waitUntil(std::chrono::steady_clock::time_point until, const std::string& why) {
  if (auto ex = executor_.lock()) ex->help(*this);
  std::unique_lock<std::mutex> lk(mu_);
  if (!cv_.wait_until(lk, until, [&] { return done_; })) {
    throw TimeoutError(fmt::format("[rank {}] {} {}", rank_, what_, why));
  }
  if (error_) std::rethrow_exception(error_);
}

bool Work::isCompleted() const {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}

std::chrono::steady_clock::time_point Work::finishedAt() const {
  std::lock_guard<std::mutex> g(mu_);
  return finished_at_;
}

void Work::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> g(mu_);
    done_ = true;
    finished_at_ = std::chrono::steady_clock::now();
    error_ = std::move(error);
  }
  cv_.notify_all();
}

}  // namespace dtrain::comm
