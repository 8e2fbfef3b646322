// MIL-NCE with ZeRO stages 2 and 3 (milnce train --zero, FSDP per encoder): the same steps as one
// process with DDP, per-rank checkpoints resumed at another world size with the same global batch and
// the parameters as saved, restoreSharded from in-memory parts equal to the directory overload (FSDP and
// ZeroRedundancyOptimizer), and the options ZeRO refuses.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <fmt/format.h>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "dtrain/checkpoint.h"
#include "dtrain/comm/store.h"
#include "dtrain/fsdp.h"
#include "dtrain/zero.h"
#include "harness.h"
#include "milnce_test_util.h"
#include "milnce/data.h"
#include "milnce/model.h"
#include "milnce/train.h"

namespace milnce {
namespace {

using test::lossesOf;
using test::worldOfOne;


std::shared_ptr<dtrain::comm::ProcessGroup> groupOf(const dtrain::test::StoreServer& server, int rank, int world) {
  dtrain::comm::GroupOptions go;
  go.timeout = std::chrono::seconds(60);
  return dtrain::comm::ProcessGroup::create(server.client(), rank, world, go);
}

dtrain::Distributed worldOf(const dtrain::test::StoreServer& server, int rank, int world) {
  auto pg = groupOf(server, rank, world);
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(r);
  return dtrain::Distributed(pg, pg, dtrain::comm::WorldInfo{rank, world, rank, world, "explicit", 0, 1, "", {ranks}});
}

void generate(const std::string& out) {
  GenOptions g;
  g.out = out;
  g.videos = 120;
  g.eval_videos = 20;
  g.misalign = 0.3;
  generateData(g);
}

TrainOptions small(const std::string& data) {
  TrainOptions o;
  o.data = data;
  o.eval = false;
  o.progress = dtrain::ProgressOptions::Mode::off;
  o.model.hidden = 64;
  o.model.embed = 32;
  return o;
}

// Largest |a - b| over every tensor of `want`, relative to max(1e-3, max |want|) per tensor.
double maxRelDiff(const std::map<std::string, at::Tensor>& want, const std::map<std::string, at::Tensor>& got) {
  double worst = 0;
  for (const auto& [name, t] : want) {
    auto it = got.find(name);
    EXPECT_NE(it, got.end()) << name;
    if (it == got.end()) continue;
    double scale = std::max(1e-3, t.abs().max().item<double>());
    worst = std::max(worst, (t - it->second).abs().max().item<double>() / scale);
  }
  return worst;
}

class ZeroStage : public testing::TestWithParam<int> {};

// ZeRO on 2 ranks (each its half of every micro-batch, 2 micro-batches a step: noSync in between) takes
// the same 3 steps as DDP in one process on the whole batches: losses and parameters agree up to the
// order of the gradient sums.
TEST_P(ZeroStage, TwoRanksMatchOneProcess) {
  dtrain::test::TempDir dir;
  generate(dir.path());
  dtrain::test::StoreServer server;
  auto results = dtrain::test::runRanks(2, [&](int rank) {
    Dataset data = Dataset::load(dir.path());
    TrainOptions o = small(dir.path());
    o.accum = 2;
    o.lr = 3e-3;
    auto two = worldOf(server, rank, 2);
    auto one = worldOfOne();
    TrainOptions so = o;
    so.zero = GetParam();
    Trainer sharded(two, data, so);
    Trainer ref(one, data, o);
    EXPECT_EQ(sharded.sharded(), GetParam() >= 2);
    EXPECT_LT(maxRelDiff(ref.fullState(), sharded.fullState()), 1e-7);  // the same initial values
    std::mt19937_64 rng(7);
    for (int64_t step = 0; step < 3; ++step) {
      for (int a = 0; a < 2; ++a) {
        std::vector<int64_t> rows;
        for (int64_t i = 0; i < 16; ++i) rows.push_back((step * 2 + a) * 16 + i);
        Batch global = makeBatch(data, rows, o.loader, rng);
        Batch local{global.video.narrow(0, rank * 8, 8), global.text.narrow(0, rank * 8, 8)};
        const double l2 = sharded.lossAndBackward(local, a == 1), l1 = ref.lossAndBackward(global, a == 1);
        EXPECT_NEAR(l2, l1, 1e-4 * std::abs(l1)) << "step " << step << " micro-batch " << a;
      }
      sharded.optimizerStep(step, 10, 2);
      ref.optimizerStep(step, 10, 2);
    }
    // (Adam divides by the root of the squared gradients: where a gradient is near 0, a difference in
    // its last bits moves the update by up to the learning rate; measured 1e-4 at most.)
    EXPECT_LT(maxRelDiff(ref.fullState(), sharded.fullState()), 5e-4);
    // The evaluation model holds the gathered values (collective on both ranks; the model at stage 1).
    auto eval = sharded.evalModel()->named_parameters();
    for (const auto& [name, t] : sharded.fullState()) EXPECT_TRUE(torch::equal(eval[name], t)) << name;
  });
  dtrain::test::expectAllOk(results);
}

INSTANTIATE_TEST_SUITE_P(Stages, ZeroStage, testing::Values(1, 2, 3));

// The newest per-rank checkpoint directory under `checkpoints` and every rank's file in it.
std::vector<dtrain::CheckpointState> partsOf(const std::string& ckpt_dir, int world) {
  auto parts = dtrain::Checkpointer::loadRanks(ckpt_dir);
  EXPECT_EQ(static_cast<int>(parts.size()), world) << ckpt_dir;
  return parts;
}

// Data in DIR/data; --zero `zero`, batch 8 x accum 2, one epoch, a checkpoint every step, stopped after
// step 1; out: DIR/run.
TrainOptions stoppedAfterStepOne(const std::string& dir, int zero) {
  generate(dir + "/data");
  TrainOptions o = small(dir + "/data");
  o.batch = 8;
  o.accum = 2;
  o.epochs = 1;
  o.checkpoint_every = 1;
  o.stop_after_steps = 1;
  o.zero = zero;
  o.out = dir + "/run";
  return o;
}

// Saved by 3 ranks with --zero 2 (batch 8 x accum 2 x 3 = 48 clips a step) after step 1, resumed by 2:
// accum 3 keeps the global batch; the restored parameters are the saved shards put together (and match
// the same step under DDP); training goes on to the epoch's end.
TEST(ZeroTraining, ResumesAtAnotherWorldSize) {
  dtrain::test::TempDir dir;
  TrainOptions o = stoppedAfterStepOne(dir.path(), 2);
  TrainOptions ddp = o;
  ddp.zero = 0;
  ddp.out = dir.path() + "/ddp";
  {
    dtrain::test::StoreServer server;
    dtrain::test::expectAllOk(dtrain::test::runRanks(3, [&](int rank) { train(worldOf(server, rank, 3), o); }));
  }
  {
    dtrain::test::StoreServer server;
    dtrain::test::expectAllOk(dtrain::test::runRanks(3, [&](int rank) { train(worldOf(server, rank, 3), ddp); }));
  }
  const std::string saved = o.out + "/checkpoints/" + dtrain::Checkpointer::dirName(0, 1);
  const auto parts = partsOf(saved, 3);
  EXPECT_EQ(parts[0].scheduler.at("global_batch"), 48);
  EXPECT_EQ(parts[0].samples, 48);
  EXPECT_EQ(parts[2].step, 1);
  ASSERT_TRUE(parts[1].sharded.count("video.0.shard") && parts[1].sharded.count("text.0.exp_avg"));
  auto ddp_state = dtrain::Checkpointer(ddp.out + "/checkpoints").loadLatest();
  ASSERT_TRUE(ddp_state.has_value());
  EXPECT_EQ(ddp_state->step, 1);

  {
    dtrain::test::StoreServer server;
    dtrain::test::expectAllOk(dtrain::test::runRanks(2, [&](int rank) {
      auto two = worldOf(server, rank, 2);
      Dataset data = Dataset::load(o.data);
      Trainer t(two, data, o);
      t.restoreTraining(parts, saved);
      const auto full = t.fullState();
      // Each encoder's one unit: its trainable parameters in order, flat, cut into the 3 old shards.
      for (const std::string enc : {"video", "text"}) {
        std::vector<at::Tensor> shards;
        for (const auto& p : parts) shards.push_back(p.sharded.at(enc + ".0.shard"));
        const at::Tensor flat = torch::cat(shards);
        int64_t offset = 0;
        for (const auto& item : t.model()->named_children()) {
          if (item.key() != enc) continue;
          for (const auto& p : item.value()->named_parameters()) {
            if (!p.value().requires_grad()) continue;
            const at::Tensor& got = full.at(enc + "." + p.key());
            EXPECT_TRUE(torch::equal(flat.narrow(0, offset, got.numel()).view(got.sizes()), got)) << p.key();
            offset += got.numel();
          }
        }
        EXPECT_GT(offset, 0);
      }
      std::map<std::string, at::Tensor> want;
      for (const auto& [name, v] : ddp_state->model)
        if (full.count(name)) want[name] = v;
      EXPECT_EQ(want.size(), full.size());
      EXPECT_LT(maxRelDiff(want, full), 1e-4);
    }));
  }

  o.resume = true;
  o.stop_after_steps = 0;
  dtrain::test::StoreServer server;
  auto results = dtrain::test::runRanks(2, [&](int rank) { train(worldOf(server, rank, 2), o); });
  dtrain::test::expectAllOk(results);
  EXPECT_NE(results[0].output.find("resumed from epoch 0, step 1, sample 48 of the epoch (world 2, accum 3)"),
            std::string::npos)
      << results[0].output;
  // 120 clips, 48 read: 72 left, 36 per rank, one step of 8 x 3 each, then the epoch's checkpoint.
  const auto done = partsOf(o.out + "/checkpoints/" + dtrain::Checkpointer::dirName(1, 2), 2);
  EXPECT_EQ(done[0].step, 2);
  EXPECT_EQ(done[1].epoch, 1);
  EXPECT_EQ(done[0].scheduler.at("global_batch"), 48);
  std::ifstream m(o.out + "/metrics.jsonl");
  std::vector<int> steps, zero;
  for (std::string line; std::getline(m, line);) {
    auto j = nlohmann::json::parse(line);
    if (j["kind"] == "step") steps.push_back(j["step"]);
    if (j["kind"] == "run") zero.push_back(j["config"]["zero"]);
  }
  EXPECT_EQ(steps, (std::vector<int>{1, 2}));
  EXPECT_EQ(zero, (std::vector<int>{2, 2}));
}

// Stage 1 (DDP, the optimizer state sharded): saved by 3 ranks, resumed by 2 with the same global batch;
// the model from rank 0's file, each rank's Adam state from the owners' files; a run with another
// --zero refuses the checkpoint.
TEST(ZeroTraining, StageOneResumesAtAnotherWorldSize) {
  dtrain::test::TempDir dir;
  TrainOptions o = stoppedAfterStepOne(dir.path(), 1);
  {
    dtrain::test::StoreServer server;
    dtrain::test::expectAllOk(dtrain::test::runRanks(3, [&](int rank) { train(worldOf(server, rank, 3), o); }));
  }
  const std::string saved = o.out + "/checkpoints/" + dtrain::Checkpointer::dirName(0, 1);
  const auto parts = partsOf(saved, 3);
  ASSERT_TRUE(parts[0].sharded.count("zero.param_groups"));
  {
    dtrain::test::StoreServer server;
    dtrain::test::expectAllOk(dtrain::test::runRanks(2, [&](int rank) {
      Dataset data = Dataset::load(o.data);
      Trainer t(worldOf(server, rank, 2), data, o);
      t.restoreTraining(parts, saved);
      for (const auto& [name, v] : t.fullState()) EXPECT_TRUE(torch::equal(v, parts[0].model.at(name))) << name;
      // Every parameter's Adam state is on its owner after the restore: one step changes every parameter.
      EXPECT_GT(t.optimizer().state().size(), 0u);
    }));
  }
  TrainOptions ddp = o;
  ddp.zero = 0;
  ddp.resume = true;
  EXPECT_NE(dtrain::test::errorOf([&] { train(worldOfOne(), ddp); }).find("per-rank checkpoints (ckpt-000000-000000001), saved with --zero 1, 2 or 3; this run has --zero 0"),
            std::string::npos);
  TrainOptions fsdp = ddp;
  fsdp.zero = 2;
  EXPECT_NE(dtrain::test::errorOf([&] { train(worldOfOne(), fsdp); }).find("was saved with --zero 1, this run has --zero 2"),
            std::string::npos);
  o.resume = true;
  o.stop_after_steps = 0;
  dtrain::test::StoreServer server;
  auto results = dtrain::test::runRanks(2, [&](int rank) { train(worldOf(server, rank, 2), o); });
  dtrain::test::expectAllOk(results);
  EXPECT_NE(results[0].output.find("resumed from epoch 0, step 1, sample 48 of the epoch (world 2, accum 3)"),
            std::string::npos)
      << results[0].output;
  const auto done = partsOf(o.out + "/checkpoints/" + dtrain::Checkpointer::dirName(1, 2), 2);
  EXPECT_EQ(done[0].scheduler.at("global_batch"), 48);
}


// Saved with --zero 2 by 3 ranks on 3 "nodes" (agents: stores served by this test process), to disk and
// to peer memory after step 1; node 0's agent is then lost. Resumed by 2 ranks from memory (node 0's
// shard from node 1's agent) and, in a copy of the run, from disk: the same training, bit for bit.
TEST(ZeroTraining, ResumesFromPeerMemoryAsFromDisk) {
  dtrain::test::TempDir dir;
  TrainOptions o = stoppedAfterStepOne(dir.path(), 2);
  o.epochs = 2;
  o.snapshot_every = 1;
  o.out = dir.path() + "/memory";
  std::vector<std::unique_ptr<dtrain::comm::TcpStoreServer>> agents;
  for (int i = 0; i < 3; ++i) agents.push_back(std::make_unique<dtrain::comm::TcpStoreServer>("127.0.0.1", 0));
  auto stores = [&](std::vector<int> nodes) {
    std::string list;
    for (int n : nodes) list += (list.empty() ? "" : ",") + fmt::format("127.0.0.1:{}", agents[static_cast<size_t>(n)]->port());
    return list;
  };
  // One rank per node, as on the emulated cluster.
  auto onNodes = [](const dtrain::test::StoreServer& server, int rank, int world) {
    std::vector<std::vector<int>> nodes;
    for (int r = 0; r < world; ++r) nodes.push_back({r});
    return dtrain::Distributed(groupOf(server, rank, world), nullptr,
                               dtrain::comm::WorldInfo{rank, world, 0, 1, "explicit", rank, world, "", nodes});
  };
  o.snapshot_stores = stores({0, 1, 2});
  {
    dtrain::test::StoreServer server;
    dtrain::test::expectAllOk(dtrain::test::runRanks(3, [&](int rank) { train(onNodes(server, rank, 3), o); }));
  }
  std::filesystem::copy(o.out, dir.path() + "/disk", std::filesystem::copy_options::recursive);
  agents[0].reset();
  o.resume = true;
  o.stop_after_steps = 0;
  o.snapshot_stores = stores({1, 2});
  {
    dtrain::test::StoreServer server;
    auto results = dtrain::test::runRanks(2, [&](int rank) { train(onNodes(server, rank, 2), o); });
    dtrain::test::expectAllOk(results);
    EXPECT_NE(results[0].output.find("resumed from peer memory: the snapshot of step 1 taken by 3 rank(s) in round 0"),
              std::string::npos) << results[0].output;
  }
  TrainOptions d = o;
  d.out = dir.path() + "/disk";
  d.snapshot_every = 0;
  {
    dtrain::test::StoreServer server;
    dtrain::test::expectAllOk(dtrain::test::runRanks(2, [&](int rank) { train(worldOf(server, rank, 2), d); }));
  }
  const auto a = lossesOf(o.out + "/metrics.jsonl"), b = lossesOf(d.out + "/metrics.jsonl");
  ASSERT_GE(a.size(), 3u);  // step 1 on 3 ranks, then the rest on 2 (the first run's records kept)
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "record " << i;
}

// restoreSharded from every old rank's state in memory equals restoreSharded from the directory, for
// FSDP (two instances with their own checkpoint_prefix in one state) and ZeroRedundancyOptimizer.
TEST(ZeroTraining, RestoreShardedFromPartsEqualsDirectory) {
  dtrain::test::TempDir dir;
  auto model = [] {
    torch::manual_seed(1);
    return torch::nn::Sequential(torch::nn::Linear(5, 7), torch::nn::Tanh(), torch::nn::Linear(7, 3));
  };
  auto fsdpOf = [](torch::nn::Sequential seq, std::shared_ptr<dtrain::comm::ProcessGroup> pg, const std::string& prefix) {
    dtrain::FsdpOptions fo;
    fo.stage = 2;
    fo.units = {2, 1};
    fo.checkpoint_prefix = prefix;
    return std::make_unique<dtrain::FullyShardedDataParallel>(seq, pg, fo);
  };
  auto adam = [](std::vector<torch::optim::OptimizerParamGroup> g) {
    return std::make_unique<torch::optim::Adam>(std::move(g), torch::optim::AdamOptions(1e-2));
  };
  {
    dtrain::test::StoreServer server;
    dtrain::test::expectAllOk(dtrain::test::runRanks(3, [&](int rank) {
      auto pg = groupOf(server, rank, 3);
      auto a = fsdpOf(model(), pg, "a"), b = fsdpOf(model(), pg, "b");
      auto shards = a->shards();
      for (auto& s : b->shards()) shards.push_back(s);
      torch::optim::Adam opt(shards, torch::optim::AdamOptions(1e-2));
      auto zmodel = model();
      dtrain::ZeroRedundancyOptimizer zero(zmodel->parameters(), adam, pg);
      torch::manual_seed(10 + rank);
      auto x = torch::randn({4, 5});
      (a->forward(x).sum() + b->forward(x).pow(2).sum()).backward();
      zmodel->forward(x).sum().backward();
      opt.step();
      zero.step();
      dtrain::CheckpointState s;
      a->captureSharded(s, opt);
      b->captureSharded(s, opt);
      zero.captureSharded(s);
      dtrain::Checkpointer(dir.path(), pg).save(s);
    }));
  }
  const std::string saved = dir.path() + "/" + dtrain::Checkpointer::dirName(0, 0);
  const auto parts = partsOf(saved, 3);
  dtrain::test::StoreServer server;
  dtrain::test::expectAllOk(dtrain::test::runRanks(2, [&](int rank) {
    auto pg = groupOf(server, rank, 2);
    auto restored = [&](bool from_parts) {
      auto a = fsdpOf(model(), pg, "a"), b = fsdpOf(model(), pg, "b");
      auto shards = a->shards();
      for (auto& s : b->shards()) shards.push_back(s);
      torch::optim::Adam opt(shards, torch::optim::AdamOptions(1e-3));
      auto zmodel = model();
      dtrain::ZeroRedundancyOptimizer zero(zmodel->parameters(), adam, pg);
      for (auto* f : {a.get(), b.get()}) {
        if (from_parts) f->restoreSharded(parts, opt, "parts");
        else f->restoreSharded(saved, opt);
      }
      if (from_parts) zero.restoreSharded(parts, "parts");
      else zero.restoreSharded(saved);
      dtrain::CheckpointState s;
      a->captureSharded(s, opt);
      b->captureSharded(s, opt);
      zero.captureSharded(s);
      EXPECT_EQ(opt.param_groups()[0].options().get_lr(), 1e-2);  // the saved options
      return s.sharded;
    };
    const auto dir_state = restored(false), parts_state = restored(true);
    ASSERT_EQ(dir_state.size(), parts_state.size());
    EXPECT_TRUE(dir_state.count("a.0.exp_avg") && dir_state.count("b.1.shard"));
    for (const auto& [name, t] : dir_state) EXPECT_TRUE(torch::equal(t, parts_state.at(name))) << name;
    EXPECT_NE(dtrain::test::errorOf([&] {
                auto a = fsdpOf(model(), pg, "a");
                torch::optim::Adam opt(a->shards(), torch::optim::AdamOptions(1e-3));
                a->restoreSharded(std::vector<dtrain::CheckpointState>{}, opt, "no snapshots");
              }).find("no snapshots"),
              std::string::npos);
  }));
}

// --zero 2/3 with options FSDP cannot take, and stage 1: errors naming the options.
TEST(ZeroTraining, RefusesOptionsItCannotTake) {
  dtrain::test::TempDir dir;
  generate(dir.path());
  Dataset data = Dataset::load(dir.path());
  auto one = worldOfOne();
  auto error = [&](int zero, const std::function<void(TrainOptions&)>& set) {
    TrainOptions o = small(dir.path());
    o.zero = zero;
    set(o);
    return dtrain::test::errorOf([&] { Trainer t(one, data, o); });
  };
  EXPECT_NE(error(2, [](TrainOptions& o) { o.comm_hook = "fp16"; }).find("--zero 2 and --comm-hook fp16"), std::string::npos);
  EXPECT_NE(error(3, [](TrainOptions& o) { o.local_sgd = 2; }).find("--zero 3 and --local-sgd 2"), std::string::npos);
  EXPECT_NE(error(2, [](TrainOptions& o) { o.optimizer = "lamb"; }).find("--zero 2 and --optimizer lamb"), std::string::npos);
  EXPECT_NE(error(2, [](TrainOptions& o) { o.optimizer = "lars"; }).find("--optimizer lars"), std::string::npos);
  EXPECT_NE(error(1, [](TrainOptions& o) { o.local_sgd = 2; }).find("--zero 1 and --local-sgd 2"), std::string::npos);
  EXPECT_EQ(error(1, [](TrainOptions& o) { o.optimizer = "lamb"; }), "no dtrain::Error");
  EXPECT_NE(error(4, [](TrainOptions&) {}).find("--zero 4"), std::string::npos);
  EXPECT_EQ(error(2, [](TrainOptions&) {}), "no dtrain::Error");
}

}  // namespace
}  // namespace milnce
