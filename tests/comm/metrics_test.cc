// The metrics logger (dtrain/metrics.h): lines that parse back as JSON with the values written, NaN and
// infinity as null, flushed line by line, an unopenable file named; and comm::bytesSent(), which must
// grow by exactly the payload a rank sends in a known allreduce and send.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dtrain/comm/error.h"
#include "dtrain/metrics.h"
#include "harness.h"

namespace {

using dtrain::MetricsLog;
using dtrain::Record;
using nlohmann::json;

std::vector<json> readLines(const std::string& path) {
  std::ifstream f(path);
  std::vector<json> out;
  for (std::string line; std::getline(f, line);) out.push_back(json::parse(line));  // throws on bad JSON
  return out;
}

TEST(Metrics, LinesParseBackWithTheValuesWritten) {
  dtrain::test::TempDir dir;
  const std::string path = dir.path() + "/run/metrics.jsonl";  // the directory is created
  MetricsLog log(path);
  log.writeRun("test", 2, Record().set("lr", 1e-4).set("name", "a \"quoted\"\\path\n\x01 caf\xc3\xa9").set("on", true));
  const double awkward = 0.1 + 0.2;  // 0.30000000000000004: must read back bit for bit
  log.write(Record("step").set("step", int64_t{12}).set("loss", awkward).set("tiny", 1e-300).set("big", uint64_t{1} << 63)
                .set("neg", -3));
  // Flushed per line: readable while the log is still open.
  auto lines = readLines(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["kind"], "run");
  EXPECT_EQ(lines[0]["app"], "test");
  EXPECT_EQ(lines[0]["world_size"], 2);
  EXPECT_NEAR(lines[0]["start_unix"].get<double>(), dtrain::unixTime(), 60.0);
  EXPECT_EQ(lines[0]["config"]["lr"].get<double>(), 1e-4);
  EXPECT_EQ(lines[0]["config"]["name"], "a \"quoted\"\\path\n\x01 caf\xc3\xa9");
  EXPECT_EQ(lines[0]["config"]["on"], true);
  EXPECT_EQ(lines[1]["kind"], "step");
  EXPECT_EQ(lines[1]["step"], 12);
  EXPECT_EQ(lines[1]["loss"].get<double>(), awkward);
  EXPECT_EQ(lines[1]["tiny"].get<double>(), 1e-300);
  EXPECT_EQ(lines[1]["big"].get<uint64_t>(), uint64_t{1} << 63);
  EXPECT_EQ(lines[1]["neg"], -3);
  // The first key is the kind, in the order set.
  std::ifstream f(path);
  std::string first;
  std::getline(f, first);
  EXPECT_EQ(first.rfind("{\"kind\":\"run\",\"app\":\"test\"", 0), 0u) << first;
}

TEST(Metrics, NanAndInfinityAreNull) {
  dtrain::test::TempDir dir;
  MetricsLog log(dir.path() + "/m.jsonl");
  log.write(Record("step").set("loss", std::nan("")).set("lr", std::numeric_limits<double>::infinity())
                .set("x", -std::numeric_limits<double>::infinity()).set("ok", 1.5));
  auto lines = readLines(log.path());
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_TRUE(lines[0]["loss"].is_null());
  EXPECT_TRUE(lines[0]["lr"].is_null());
  EXPECT_TRUE(lines[0]["x"].is_null());
  EXPECT_EQ(lines[0]["ok"], 1.5);
}

TEST(Metrics, StepTimesDeriveComputeAndHiddenFractionOnlyWhenCommunicating) {
  json with = json::parse(Record("step").stepTimes(0.5, 0.2, 0.05).json());
  EXPECT_EQ(with["step_s"], 0.5);
  EXPECT_EQ(with["comm_s"], 0.2);
  EXPECT_EQ(with["exposed_comm_s"], 0.05);
  EXPECT_DOUBLE_EQ(with["compute_s"].get<double>(), 0.45);
  EXPECT_DOUBLE_EQ(with["hidden_fraction"].get<double>(), 0.75);
  // A world of one communicates nothing: no comm fields, rather than made-up ones.
  json alone = json::parse(Record("step").stepTimes(0.5, 0, 0).json());
  EXPECT_EQ(alone.size(), 2u) << alone.dump();
  EXPECT_EQ(alone["step_s"], 0.5);
}

TEST(Metrics, AppendKeepsAndTruncateStartsOver) {
  dtrain::test::TempDir dir;
  const std::string path = dir.path() + "/m.jsonl";
  MetricsLog(path).write(Record("a"));
  MetricsLog(path, MetricsLog::Open::append).write(Record("b"));
  ASSERT_EQ(readLines(path).size(), 2u);
  MetricsLog(path).write(Record("c"));
  auto lines = readLines(path);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0]["kind"], "c");
}

TEST(Metrics, UnopenableFileIsNamed) {
  dtrain::test::TempDir dir;
  const std::string file = dir.path() + "/plain";
  std::ofstream(file) << "x";
  const std::string path = file + "/metrics.jsonl";  // under a regular file: cannot exist
  std::string err = dtrain::test::errorOf([&] { MetricsLog log(path); });
  EXPECT_NE(err.find("cannot open metrics file " + path), std::string::npos) << err;
}

TEST(Metrics, ResidentBytesMatchesTheKernelsCount) {
  const double statm = static_cast<double>(dtrain::residentBytes());
  const double status = static_cast<double>(dtrain::test::rssKiB()) * 1024;
  EXPECT_GT(statm, 1 << 20);
  EXPECT_NEAR(statm, status, 8 << 20);
  std::vector<char> block(64 << 20, 1);  // touched: resident
  EXPECT_GT(static_cast<double>(dtrain::residentBytes()), statm + (48 << 20)) << static_cast<int>(block[12345]);
}

TEST(Metrics, StopwatchLapsAddUp) {
  dtrain::Stopwatch w;
  double a = w.lap(), b = w.lap();
  EXPECT_GE(a, 0);
  EXPECT_GE(b, 0);
  EXPECT_LE(a + b, w.seconds());
}

// Two ranks, each transport: an allreduce of 1024 f32 has each rank send 4096 bytes whatever the
// algorithm (ring: two half blocks; recursive doubling: the whole buffer once; shm's direct allreduce,
// automatic's choice there: what its peer reads of its staging area, half its input and its reduced
// half); a send of 100 bytes
// counts 100 on the sender and nothing on the receiver.
TEST(Metrics, BytesSentCountsExactlyThePayloadSent) {
  for (const char* transport : {"tcp", "shm"}) {
    SCOPED_TRACE(transport);
    dtrain::test::StoreServer server;
    auto results = dtrain::test::runRanks(2, [&](int rank) {
      dtrain::comm::GroupOptions o;
      o.transport = transport;
      o.timeout = std::chrono::seconds(30);
      auto pg = dtrain::comm::ProcessGroup::create(server.client(), rank, 2, o);
      std::vector<float> buf(1024, 1.0f);
      dtrain::BytesSentMeter meter;
      const uint64_t before = dtrain::comm::bytesSent();
      for (auto algo : {dtrain::comm::AllreduceAlgorithm::automatic, dtrain::comm::AllreduceAlgorithm::ring,
                        dtrain::comm::AllreduceAlgorithm::recursive_doubling}) {
        pg->allreduce(buf.data(), buf.data(), buf.size(), dtrain::comm::DType::f32, dtrain::comm::ReduceOp::sum, algo)
            ->wait();
        EXPECT_EQ(meter.sinceLast(), 4096u) << "allreduce algorithm " << static_cast<int>(algo);
      }
      std::vector<uint8_t> msg(100, 7);
      if (rank == 0) pg->send(msg.data(), msg.size(), dtrain::comm::DType::u8, 1)->wait();
      else pg->recv(msg.data(), msg.size(), dtrain::comm::DType::u8, 0)->wait();
      EXPECT_EQ(meter.sinceLast(), rank == 0 ? 100u : 0u);
      EXPECT_EQ(dtrain::comm::bytesSent() - before, 3 * 4096u + (rank == 0 ? 100 : 0));
    });
    dtrain::test::expectAllOk(results);
  }
}

}  // namespace
