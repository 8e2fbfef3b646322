// Starting the timeline in initWorld(): the ranks' agreement, the clock offset to rank 0 and the file.
//
// Clock alignment: rank r sends rank 0 a message at t0 (its clock), rank 0 answers with its clock t1
// at once, the answer arrives at t3. If both directions took as long, rank 0's clock read t1 when
// rank r's read (t0 + t3) / 2, so offset = t1 - (t0 + t3) / 2, within half the round trip. Of
// kRounds exchanges, the one with the shortest round trip (the least room for asymmetry) counts.
// dtrain-trace merge adds each rank's offset to its timestamps.
#include "comm/trace/timeline_start.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <limits>

#include "comm/trace/timeline_buffer.h"
#include "comm/util/json_text.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm::trace::timeline {

namespace {

constexpr int kRounds = 16;
constexpr uint32_t kClockTag = 0x7C10C4;  // the clock exchange's point-to-point tag

struct ClockSync {
  int64_t offset_us = 0;
  int64_t rtt_us = 0;
  bool synced = true;
};

std::string key(int rank) { return fmt::format("timeline/{}", rank); }

// Rank 0: answers each rank whose timeline is on, kRounds times, with its clock.
void serveClock(ProcessGroup& world, Store& store, int64_t skew_us) {
  std::string off;
  for (int r = 1; r < world.size(); ++r) {
    if (toString(store.get(key(r))) != "1") {
      off += fmt::format("{}{}", off.empty() ? "" : ", ", r);
      continue;
    }
    for (int k = 0; k < kRounds; ++k) {
      int64_t ping = 0;
      world.recv(&ping, 1, DType::i64, r, kClockTag)->wait();
      int64_t t1 = nowUs() + skew_us;
      world.send(&t1, 1, DType::i64, r, kClockTag)->wait();
    }
  }
  if (!off.empty())
    std::fprintf(stderr, "[rank 0] dtrain: DTRAIN_TIMELINE is not set on rank(s) %s: they write no timeline\n",
                 off.c_str());
}

ClockSync askClock(ProcessGroup& world, Store& store, int64_t skew_us) {
  ClockSync s;
  if (toString(store.get(key(0))) != "1") {
    std::fprintf(stderr,
                 "[rank %d] dtrain: DTRAIN_TIMELINE is set here but not on rank 0: this rank's clock offset is not "
                 "measured (clock_synced false)\n",
                 world.rank());
    s.synced = false;
    return s;
  }
  s.rtt_us = std::numeric_limits<int64_t>::max();
  for (int k = 0; k < kRounds; ++k) {
    int64_t t0 = nowUs() + skew_us, t1 = 0;
    world.sendRecv({P2POp{P2POp::kSend, &t0, 1, DType::i64, 0, kClockTag},
                    P2POp{P2POp::kRecv, &t1, 1, DType::i64, 0, kClockTag}})->wait();
    const int64_t t3 = nowUs() + skew_us;
    if (t3 - t0 < s.rtt_us) {
      s.rtt_us = t3 - t0;
      s.offset_us = t1 - t0 - (t3 - t0) / 2;
    }
  }
  return s;
}

}  // namespace

Config configFrom(const rendezvous::Environment& env) {
  Config c;
  if (const char* d = env.get("DTRAIN_TIMELINE")) c.dir = d;
  c.skew_us = env.integer("DTRAIN_TIMELINE_SKEW_US", 0, -(1 << 24));
  return c;
}

void startWorld(const Config& c, ProcessGroup& world, Store* store, const std::string& host) {
  const int rank = world.rank();
  const bool on = !c.dir.empty();
  if (on && timeline::on()) return;  // a second world in this process: the timeline goes on in its file
  if (world.size() > 1) store->set(key(rank), toBytes(on ? "1" : "0"));
  if (!on) return;
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(c.dir, ec);
  if (ec)
    throw IoError(fmt::format("[rank {}] DTRAIN_TIMELINE={}: cannot create the directory: {}", rank, c.dir,
                              ec.message()));
  ClockSync s;
  if (world.size() > 1) {
    if (rank == 0) serveClock(world, *store, c.skew_us);
    else s = askClock(world, *store, c.skew_us);
  }
  std::string other = fmt::format(
      "\"rank\":{},\"world_size\":{},\"clock_offset_us\":{},\"clock_rtt_us\":{},\"clock_synced\":{},\"host\":", rank,
      world.size(), s.offset_us, s.rtt_us, s.synced ? "true" : "false");
  dtrain::detail::appendJsonQuoted(other, host);
  other += fmt::format(",\"process_id\":{}", static_cast<long>(::getpid()));
  openFile((fs::path(c.dir) / fmt::format("trace-rank{}.json", rank)).string(), rank, c.skew_us, other);
}

}  // namespace dtrain::comm::trace::timeline
