// A file descriptor that closes itself, and deadlines for poll(): the small POSIX helpers dtrain's
// socket layer is built on, public for programs around dtrain such as the launcher (dtrain-run).
// Implemented in dtrain_comm_base.
//
// \code
//   dtrain::comm::net::Fd out(::open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644));  // closed with `out`
//   if (!out.valid()) throw dtrain::IoError(fmt::format("cannot open {}", path));
//   auto deadline = dtrain::comm::net::deadlineAfter(std::chrono::seconds(10));
//   pollfd p{child_status.get(), POLLIN, 0};                     // child_status: another Fd
//   int n = ::poll(&p, 1, dtrain::comm::net::msUntil(deadline));  // 0: the deadline passed
// \endcode
#pragma once
#include <chrono>

namespace dtrain::comm::net {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// Saturates at Deadline::max(): a huge timeout (e.g. milliseconds::max() for "no limit") must not
// overflow into a deadline in the past.
inline Deadline deadlineAfter(std::chrono::milliseconds d) {
  const Deadline now = Clock::now();
  if (d.count() <= 0) return now;
  if (d >= std::chrono::duration_cast<std::chrono::milliseconds>(Deadline::max() - now)) return Deadline::max();
  return now + d;
}
// Milliseconds left until the deadline, rounded up (poll() must not return before the deadline),
// clamped to [0, INT_MAX] for poll().
int msUntil(Deadline d);

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset();

 private:
  int fd_ = -1;
};

}  // namespace dtrain::comm::net
