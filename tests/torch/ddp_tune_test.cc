// DDP's bucket-size tuning (DDPOptions::tune, DTRAIN_TUNE): it tries every distinct layout for the
// passes it says, keeps the fastest on every rank alike, trains as one process meanwhile, caches its
// choice (a later run takes it and times nothing; refresh tunes again), and stays off or stops where
// it must (a world of one, a comm hook, DTRAIN_TUNE off or unset, a bad value).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <set>

#include "ddp_test_util.h"
#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "harness.h"

namespace dtrain::test {
namespace {

using Kind = DDPTuning::State;

// Five 512x512 layers in double (2 MiB of weight each): the candidate caps of 1-64 MiB make several
// distinct layouts.
torch::nn::Sequential wideNet() {
  torch::manual_seed(11);
  torch::nn::Sequential s;
  for (int i = 0; i < 5; ++i) {
    s->push_back(torch::nn::Linear(512, 512));
    if (i + 1 < 5) s->push_back(torch::nn::Tanh());
  }
  s->to(torch::kDouble);
  return s;
}

constexpr int kRows = 4;  // per rank

std::pair<at::Tensor, at::Tensor> wideBatch(int step, int world) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return {at::randn({world * kRows, 512}, g, torch::kDouble), at::randn({world * kRows, 512}, g, torch::kDouble)};
}

// One step of rank `rank`'s share under DDP (world > 0), or of the whole batch in one process (world 0
// with the batch of `of` ranks).
void step(torch::nn::Sequential& net, torch::optim::SGD& opt, int s, int rank, int world, int of) {
  auto [x, y] = wideBatch(s, of);
  if (world > 0) {
    x = x.narrow(0, rank * kRows, kRows);
    y = y.narrow(0, rank * kRows, kRows);
  }
  opt.zero_grad();
  torch::mse_loss(net->forward(x), y).backward();
  opt.step();
}

struct EnvVar {
  EnvVar(const char* name, const std::string& value) : name_(name) { setenv(name, value.c_str(), 1); }
  ~EnvVar() { unsetenv(name_); }
  const char* name_;
};

TEST(DdpTune, TriesEveryLayoutKeepsTheFastestTrainsAsOneProcessAndCaches) {
  TempDir tmp;
  EnvVar cache("DTRAIN_TUNE_CACHE", tmp.path() + "/tune.tsv");
  StoreServer server;
  constexpr int world = 2, rounds = 2;
  expectAllOk(runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    auto net = wideNet(), ref = wideNet();
    DDPOptions o;
    o.tune = DDPOptions::Tune::on;
    o.tune_rounds = rounds;
    DistributedDataParallel ddp(net.ptr(), pg, o);
    EXPECT_EQ(ddp.tuning().state, Kind::off);  // nothing before the first pass
    torch::optim::SGD opt(net->parameters(), 0.05), ref_opt(ref->parameters(), 0.05);
    int steps = 0;
    std::set<std::vector<std::vector<size_t>>> tried;  // the layouts the probing passes ran with
    do {
      step(net, opt, steps, rank, world, world);
      step(ref, ref_opt, steps, rank, 0, world);
      ++steps;
      if (steps == 1) {
        ASSERT_EQ(ddp.tuning().state, Kind::probing);
      }
      if (ddp.tuning().state == Kind::probing) tried.insert(ddp.bucketLayout());
    } while (ddp.tuning().state == Kind::probing && steps < 200);
    const DDPTuning t = ddp.tuning();
    ASSERT_EQ(t.state, Kind::tuned);
    const size_t n = t.candidates.size();
    ASSERT_GE(n, 3u) << "the caps should give several layouts of this 10 MiB model";
    // One first pass, then one pass per candidate per round.
    EXPECT_EQ(steps, 1 + rounds * static_cast<int>(n));
    int configured = 0;
    size_t best = 0;
    for (size_t c = 0; c < n; ++c) {
      configured += t.candidates[c].configured;
      ASSERT_EQ(t.candidates[c].ms.size(), static_cast<size_t>(rounds));
      EXPECT_GT(t.candidates[c].median_ms, 0.0);
      if (t.candidates[c].median_ms < t.candidates[best].median_ms) best = c;
      EXPECT_GT(t.candidates[c].buckets, 0u);
    }
    EXPECT_EQ(configured, 1) << "the configured 25 MiB is one of the layouts";
    // Each candidate, not only the winner: its caps, with the first bucket's at min(cap, 1 MiB), and how
    // many buckets they make of the ten parameters (gradients come last layer first, 9 down to 0; a layer
    // is its 2 MiB weight and its 4 KiB bias). 2 MiB gives 1 MiB's layout and 16 and 64 MiB give 8 MiB's,
    // which is the configured 25 MiB's: each layout counts once, under the sizes that named it first (the
    // configured ones win their own).
    struct Want {
      size_t mib, first_mib, buckets;
      bool configured;
    };
    const std::vector<Want> want{{1, 1, 5, false}, {4, 1, 3, false}, {25, 1, 2, true}};
    ASSERT_EQ(n, want.size());
    for (size_t c = 0; c < n; ++c) {
      EXPECT_EQ(t.candidates[c].bucket_bytes, want[c].mib << 20) << "candidate " << c;
      EXPECT_EQ(t.candidates[c].first_bucket_bytes, want[c].first_mib << 20) << "candidate " << c;
      EXPECT_EQ(t.candidates[c].buckets, want[c].buckets) << "candidate " << c;
      EXPECT_EQ(t.candidates[c].configured, want[c].configured) << "candidate " << c;
    }
    // ... and the buckets each probing pass ran with are those three layouts, parameter by parameter.
    const std::set<std::vector<std::vector<size_t>>> layouts{
        {{9, 8}, {7, 6}, {5, 4}, {3, 2}, {1, 0}},
        {{9, 8}, {7, 6, 5, 4}, {3, 2, 1, 0}},
        {{9, 8}, {7, 6, 5, 4, 3, 2, 1, 0}}};
    EXPECT_EQ(tried, layouts) << ::testing::PrintToString(tried);
    EXPECT_EQ(t.bucket_bytes, t.candidates[best].bucket_bytes);
    EXPECT_EQ(t.first_bucket_bytes, t.candidates[best].first_bucket_bytes);
    EXPECT_EQ(ddp.bucketLayout().size(), t.candidates[best].buckets);
    // Every rank chose the same.
    std::vector<int64_t> mine{static_cast<int64_t>(t.bucket_bytes), -static_cast<int64_t>(t.bucket_bytes)};
    pg->allreduce(mine.data(), 2, comm::DType::i64, comm::ReduceOp::max)->wait();
    EXPECT_EQ(mine[0], -mine[1]);
    // Training went on as one process on the whole batch, through every layout.
    for (int s = 0; s < 3; ++s, ++steps) {
      step(net, opt, steps, rank, world, world);
      step(ref, ref_opt, steps, rank, 0, world);
    }
    expectClose(*net, *ref, 1e-9, "tuned DDP against one process");

    // Rank 0 cached the choice under this job's key; a second run takes it after its first pass.
    if (rank == 0) {
      std::ifstream in(tmp.path() + "/tune.tsv");
      std::string line;
      ASSERT_TRUE(std::getline(in, line)) << "no tuning cache written";
      EXPECT_EQ(line.rfind(t.key + "\t" + std::to_string(t.bucket_bytes) + "\t", 0), 0u) << line;
      EXPECT_NE(t.key.find("world=2"), std::string::npos) << t.key;
    }
    pg->barrier()->wait();
    auto net2 = wideNet();
    torch::optim::SGD opt2(net2->parameters(), 0.05);
    DistributedDataParallel again(net2.ptr(), pg, o);
    step(net2, opt2, 0, rank, world, world);
    EXPECT_EQ(again.tuning().state, Kind::cached);
    EXPECT_EQ(again.tuning().bucket_bytes, t.bucket_bytes);
    EXPECT_EQ(again.bucketLayout().size(), t.candidates[best].buckets);
    // refresh: tunes again despite the cache.
    auto net3 = wideNet();
    torch::optim::SGD opt3(net3->parameters(), 0.05);
    o.tune = DDPOptions::Tune::refresh;
    DistributedDataParallel fresh(net3.ptr(), pg, o);
    step(net3, opt3, 0, rank, world, world);
    EXPECT_EQ(fresh.tuning().state, Kind::probing);
  }));
}

TEST(DdpTune, AHookStopsItAndOneRankOrOffNeverStarts) {
  StoreServer server;
  TempDir tmp;
  EnvVar cache("DTRAIN_TUNE_CACHE", tmp.path() + "/tune.tsv");
  expectAllOk(runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    auto net = wideNet();
    DDPOptions o;
    o.tune = DDPOptions::Tune::on;
    DistributedDataParallel ddp(net.ptr(), pg, o);
    torch::optim::SGD opt(net->parameters(), 0.05);
    step(net, opt, 0, rank, 2, 2);
    step(net, opt, 1, rank, 2, 2);  // the first candidate's pass
    ASSERT_EQ(ddp.tuning().state, Kind::probing);
    ddp.registerCommHook(fp16CompressHook(/*always=*/true));
    const DDPTuning t = ddp.tuning();
    EXPECT_EQ(t.state, Kind::off);
    EXPECT_NE(t.why_off.find("comm hook"), std::string::npos) << t.why_off;
    EXPECT_EQ(t.bucket_bytes, o.bucket_bytes);
    EXPECT_EQ(t.first_bucket_bytes, o.first_bucket_bytes);
    for (int s = 2; s < 5; ++s) step(net, opt, s, rank, 2, 2);
    EXPECT_EQ(ddp.tuning().state, Kind::off);
    // Off (the default without DTRAIN_TUNE), whatever the passes.
    auto net2 = wideNet();
    torch::optim::SGD opt2(net2->parameters(), 0.05);
    DistributedDataParallel plain(net2.ptr(), pg);
    step(net2, opt2, 0, rank, 2, 2);
    step(net2, opt2, 1, rank, 2, 2);
    EXPECT_EQ(plain.tuning().state, Kind::off);
    EXPECT_NE(plain.tuning().why_off.find("DTRAIN_TUNE"), std::string::npos) << plain.tuning().why_off;
  }));
  // One rank: nothing to tune.
  auto net = wideNet();
  DDPOptions o;
  o.tune = DDPOptions::Tune::on;
  DistributedDataParallel alone(net.ptr(), comm::ProcessGroup::create(nullptr, 0, 1), o);
  torch::optim::SGD opt(net->parameters(), 0.05);
  step(net, opt, 0, 0, 1, 1);
  EXPECT_EQ(alone.tuning().state, Kind::off);
  EXPECT_NE(alone.tuning().why_off.find("one rank"), std::string::npos) << alone.tuning().why_off;
}

TEST(DdpTune, BadSettingsAreNamed) {
  auto net = wideNet();
  auto pg = comm::ProcessGroup::create(nullptr, 0, 1);
  {
    EnvVar v("DTRAIN_TUNE", "sometimes");
    try {
      DistributedDataParallel ddp(net.ptr(), pg);
      FAIL() << "DTRAIN_TUNE=sometimes was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("DTRAIN_TUNE='sometimes'"), std::string::npos) << e.what();
    }
    DDPOptions explicit_off;
    explicit_off.tune = DDPOptions::Tune::off;  // an explicit setting does not read the variable
    EXPECT_NO_THROW(DistributedDataParallel(net.ptr(), pg, explicit_off));
  }
  DDPOptions o;
  o.tune_rounds = 0;
  EXPECT_THROW(DistributedDataParallel(net.ptr(), pg, o), InvalidArgument);
}

}  // namespace
}  // namespace dtrain::test
