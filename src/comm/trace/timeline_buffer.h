// The timeline's event buffers (internal to src/comm/trace/timeline*.cc).
//
// Each thread appends raw events (no formatting, no lock) to its own list of chunks; a chunk is
// published event by event through an atomic count, so the writer thread (timeline_writer.cc) reads
// and formats what is there at any time, without stopping the thread that records. Strings that do not
// outlive the call (group names, run-time span names, error messages) and peer lists are copied into
// the chunk's arena. A full chunk is followed by a new one; the writer frees a chunk once it has read
// it and its owner moved on.
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/trace/trace_internal.h"

namespace dtrain::comm::trace::timeline {

struct Event {
  enum Kind : uint8_t { kSpan, kAsync, kOp, kFlowOut, kFlowIn };
  Kind kind = kSpan;
  bool failed = false;         // op: it ended with an error (`text` holds it)
  int32_t npeers = 0;          // op: entries at `peers`
  int32_t root = -1;           // op
  int64_t ts = 0;              // trace clock (nowUs), before the skew test hook
  int64_t dur = 0;
  int64_t index = -1;          // >= 0: appended to the name ("bucket " 3)
  const char* name = "";       // a literal, or text in the chunk's arena
  const char* cat = "";
  uint64_t id = 0;             // flows: the message's id
  // Ops.
  const char* op_dtype = "";
  const char* algorithm = "";
  const char* group = "";      // in the arena
  const char* text = nullptr;  // the error message, in the arena
  const int* peers = nullptr;  // global ranks, in the arena
  uint64_t seq = OpRecord::kNoSeq;
  uint64_t count = 0, bytes = 0;
  int64_t queued_us = 0;
  Arg args[4];
};

struct Chunk {
  static constexpr uint32_t kEvents = 512;
  static constexpr uint32_t kArena = 16384;
  std::atomic<uint32_t> published{0};  // events[0, published) are complete (release by the owner)
  std::atomic<Chunk*> next{nullptr};   // set by the owner once it writes no more here
  uint32_t arena_used = 0;             // owner only
  Event events[kEvents];
  alignas(8) char arena[kArena];
};

// One recording thread's chunks: the owner appends at `tail`, the writer reads from `head`.
struct ThreadBuffer {
  uint64_t thread = 0;          // threadNumber(): the tid of its events
  Chunk* head = nullptr;        // writer only
  uint32_t read = 0;            // writer only: events of head already formatted
  Chunk* tail = nullptr;        // owner only
  std::atomic<bool> exited{false};  // the thread ended: the writer frees this once drained
  // Drained chunks the writer hands back for reuse (a fresh chunk is some 130 KB: allocating and
  // freeing one per 512 events costs page faults and allocator work on the recording thread).
  std::mutex spare_mu;
  std::vector<Chunk*> spare;

  ~ThreadBuffer() {
    for (Chunk* c : spare) delete c;
  }
  // A drained chunk back to the owner (the writer); freed when enough are kept.
  void recycle(Chunk* c);

  // The next event to fill (on the owner's thread), with room for `arena` bytes of copies; publish()
  // makes it visible.
  Event& next(uint32_t arena);
  void publish();
  // A copy of n bytes (plus a NUL for text) in the current chunk's arena: reserve first with next().
  const char* copy(const char* s, size_t n);
  const int* copy(const int* v, size_t n);
};

// The calling thread's buffer (registered with the writer on first use).
ThreadBuffer& threadBuffer();

// Opens DIR/trace-rank<R>.json (throws naming it on failure) and starts the writer thread; the header
// carries `other` (otherData's members, JSON text without braces).
void openFile(const std::string& path, int rank, int64_t skew_us, const std::string& other);
// Every registered buffer, for the writer (under the registry's lock).
std::mutex& registryMutex();
std::vector<ThreadBuffer*>& registry();
// Thread names to write (under the registry's lock).
std::vector<std::pair<uint64_t, std::string>>& pendingNames();
// Appends one event as JSON, preceded by "\n," (timeline_format.cc).
void format(std::string& out, const Event& e, int pid, uint64_t tid, int64_t skew_us);

}  // namespace dtrain::comm::trace::timeline
