/// @file
/// A file descriptor that closes itself, and deadlines for poll(): the small POSIX helpers dtrain's
/// socket layer is built on, public for programs around dtrain such as the launcher (dtrain-run).
/// Implemented in dtrain_comm_base.
///
/// \code
///   dtrain::comm::net::Fd out(::open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0644));  // closed with `out`
///   if (!out.valid()) throw dtrain::IoError(fmt::format("cannot open {}", path));
///   auto deadline = dtrain::comm::net::deadlineAfter(std::chrono::seconds(10));
///   pollfd p{child_status.get(), POLLIN, 0};                     // child_status: another Fd
///   int n = ::poll(&p, 1, dtrain::comm::net::msUntil(deadline));  // 0: the deadline passed
/// \endcode
#pragma once
#include <chrono>

/// Small POSIX helpers of the socket layer: a file descriptor that closes itself, and poll() deadlines.
namespace dtrain::comm::net {

/// The clock of deadlines: steady, unaffected by changes of the wall clock.
using Clock = std::chrono::steady_clock;
/// A point in time after which a wait gives up.
using Deadline = Clock::time_point;

/// Now plus d (now when d <= 0). Saturates at Deadline::max(): a huge timeout (e.g.
/// milliseconds::max() for "no limit") must not overflow into a deadline in the past.
inline Deadline deadlineAfter(std::chrono::milliseconds d) {
  const Deadline now = Clock::now();
  if (d.count() <= 0) return now;
  if (d >= std::chrono::duration_cast<std::chrono::milliseconds>(Deadline::max() - now)) return Deadline::max();
  return now + d;
}
/// Milliseconds left until the deadline, rounded up (poll() must not return before the deadline),
/// clamped to [0, INT_MAX] for poll().
int msUntil(Deadline d);

/// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  /// No descriptor (get() is -1).
  Fd() = default;
  /// Takes ownership of fd (a negative fd: none).
  explicit Fd(int fd) : fd_(fd) {}
  /// Closes the descriptor, if any.
  ~Fd() { reset(); }
  /// Takes o's descriptor; o is left without one.
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  /// Closes this descriptor and takes o's; o is left without one.
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  /// The descriptor, or -1.
  int get() const { return fd_; }
  /// True when there is a descriptor.
  bool valid() const { return fd_ >= 0; }
  /// Gives up ownership: returns the descriptor (or -1) without closing it.
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  /// Closes the descriptor, if any; get() is -1 afterwards.
  void reset();

 private:
  int fd_ = -1;
};

}  // namespace dtrain::comm::net
