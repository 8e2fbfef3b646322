// The timeline of a 2-rank DistributedDataParallel run (DTRAIN_TIMELINE set, ranks started by
// initWorld()), merged by dtrain-trace: every bucket's allreduce appears on both ranks with the same
// sequence number, the library's forward/backward/bucket events are there, the file has the fields
// of Chrome's format (X, M, s/f). And a 2-stage pipeline's micro-batches and a checkpoint's save.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <map>
#include <set>

#include "ddp_test_util.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm/rendezvous.h"
#include "dtrain/ddp.h"
#include "dtrain/pipeline.h"
#include "dtrain/trace.h"
#include "harness.h"
#include "timeline_util.h"

namespace dtrain::test {
namespace {

constexpr int kSteps = 3;

// Rank `rank` of 2, its timeline in `dir`, on the default transport.
std::shared_ptr<comm::ProcessGroup> startRank(const StoreServer& server, int rank, const std::string& dir) {
  for (const char* v : {"DTRAIN_TRANSPORT", "DTRAIN_INIT_METHOD", "DTRAIN_RESTART_COUNT", "DTRAIN_TIMELINE_SKEW_US"})
    unsetenv(v);
  setRankEnv(server, rank, 2);
  setenv("DTRAIN_TIMELINE", dir.c_str(), 1);
  return comm::initWorld();
}

TEST(DDPTimeline, EveryBucketsAllreduceOnBothRanks) {
  TempDir dir;
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto world = startRank(server, rank, dir.path());
    Net model = makeNet();
    DDPOptions o;
    o.bucket_bytes = o.first_bucket_bytes = 256;  // several buckets
    DistributedDataParallel ddp(model.ptr(), world, o);
    auto opt = makeOpt("sgd", *model);
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step, 2);
      opt->zero_grad();
      auto loss = torch::nn::functional::cross_entropy(ddp.forward(model, x.narrow(0, rank * kPerRank, kPerRank)),
                                                       y.narrow(0, rank * kPerRank, kPerRank));
      loss.backward();
      DTRAIN_SPAN("optimizer.step", "optim");
      opt->step();
    }
    dtrain::trace::flush();
  });
  expectAllOk(results);
  Merged m = mergeTimeline(dir.path());
  ASSERT_EQ(m.exit_code, 0) << m.output;
  const json& trace = m.trace;
  ASSERT_TRUE(trace.at("traceEvents").is_array());
  for (const auto& e : trace.at("traceEvents")) {
    ASSERT_TRUE(e.contains("ph") && e.contains("pid") && e.contains("name")) << e;
    if (e["ph"] == "X") checkComplete(e);
  }
  std::vector<std::vector<uint64_t>> bucket_seqs(2);
  std::vector<std::set<uint64_t>> allreduce_seqs(2);
  for (int pid = 0; pid < 2; ++pid) {
    for (const auto& e : eventsOf(trace, "X", pid, "allreduce")) {
      const auto& a = e.at("args");
      for (const char* k : {"group", "seq", "op", "dtype", "count", "bytes", "algorithm", "peers"})
        EXPECT_TRUE(a.contains(k)) << k << " missing: " << e;
      EXPECT_EQ(e.at("cat"), "comm");
      EXPECT_EQ(a.at("group"), "world");
      EXPECT_EQ(a.at("dtype"), "f64");
      EXPECT_EQ(a.at("peers"), json::array({1 - pid}));
      EXPECT_EQ(a.at("bytes").get<int64_t>(), a.at("count").get<int64_t>() * 8);
      allreduce_seqs[pid].insert(a.at("seq").get<uint64_t>());
    }
    // Buckets: async slices (b/e) from their last gradient to their allreduce's end, naming its seq.
    for (const auto& b : eventsOf(trace, "b", pid)) {
      EXPECT_EQ(b.at("cat"), "ddp");
      EXPECT_EQ(b.at("name").get<std::string>().rfind("bucket ", 0), 0u) << b;
      EXPECT_GT(b.at("args").at("bytes").get<int64_t>(), 0);
      bucket_seqs[pid].push_back(b.at("args").at("seq").get<uint64_t>());
    }
    EXPECT_EQ(eventsOf(trace, "e", pid).size(), bucket_seqs[pid].size());
    EXPECT_GE(bucket_seqs[pid].size(), 2u * kSteps) << "several buckets per step";
    for (uint64_t s : bucket_seqs[pid]) EXPECT_TRUE(allreduce_seqs[pid].count(s)) << "bucket's allreduce seq " << s;
    EXPECT_EQ(bucket_seqs[pid].size(), allreduce_seqs[pid].size()) << "every allreduce is a bucket's";
    EXPECT_EQ(eventsOf(trace, "X", pid, "forward").size(), static_cast<size_t>(kSteps));
    EXPECT_EQ(eventsOf(trace, "X", pid, "backward").size(), static_cast<size_t>(kSteps));
    EXPECT_EQ(eventsOf(trace, "X", pid, "optimizer.step").size(), static_cast<size_t>(kSteps));
    EXPECT_FALSE(eventsOf(trace, "X", pid, "broadcast").empty()) << "DDP's initial parameter broadcast";
    std::set<std::string> meta;
    for (const auto& e : eventsOf(trace, "M", pid)) meta.insert(e.at("name").get<std::string>() + ":" +
                                                                 e.at("args").value("name", std::string()));
    EXPECT_TRUE(meta.count("process_name:rank " + std::to_string(pid))) << "rank " << pid;
    EXPECT_TRUE(meta.count("thread_name:main")) << "rank " << pid;
    std::set<int64_t> named;
    for (const auto& t : eventsOf(trace, "M", pid, "thread_name")) named.insert(t.at("tid").get<int64_t>());
    for (const auto& e : eventsOf(trace, "X", pid)) EXPECT_TRUE(named.count(e.at("tid"))) << "unnamed thread: " << e;
  }
  EXPECT_EQ(bucket_seqs[0], bucket_seqs[1]);
  EXPECT_EQ(allreduce_seqs[0], allreduce_seqs[1]);
  // Messages between the ranks (the tree broadcasts of DDP's start-up at least), each received after sent.
  EXPECT_GT(checkFlows(trace), 0u);
}

// Stage s's micro-batch events: a forward and a backward per micro-batch per step, the sends between
// the stages as flows; rank 0 saves a checkpoint.
TEST(DDPTimeline, PipelineMicroBatchesAndCheckpointSave) {
  TempDir dir, ckpt;
  StoreServer server;
  constexpr int kMicro = 3;
  auto results = runRanks(2, [&](int rank) {
    auto world = startRank(server, rank, dir.path());
    torch::manual_seed(3);
    torch::nn::Sequential stage = rank == 0 ? torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh())
                                            : torch::nn::Sequential(torch::nn::Linear(8, 3));
    stage->to(torch::kDouble);
    PipelineOptions po;
    po.micro_batches = kMicro;
    Pipeline pipe(stage, world, po);
    auto [x, y] = batch(0, 3);
    for (int step = 0; step < 2; ++step)
      pipe.step(x, y, [](const at::Tensor& o, const at::Tensor& t) { return torch::nn::functional::cross_entropy(o, t); });
    Checkpointer ck(ckpt.path(), 1, rank == 0);
    CheckpointState st;
    st.captureModel(*stage);
    ck.save(st);
    dtrain::trace::flush();
  });
  expectAllOk(results);
  Merged m = mergeTimeline(dir.path());
  ASSERT_EQ(m.exit_code, 0) << m.output;
  for (int pid = 0; pid < 2; ++pid) {
    for (int mb = 0; mb < kMicro; ++mb) {
      for (const char* kind : {"fwd", "bwd"}) {
        auto ev = eventsOf(m.trace, "X", pid, fmt::format("pipeline {} mb={}", kind, mb));
        ASSERT_EQ(ev.size(), 2u) << "rank " << pid << " " << kind << " mb=" << mb;
        EXPECT_EQ(ev[0].at("cat"), "pipeline");
        EXPECT_EQ(ev[0].at("args").at("stage"), pid);
      }
    }
    EXPECT_EQ(eventsOf(m.trace, "X", pid, "checkpoint save").size(), 1u)
        << "every rank calls save (rank 0 writes)";
  }
  EXPECT_GT(checkFlows(m.trace), static_cast<size_t>(2 * kMicro)) << "activations and gradients between the stages";
}

}  // namespace
}  // namespace dtrain::test
