/// @file
/// Work: the handle of one asynchronous operation of a ProcessGroup, and chains of dependent ones.
///
/// \code
///   auto w = pg->allreduce(buf, n, DType::f32);
///   w->wait();                                   // rethrows the op's error, if any
///
///   // Two dependent steps without blocking this thread: scale once the sum of norms is known.
///   auto chain = pg->allreduce(&norm, 1, DType::f32)->then([&] {
///     scale(buf, n, 1 / norm);                   // runs on the thread that completed the allreduce
///     return other_pg->allreduce(buf, n, DType::f32);   // the next step's Work (or nullptr: done)
///   });
///   chain->wait();                               // both steps done; an error names the op that failed
/// \endcode
#pragma once
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dtrain::comm {

class Work;
/// A shared handle to a Work: ops return one, and the caller and the group that runs the op share it.
using WorkPtr = std::shared_ptr<Work>;
class WorkExecutor;  // internal (src/comm/group/work_executor.h): lets a waiting thread run queued ops

/// The handle of one asynchronous operation of a ProcessGroup (or of a chain of dependent ones).
class Work {
 public:
  /// Made by the group that runs the op: `what` describes it, `deadline` bounds wait(), `rank` prefixes errors.
  Work(std::string what, std::chrono::steady_clock::time_point deadline, int rank,
       std::weak_ptr<WorkExecutor> executor = {});

  /// Blocks until the op completes and rethrows its error, if any. Bounded: the op has its own deadline;
  /// should it still be running shortly after that, this throws TimeoutError naming the op.
  void wait();
  /// As wait(), but gives up after `timeout` with a TimeoutError (the op keeps running).
  void wait(std::chrono::milliseconds timeout);
  /// True once the op has completed, successfully or not; does not block.
  bool isCompleted() const;
  /// When the op completed (steady clock); meaningful once isCompleted().
  std::chrono::steady_clock::time_point finishedAt() const;
  /// The op as errors and logs name it: "allreduce seq=41 f32 x 6291456".
  const std::string& describe() const { return what_; }

  /// How then() hands `next` to another thread: post(task) is called on the completing thread instead
  /// and must run task exactly once, on any thread.
  using Post = std::function<void(std::function<void()> task)>;
  /// A dependent step. Once this op has completed, `next` runs (unless this op failed); it may issue
  /// ops and returns the Work of the next step, or nullptr when there is none. The returned Work
  /// completes when that step does, with the first error of the chain: this op's, the exception `next`
  /// threw (a dtrain::Error as it is, anything else as an Error naming this op), or the next step's.
  /// Chains nest: `next` may return a Work made by then().
  ///
  /// Where `next` runs: by default on the thread that completes this op, which is the group's own
  /// thread (or a thread inside wait() running queued ops). It must then be short and must never wait
  /// for an op of that group (the group's thread is busy running `next`: the wait would time out).
  /// Issuing ops is fine, but ProcessGroup calls from several threads need the caller's ordering (every
  /// rank must issue the same collectives in the same order), so pass `post` to run `next` elsewhere:
  /// post(task) is called instead, on the completing thread, and must run task exactly once, on any
  /// thread. DistributedDataParallel's hooks (GradBucket::then) post to a thread that keeps the order.
  WorkPtr then(std::function<WorkPtr()> next, Post post = {});

  /// Calls fn once the op completed: at once (on this thread) if it has, else on the thread that
  /// completes it, with the same rules as then()'s `next` without `post`: short, never waiting, and
  /// never throwing.
  void onComplete(std::function<void()> fn);

  /// Used by the group that runs the op.
  void finish(std::exception_ptr error = nullptr);

 private:
  void waitUntil(const std::function<std::chrono::steady_clock::time_point()>& until, const std::string& why);
  // A chain's deadline moves with its steps (see then()).
  void extendDeadline(std::chrono::steady_clock::time_point to);
  std::chrono::steady_clock::time_point currentDeadline() const;
  static void runStep(const WorkPtr& chain, const std::string& after, std::exception_ptr error,
                      const std::function<WorkPtr()>& next);
  std::string what_;
  std::chrono::steady_clock::time_point deadline_;
  int rank_;
  std::weak_ptr<WorkExecutor> executor_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::chrono::steady_clock::time_point finished_at_;
  std::exception_ptr error_;
  std::vector<std::function<void()>> on_complete_;
};

/// A scope whose ops start at once on the group's thread, for code that issues ops and goes on.
///
/// A thread that issues an op and then waits for it runs it itself (Work::wait), which is faster than
/// handing it to the group's thread; so the group's thread leaves an op to the thread that issued it for
/// about 100 us before it runs the op itself. Code that issues ops and goes on with other work (DDP's
/// bucket launches during backward, a comm hook's continuations) says so with this guard, and its ops
/// start at once:
///
/// \code
///   { comm::IssueAndMoveOn guard; work = pg.allreduce(buf, n, DType::f32); }   // runs while we compute
/// \endcode
class IssueAndMoveOn {
 public:
  /// Ops this thread issues until the guard's end start at once.
  IssueAndMoveOn();
  /// Back to the enclosing setting (guards nest).
  ~IssueAndMoveOn();
  IssueAndMoveOn(const IssueAndMoveOn&) = delete;
  IssueAndMoveOn& operator=(const IssueAndMoveOn&) = delete;

 private:
  bool outer_;
};

}  // namespace dtrain::comm
