// The shared-memory segment of the shm transport: its layout (per-rank slots with doorbell, abort
// record and published call; per-pair ring control; staging progress counters) and the futex and
// spinning primitives its waits use. Only shm/transport.cc includes it.
#pragma once
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>

#include "comm/transport/spin.h"
#include "comm/transport/transport.h"

namespace dtrain::comm::transport::shm {


constexpr uint64_t kSegMagic = 0x4D48535F4E525444ull;  // "DTRN_SHM"
constexpr size_t kPiece = 64u << 10;                    // publish progress at least this often
constexpr size_t kMinRing = 4096;
constexpr size_t kChunkSmall = 256u << 10;
constexpr size_t kChunkLarge = 1u << 20;
constexpr auto kSleepSlice = std::chrono::milliseconds(50);

// A rank's published call: stamp is the number of collectives it has begun on this group (written last,
// seq_cst), so a reader that sees the stamp it expects sees the fingerprint too. Two entries
// (stamp parity): a rank cannot begin collective s + 2 before every rank has begun s + 1, which each
// does only after reading everyone's entry for s, so an entry is never overwritten while still needed.
struct FpEntry {
  std::atomic<uint64_t> stamp;
  uint32_t seq;
  Fingerprint fp;
};

struct alignas(64) RankSlot {
  std::atomic<uint32_t> doorbell;
  std::atomic<uint32_t> sleepers;
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> aborted;
  std::atomic<int32_t> cores;  // usable cores of this rank, so that every rank makes the same choices
  std::atomic<uint32_t> awaiting_calls;  // 1 while this rank waits for others to publish their call
  std::atomic<uint32_t> closed;  // 1 once this rank destroyed its group: it will not ring again
  FpEntry fps[2];
  uint32_t abort_kind;
  char abort_msg[kMaxAbortMessage + 1];
};

struct alignas(64) RingCtl {
  alignas(64) std::atomic<uint64_t> head;  // bytes written by the producer
  alignas(64) std::atomic<uint64_t> tail;  // bytes consumed by the consumer
};

// A progress counter of the staging area (Staging::Counter), one per rank and kind: absolute chunk
// numbers, so it only grows.
struct alignas(64) ProgressWord {
  std::atomic<uint64_t> v;
};
constexpr uint64_t kSlots = 4;  // staging slots: chunks in flight in a staged algorithm

struct SegHeader {
  uint64_t magic;
  uint64_t size;
  uint64_t ring_bytes;
  uint64_t total_bytes;
};

inline size_t roundUp(size_t v, size_t a) { return (v + a - 1) / a * a; }
inline size_t pow2Floor(size_t v) {
  size_t p = 1;
  while (p * 2 <= v) p *= 2;
  return p;
}

inline long futexWait(std::atomic<uint32_t>* addr, uint32_t expected, std::chrono::milliseconds d) {
  timespec ts{static_cast<time_t>(d.count() / 1000), static_cast<long>((d.count() % 1000) * 1000000)};
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
inline void futexWakeAll(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace dtrain::comm::transport::shm
