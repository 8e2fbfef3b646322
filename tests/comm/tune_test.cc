// DTRAIN_TUNE at group creation (src/comm/group/tune.cc): the crossover rule, the probe over tcp (a
// cache line per host, world and transport; results still right), the cache taken by a later group
// and obeyed by the automatic choice (seen in the flight recorder's algorithm), refresh, and a bad value.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "comm/group/tune.h"
#include "comm/trace/flight_recorder.h"
#include "comm_test_util.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "harness.h"

namespace dtrain::test {
namespace {

using comm::ProcessGroup;
using comm::tune::crossoverBytes;

TEST(TuneCrossover, TheLargestSizeUpToWhichTheSmallAlgorithmNeverLost) {
  const std::vector<size_t> sizes{1024, 2048, 4096, 8192};
  EXPECT_EQ(crossoverBytes(sizes, {10, 20, 30, 80}, {15, 25, 35, 40}), 4096u);
  EXPECT_EQ(crossoverBytes(sizes, {10, 20, 30, 40}, {15, 25, 35, 45}), 8192u);
  EXPECT_EQ(crossoverBytes(sizes, {20, 20, 30, 40}, {15, 25, 35, 45}), 0u) << "lost at the smallest: never";
  // A later win after a loss does not count (the choice is one threshold).
  EXPECT_EQ(crossoverBytes(sizes, {10, 30, 30, 40}, {15, 25, 35, 45}), 1024u);
}

std::vector<std::string> lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// Each rank's tcp group with DTRAIN_TUNE=mode; an allreduce at each size checked; the algorithm the
// group ran for each size (from the flight recorder) returned by rank 0 in `algos`, "size algo" lines.
void tcpJob(const std::string& mode, const std::string& cache, const std::string& flight_dir, const std::string* algos_file) {
  StoreServer server;
  expectAllOk(runRanks(2, [&](int rank) {
    setenv("DTRAIN_TUNE", mode.c_str(), 1);
    setenv("DTRAIN_TUNE_CACHE", cache.c_str(), 1);
    setenv("DTRAIN_FLIGHT_DIR", flight_dir.c_str(), 1);
    comm::GroupOptions o;
    o.transport = "tcp";
    auto pg = ProcessGroup::create(server.client(), rank, 2, o);
    for (size_t bytes : {size_t{4096}, size_t{256} << 10}) {
      const size_t n = bytes / 4;
      std::vector<float> v(n);
      for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(rank + 1) * static_cast<float>(i % 7);
      pg->allreduce(v.data(), n, comm::DType::f32, comm::ReduceOp::sum)->wait();
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(v[i], 3.0f * static_cast<float>(i % 7)) << bytes << " bytes, " << i;
    }
    if (rank != 0 || !algos_file) return;
    const std::string path = comm::trace::flight::dump("tune_test");
    ASSERT_FALSE(path.empty());
    auto d = nlohmann::json::parse(std::ifstream(path));
    std::ofstream out(*algos_file);
    // The last two allreduces of f32 are the checked ones (the probe's came before).
    std::vector<std::pair<int64_t, std::string>> seen;
    for (const auto& e : d.at("entries"))
      if (e.at("op") == "allreduce" && e.at("dtype") == "f32") seen.emplace_back(e.at("bytes"), e.at("algorithm"));
    ASSERT_GE(seen.size(), 2u);
    for (size_t k = seen.size() - 2; k < seen.size(); ++k) out << seen[k].first << " " << seen[k].second << "\n";
  }));
}

std::map<int64_t, std::string> readAlgos(const std::string& path) {
  std::map<int64_t, std::string> m;
  std::ifstream in(path);
  int64_t b;
  std::string a;
  while (in >> b >> a) m[b] = a;
  return m;
}

TEST(TuneAllreduce, ProbesOverTcpCachesAndTheCacheDecides) {
  TempDir tmp;
  const std::string cache = tmp.path() + "/tune.tsv", algos = tmp.path() + "/algos.txt";
  tcpJob("on", cache, tmp.path() + "/flight", nullptr);
  auto l = lines(cache);
  ASSERT_EQ(l.size(), 1u) << "the probe wrote no cache line";
  EXPECT_EQ(l[0].rfind("allreduce host=", 0), 0u) << l[0];
  EXPECT_NE(l[0].find(" world=2 transport=tcp crossover=rd-ring\t"), std::string::npos) << l[0];

  // A cached threshold is taken as it is (no new line) and decides the automatic choice: rewrite the
  // line to 1 MiB (recursive doubling for both sizes), then to 0 (the ring for both).
  const std::string key = l[0].substr(0, l[0].find('\t'));
  std::ofstream(cache) << key << "\t1048576\t0\n";
  tcpJob("on", cache, tmp.path() + "/flight", &algos);
  EXPECT_EQ(lines(cache).size(), 1u);
  auto a = readAlgos(algos);
  EXPECT_EQ(a[4096], "recursive_doubling");
  EXPECT_EQ(a[256 << 10], "recursive_doubling");
  std::ofstream(cache) << key << "\t0\t0\n";
  tcpJob("on", cache, tmp.path() + "/flight", &algos);
  a = readAlgos(algos);
  EXPECT_EQ(a[4096], "ring");
  EXPECT_EQ(a[256 << 10], "ring");

  // refresh probes again and appends its choice.
  tcpJob("refresh", cache, tmp.path() + "/flight", nullptr);
  EXPECT_EQ(lines(cache).size(), 2u);
  // off: no probe, no line, the defaults (recursive doubling at 4 KiB, the ring at 256 KiB).
  tcpJob("off", cache, tmp.path() + "/flight", &algos);
  EXPECT_EQ(lines(cache).size(), 2u);
  a = readAlgos(algos);
  EXPECT_EQ(a[4096], "recursive_doubling");
  EXPECT_EQ(a[256 << 10], "ring");
}

TEST(TuneAllreduce, ABadValueIsNamed) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    setenv("DTRAIN_TUNE", "always", 1);
    try {
      ProcessGroup::create(server.client(), rank, 2);
      ADD_FAILURE() << "DTRAIN_TUNE=always was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("DTRAIN_TUNE='always' (expected on, off or refresh)"), std::string::npos)
          << e.what();
    }
  });
  expectAllOk(results);
}

}  // namespace
}  // namespace dtrain::test
