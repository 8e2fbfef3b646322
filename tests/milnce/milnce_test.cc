// The MIL-NCE job: the loss and its gradient against closed forms and an independent PyTorch
// computation, world 2 against world 1 on the same global batch, bit-for-bit resume, and the point of
// MIL-NCE: with misaligned narrations, K=4 candidate captions retrieve better than K=1.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <map>
#include <set>
#include <sstream>

#include "dtrain/checkpoint.h"
#include "harness.h"
#include "milnce_test_util.h"
#include "milnce/data.h"
#include "milnce/model.h"
#include "milnce/train.h"

namespace milnce {
namespace {

using test::lossesOf;
using test::worldOfOne;


TEST(MilNceLoss, HandCheckedCases) {
  // One clip, two candidates: numerator = lse(a, b), denominator = lse(a, b, a, b) = lse(a, b) + log 2.
  auto v = torch::tensor({{1.0, 2.0}}, torch::kDouble);
  auto t = torch::tensor({{0.5, -1.0}, {3.0, 0.25}}, torch::kDouble);
  EXPECT_NEAR(milNceLoss(v, t).item<double>(), std::log(2.0), 1e-12);
  // Two clips, one candidate each: x = [[a, b], [c, d]];
  // loss = mean(lse(a, b, a, c) - a, lse(c, d, b, d) - d).
  v = torch::tensor({{1.0, 0.0}, {0.0, 1.0}}, torch::kDouble);
  t = torch::tensor({{2.0, 1.0}, {-1.0, 3.0}}, torch::kDouble);
  double a = 2, b = -1, c = 1, d = 3;
  auto lse = [](std::vector<double> xs) {
    double m = *std::max_element(xs.begin(), xs.end()), s = 0;
    for (double x : xs) s += std::exp(x - m);
    return m + std::log(s);
  };
  double want = 0.5 * ((lse({a, b, a, c}) - a) + (lse({c, d, b, d}) - d));
  EXPECT_NEAR(milNceLoss(v, t).item<double>(), want, 1e-12);
}

// The loss and its gradients equal benches/peers/milnce_torch.py's `milnce` (the reference code's formula),
// run by Python's PyTorch on the same inputs.
TEST(MilNceLoss, MatchesPyTorchReference) {
  dtrain::test::TempDir dir;
  torch::manual_seed(3);
  auto v = torch::randn({6, 8}, torch::kDouble).requires_grad_();
  auto t = torch::randn({18, 8}, torch::kDouble).requires_grad_();  // K = 3
  auto loss = milNceLoss(v, t);
  loss.backward();
  writeNpy(dir.path() + "/v.npy", v.detach().to(torch::kFloat));
  writeNpy(dir.path() + "/t.npy", t.detach().to(torch::kFloat));
  std::string out = dtrain::test::runPython(
      "import importlib.util, sys, numpy as np, torch\n"
      "spec = importlib.util.spec_from_file_location('ref', '" DTRAIN_SOURCE_DIR "/benches/peers/milnce_torch.py')\n"
      "ref = importlib.util.module_from_spec(spec); spec.loader.exec_module(ref)\n"
      "d = '" + dir.path() + "'\n"
      "v = torch.from_numpy(np.load(d + '/v.npy')).double().requires_grad_()\n"
      "t = torch.from_numpy(np.load(d + '/t.npy')).double().requires_grad_()\n"
      "l = ref.milnce(v, t); l.backward()\n"
      "np.save(d + '/gv.npy', v.grad.float().numpy()); np.save(d + '/gt.npy', t.grad.float().numpy())\n"
      "print(repr(l.item()))\n");
  ASSERT_FALSE(out.empty());
  // Inputs went through float32 files: compare at float precision.
  auto vf = v.detach().to(torch::kFloat).to(torch::kDouble), tf = t.detach().to(torch::kFloat).to(torch::kDouble);
  EXPECT_NEAR(std::stod(out), milNceLoss(vf, tf).item<double>(), 1e-5) << out;
  auto gv = readNpy(dir.path() + "/gv.npy").to(torch::kDouble), gt = readNpy(dir.path() + "/gt.npy").to(torch::kDouble);
  EXPECT_LT((gv - v.grad()).abs().max().item<double>(), 1e-4);
  EXPECT_LT((gt - t.grad()).abs().max().item<double>(), 1e-4);
}

GenOptions smallData(const std::string& out, double misalign = 0.3, int videos = 120) {
  GenOptions g;
  g.out = out;
  g.videos = videos;
  g.eval_videos = 20;
  g.misalign = misalign;
  return g;
}

// World 2 (each rank its half of the global batch, embeddings all-gathered, DDP) gives the same loss
// and gradients as world 1 on the whole global batch.
TEST(MilNceTraining, WorldTwoEqualsWorldOne) {
  dtrain::test::TempDir dir;
  generateData(smallData(dir.path()));
  dtrain::test::StoreServer server;
  auto results = dtrain::test::runRanks(2, [&](int rank) {
    Dataset data = Dataset::load(dir.path());
    TrainOptions o;
    o.data = dir.path();
    o.model.hidden = 64;
    o.model.embed = 32;
    std::mt19937_64 rng(42);
    std::vector<int64_t> rows;
    for (int64_t i = 0; i < 16; ++i) rows.push_back(i);
    Batch global = makeBatch(data, rows, o.loader, rng);
    Batch local{global.video.narrow(0, rank * 8, 8), global.text.narrow(0, rank * 8, 8)};

    dtrain::comm::GroupOptions go;
    go.timeout = std::chrono::seconds(30);
    auto pg = dtrain::comm::ProcessGroup::create(server.client(), rank, 2, go);
    dtrain::Distributed two(pg, pg, dtrain::comm::WorldInfo{rank, 2, rank, 2, "explicit", 0, 1, "", {{0, 1}}});
    Trainer dist_trainer(two, data, o);
    double loss2 = dist_trainer.lossAndBackward(local);

    auto one = worldOfOne();
    Trainer ref(one, data, o);
    double loss1 = ref.lossAndBackward(global);
    EXPECT_NEAR(loss2, loss1, 1e-6 * std::abs(loss1));
    auto p2 = dist_trainer.model()->named_parameters(), p1 = ref.model()->named_parameters();
    for (const auto& item : p1) {
      if (!item.value().requires_grad()) continue;
      auto g1 = item.value().grad(), g2 = p2[item.key()].grad();
      double scale = std::max(1e-3, g1.abs().max().item<double>());
      EXPECT_LT((g1 - g2).abs().max().item<double>() / scale, 1e-4) << item.key();
    }
  });
  dtrain::test::expectAllOk(results);
}


// Trains o for 3 epochs at once (out: DIR/straight) and, after `interrupted` changed o, for 2 epochs
// then resumed (DIR/resumed); returns the stdout of the resumed run.
std::string straightAndResumed(const std::string& dir, TrainOptions o, const std::function<void(TrainOptions&)>& interrupted) {
  generateData(smallData(dir + "/data"));
  auto one = worldOfOne();
  o.data = dir + "/data";
  o.eval = false;
  o.progress = dtrain::ProgressOptions::Mode::off;
  o.batch = 16;
  o.model.hidden = 64;
  o.model.embed = 32;
  o.epochs = 3;
  o.out = dir + "/straight";
  train(one, o);
  o.out = dir + "/resumed";
  interrupted(o);
  o.stop_after = 2;
  train(one, o);
  o.stop_after = 0;
  o.stop_after_steps = 0;
  o.resume = true;
  testing::internal::CaptureStdout();
  train(one, o);
  return testing::internal::GetCapturedStdout();
}

// Every step's loss of both runs, read back from the metrics (logged in full precision): equal.
void expectSameLosses(const std::string& dir) {
  auto a = lossesOf(dir + "/straight/metrics.jsonl"), b = lossesOf(dir + "/resumed/metrics.jsonl");
  ASSERT_FALSE(a.empty());
  ASSERT_EQ(a.size() % 3, 0u);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
}

// Stopping after 2 epochs and resuming gives the same 3rd epoch, bit for bit, as running 3 at once.
TEST(MilNceTraining, ResumeContinuesBitForBit) {
  dtrain::test::TempDir dir;
  straightAndResumed(dir.path(), TrainOptions{}, [](TrainOptions&) {});
  expectSameLosses(dir.path());
  auto sa = dtrain::Checkpointer(dir.path() + "/straight/checkpoints").loadLatest();
  auto sb = dtrain::Checkpointer(dir.path() + "/resumed/checkpoints").loadLatest();
  ASSERT_TRUE(sa && sb);
  for (const auto& [name, t] : sa->model) EXPECT_TRUE(torch::equal(t, sb->model.at(name))) << name;
}

// Stopped mid-epoch instead (7 steps an epoch: after step 10, checkpointed) and resumed: the clips drawn
// after the resume are the ones the uninterrupted run drew (clipRng), so every step's loss is the same.
TEST(MilNceTraining, ResumeMidEpochContinuesBitForBit) {
  dtrain::test::TempDir dir;
  const std::string out = straightAndResumed(dir.path(), TrainOptions{}, [](TrainOptions& o) {
    o.checkpoint_every = 1;
    o.stop_after_steps = 10;
  });
  EXPECT_NE(out.find("resumed from epoch 1, step 10, sample 48 of the epoch"), std::string::npos) << out;
  expectSameLosses(dir.path());
}

// --stop-after-steps at an epoch's last step stops after the epoch's checkpoint, so the resume starts at
// the next epoch with nothing lost or repeated.
TEST(MilNceTraining, StopAfterTheLastStepOfAnEpochKeepsItsCheckpoint) {
  dtrain::test::TempDir dir;
  const std::string out =
      straightAndResumed(dir.path(), TrainOptions{}, [](TrainOptions& o) { o.stop_after_steps = 7; });
  EXPECT_NE(out.find("resumed from epoch 1, step 7, sample 0 of the epoch"), std::string::npos) << out;
  expectSameLosses(dir.path());
}

// The same with no disk at all: stopped after 2 epochs, resumed from the snapshot a dtrain-run agent's
// store kept in memory (a store served by this test process, which outlives the runs as an agent does).
TEST(MilNceTraining, ResumeFromPeerMemoryContinuesBitForBit) {
  dtrain::test::TempDir dir;
  dtrain::comm::TcpStoreServer agent("127.0.0.1", 0);
  const std::string out = straightAndResumed(dir.path(), TrainOptions{}, [&](TrainOptions& o) {
    o.disk_checkpoints = false;
    o.snapshot_every = 2;
    o.snapshot_stores = "127.0.0.1:" + std::to_string(agent.port());
  });
  EXPECT_NE(out.find("resumed from peer memory: the snapshot of step"), std::string::npos) << out;
  EXPECT_NE(out.find("peer snapshots: "), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/resumed/checkpoints"));
  expectSameLosses(dir.path());
}

// Interrupted mid-epoch on 2 ranks (a checkpoint every 2 steps, stopped after 4) and resumed alone: the
// run keeps the global batch (accum 1 -> 2) and the schedule, and the samples of the committed steps
// (each rank's log) cover the epoch's order exactly once, as DistributedSampler's drop_last allows.
TEST(MilNceTraining, ResumesMidEpochAtAnotherWorldSize) {
  dtrain::test::TempDir dir;
  GenOptions g = smallData(dir.path() + "/data");
  generateData(g);
  TrainOptions o;
  o.data = dir.path() + "/data";
  o.out = dir.path() + "/run";
  o.eval = false;
  o.progress = dtrain::ProgressOptions::Mode::off;
  o.batch = 8;
  o.epochs = 1;
  o.model.hidden = 64;
  o.model.embed = 32;
  o.checkpoint_every = 2;
  o.stop_after_steps = 4;
  o.log_samples = true;
  dtrain::test::StoreServer server;
  auto results = dtrain::test::runRanks(2, [&](int rank) {
    dtrain::comm::GroupOptions go;
    go.timeout = std::chrono::seconds(60);
    auto pg = dtrain::comm::ProcessGroup::create(server.client(), rank, 2, go);
    dtrain::Distributed two(pg, pg, dtrain::comm::WorldInfo{rank, 2, rank, 2, "explicit", 0, 1, "", {{0, 1}}});
    train(two, o);
  });
  dtrain::test::expectAllOk(results);
  auto st = dtrain::Checkpointer(o.out + "/checkpoints").loadLatest();
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->epoch, 0);
  EXPECT_EQ(st->step, 4);
  EXPECT_EQ(st->samples, 4 * 16);
  EXPECT_EQ(st->scheduler.at("global_batch"), 16);

  o.resume = true;
  o.stop_after_steps = 0;
  testing::internal::CaptureStdout();
  train(worldOfOne(), o);
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("resumed from epoch 0, step 4, sample 64 of the epoch (world 1, accum 2)"), std::string::npos)
      << out;
  // Every committed step's samples, from both logs (the 2-rank run stopped right after its checkpoint).
  std::map<int64_t, int> seen;
  std::set<int64_t> steps;
  for (int r = 0; r < 2; ++r) {
    std::ifstream f(o.out + "/samples-rank" + std::to_string(r) + ".txt");
    for (std::string line; std::getline(f, line);) {
      if (line.rfind("# start: ", 0) == 0) continue;  // one per process that appended
      std::istringstream in(line);
      std::string word;
      int64_t epoch = -1, step = -1;
      in >> word >> epoch >> word >> step >> word;
      EXPECT_EQ(epoch, 0) << line;
      steps.insert(step);
      for (int64_t i; in >> i;) ++seen[i];
    }
  }
  const int64_t n = g.videos;
  const int64_t first = 4 * 16, rest = (n - first) / 8 / 2 * 16;  // 1 rank, batch 8 x accum 2
  int64_t reads = 0;
  for (const auto& [i, k] : seen) {
    EXPECT_EQ(k, 1) << "sample " << i << " read " << k << " times";
    EXPECT_LT(i, n);
    reads += k;
  }
  EXPECT_EQ(reads, first + rest);
  EXPECT_EQ(static_cast<int64_t>(steps.size()), 4 + rest / 16);  // steps 1..4 on 2 ranks, then alone
  auto done = dtrain::Checkpointer(o.out + "/checkpoints").loadLatest();
  ASSERT_TRUE(done.has_value());
  EXPECT_EQ(done->epoch, 1);
  EXPECT_EQ(done->samples, 0);
  EXPECT_EQ(done->step, 4 + rest / 16);
}

// Narrations that mostly announce the next step of the procedure (misalign 0.8, lead 1): a single
// caption pairs each clip with the wrong step most of the time, so K=1 learns the shifted pairing; a
// bag of K=4 nearby captions contains the right one and MIL-NCE finds it. (Measured over seeds 1-3:
// R@10 29-31% for K=4 against 4-13% for K=1, median rank 20-22 against 39-65.)
TEST(MilNceTraining, CandidatesHelpWithMisalignedNarration) {
  dtrain::test::TempDir dir;
  GenOptions g = smallData(dir.path() + "/data", /*misalign=*/0.8, /*videos=*/300);
  g.eval_videos = 40;
  g.concepts = 40;
  g.lead = 1.0;
  generateData(g);
  auto one = worldOfOne();
  Dataset data = Dataset::load(g.out);
  auto score = [&](int k) {
    TrainOptions o;
    o.data = g.out;
    o.eval = false;
    o.progress = dtrain::ProgressOptions::Mode::off;
    o.epochs = 15;
    o.model.hidden = 128;
    o.model.embed = 64;
    o.loader.num_candidates = k;
    o.out = dir.path() + "/k" + std::to_string(k);
    train(one, o);
    auto st = dtrain::Checkpointer(o.out + "/checkpoints").loadLatest();
    ModelOptions mo = o.model;
    mo.feature_dim = data.feature_dim;
    MilNceNet model(data.word_vectors, mo);
    st->restoreModel(*model);
    return evaluate(model, data, o.loader, 4);
  };
  Retrieval k1 = score(1), k4 = score(4);
  std::printf("K=1: R@1 %.3f R@5 %.3f R@10 %.3f median %.1f\nK=4: R@1 %.3f R@5 %.3f R@10 %.3f median %.1f\n", k1.r1,
              k1.r5, k1.r10, k1.median_rank, k4.r1, k4.r5, k4.r10, k4.median_rank);
  EXPECT_GT(k4.r10, 1.5 * k1.r10);
  EXPECT_LT(k4.median_rank, k1.median_rank);
}

}  // namespace
}  // namespace milnce
