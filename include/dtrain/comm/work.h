// Work: the handle of one asynchronous operation of a ProcessGroup.
#pragma once
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>

namespace dtrain::comm {

class Work;

// Whoever runs a Work's op may let a thread that waits for it run queued ops itself (saving two
// thread hand-offs per op, which dominate small-message latency). Internal to dtrain::comm.
class WorkExecutor {
 public:
  virtual ~WorkExecutor() = default;
  // Runs queued ops on the calling thread, in order, while `w` is incomplete and nobody else is
  // running one. Returns when w is complete or another thread is busy.
  virtual void help(const Work& w) = 0;
};

class Work {
 public:
  Work(std::string what, std::chrono::steady_clock::time_point deadline, int rank,
       std::weak_ptr<WorkExecutor> executor = {})
      : what_(std::move(what)), deadline_(deadline), rank_(rank), executor_(std::move(executor)) {}

  // Blocks until the op completes and rethrows its error, if any. Bounded: the op has its own deadline;
  // should it still be running shortly after that, this throws TimeoutError naming the op.
  void wait();
  // As wait(), but gives up after `timeout` with a TimeoutError (the op keeps running).
  void wait(std::chrono::milliseconds timeout);
  bool isCompleted() const;
  // When the op completed (steady clock); meaningful once isCompleted().
  std::chrono::steady_clock::time_point finishedAt() const;
  // "allreduce seq=41 f32 x 6291456"
  const std::string& describe() const { return what_; }

  // Used by the group that runs the op.
  void finish(std::exception_ptr error = nullptr);

 private:
  void waitUntil(std::chrono::steady_clock::time_point until, const std::string& why);
  std::string what_;
  std::chrono::steady_clock::time_point deadline_;
  int rank_;
  std::weak_ptr<WorkExecutor> executor_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::chrono::steady_clock::time_point finished_at_;
  std::exception_ptr error_;
};

using WorkPtr = std::shared_ptr<Work>;

}  // namespace dtrain::comm
