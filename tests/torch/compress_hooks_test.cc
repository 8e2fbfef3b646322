// The fp16 and bf16 hooks on float32 buckets (the path that converts with dtrain's vectorised
// conversions): on 2 and 3 ranks, each bucket's gradient equals the average computed independently with
// torch ops: every rank's gradient rounded to 16 bits, summed in float with a rounding to 16 bits after
// each addition, divided by the world size and rounded again (bit for bit on 2 ranks; on 3 within the
// roundings of a different order of addition).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp_test_util.h"
#include "dtrain/ddp.h"
#include "harness.h"

namespace dtrain::test {
namespace {

void checkHook(int world, bool bf16) {
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world);
    torch::manual_seed(3);
    Net model(false, false);  // float32
    DDPOptions o;
    o.bucket_bytes = o.first_bucket_bytes = 512;
    DistributedDataParallel ddp(model.ptr(), pg, o);
    ddp.registerCommHook(bf16 ? bf16CompressHook(/*always=*/true) : fp16CompressHook(/*always=*/true));
    const auto t = bf16 ? at::kBFloat16 : at::kHalf;
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = batch(step, world);
      x = x.to(at::kFloat);
      // Every rank's local gradient, computed here for all ranks (the model's weights are the same).
      std::vector<std::vector<at::Tensor>> local(world);
      for (int r = 0; r < world; ++r) {
        Net copy(false, false);
        {
          torch::NoGradGuard g;
          auto src = model->parameters(), dst = copy->parameters();
          for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
        }
        torch::nn::functional::cross_entropy(copy->forward(x.narrow(0, r * kPerRank, kPerRank)),
                                             y.narrow(0, r * kPerRank, kPerRank))
            .backward();
        for (auto& p : copy->parameters()) local[r].push_back(p.grad().clone());
      }
      model->zero_grad();
      torch::nn::functional::cross_entropy(model->forward(x.narrow(0, rank * kPerRank, kPerRank)),
                                           y.narrow(0, rank * kPerRank, kPerRank))
          .backward();
      auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        at::Tensor acc = local[0][i].to(t);
        for (int r = 1; r < world; ++r) acc = (acc.to(at::kFloat) + local[r][i].to(t).to(at::kFloat)).to(t);
        at::Tensor want = (acc.to(at::kFloat) / world).to(t).to(at::kFloat);
        // Two ranks: exactly (a + b is a + b in either order). More: the shared-memory allreduce adds each
        // slice in its owner's order, so allow one 16-bit rounding step per addition.
        const double eps = bf16 ? 1.0 / 128 : 1.0 / 1024;
        at::Tensor scale = local[0][i].abs();
        for (int r = 1; r < world; ++r) scale = scale + local[r][i].abs();  // bounds every partial sum
        const auto diff = (params[i].grad() - want).abs();
        const bool ok = world <= 2 ? torch::equal(params[i].grad(), want)
                                   : (diff <= scale * eps + 1e-7).all().item<bool>();
        EXPECT_TRUE(ok)
            << "world " << world << " rank " << rank << " step " << step << " parameter " << i << ": max diff "
            << (params[i].grad() - want).abs().max().item<double>() << " got " << params[i].grad().view(-1).slice(0, 0, 4)
            << " want " << want.view(-1).slice(0, 0, 4) << " local0 " << local[0][i].view(-1).slice(0, 0, 4);
      }
      torch::NoGradGuard g;
      for (auto& p : params) p.sub_(0.1 * p.grad());
    }
  });
  expectAllOk(results);
}

TEST(CompressHooks, Fp16OnFloatBucketsEqualsTheRoundedAverage) {
  checkHook(2, false);
  checkHook(3, false);
}

TEST(CompressHooks, Bf16OnFloatBucketsEqualsTheRoundedAverage) {
  checkHook(2, true);
  checkHook(3, true);
}

}  // namespace
}  // namespace dtrain::test

namespace dtrain::test {
namespace {

// By default the 16-bit hooks do not compress where every rank shares memory (the conversions cost more
// than the halved copies save there): over shm the gradients equal those of no hook bit for bit and as
// many bytes move; over tcp the hook compresses (half the bytes, gradients rounded).
TEST(CompressHooks, OverSharedMemoryFloatBucketsTravelAsTheyAre) {
  for (const std::string transport : {"shm", "tcp"}) {
    for (bool bf16 : {false, true}) {
      StoreServer server;
      auto results = runRanks(2, [&](int rank) {
        auto pg = group(server, rank, 2, 30, transport);
        ASSERT_EQ(pg->transportName(), transport);
        auto gradsAndBytes = [&](bool hook) {
          torch::manual_seed(3);
          Net model(false, false);
          DistributedDataParallel ddp(model.ptr(), pg);
          if (hook) ddp.registerCommHook(bf16 ? bf16CompressHook() : fp16CompressHook());
          auto [x, y] = batch(0, 2);
          const uint64_t before = comm::bytesSent();
          torch::nn::functional::cross_entropy(model->forward(x.to(at::kFloat).narrow(0, rank * kPerRank, kPerRank)),
                                               y.narrow(0, rank * kPerRank, kPerRank))
              .backward();
          const uint64_t sent = comm::bytesSent() - before;
          std::vector<at::Tensor> grads;
          for (auto& p : model->parameters()) grads.push_back(p.grad().clone());
          return std::make_pair(grads, sent);
        };
        auto [plain, plain_bytes] = gradsAndBytes(false);
        auto [hooked, hooked_bytes] = gradsAndBytes(true);
        const std::string what = transport + (bf16 ? " bf16" : " fp16");
        bool equal = true;
        for (size_t i = 0; i < plain.size(); ++i) equal = equal && torch::equal(plain[i], hooked[i]);
        if (transport == "shm") {
          EXPECT_TRUE(equal) << what << ": the gradients changed";
          EXPECT_EQ(hooked_bytes, plain_bytes) << what;
        } else {
          EXPECT_FALSE(equal) << what << ": no rounding to 16 bits";
          EXPECT_LT(hooked_bytes, plain_bytes * 6 / 10) << what << " (" << plain_bytes << " without the hook)";
        }
      });
      expectAllOk(results);
    }
  }
}

}  // namespace
}  // namespace dtrain::test
