// The flight recorder's parts (internal to dtrain): the ring of this process's last ops
// (flight_recorder.cc, fed by the hooks of trace_internal.h), the dump's JSON and its file
// (flight_dump.cc), and the SIGUSR1 watcher (flight_signal.cc). docs/OBSERVABILITY.md describes the
// variables, the dump format and the triggers.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/trace/trace_internal.h"

namespace dtrain::comm::trace::flight {

enum class State : uint8_t { issued, started, completed, failed };
const char* stateName(State s);

// One op as the ring keeps it. Written on the hot path without allocating: names are the static
// strings of the OpRecord, peers are kept inline (the first kInlinePeers; npeers counts them all), the
// group is one the recorder keeps alive for good (a process has few).
struct Entry {
  static constexpr size_t kInlinePeers = 8;
  uint64_t id = 0;  // 1, 2, ... in issue order in this process; 0: an empty slot
  const GroupInfo* group = nullptr;
  uint64_t seq = OpRecord::kNoSeq;
  const char* op = "";
  const char* dtype = "";
  const char* algorithm = "";
  size_t count = 0;
  size_t bytes = 0;
  int root = -1;
  uint32_t npeers = 0;
  std::array<int, kInlinePeers> peers{};  // group ranks
  State state = State::issued;
  int64_t issued_us = 0, started_us = 0, finished_us = 0;
  std::string error;  // a failed op's error (allocated only then)
};

// Everything a dump says about this process, taken at dump time.
struct Snapshot {
  std::string file_stem;   // "rank3" (or "server0" for a parameter-server process)
  int rank = -1;           // in the world; -1 before the first op
  int world_size = 0;
  std::string job;
  size_t capacity = 0;
  uint64_t recorded = 0;   // ops recorded since the start (entries.size() of them are kept)
  std::vector<Entry> entries;  // oldest first
};

// The dump's JSON text (flight_dump.cc).
std::string formatDump(const Snapshot& s, const std::string& reason,
                       const std::vector<::dtrain::trace::OpenSpans>& spans);
// Writes `text` to dir/stem.json through a temporary file and a rename, creating dir; IoError naming the
// file otherwise. Returns the file's path.
std::string writeDumpFile(const std::string& dir, const std::string& stem, const std::string& text);

// Writes this process's dump now, on the calling thread, and says where on stderr. Returns the path,
// "" when the recorder is off or the dump could not be written (the reason is printed).
std::string dump(const std::string& reason);
// The dump of the first failure (a timeout, an abort, a peer's failure): at most one per process.
void dumpOnFailure(const std::string& reason);

// Installs the SIGUSR1 handler and starts the thread that dumps when it fires (flight_signal.cc).
// `request` returns (and clears) the reason a launcher left in the progress file, "" when none.
void watchSignal(std::string (*request)());

}  // namespace dtrain::comm::trace::flight
