// DDP comm hooks that chain dependent collectives per bucket (GradBucket::then): right gradients on
// 3 ranks compared with one process, while backward keeps running, with first stages deliberately
// completing out of bucket order on some ranks; and a failing continuation names the hook and bucket.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <thread>

#include "ddp_test_util.h"
#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"

namespace dtrain::test {
namespace {

using Clock = std::chrono::steady_clock;

// Averages a bucket in two dependent collectives: (1) allreduce the bucket's squared norm S, (2) scale
// the bucket by 1/sqrt(S), allreduce the scaled bucket, and scale the sum back by sqrt(S)/world. A step
// that used another bucket's S, or ranks pairing different buckets' second stages, gives wrong
// gradients (or a collective mismatch). Rank 1 delays bucket 0's first stage and rank 2 bucket 2's, so
// that on them the next bucket's first stage completes first.
struct NormThenSumHook : CommHook {
  explicit NormThenSumHook(int rank) : rank(rank) {}
  ~NormThenSumHook() override {
    for (auto& t : sleepers) t.join();
  }
  std::string name() const override { return "norm_then_sum"; }
  bool chainsCollectives() const override { return true; }
  int delayedBucket() const { return rank == 1 ? 0 : rank == 2 ? 2 : -1; }

  comm::WorkPtr run(comm::ProcessGroup& pg, GradBucket& b) override {
    b.scratch = b.flat.square().sum().reshape({1});
    comm::WorkPtr first = pg.allreduce(b.scratch.data_ptr(), 1, comm::DType::f64, comm::ReduceOp::sum);
    if (b.index == delayedBucket()) first = delayed(first);
    first->onComplete([this, i = b.index] { note(first_done, {i, 1}); });
    const double world = pg.size();
    auto chain = b.then(first, [this, &b, world] {
      note(steps, {b.index, 2});
      const double total = b.scratch.item<double>();
      const double s = total > 0 ? 1.0 / std::sqrt(total) : 1.0;
      b.flat.mul_(s);
      auto sum = b.chainGroup().allreduce(b.flat.data_ptr(), static_cast<size_t>(b.flat.numel()), comm::DType::f64,
                                          comm::ReduceOp::sum);
      return b.then(sum, [this, &b, s, world] {
        note(steps, {b.index, 3});
        b.flat.div_(s * world);
        return comm::WorkPtr();
      });
    });
    chains.push_back(chain);  // autograd's thread only
    return chain;
  }

  // A Work that completes 300 ms after w.
  comm::WorkPtr delayed(comm::WorkPtr w) {
    auto d = std::make_shared<comm::Work>("delayed norm", Clock::now() + std::chrono::seconds(60), rank);
    sleepers.emplace_back([w, d] {
      std::exception_ptr error;
      try {
        w->wait();
      } catch (...) {
        error = std::current_exception();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      d->finish(error);
    });
    return d;
  }

  using Event = std::pair<int, int>;  // (bucket, stage)
  void note(std::vector<Event>& v, Event e) {
    std::lock_guard<std::mutex> g(mu);
    v.push_back(e);
  }
  std::vector<Event> take(std::vector<Event>& v) {
    std::lock_guard<std::mutex> g(mu);
    return std::exchange(v, {});
  }

  int rank;
  std::mutex mu;
  std::vector<Event> first_done, steps;  // first stages in completion order; continuations in run order
  std::vector<comm::WorkPtr> chains;     // this pass's, in launch order
  std::vector<std::thread> sleepers;
};

size_t positionOf(const std::vector<std::pair<int, int>>& v, int bucket) {
  return static_cast<size_t>(std::find(v.begin(), v.end(), std::make_pair(bucket, 1)) - v.begin());
}

TEST(DDPChainedHook, TwoDependentCollectivesPerBucketOutOfOrderCompletion) {
  constexpr int kWorld = 3, kSteps = 3;
  StoreServer server;
  auto results = runRanks(kWorld, [&](int rank) {
    auto pg = group(server, rank, kWorld);
    Net model = makeNet(), ref = makeNet();
    DDPOptions o;
    o.bucket_bytes = o.first_bucket_bytes = 1;  // one parameter per bucket: 6 buckets
    DistributedDataParallel ddp(model.ptr(), pg, o);
    auto hook = std::make_shared<NormThenSumHook>(rank);
    ddp.registerCommHook(hook);
    torch::optim::SGD opt(model->parameters(), 0.05), ref_opt(ref->parameters(), 0.05);
    const size_t buckets = ddp.bucketLayout().size();
    ASSERT_EQ(buckets, 6u);
    for (int step = 0; step < kSteps; ++step) {
      auto [x, y] = batch(step, kWorld);
      ref_opt.zero_grad();
      torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
      opt.zero_grad();
      hook->chains.clear();
      auto xs = x.narrow(0, rank * kPerRank, kPerRank), ys = y.narrow(0, rank * kPerRank, kPerRank);
      // Backward reaches fc1's output after fc3's and fc2's buckets launched and before fc1's: there,
      // on autograd's thread, bucket 0's whole chain (delayed first stage included) must complete.
      size_t launched_then = 0;
      std::string chain_error;
      auto h = model->fc1->forward(xs);
      h.register_hook([&](torch::Tensor) {
        launched_then = hook->chains.size();
        try {
          hook->chains.at(0)->wait(std::chrono::seconds(30));
        } catch (const std::exception& e) {
          chain_error = e.what();
        }
      });
      auto out = model->fc3->forward(torch::tanh(model->fc2->forward(torch::relu(h))));
      torch::nn::functional::cross_entropy(out, ys).backward();
      EXPECT_EQ(chain_error, "") << "step " << step;
      EXPECT_GE(launched_then, 1u) << "step " << step;
      EXPECT_LT(launched_then, buckets) << "step " << step << ": fc1's buckets launched before its gradients existed";

      auto refp = ref->named_parameters();
      for (const auto& item : model->named_parameters()) {
        double err = (item.value().grad() - refp[item.key()].grad()).abs().max().item<double>();
        EXPECT_LE(err, 1e-10) << "step " << step << " " << item.key();
      }
      // Continuations ran bucket by bucket, each bucket's two steps together, on every rank.
      std::vector<NormThenSumHook::Event> want;
      for (int i = 0; i < static_cast<int>(buckets); ++i) {
        want.push_back({i, 2});
        want.push_back({i, 3});
      }
      EXPECT_EQ(hook->take(hook->steps), want) << "step " << step;
      // ... although first stages completed out of order here.
      auto done = hook->take(hook->first_done);
      ASSERT_EQ(done.size(), buckets);
      if (int d = hook->delayedBucket(); d >= 0) {
        EXPECT_LT(positionOf(done, d + 1), positionOf(done, d))
            << "step " << step << ": bucket " << d + 1 << "'s first stage did not complete before bucket " << d << "'s";
      }
      opt.step();
      ref_opt.step();
    }
    expectClose(*model, *ref, 1e-10, "after " + std::to_string(kSteps) + " steps");
  });
  expectAllOk(results);
}

// A continuation that throws fails the backward with the hook's name and the bucket.
struct ThrowingHook : CommHook {
  std::string name() const override { return "throwing"; }
  comm::WorkPtr run(comm::ProcessGroup& pg, GradBucket& b) override {
    auto w =
        pg.allreduce(b.flat.data_ptr(), static_cast<size_t>(b.flat.numel()), comm::DType::f64, comm::ReduceOp::avg);
    return b.then(w, [&b]() -> comm::WorkPtr {
      if (b.index == 1) throw std::runtime_error("decompression failed");
      return nullptr;
    });
  }
};

TEST(DDPChainedHook, FailingContinuationNamesHookAndBucket) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    Net model = makeNet();
    DDPOptions o;
    o.bucket_bytes = o.first_bucket_bytes = 1;
    DistributedDataParallel ddp(model.ptr(), pg, o);
    ddp.registerCommHook(std::make_shared<ThrowingHook>());
    auto [x, y] = batch(0, 2);
    auto xs = x.narrow(0, rank * kPerRank, kPerRank), ys = y.narrow(0, rank * kPerRank, kPerRank);
    try {
      torch::nn::functional::cross_entropy(model->forward(xs), ys).backward();
      ADD_FAILURE() << "backward did not fail";
    } catch (const std::exception& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find("DDP comm hook 'throwing', bucket 1: a continuation failed: decompression failed"),
                std::string::npos)
          << msg;
    }
  });
  expectAllOk(results);
}

}  // namespace
}  // namespace dtrain::test
