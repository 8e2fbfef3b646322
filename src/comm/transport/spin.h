// Busy-waiting before sleeping, shared by the transports' waits (shm: before the doorbell futex; tcp:
// before poll()). A waiter that sleeps pays a wake-up (a futex wake or a socket's readiness, then the
// scheduler) of tens of microseconds, sometimes far more on a VM, where the peer's answer often comes a
// few microseconds later; spinning for a bounded time first catches those answers. The budget is time,
// not iterations, so it means the same on every CPU; it pauses between checks and yields the core now
// and then, so a peer that shares this core (another job, or more ranks than cores) still gets to run.
// The transports spin only when their ranks on this host do not outnumber its usable cores.
#pragma once
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DTRAIN_CPU_RELAX() _mm_pause()
#else
#define DTRAIN_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace dtrain::comm::transport {

// Cores this process may run on (its affinity mask, which taskset and cgroups narrow), not the
// machine's count.
inline int usableCores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// How long a waiter spins before sleeping when nothing sets it (GroupOptions::spin_us, DTRAIN_SPIN_US):
// shm 4 KiB allreduce at world 2 on the 2-core VM (docs/PERFORMANCE.md, "Closer to the machine's limit").
inline constexpr int kDefaultSpinUs = 100;

// How a transport's waits spin: for `budget`, yielding the core when (tries & yield_mask) == 0. 1023
// yields every 1024th try (tens of microseconds); 0 yields on every try, for ranks that share cores,
// where the peer waited for may be the one that needs this core. A yield that lets another task run
// preempts this one: yielding every 64th try cost a 4 KiB allreduce loop at world 2 over a thousand
// involuntary switches a second.
struct SpinPolicy {
  std::chrono::microseconds budget{0};
  unsigned yield_mask = 1023;
};

// The policy of a transport: `asked` (>= 0) when set, else the default; when this host's ranks
// outnumber its cores, no spinning by default (a spinning rank takes the core its peer needs) and, when
// asked for, a yield on every try.
inline SpinPolicy spinBudget(int asked, bool oversubscribed) {
  if (oversubscribed) return {std::chrono::microseconds(asked >= 0 ? asked : 0), 0u};
  return {std::chrono::microseconds(asked >= 0 ? asked : kDefaultSpinUs), 1023u};
}

// One idle period's spinning: reset() when progress was made, then spin() while nothing moves; spin()
// pauses once and says whether the budget allows another try (false: sleep now).
class SpinWait {
 public:
  explicit SpinWait(const SpinPolicy& policy) : policy_(policy) {}
  void reset() {
    tries_ = 0;
    spent_ = false;
  }
  bool spin() {
    if (spent_ || policy_.budget.count() <= 0) return false;
    if (tries_ == 0) start_ = std::chrono::steady_clock::now();
    ++tries_;
    if ((tries_ & policy_.yield_mask) == 0) {
      sched_yield();
    } else {
      DTRAIN_CPU_RELAX();
    }
    // The clock (vDSO, ~20 ns) every 8 tries: a pause is 10-140 cycles depending on the CPU.
    if ((tries_ & 7) == 0 && std::chrono::steady_clock::now() - start_ >= policy_.budget) spent_ = true;
    return !spent_;
  }

 private:
  SpinPolicy policy_;
  std::chrono::steady_clock::time_point start_{};
  unsigned tries_ = 0;
  bool spent_ = false;
};

}  // namespace dtrain::comm::transport
