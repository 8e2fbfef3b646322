// DistributedDataParallel on 2 and 3 real processes against one process on the global batch:
// SGD with momentum and Adam, no_sync accumulation, an unused branch, BatchNorm buffers, bucket
// rebuilding, the fp16/bf16 hooks, and the error when a parameter gets no gradient.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "ddp_test_util.h"
#include "harness.h"

namespace dtrain::test {
namespace {

struct Case {
  std::string opt = "sgd";
  int micro = 1;            // micro-batches per step (all but the last under noSync)
  bool bn = false;
  bool unused = false;
  std::shared_ptr<CommHook> (*hook)() = nullptr;
  size_t bucket_bytes = 256;  // tiny buckets: several per model, so ordering and rebuilds matter
  size_t last_bucket_bytes = 0;
  size_t buckets = 0;  // when not 0: how many buckets DDP must make
};

// Each rank trains with DDP on its slice and, alongside, a reference model trained by one process
// on the whole global batch (for BatchNorm: the whole batch in per-rank slices, buffers from slice 0,
// which is what DDP without SyncBatchNorm computes). After 5 steps the two must agree.
void trainAndCompare(int world, const Case& c, double tol) {
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    Net model = makeNet(c.bn, c.unused), ref = makeNet(c.bn, c.unused);
    if (rank != 0) {  // DDP must broadcast rank 0's weights: start the others elsewhere
      torch::NoGradGuard g;
      for (auto& p : model->parameters()) p.add_(0.5 * (rank + 1));
    }
    DDPOptions o;
    o.bucket_bytes = c.bucket_bytes;
    o.first_bucket_bytes = c.bucket_bytes;
    o.find_unused_parameters = c.unused;
    o.last_bucket_bytes = c.last_bucket_bytes;
    DistributedDataParallel ddp(model.ptr(), pg, o);
    if (c.buckets) {
      EXPECT_EQ(ddp.bucketLayout().size(), c.buckets);
    }
    if (c.hook) ddp.registerCommHook(c.hook());
    auto opt = makeOpt(c.opt, *model), ref_opt = makeOpt(c.opt, *ref);
    for (int step = 0; step < 5; ++step) {
      opt->zero_grad();
      for (int k = 0; k < c.micro; ++k) {
        auto [x, y] = batch(step * 10 + k, world);
        auto xs = x.narrow(0, rank * kPerRank, kPerRank), ys = y.narrow(0, rank * kPerRank, kPerRank);
        auto loss = torch::nn::functional::cross_entropy(ddp.forward(model, xs), ys);
        if (k + 1 < c.micro) {
          auto guard = ddp.noSync();
          loss.backward();
        } else {
          loss.backward();
        }
      }
      opt->step();
      // The reference: one process, the whole batch.
      ref_opt->zero_grad();
      for (int k = 0; k < c.micro; ++k) {
        auto [x, y] = batch(step * 10 + k, world);
        if (!c.bn) {
          torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
          continue;
        }
        std::vector<torch::Tensor> start, after0;
        for (auto& b : ref->buffers()) start.push_back(b.clone());
        for (int r = 0; r < world; ++r) {
          {
            torch::NoGradGuard g;
            auto bufs = ref->buffers();
            for (size_t i = 0; i < bufs.size(); ++i) bufs[i].copy_(start[i]);
          }
          auto l = torch::nn::functional::cross_entropy(ref->forward(x.narrow(0, r * kPerRank, kPerRank)),
                                                        y.narrow(0, r * kPerRank, kPerRank));
          (l / world).backward();
          if (r == 0)
            for (auto& b : ref->buffers()) after0.push_back(b.clone());
        }
        torch::NoGradGuard g;
        auto bufs = ref->buffers();
        for (size_t i = 0; i < bufs.size(); ++i) bufs[i].copy_(after0[i]);
      }
      ref_opt->step();
    }
    // Buffers are rank 0's from the next forward on (broadcast_buffers): sync them before comparing.
    ddp.beforeForward();
    expectClose(*model, *ref, tol, fmt::format("rank {} world {} {}", rank, world, c.opt));
  });
  expectAllOk(results);
}

class DDP : public ::testing::TestWithParam<int> {};

TEST_P(DDP, SgdMomentumEqualsOneProcess) { trainAndCompare(GetParam(), Case{}, 1e-5); }
TEST_P(DDP, AdamEqualsOneProcess) {
  Case c;
  c.opt = "adam";
  trainAndCompare(GetParam(), c, 1e-5);
}
TEST_P(DDP, NoSyncOverThreeMicroBatches) {
  Case c;
  c.micro = 3;
  trainAndCompare(GetParam(), c, 1e-5);
}
TEST_P(DDP, UnusedBranchWithFindUnused) {
  Case c;
  c.unused = true;
  c.opt = "adam";
  trainAndCompare(GetParam(), c, 1e-5);
}
TEST_P(DDP, BatchNormBuffersFromRankZero) {
  Case c;
  c.bn = true;
  trainAndCompare(GetParam(), c, 1e-5);
}
TEST_P(DDP, LargeBucketsOneAllreduce) {
  Case c;
  c.bucket_bytes = 25u << 20;
  c.buckets = 1;
  trainAndCompare(GetParam(), c, 1e-5);
}
// DDPOptions::last_bucket_bytes: the one bucket keeps its last parameters as a second one.
TEST_P(DDP, TheLastBucketRuleSplitsTheLastBucket) {
  Case c;
  c.bucket_bytes = 25u << 20;
  c.last_bucket_bytes = 64;
  c.buckets = 2;
  trainAndCompare(GetParam(), c, 1e-5);
}
// Rounding to 16 bits moves the parameters of these 5 steps by at most 4e-5 (fp16) and 2e-4 (bf16);
// a hook that left one bucket (fc1's) un-averaged moves them by 6e-3 to 2e-2.
TEST_P(DDP, Fp16AndBf16HooksStayClose) {
  Case c;
  c.hook = [] { return fp16CompressHook(/*always=*/true); };
  trainAndCompare(GetParam(), c, 3e-4);
  c.hook = [] { return bf16CompressHook(/*always=*/true); };
  trainAndCompare(GetParam(), c, 1e-3);
}

INSTANTIATE_TEST_SUITE_P(World, DDP, ::testing::Values(2, 3), [](const auto& p) {
  return "world" + std::to_string(p.param);
});

// The plain average (what DDP does without a hook) that records each bucket it launches.
struct RecordingHook : CommHook {
  struct Launch {
    int index;
    void* data;
    int64_t numel;
    comm::WorkPtr work;
  };
  std::vector<Launch> launches;
  std::string name() const override { return "recording"; }
  comm::WorkPtr run(comm::ProcessGroup& pg, GradBucket& b) override {
    auto w = pg.allreduce(b.flat.data_ptr(), static_cast<size_t>(b.flat.numel()), comm::DType::f64, comm::ReduceOp::avg);
    launches.push_back({b.index, b.flat.data_ptr(), b.flat.numel(), w});
    return w;
  }
};

// Parameters registered in the opposite order of their use: the initial (reverse registration)
// layout puts body first, but backward produces head's gradients first.
struct SwappedImpl : torch::nn::Module {
  SwappedImpl() {
    head = register_module("head", torch::nn::Linear(6, 3));
    body = register_module("body", torch::nn::Linear(6, 6));
  }
  torch::Tensor forward(torch::Tensor x) { return head->forward(torch::relu(body->forward(x))); }
  torch::nn::Linear head{nullptr}, body{nullptr};
};
TORCH_MODULE(Swapped);

// Buckets hold parameters in reverse order first, then in the order gradients arrived; gradients
// are the buckets' memory (what the allreduce reads and writes), not copies.
TEST(DDPBuckets, ReverseOrderThenArrivalOrder) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    torch::manual_seed(7);
    Swapped model;
    torch::manual_seed(7);
    Swapped ref;
    model->to(torch::kDouble);
    ref->to(torch::kDouble);
    DDPOptions o;
    o.bucket_bytes = o.first_bucket_bytes = 1;  // one parameter per bucket
    DistributedDataParallel ddp(model.ptr(), pg, o);
    const auto& names = ddp.parameterNames();
    auto namesOf = [&](const std::vector<std::vector<size_t>>& layout) {
      std::vector<std::string> out;
      for (auto& b : layout) out.push_back(names[b.at(0)]);
      return out;
    };
    EXPECT_EQ(namesOf(ddp.bucketLayout()), (std::vector<std::string>{"body.bias", "body.weight", "head.bias", "head.weight"}));
    auto [x, y] = batch(0, 2);
    auto xs = x.narrow(0, rank * kPerRank, kPerRank), ys = y.narrow(0, rank * kPerRank, kPerRank);
    torch::nn::functional::cross_entropy(model->forward(xs), ys).backward();
    // Rebuilt in arrival order: head's two parameters (in whichever order the engine ran them), then body's.
    auto rebuilt = namesOf(ddp.bucketLayout());
    ASSERT_EQ(rebuilt.size(), 4u);
    EXPECT_EQ(std::set<std::string>(rebuilt.begin(), rebuilt.begin() + 2), (std::set<std::string>{"head.weight", "head.bias"}));
    EXPECT_EQ(std::set<std::string>(rebuilt.begin() + 2, rebuilt.end()), (std::set<std::string>{"body.weight", "body.bias"}));
    // Another pass in the rebuilt layout: every .grad() is the very memory its bucket's allreduce
    // averaged in place, and holds the average (the gradient of the whole batch).
    auto hook = std::make_shared<RecordingHook>();
    ddp.registerCommHook(hook);
    model->zero_grad();
    torch::nn::functional::cross_entropy(model->forward(xs), ys).backward();
    torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
    auto layout = ddp.bucketLayout();
    ASSERT_EQ(hook->launches.size(), layout.size());
    auto refp = ref->named_parameters();
    for (const auto& l : hook->launches) {
      size_t i = layout[l.index].at(0);
      const auto& g = ddp.parameters()[i].grad();
      EXPECT_EQ(g.data_ptr(), l.data) << names[i] << "'s gradient is not its bucket";
      EXPECT_EQ(g.numel(), l.numel) << names[i];
      EXPECT_LE((g - refp[names[i]].grad()).abs().max().item<double>(), 1e-12) << names[i];
    }
  });
  expectAllOk(results);
}

// The README's claim that allreduce overlaps backward, shown without timing. A hook on fc1's output
// runs while backward still has fc1 to do: by then fc3's and fc2's buckets must have been launched
// (not fc1's), and the first of them can complete (the group's thread runs it) with the average of
// the ranks' gradients in it, before fc1's gradients exist.
TEST(DDPOverlap, BucketsAreAveragedWhileBackwardStillRuns) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    Net model = makeNet(), ref = makeNet();
    DDPOptions o;
    o.bucket_bytes = o.first_bucket_bytes = 1;  // one parameter per bucket
    DistributedDataParallel ddp(model.ptr(), pg, o);
    auto hook = std::make_shared<RecordingHook>();
    ddp.registerCommHook(hook);
    const auto& names = ddp.parameterNames();
    auto layout = ddp.bucketLayout();  // the first pass runs in this layout
    auto [x, y] = batch(0, 2);
    torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
    auto refp = ref->named_parameters();

    std::set<std::string> launched_early;
    double first_err = -1;
    auto xs = x.narrow(0, rank * kPerRank, kPerRank), ys = y.narrow(0, rank * kPerRank, kPerRank);
    auto h = model->fc1->forward(xs);
    h.register_hook([&](torch::Tensor) {
      for (const auto& l : hook->launches) launched_early.insert(names[layout[l.index].at(0)]);
      if (hook->launches.empty()) return;
      const auto& first = hook->launches.front();
      first.work->wait();
      size_t i = layout[first.index].at(0);
      auto avg = torch::from_blob(first.data, {first.numel}, torch::kDouble);
      first_err = (avg - refp[names[i]].grad().reshape({-1})).abs().max().item<double>();
    });
    auto out = model->fc3->forward(torch::tanh(model->fc2->forward(torch::relu(h))));
    torch::nn::functional::cross_entropy(out, ys).backward();
    EXPECT_EQ(launched_early, (std::set<std::string>{"fc3.weight", "fc3.bias", "fc2.weight", "fc2.bias"}))
        << "buckets launched before backward reached fc1";
    EXPECT_GE(first_err, 0) << "no bucket was launched during backward";
    EXPECT_LE(first_err, 1e-12) << "the first bucket, complete during backward, does not hold the average";
  });
  expectAllOk(results);
}

// A parameter without a gradient (find_unused_parameters off) is an error naming it, on the rank
// that skipped it, and the other rank fails promptly too instead of waiting for the timeout.
TEST(DDPErrors, UnusedParameterIsNamedAndPeersFailPromptly) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    Net model = makeNet();
    DistributedDataParallel ddp(model.ptr(), pg);
    auto [x, y] = batch(0, 2);
    auto t0 = std::chrono::steady_clock::now();
    try {
      // Rank 1 skips fc2 in this step; rank 0 uses it.
      torch::nn::functional::cross_entropy(model->forward(x, rank == 1), y).backward();
      ADD_FAILURE() << "backward succeeded";
    } catch (const std::exception& e) {
      std::string m = e.what();
      printf("rank %d: %s\n", rank, m.c_str());
      EXPECT_NE(m.find("fc2.weight"), std::string::npos) << m;
      EXPECT_NE(m.find("find_unused_parameters"), std::string::npos) << m;
      EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
    }
  });
  expectAllOk(results);
}

}  // namespace
}  // namespace dtrain::test
