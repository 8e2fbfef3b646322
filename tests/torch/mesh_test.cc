// DeviceMesh on 4 real processes: the sub-groups of every layout have the right members (checked by
// an allreduce of world ranks in each), and the hybrid of 2 data-parallel replicas x 2 pipeline
// stages (DDP over the data group of each stage) trains exactly like one process on the whole batch.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "dtrain/fsdp.h"
#include "dtrain/mesh.h"
#include "dtrain/pipeline.h"
#include "dtrain/tensor_parallel.h"
#include "dtrain/zero.h"
#include "harness.h"

namespace dtrain::test {
namespace {

std::shared_ptr<comm::ProcessGroup> group(const StoreServer& s, int rank, int world) {
  comm::GroupOptions o;
  o.timeout = std::chrono::seconds(30);
  return comm::ProcessGroup::create(s.client(), rank, world, o);
}

// The sum of the world ranks of a group's members, computed by the group itself.
int64_t sumOfMembers(comm::ProcessGroup& g, int world_rank) {
  int64_t v = world_rank;
  g.allreduce(&v, 1, comm::DType::i64)->wait();
  return v;
}

class MeshLayouts : public testing::TestWithParam<MeshShape> {};

TEST_P(MeshLayouts, SubGroupsHaveTheRightMembers) {
  const MeshShape s = GetParam();
  StoreServer server;
  auto results = runRanks(4, [&](int rank) {
    auto world = group(server, rank, 4);
    DeviceMesh mesh(world, s);
    // Tensor fastest, then data, then pipeline.
    const int t = rank % s.tensor, d = (rank / s.tensor) % s.data, p = rank / (s.tensor * s.data);
    EXPECT_EQ(mesh.tensorRank(), t) << mesh.describe();
    EXPECT_EQ(mesh.dataRank(), d) << mesh.describe();
    EXPECT_EQ(mesh.pipelineRank(), p) << mesh.describe();
    EXPECT_EQ(mesh.data()->size(), s.data);
    EXPECT_EQ(mesh.pipeline()->size(), s.pipeline);
    EXPECT_EQ(mesh.tensor()->size(), s.tensor);
    auto expect = [&](auto coord) {
      int64_t sum = 0;
      for (int i = 0; i < 4; ++i) sum += coord(i) ? i : 0;
      return sum;
    };
    EXPECT_EQ(sumOfMembers(*mesh.data(), rank), expect([&](int i) {
                return i % s.tensor == t && i / (s.tensor * s.data) == p;
              }));
    EXPECT_EQ(sumOfMembers(*mesh.pipeline(), rank), expect([&](int i) {
                return i % s.tensor == t && (i / s.tensor) % s.data == d;
              }));
    EXPECT_EQ(sumOfMembers(*mesh.tensor(), rank), expect([&](int i) { return i / s.tensor == rank / s.tensor; }));
    EXPECT_EQ(mesh.worldRank(d, p, t), rank);
    EXPECT_EQ(mesh.dataRanks()[d], rank);
    EXPECT_EQ(mesh.pipelineRanks()[p], rank);
    EXPECT_EQ(mesh.tensorRanks()[t], rank);
  });
  expectAllOk(results);
}

INSTANTIATE_TEST_SUITE_P(FourRanks, MeshLayouts,
                         testing::Values(MeshShape{2, 2, 1}, MeshShape{1, 2, 2}, MeshShape{2, 1, 2}, MeshShape{4, 1, 1},
                                         MeshShape{1, 1, 4}),
                         [](const testing::TestParamInfo<MeshShape>& i) {
                           return fmt::format("d{}_p{}_t{}", i.param.data, i.param.pipeline, i.param.tensor);
                         });

TEST(Mesh, ShapeMustMakeTheWorld) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto world = group(server, rank, 2);
    try {
      DeviceMesh mesh(world, MeshShape{2, 2, 1});
      ADD_FAILURE() << "constructed";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("data 2 x pipeline 2 x tensor 1 does not make the world of 2 ranks"),
                std::string::npos)
          << e.what();
    }
  });
  expectAllOk(results);
}

torch::nn::Sequential makeModel() {
  torch::manual_seed(21);
  torch::nn::Sequential m(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16), torch::nn::Tanh(),
                          torch::nn::Linear(16, 3));
  m->to(torch::kDouble);
  return m;
}

at::Tensor lossFn(const at::Tensor& out, const at::Tensor& y) { return torch::nn::functional::cross_entropy(out, y); }

// 4 ranks = 2 data x 2 pipeline: replica d trains on rows [8d, 8d + 8) of each 16-row batch, through
// a 2-stage 1F1B pipeline with 4 micro-batches; DDP averages each stage's gradients with the same
// stage of the other replica. The result must equal one process on the whole batch.
TEST(Hybrid, TwoDataByTwoPipelineEqualsOneProcess) {
  StoreServer server;
  auto results = runRanks(4, [&](int rank) {
    auto world = group(server, rank, 4);
    DeviceMesh mesh(world, MeshShape{2, 2, 1});
    auto model = makeModel(), ref = makeModel();
    auto stage = pipelineStage(model, mesh.pipelineRank(), mesh.pipelineSize());
    DDPOptions ddp_opts;
    ddp_opts.bucket_bytes = ddp_opts.first_bucket_bytes = 512;  // several buckets per stage
    DistributedDataParallel ddp(stage.ptr(), mesh.data(), ddp_opts);
    Pipeline pipe(stage, mesh.pipeline(), PipelineOptions{4, PipelineSchedule::one_f_one_b});
    pipe.attachDataParallel(&ddp);
    torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    const bool first = mesh.pipelineRank() == 0, last = mesh.pipelineRank() == mesh.pipelineSize() - 1;
    for (int step = 0; step < 3; ++step) {
      auto g = at::make_generator<at::CPUGeneratorImpl>(700 + step);
      auto x = at::randn({16, 6}, g, torch::kDouble);
      auto y = at::randint(0, 3, {16}, g, torch::kLong);
      auto xs = x.narrow(0, 8 * mesh.dataRank(), 8), ys = y.narrow(0, 8 * mesh.dataRank(), 8);
      opt.zero_grad();
      double loss = pipe.step(first ? xs : at::Tensor(), last ? ys : at::Tensor(), lossFn);
      opt.step();
      mesh.data()->allreduce(&loss, 1, comm::DType::f64, comm::ReduceOp::avg)->wait();

      ref_opt.zero_grad();
      auto ref_loss = lossFn(ref->forward(x), y);
      ref_loss.backward();
      ref_opt.step();
      EXPECT_NEAR(loss, ref_loss.item<double>(), 1e-5 * std::abs(ref_loss.item<double>())) << "step " << step;
      EXPECT_LE(pipe.stats().peak_stored_activations, 2);
    }
    auto ref_params = ref->named_parameters();
    for (const auto& p : stage->named_parameters()) {
      auto r = ref_params[p.key()];
      double diff = (p.value() - r).abs().max().item<double>() / std::max(1.0, r.abs().max().item<double>());
      EXPECT_LE(diff, 1e-5) << mesh.describe() << " parameter " << p.key();
    }
  });
  expectAllOk(results);
}

// The same 2 data x 2 pipeline mesh with the training state sharded over each data group: ZeRO stage 1
// (DDP and ZeroRedundancyOptimizer) and stages 2 and 3 (FullyShardedDataParallel attached to the
// pipeline), Adam. Equal to one process on the whole batch.
void shardedMeshEqualsOneProcess(int zero_stage) {
  StoreServer server;
  auto results = runRanks(4, [&](int rank) {
    auto world = group(server, rank, 4);
    DeviceMesh mesh(world, MeshShape{2, 2, 1});
    auto model = makeModel(), ref = makeModel();
    auto stage = pipelineStage(model, mesh.pipelineRank(), mesh.pipelineSize());
    Pipeline pipe(stage, mesh.pipeline(), PipelineOptions{4, PipelineSchedule::one_f_one_b});
    auto adam = [](std::vector<torch::optim::OptimizerParamGroup> g) {
      return std::make_unique<torch::optim::Adam>(std::move(g), torch::optim::AdamOptions(0.01));
    };
    std::unique_ptr<DistributedDataParallel> ddp;
    std::unique_ptr<ZeroRedundancyOptimizer> zero;
    std::unique_ptr<FullyShardedDataParallel> fsdp;
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (zero_stage == 1) {
      ddp = std::make_unique<DistributedDataParallel>(stage.ptr(), mesh.data());
      pipe.attachDataParallel(ddp.get());
      zero = std::make_unique<ZeroRedundancyOptimizer>(stage->parameters(), adam, mesh.data());
    } else {
      FsdpOptions o;
      o.stage = zero_stage;
      o.min_unit_params = 1;
      fsdp = std::make_unique<FullyShardedDataParallel>(stage, mesh.data(), o);
      pipe.attachSharded(fsdp.get());
      opt = adam({torch::optim::OptimizerParamGroup(fsdp->shards())});
    }
    auto ref_opt = adam({torch::optim::OptimizerParamGroup(ref->parameters())});
    const bool first = mesh.pipelineRank() == 0, last = mesh.pipelineRank() == mesh.pipelineSize() - 1;
    for (int step = 0; step < 3; ++step) {
      auto g = at::make_generator<at::CPUGeneratorImpl>(700 + step);
      auto x = at::randn({16, 6}, g, torch::kDouble);
      auto y = at::randint(0, 3, {16}, g, torch::kLong);
      auto xs = x.narrow(0, 8 * mesh.dataRank(), 8), ys = y.narrow(0, 8 * mesh.dataRank(), 8);
      if (zero) zero->zeroGrad();
      else opt->zero_grad();
      pipe.step(first ? xs : at::Tensor(), last ? ys : at::Tensor(), lossFn);
      if (zero) zero->step();
      else opt->step();
      ref_opt->zero_grad();
      lossFn(ref->forward(x), y).backward();
      ref_opt->step();
    }
    auto ref_params = ref->named_parameters();
    std::map<std::string, at::Tensor> got;
    if (fsdp) got = fsdp->fullState();
    else
      for (const auto& p : stage->named_parameters()) got[p.key()] = p.value();
    EXPECT_EQ(got.size(), stage->named_parameters().size());
    for (const auto& [name, t] : got) {
      auto r = ref_params[name];
      double diff = (t - r).abs().max().item<double>() / std::max(1.0, r.abs().max().item<double>());
      EXPECT_LE(diff, 1e-5) << mesh.describe() << " ZeRO stage " << zero_stage << " parameter " << name;
    }
  });
  expectAllOk(results);
}

TEST(Hybrid, TwoDataByTwoPipelineWithZeroStage1EqualsOneProcess) { shardedMeshEqualsOneProcess(1); }
TEST(Hybrid, TwoDataByTwoPipelineWithZeroStage2EqualsOneProcess) { shardedMeshEqualsOneProcess(2); }
TEST(Hybrid, TwoDataByTwoPipelineWithZeroStage3EqualsOneProcess) { shardedMeshEqualsOneProcess(3); }

// 2 data x 2 tensor: a tensor-parallel MLP whose slices are replicated by DDP over the data group.
TEST(Hybrid, TwoDataByTwoTensorEqualsOneProcess) {
  StoreServer server;
  auto results = runRanks(4, [&](int rank) {
    auto world = group(server, rank, 4);
    DeviceMesh mesh(world, MeshShape{2, 1, 2});
    torch::manual_seed(31);
    torch::nn::Linear fc1(5, 8), fc2(8, 5);
    fc1->to(torch::kDouble);
    fc2->to(torch::kDouble);
    auto mlp = ParallelMLP(fc1, fc2, mesh.tensor());
    DistributedDataParallel ddp(mlp.ptr(), mesh.data());
    torch::optim::SGD opt(mlp->parameters(), 0.1), ref_opt({fc1->weight, fc1->bias, fc2->weight, fc2->bias}, 0.1);
    for (int step = 0; step < 3; ++step) {
      auto g = at::make_generator<at::CPUGeneratorImpl>(900 + step);
      auto x = at::randn({8, 5}, g, torch::kDouble), target = at::randn({8, 5}, g, torch::kDouble);
      opt.zero_grad();
      auto xs = x.narrow(0, 4 * mesh.dataRank(), 4), ts = target.narrow(0, 4 * mesh.dataRank(), 4);
      torch::mse_loss(mlp->forward(xs), ts).backward();
      opt.step();
      ref_opt.zero_grad();
      torch::mse_loss(fc2->forward(torch::gelu(fc1->forward(x))), target).backward();
      ref_opt.step();
    }
    auto [o0, o1] = partitionRange(8, 2, mesh.tensorRank());
    torch::NoGradGuard ng;
    EXPECT_LE((mlp->fc1->weight - fc1->weight.narrow(0, o0, o1 - o0)).abs().max().item<double>(), 1e-10);
    EXPECT_LE((mlp->fc2->weight - fc2->weight.narrow(1, o0, o1 - o0)).abs().max().item<double>(), 1e-10);
    EXPECT_LE((mlp->fc2->bias - fc2->bias).abs().max().item<double>(), 1e-10);
  });
  expectAllOk(results);
}

}  // namespace
}  // namespace dtrain::test
