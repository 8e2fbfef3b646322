// The timeline's event buffers (internal to src/comm/trace/timeline*.cc).
//
// Each thread appends raw events (no formatting, no lock) to its own list of chunks; a chunk is
// published event by event through an atomic count, so the writer thread (timeline_writer.cc) reads
// and spools what is there at any time, without stopping the thread that records. Strings that do not
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

// The constant part of an op: what a loop of one collective repeats (group, op, dtype, count, peers).
// A recording thread stores it once per chunk for a run of alike ops, in the chunk's arena.
struct OpShape {
  const GroupInfo* key = nullptr;  // the group it was recorded from: identity for matching only
  int32_t rank = 0;                // the recording rank in the group (matching only)
  int32_t root = -1;
  int64_t group_size = 1;
  const char* group = "";          // in the arena
  const char* op = "";
  const char* dtype = "";
  const char* algorithm = "";
  uint64_t count = 0, bytes = 0;
  int32_t npeers = 0;              // entries at `peers`
  const int* peers = nullptr;      // global ranks, in the arena
};

// One event: 120 bytes (a span's name, args and flow id, or an op's shape and what changes per op).
// The recording thread sets only the fields its kind uses; nothing is cleared first.
struct Event {
  enum Kind : uint8_t { kSpan, kAsync, kOp, kFlowOut, kFlowIn };
  struct SpanPart {
    int64_t index;  // >= 0: appended to the name ("bucket " 3)
    uint64_t id;    // async slices and flows
    Arg args[4];
  };
  struct OpPart {
    const OpShape* shape;
    const char* text;  // the error message (failed), in the arena
    uint64_t seq;
    int64_t queued_us;
  };
  Kind kind = kSpan;
  bool failed = false;   // op: it ended with an error (`o.text` holds it)
  int64_t ts = 0;        // trace clock (nowUs), before the skew test hook
  int64_t dur = 0;
  const char* name = "";  // a literal, or text in the chunk's arena
  const char* cat = "";
  union {
    SpanPart s;
    OpPart o;
  };
};

struct Chunk {
  static constexpr uint32_t kEvents = 512;
  static constexpr uint32_t kArena = 16384;
  std::atomic<uint32_t> published{0};  // events[0, published) are complete (release by the owner)
  std::atomic<Chunk*> next{nullptr};   // set by the owner once it writes no more here
  uint32_t arena_used = 0;             // owner only
  const OpShape* shape = nullptr;      // owner only: the last op shape stored here
  Event events[kEvents];
  alignas(8) char arena[kArena];
};

// One recording thread's chunks: the owner appends at `tail`, the writer reads from `head`.
struct ThreadBuffer {
  uint64_t thread = 0;          // threadNumber(): the tid of its events
  Chunk* head = nullptr;        // writer only
  uint32_t read = 0;            // writer only: events of head already formatted
  Chunk* tail = nullptr;        // owner only
  uint32_t filled = 0;          // owner only: chunks filled, to nudge the writer every kNudgeChunks
  std::atomic<bool> exited{false};  // the thread ended: the writer frees this once drained
  // Drained chunks the writer hands back for reuse (a fresh chunk is some 77 KB: allocating and
  // freeing one per 512 events costs page faults and allocator work on the recording thread).
  std::mutex spare_mu;
  std::vector<Chunk*> spare;

  ~ThreadBuffer() {
    for (Chunk* c : spare) delete c;
  }
  // A drained chunk back to the owner (the writer); freed when enough are kept.
  void recycle(Chunk* c);

  // The next event to fill (on the owner's thread), with room for `arena` bytes of copies (a fresh
  // chunk's whole arena when it moves on); publish() makes it visible.
  Event& next(uint32_t arena);
  void publish();
  // A copy of n bytes (plus a NUL for text) in the current chunk's arena: reserve first with next().
  const char* copy(const char* s, size_t n);
  const int* copy(const int* v, size_t n);
};

// A recording thread that filled this many chunks since it last did wakes the writer before its period
// ends (nudgeWriter()), so that a busy thread's chunks are formatted and reused while still in cache: the
// period alone let a tight loop put some 30 MB in flight.
constexpr uint32_t kNudgeChunks = 32;
void nudgeWriter();

// Makes the chunks the recording threads take first (openFile()).
void prepareChunks();

// The calling thread's buffer (registered with the writer on first use).
ThreadBuffer& threadBuffer();

// Opens DIR/trace-rank<R>.json and its spool (throws naming one on failure) and starts the writer thread; the header
// carries `other` (otherData's members, JSON text without braces).
void openFile(const std::string& path, int rank, int64_t skew_us, const std::string& other);
// Every registered buffer, for the writer (under the registry's lock).
std::mutex& registryMutex();
std::vector<ThreadBuffer*>& registry();
// Thread names to write (under the registry's lock).
std::vector<std::pair<uint64_t, std::string>>& pendingNames();
// Appends one event as JSON, preceded by "\n," (timeline_format.cc; run on the spool's events).
void format(std::string& out, const Event& e, int pid, uint64_t tid, int64_t skew_us);
// Before format() is given events of other shapes (a new conversion's): it must not trust a pointer it saw.
void forgetShapes();

}  // namespace dtrain::comm::trace::timeline
