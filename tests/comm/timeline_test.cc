// The timeline (DTRAIN_TIMELINE=DIR) on real ranks started by initWorld(), merged by dtrain-trace:
// the clock offsets measured at start-up recover a skew injected through DTRAIN_TIMELINE_SKEW_US and
// every message is received after it was sent; collectives carry their fields; nothing is written
// when the timeline is off; merge keeps a cut file's whole events and names a corrupt one.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <regex>
#include <filesystem>
#include <fstream>
#include <set>

#include "comm/trace/trace_internal.h"
#include "dtrain/comm/comm.h"
#include "dtrain/trace.h"
#include "rendezvous_env.h"
#include "timeline_util.h"

namespace dtrain::test {
namespace {

namespace fs = std::filesystem;

class Timeline : public Env {};

// Each rank: allreduces (recursive doubling and ring over tcp: messages between the ranks), a user
// span, point-to-point messages both ways, then flush().
void someTraffic(comm::ProcessGroup& world) {
  const int peer = 1 - world.rank();
  std::vector<float> small(1024, 1.0f), big(64 * 1024, 1.0f);
  for (int i = 0; i < 10; ++i) {
    DTRAIN_SPAN("step", "user");
    world.allreduce(small.data(), small.size(), comm::DType::f32)->wait();
  }
  world.allreduce(big.data(), big.size(), comm::DType::f32)->wait();
  for (int i = 0; i < 3; ++i) {
    int32_t x = i;
    if (world.rank() == 0) world.send(&x, 1, comm::DType::i32, peer, 7)->wait();
    else world.recv(&x, 1, comm::DType::i32, peer, 7)->wait();
  }
  world.barrier()->wait();
  EXPECT_EQ(small[0], 1024.0f) << "10 rounds of sums over 2 ranks";
  dtrain::trace::flush();
}

TEST_F(Timeline, ClockSkewIsRecoveredAndMessagesArriveAfterTheyLeave) {
  TempDir dir;
  StoreServer server;
  const int64_t skew[2] = {50000, -50000};
  auto results = runRanks(2, [&](int rank) {
    setRankEnv(server, rank, 2);
    setenv("DTRAIN_TRANSPORT", "tcp", 1);
    setenv("DTRAIN_TIMELINE", dir.path().c_str(), 1);
    setenv("DTRAIN_TIMELINE_SKEW_US", std::to_string(skew[rank]).c_str(), 1);
    auto world = comm::initWorld();
    EXPECT_TRUE(dtrain::trace::timelineOn());
    someTraffic(*world);
  });
  expectAllOk(results);
  Merged m = mergeTimeline(dir.path());
  ASSERT_EQ(m.exit_code, 0) << m.output;
  EXPECT_NE(m.output.find("rank 0  trace-rank0.json"), std::string::npos) << m.output;
  EXPECT_NE(m.output.find("rank 1  trace-rank1.json"), std::string::npos) << m.output;
  // Offsets onto rank 0's clock: rank r's clock reads skew[r] - skew[0] more than rank 0's.
  const auto& ranks = m.trace.at("otherData").at("ranks");
  ASSERT_EQ(ranks.size(), 2u);
  // Both the offset measured at start-up and the one applied (moved, if at all, to keep every message's
  // receive after its send).
  for (const auto& r : ranks) {
    const int rank = r.at("rank").get<int>();
    const double want = static_cast<double>(skew[0] - skew[rank]);
    for (const char* k : {"clock_offset_measured_us", "clock_offset_us"})
      EXPECT_NEAR(r.at(k).get<double>(), want, 200.0) << k << " of rank " << rank << ": " << m.output;
  }
  EXPECT_EQ(m.output.find("warning"), std::string::npos) << m.output;
  EXPECT_GT(checkFlows(m.trace), 20u);
  // The merged events are sorted by time.
  int64_t last = INT64_MIN;
  for (const auto& e : m.trace.at("traceEvents")) {
    if (!e.contains("ts")) continue;
    EXPECT_GE(e["ts"].get<int64_t>(), last);
    last = e["ts"].get<int64_t>();
  }
  // Both ranks ran the same collectives, with the same sequence numbers, algorithms and sizes.
  std::vector<std::set<std::tuple<uint64_t, std::string, std::string, int64_t>>> calls(2);
  for (int pid = 0; pid < 2; ++pid) {
    for (const auto& e : eventsOf(m.trace, "X", pid)) {
      checkComplete(e);
      if (e.at("cat") != "comm" || !e.at("args").contains("seq")) continue;
      const auto& a = e.at("args");
      EXPECT_EQ(a.at("group"), "world");
      EXPECT_EQ(a.at("peers"), json::array({1 - pid}));
      EXPECT_EQ(a.at("op"), e.at("name"));
      calls[pid].insert({a.at("seq").get<uint64_t>(), a.at("op").get<std::string>(), a.value("algorithm", ""),
                         a.at("bytes").get<int64_t>()});
    }
    EXPECT_EQ(eventsOf(m.trace, "X", pid, "step").size(), 10u);
    EXPECT_EQ(eventsOf(m.trace, "X", pid, "send").size() + eventsOf(m.trace, "X", pid, "recv").size(), 3u);
  }
  EXPECT_EQ(calls[0], calls[1]);
  ASSERT_EQ(calls[0].size(), 12u);  // 11 allreduces and the barrier
  auto first = *calls[0].begin(), big = *std::next(calls[0].begin(), 10);
  EXPECT_EQ(first, std::make_tuple(uint64_t{0}, std::string("allreduce"), std::string("recursive_doubling"), int64_t{4096}));
  EXPECT_EQ(big, std::make_tuple(uint64_t{10}, std::string("allreduce"), std::string("ring"), int64_t{256 * 1024}));
  // Metadata: each rank's process name and its threads' names.
  for (int pid = 0; pid < 2; ++pid) {
    auto procs = eventsOf(m.trace, "M", pid, "process_name");
    ASSERT_EQ(procs.size(), 1u);
    EXPECT_EQ(procs[0].at("args").at("name"), "rank " + std::to_string(pid));
    std::map<int64_t, std::string> threads;
    for (const auto& t : eventsOf(m.trace, "M", pid, "thread_name")) threads[t.at("tid")] = t.at("args").at("name");
    for (const auto& e : eventsOf(m.trace, "X", pid)) EXPECT_TRUE(threads.count(e.at("tid"))) << "unnamed thread: " << e;
    auto main = eventsOf(m.trace, "X", pid, "step");
    ASSERT_FALSE(main.empty());
    EXPECT_EQ(threads[main[0].at("tid")], "main");
  }
}

TEST_F(Timeline, OffWritesNothing) {
  TempDir dir;
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    setRankEnv(server, rank, 2);
    ASSERT_EQ(chdir(dir.path().c_str()), 0);
    auto world = comm::initWorld();
    EXPECT_FALSE(dtrain::trace::timelineOn());
    someTraffic(*world);
  });
  expectAllOk(results);
  EXPECT_TRUE(fs::is_empty(dir.path())) << "a file was written with DTRAIN_TIMELINE unset";
}

// One rank alone (a world of one, no store): its file, then the same file cut inside its last line,
// then a file with a broken line in the middle.
TEST_F(Timeline, MergeKeepsACutFileAndNamesACorruptOne) {
  TempDir dir;
  auto results = runRanks(1, [&](int) {
    setenv("DTRAIN_TIMELINE", dir.path().c_str(), 1);
    auto world = comm::initWorld();
    std::vector<double> x(100, 1.0);
    for (int i = 0; i < 50; ++i) {
      DTRAIN_SPAN(std::string("epoch ") + std::to_string(i));  // run-time names are copied
      world->allreduce(x.data(), x.size(), comm::DType::f64)->wait();
    }
    dtrain::trace::flush();
  });
  expectAllOk(results);
  const std::string file = dir.path() + "/trace-rank0.json";
  Merged whole = mergeTimeline(dir.path());
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  EXPECT_EQ(eventsOf(whole.trace, "X", 0, "allreduce").size(), 50u);
  EXPECT_EQ(eventsOf(whole.trace, "X", 0, "epoch 49").size(), 1u);
  EXPECT_EQ(eventsOf(whole.trace, "X", 0, "allreduce")[0].at("args").at("peers"), json::array());

  std::string text;
  {
    std::ifstream f(file);
    text.assign(std::istreambuf_iterator<char>(f), {});
  }
  const size_t cut = text.rfind("\"epoch 49\"");  // inside the last span's line
  ASSERT_NE(cut, std::string::npos);
  std::ofstream(file, std::ios::trunc) << text.substr(0, cut);
  Merged part = mergeTimeline(dir.path());
  ASSERT_EQ(part.exit_code, 0) << part.output;
  EXPECT_NE(part.output.find("cut short"), std::string::npos) << part.output;
  EXPECT_EQ(eventsOf(part.trace, "X", 0, "epoch 48").size(), 1u);
  EXPECT_EQ(eventsOf(part.trace, "X", 0, "epoch 49").size(), 0u);

  const size_t middle = text.find("\"epoch 10\"");
  ASSERT_NE(middle, std::string::npos);
  std::ofstream(file, std::ios::trunc) << text.substr(0, middle) << "{{{" << text.substr(middle);
  Merged bad = mergeTimeline(dir.path());
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("trace-rank0.json: line"), std::string::npos) << bad.output;

  std::ofstream(file, std::ios::trunc) << "not json at all";
  Merged junk = mergeTimeline(dir.path());
  EXPECT_EQ(junk.exit_code, 1);
  EXPECT_NE(junk.output.find("trace-rank0.json is not a dtrain timeline"), std::string::npos) << junk.output;
}

// Each flush turns the spool into events appended after the last: after every flush the file is the
// complete JSON of everything recorded so far, ending with the closer and nothing after it. Ops alternate in size
// and type, so the writer's copy of the last op's constant part is replaced as often as it is used.
void checkFileAfterEachFlush(const std::string& dir) {
  auto results = runRanks(1, [&](int) {
    setenv("DTRAIN_TIMELINE", dir.c_str(), 1);
    auto world = comm::initWorld();
    std::vector<float> f(300, 1.0f);
    std::vector<double> d(70, 1.0);
    const std::string file = dir + "/trace-rank0.json";
    size_t ops = 0;
    for (int round = 0; round < 12; ++round) {
      for (int i = 0; i < 150; ++i, ops += 2) {
        DTRAIN_SPAN(std::string("it ") + std::to_string(i));
        world->allreduce(f.data(), f.size() - static_cast<size_t>(i % 3), comm::DType::f32)->wait();
        world->allreduce(d.data(), d.size(), comm::DType::f64)->wait();
      }
      dtrain::trace::flush();
      std::ifstream in(file);
      const std::string text((std::istreambuf_iterator<char>(in)), {});
      ASSERT_GE(text.size(), 4u);
      EXPECT_EQ(text.substr(text.size() - 4), "\n]}\n") << "round " << round;
      const json trace = json::parse(text);
      auto all = eventsOf(trace, "X", 0, "allreduce");
      ASSERT_EQ(all.size(), ops) << "round " << round;
      for (size_t k = 0; k < all.size(); ++k) {
        const auto& a = all[k].at("args");
        const bool single = k % 2 == 0;
        const size_t i = (k / 2) % 150;
        EXPECT_EQ(a.at("dtype"), single ? "f32" : "f64") << k;
        EXPECT_EQ(a.at("count").get<size_t>(), single ? 300 - i % 3 : 70u) << k;
        EXPECT_EQ(a.at("bytes").get<size_t>(), single ? 4 * (300 - i % 3) : 560u) << k;
        EXPECT_EQ(a.at("seq").get<size_t>(), k) << k;
        EXPECT_EQ(a.at("op"), "allreduce");
        EXPECT_EQ(a.at("group"), "world");
        checkComplete(all[k]);
      }
      EXPECT_EQ(eventsOf(trace, "X", 0, "it 149").size(), static_cast<size_t>(round + 1));
    }
  });
  expectAllOk(results);
}

TEST_F(Timeline, FileIsWholeAfterEveryFlush) {
  TempDir dir;
  checkFileAfterEachFlush(dir.path());
}

// The same in /dev/shm (tmpfs).
TEST_F(Timeline, FileIsWholeAfterEveryFlushOnTmpfs) {
  char tmpl[] = "/dev/shm/dtrain-timeline-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr) << "/dev/shm: " << std::strerror(errno);
  checkFileAfterEachFlush(tmpl);
  fs::remove_all(tmpl);
}

// Recording paused (setTimelineRecording(false)) leaves no events; resumed, events come again. The
// file is whole after a flush made while paused.
TEST_F(Timeline, PausedRecordingLeavesNoEvents) {
  TempDir dir;
  auto results = runRanks(1, [&](int) {
    setenv("DTRAIN_TIMELINE", dir.path().c_str(), 1);
    auto world = comm::initWorld();
    std::vector<float> f(16, 1.0f);
    for (int phase = 0; phase < 3; ++phase) {
      dtrain::trace::setTimelineRecording(phase != 1);
      EXPECT_EQ(dtrain::trace::timelineOn(), phase != 1);
      for (int i = 0; i < 20; ++i) {
        DTRAIN_SPAN(std::string("phase ") + std::to_string(phase));
        world->allreduce(f.data(), f.size() - static_cast<size_t>(phase), comm::DType::f32)->wait();
      }
      dtrain::trace::flush();
    }
  });
  expectAllOk(results);
  Merged m = mergeTimeline(dir.path());
  ASSERT_EQ(m.exit_code, 0) << m.output;
  EXPECT_EQ(eventsOf(m.trace, "X", 0, "phase 0").size(), 20u);
  EXPECT_EQ(eventsOf(m.trace, "X", 0, "phase 1").size(), 0u) << "recorded while paused";
  EXPECT_EQ(eventsOf(m.trace, "X", 0, "phase 2").size(), 20u);
  std::map<size_t, int> by_count;
  for (const auto& e : eventsOf(m.trace, "X", 0, "allreduce")) ++by_count[e.at("args").at("count").get<size_t>()];
  EXPECT_EQ(by_count, (std::map<size_t, int>{{16, 20}, {14, 20}}));
}

// A rank that ends without exit (killed) leaves its spool beside its JSON: merge reads both. One killed
// while turning its spool into JSON leaves some events in both: merge keeps them once.
TEST_F(Timeline, MergeReadsTheSpoolOfARankThatDidNotExit) {
  TempDir dir;
  const std::string spool = dir.path() + "/trace-rank0.spool", saved = dir.path() + "/saved.bin";
  auto results = runRanks(1, [&](int) {
    setenv("DTRAIN_TIMELINE", dir.path().c_str(), 1);
    auto world = comm::initWorld();
    std::vector<int64_t> x(8, 1);
    auto some = [&](const char* what, int n) {
      for (int i = 0; i < n; ++i) {
        dtrain::trace::Span s(std::string(what) + " " + std::to_string(i));
        world->allreduce(x.data(), x.size(), comm::DType::i64)->wait();
      }
    };
    some("early", 30);
    dtrain::trace::flushSpool();  // spooled, not yet JSON
    fs::copy_file(spool, saved);
    dtrain::trace::flush();       // now JSON; the spool is emptied
    some("late", 40);
    dtrain::trace::flushSpool();
    _exit(::testing::Test::HasFailure() ? 2 : 0);  // no exit handlers: the late events stay in the spool
  });
  expectAllOk(results);
  ASSERT_TRUE(fs::exists(spool));
  Merged m = mergeTimeline(dir.path());
  ASSERT_EQ(m.exit_code, 0) << m.output;
  // The 80 late events (40 spans, 40 allreduces) come from the spool; a few events at the edge of the
  // flush may be both in the JSON and still in the spool (merge keeps them once: see the counts below).
  std::smatch spooled;
  ASSERT_TRUE(std::regex_search(m.output, spooled, std::regex(R"((\d+) of them from its spool)"))) << m.output;
  EXPECT_GE(std::stoi(spooled[1]), 80) << m.output;
  EXPECT_LE(std::stoi(spooled[1]), 90) << m.output;
  EXPECT_EQ(eventsOf(m.trace, "X", 0, "early 29").size(), 1u);
  EXPECT_EQ(eventsOf(m.trace, "X", 0, "late 39").size(), 1u);
  EXPECT_EQ(eventsOf(m.trace, "X", 0, "allreduce").size(), 70u);
  for (const auto& e : eventsOf(m.trace, "X", 0, "allreduce")) checkComplete(e);

  // Killed after its early events went into the JSON but before the spool was emptied.
  fs::copy_file(saved, spool, fs::copy_options::overwrite_existing);
  Merged twice = mergeTimeline(dir.path());
  ASSERT_EQ(twice.exit_code, 0) << twice.output;
  EXPECT_EQ(eventsOf(twice.trace, "X", 0, "early 29").size(), 1u) << "an event in the JSON and the spool";
  EXPECT_EQ(eventsOf(twice.trace, "X", 0, "allreduce").size(), 30u);

  std::ofstream(spool, std::ios::trunc) << "not a spool";
  Merged junk = mergeTimeline(dir.path());
  EXPECT_EQ(junk.exit_code, 1);
  EXPECT_NE(junk.output.find("trace-rank0.spool"), std::string::npos) << junk.output;
}

// Recording threads reuse the chunks the writer drained (events are not cleared first, each kind sets
// its own fields): over tcp, 8 rounds of spans, async slices with args, allreduces of two shapes (with
// flows between the ranks) and flushes refill chunks many times, and every event comes back whole.
TEST_F(Timeline, ReusedChunksKeepEveryEventWhole) {
  TempDir dir;
  StoreServer server;
  constexpr int kRounds = 8, kIters = 200;
  auto results = runRanks(2, [&](int rank) {
    setRankEnv(server, rank, 2);
    setenv("DTRAIN_TRANSPORT", "tcp", 1);
    setenv("DTRAIN_TIMELINE", dir.path().c_str(), 1);
    auto world = comm::initWorld();
    std::vector<float> f(64, 1.0f);
    for (int round = 0; round < kRounds; ++round) {
      for (int i = 0; i < kIters; ++i) {
        DTRAIN_SPAN("step", "user");
        const int64_t t0 = dtrain::trace::nowUs();
        world->allreduce(f.data(), f.size() - static_cast<size_t>(i % 2), comm::DType::f32)->wait();
        comm::trace::timeline::asyncSpan("slice ", i, "test", t0, dtrain::trace::nowUs(), {"i", i}, {"round", round});
      }
      dtrain::trace::flush();
    }
  });
  expectAllOk(results);
  Merged m = mergeTimeline(dir.path());
  ASSERT_EQ(m.exit_code, 0) << m.output;
  EXPECT_GT(checkFlows(m.trace), static_cast<size_t>(kRounds * kIters));
  for (int pid = 0; pid < 2; ++pid) {
    EXPECT_EQ(eventsOf(m.trace, "X", pid, "step").size(), static_cast<size_t>(kRounds * kIters));
    auto ops = eventsOf(m.trace, "X", pid, "allreduce");
    ASSERT_EQ(ops.size(), static_cast<size_t>(kRounds * kIters));
    std::sort(ops.begin(), ops.end(), [](const json& a, const json& b) { return a["args"]["seq"] < b["args"]["seq"]; });
    for (size_t k = 0; k < ops.size(); ++k) {
      const auto& a = ops[k].at("args");
      EXPECT_EQ(a.at("seq").get<size_t>(), k);
      EXPECT_EQ(a.at("count").get<size_t>(), 64 - k % 2) << k;
      EXPECT_EQ(a.at("peers"), json::array({1 - pid})) << k;
      EXPECT_EQ(a.at("group_size"), 2) << k;
      EXPECT_FALSE(a.contains("error")) << k;
      checkComplete(ops[k]);
    }
    auto begins = eventsOf(m.trace, "b", pid);
    ASSERT_EQ(begins.size(), static_cast<size_t>(kRounds * kIters));
    std::map<int, int> per_round;
    for (const auto& b : begins) {
      const auto& a = b.at("args");
      EXPECT_EQ(b.at("name"), "slice " + std::to_string(a.at("i").get<int>())) << b;
      EXPECT_EQ(a.size(), 2u) << b;
      ++per_round[a.at("round").get<int>()];
    }
    for (int r = 0; r < kRounds; ++r) EXPECT_EQ(per_round[r], kIters) << "round " << r;
  }
}

// Offsets measured 10 us short of what a message's order allows: merge moves rank 1's by just that.
TEST(TimelineMerge, MovesAnOffsetThatPutsAReceiveBeforeItsSend) {
  TempDir dir;
  auto write = [&](int rank, const std::string& events) {
    std::ofstream(dir.path() + "/trace-rank" + std::to_string(rank) + ".json")
        << "{\"otherData\":{\"rank\":" << rank << ",\"clock_offset_us\":0,\"clock_rtt_us\":100},"
        << "\"traceEvents\":[" << events << "]}";
  };
  const std::string flow = R"({"ph":"P","name":"message","cat":"flow","id":I,"ts":T,"pid":R,"tid":2})";
  auto ev = [&](const char* ph, int id, int ts, int rank) {
    std::string e = flow;
    e.replace(e.find('P'), 1, ph);
    e.replace(e.find('I'), 1, std::to_string(id));
    e.replace(e.find('T'), 1, std::to_string(ts));
    e.replace(e.find('R'), 1, std::to_string(rank));
    if (ph[0] == 'f') e.insert(e.size() - 1, R"(,"bp":"e")");
    return e;
  };
  write(0, ev("s", 7, 1000, 0) + "," + ev("f", 8, 2050, 0));  // rank 1's message 8 arrives 50 us after it left
  write(1, ev("f", 7, 990, 1) + "," + ev("s", 8, 2000, 1));   // rank 0's message 7 "arrives" 10 us early
  Merged m = mergeTimeline(dir.path());
  ASSERT_EQ(m.exit_code, 0) << m.output;
  EXPECT_NE(m.output.find("rank 1  trace-rank1.json  2 events  clock offset +10 us (+-50 us) [measured +0 us, moved "
                          "+10 us so that every message arrives after it left]"),
            std::string::npos)
      << m.output;
  EXPECT_EQ(checkFlows(m.trace), 2u);
  EXPECT_EQ(m.trace.at("otherData").at("ranks")[1].at("clock_offset_us"), 10);
}

// The trace clock is the steady clock that Work::finishedAt() and the DDP bucket events convert.
TEST(TimelineClock, IsTheSteadyClock) {
  for (int i = 0; i < 5; ++i) {
    const int64_t a = comm::trace::usOf(std::chrono::steady_clock::now());
    const int64_t t = dtrain::trace::nowUs();
    const int64_t b = comm::trace::usOf(std::chrono::steady_clock::now());
    EXPECT_LE(a, t);
    EXPECT_LE(t, b);
  }
}

}  // namespace
}  // namespace dtrain::test
