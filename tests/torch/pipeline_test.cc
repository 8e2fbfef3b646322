// Pipeline parallelism on 2 and 3 real processes against one process running the whole model on the
// whole batch: GPipe and 1F1B with 4 and 8 micro-batches (loss and updated parameters within 1e-5),
// the activation counts of each schedule, uneven micro-batches with user split points, evaluation,
// blocking sends through a tiny shm ring, step statistics that survive evaluation, and the errors for
// mismatched stages; the interleaved schedule (2-3 chunks a rank) the same way, and its order.
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>
#include <unistd.h>

#include <functional>
#include <set>
#include <thread>

#include "dtrain/comm/error.h"
#include "dtrain/pipeline.h"
#include "harness.h"

namespace dtrain::test {
namespace {

torch::nn::Sequential makeModel(int64_t width = 16) {
  torch::manual_seed(11);
  torch::nn::Sequential m(torch::nn::Linear(6, width), torch::nn::Tanh(), torch::nn::Linear(width, width),
                          torch::nn::Tanh(), torch::nn::Linear(width, 12), torch::nn::Tanh(),
                          torch::nn::Linear(12, 3));
  m->to(torch::kDouble);
  return m;
}

std::pair<torch::Tensor, torch::Tensor> batch(int step, int64_t rows) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(500 + step);
  return {at::randn({rows, 6}, g, torch::kDouble), at::randint(0, 3, {rows}, g, torch::kLong)};
}

at::Tensor lossFn(const at::Tensor& out, const at::Tensor& y) { return torch::nn::functional::cross_entropy(out, y); }

std::shared_ptr<comm::ProcessGroup> group(const StoreServer& s, int rank, int world, size_t segment_bytes = 0,
                                          const std::string& transport = "auto") {
  comm::GroupOptions o;
  o.timeout = std::chrono::seconds(30);
  o.segment_bytes = segment_bytes;
  o.transport = transport;
  return comm::ProcessGroup::create(s.client(), rank, world, o);
}

double relDiff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1.0, b.abs().max().item<double>());
}

struct Case {
  int stages;
  PipelineSchedule schedule;
  int micro;
  int chunks = 1;
};

std::string caseName(const testing::TestParamInfo<Case>& i) {
  return fmt::format("P{}_{}_M{}{}", i.param.stages, scheduleName(i.param.schedule), i.param.micro,
                     i.param.chunks > 1 ? fmt::format("_V{}", i.param.chunks) : "");
}

// Trains `steps` steps with the pipeline on `world` ranks and, on each rank, the reference (one
// process, whole model, whole batch); compares the loss of every step and the stage's parameters.
// The activations a stage holds at its peak under each schedule.
int expectedPeak(const PipelineOptions& po, int stage, int stages, int chunks) {
  if (po.schedule == PipelineSchedule::gpipe) return po.micro_batches;
  if (po.schedule == PipelineSchedule::one_f_one_b) return std::min(stages - stage, po.micro_batches);
  const int total = po.micro_batches * chunks;
  const int warmup = po.micro_batches == stages ? total : std::min(2 * (stages - stage - 1) + (chunks - 1) * stages, total);
  return warmup == total ? total : warmup + 1;
}

void trainAndCompare(int world, PipelineOptions po, int64_t rows, std::vector<size_t> splits = {},
                     size_t segment_bytes = 0, int64_t width = 16, const std::string& transport = "auto",
                     int chunks = 1) {
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    auto pg = group(server, rank, world, segment_bytes, transport);
    auto model = makeModel(width), ref = makeModel(width);
    Pipeline pipe(pipelineChunks(model, rank, world, chunks, splits), pg, po);
    auto stage = pipe.module();
    torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = batch(step, rows);
      opt.zero_grad();
      // Only the first stage needs the input and only the last the target.
      double loss = pipe.step(rank == 0 ? x : at::Tensor(), rank == world - 1 ? y : at::Tensor(), lossFn);
      opt.step();
      ref_opt.zero_grad();
      auto ref_loss = lossFn(ref->forward(x), y);
      ref_loss.backward();
      ref_opt.step();
      EXPECT_NEAR(loss, ref_loss.item<double>(), 1e-5 * std::abs(ref_loss.item<double>()))
          << "rank " << rank << " step " << step;

      const auto& st = pipe.stats();
      EXPECT_EQ(st.stored_activations, 0);
      EXPECT_EQ(st.peak_stored_activations, expectedPeak(po, rank, world, chunks)) << "rank " << rank;
      if (po.schedule == PipelineSchedule::one_f_one_b) {
        EXPECT_LE(st.peak_stored_activations, world);
      }
      EXPECT_GT(st.peak_activation_bytes, 0);
      EXPECT_EQ(pipe.timeline().size(), 2u * po.micro_batches * chunks);
    }
    auto ref_params = ref->named_parameters();
    size_t compared = 0;
    for (const auto& p : stage->named_parameters()) {
      EXPECT_LE(relDiff(p.value(), ref_params[p.key()]), 1e-5) << "rank " << rank << " parameter " << p.key();
      ++compared;
    }
    EXPECT_GT(compared, 0u);
  });
  expectAllOk(results);
}

class PipelineVsOneProcess : public testing::TestWithParam<Case> {};

TEST_P(PipelineVsOneProcess, LossAndParametersMatch) {
  const Case c = GetParam();
  PipelineOptions po;
  po.schedule = c.schedule;
  po.micro_batches = c.micro;
  trainAndCompare(c.stages, po, /*rows=*/16, {}, 0, 16, "auto", c.chunks);
}

INSTANTIATE_TEST_SUITE_P(Schedules, PipelineVsOneProcess,
                         testing::Values(Case{2, PipelineSchedule::gpipe, 4}, Case{2, PipelineSchedule::gpipe, 8},
                                         Case{2, PipelineSchedule::one_f_one_b, 4},
                                         Case{2, PipelineSchedule::one_f_one_b, 8},
                                         Case{3, PipelineSchedule::gpipe, 4}, Case{3, PipelineSchedule::gpipe, 8},
                                         Case{3, PipelineSchedule::one_f_one_b, 4},
                                         Case{3, PipelineSchedule::one_f_one_b, 8},
                                         // Interleaved: 2 or 3 chunks a rank (the 7-module model in 4 or 6
                                         // parts), M = P (all warm-up) and M = 2P, 4P (steady 1F1B).
                                         Case{2, PipelineSchedule::interleaved, 2, 2},
                                         Case{2, PipelineSchedule::interleaved, 4, 2},
                                         Case{2, PipelineSchedule::interleaved, 8, 3},
                                         Case{3, PipelineSchedule::interleaved, 3, 2},
                                         Case{3, PipelineSchedule::interleaved, 6, 2}),
                         caseName);

// Interleaved chunks through a 4 KiB shm ring and over tcp: sends that cannot complete before the
// receiver takes them, with each rank's chunks sending both ways round the ring.
TEST(Pipeline, InterleavedWithBlockingSendsAndOverTcp) {
  PipelineOptions po{4, PipelineSchedule::interleaved};
  trainAndCompare(2, po, /*rows=*/64, {}, /*segment_bytes=*/4096, /*width=*/64, "auto", 3);
  trainAndCompare(2, po, /*rows=*/64, {}, /*segment_bytes=*/0, /*width=*/64, "tcp", 2);
}

// One rank with three chunks: the chunks hand activations and gradients to each other without messages.
TEST(Pipeline, InterleavedOnOneRank) {
  auto pg = comm::ProcessGroup::create(nullptr, 0, 1);
  auto model = makeModel(), ref = makeModel();
  Pipeline pipe(pipelineChunks(model, 0, 1, 3), pg, PipelineOptions{3, PipelineSchedule::interleaved});
  EXPECT_EQ(pipe.chunks(), 3);
  EXPECT_EQ(pipe.module()->size(), 7u);
  auto [x, y] = batch(0, 7);
  double loss = pipe.step(x, y, lossFn);
  auto ref_loss = lossFn(ref->forward(x), y);
  ref_loss.backward();
  EXPECT_NEAR(loss, ref_loss.item<double>(), 1e-12);
  auto rp = ref->named_parameters();
  for (const auto& p : pipe.module()->named_parameters())
    EXPECT_LE(relDiff(p.value().grad(), rp[p.key()].grad()), 1e-12) << p.key();
  torch::NoGradGuard g;
  EXPECT_LE(relDiff(pipe.forward(x), makeModel()->forward(x)), 1e-12);
}

// Chunks built by hand, each a Sequential of its own whose modules are named from "0": module() keeps
// every chunk's modules (a clash takes the chunk's index in front), and the step is one process's.
TEST(Pipeline, InterleavedChunksBuiltByHand) {
  auto pg = comm::ProcessGroup::create(nullptr, 0, 1);
  auto ref = makeModel();
  std::vector<torch::nn::Sequential> chunks(2);
  for (size_t i = 0; i < ref->size(); ++i)
    chunks[i < 3 ? 0 : 1]->push_back(*(ref->begin() + static_cast<std::ptrdiff_t>(i)));
  Pipeline pipe(chunks, pg, PipelineOptions{2, PipelineSchedule::interleaved});
  EXPECT_EQ(pipe.module()->size(), 7u);
  EXPECT_TRUE(pipe.module()->named_children().contains("chunk1_0"));
  auto [x, y] = batch(0, 6);
  double loss = pipe.step(x, y, lossFn);
  EXPECT_NEAR(loss, lossFn(makeModel()->forward(x), y).item<double>(), 1e-12);
  EXPECT_EQ(pipe.module()->parameters().size(), ref->parameters().size());
}

// The interleaved schedule's order: every (chunk, micro-batch) has one forward and, after it, one
// backward; chunks run forwards in groups of P micro-batches; the warm-up is 2(P-s-1) + (V-1)P.
TEST(Pipeline, InterleavedOrder) {
  const int P = 4, V = 2, M = 8;
  for (int s = 0; s < P; ++s) {
    auto order = pipelineActions(PipelineSchedule::interleaved, s, P, M, V);
    ASSERT_EQ(order.size(), 2u * M * V);
    std::set<std::pair<int, int>> fwd, bwd;
    int warmup = 0;
    for (const auto& a : order) {
      ASSERT_TRUE(a.chunk >= 0 && a.chunk < V && a.micro >= 0 && a.micro < M);
      if (a.kind == 'F') {
        EXPECT_TRUE(fwd.insert({a.chunk, a.micro}).second);
        if (bwd.empty()) ++warmup;
      } else {
        EXPECT_TRUE(fwd.count({a.chunk, a.micro})) << "backward before forward";
        EXPECT_TRUE(bwd.insert({a.chunk, a.micro}).second);
      }
    }
    EXPECT_EQ(warmup, 2 * (P - s - 1) + (V - 1) * P + 1) << "stage " << s;  // + the first steady forward
    EXPECT_EQ(order[0].chunk, 0);
    EXPECT_EQ(order[P].chunk, 1);  // P micro-batches through chunk 0, then chunk 1
    EXPECT_EQ(order[P].micro, 0);
  }
  EXPECT_THROW(pipelineActions(PipelineSchedule::interleaved, 0, 4, 6, 2), InvalidArgument);
  EXPECT_THROW(pipelineActions(PipelineSchedule::one_f_one_b, 0, 4, 8, 2), InvalidArgument);
}

// 10 rows in 4 micro-batches (3, 3, 2, 2): each weighs by its share of the batch. User split points.
TEST(Pipeline, UnevenMicroBatchesAndSplitPoints) {
  PipelineOptions po;
  po.micro_batches = 4;
  trainAndCompare(3, po, /*rows=*/10, /*splits=*/{1, 5});
}

// Fewer micro-batches than stages: 1F1B degenerates to warm-up and drain, still exact.
TEST(Pipeline, FewerMicroBatchesThanStages) {
  PipelineOptions po;
  po.micro_batches = 2;
  trainAndCompare(3, po, /*rows=*/6);
}

// Activations of 16 x 64 doubles (8 KiB) through a 4 KiB shm ring: every send blocks until the peer
// reads, which is where a schedule without paired send/recv would deadlock.
TEST(Pipeline, BlockingSendsDoNotDeadlock) {
  for (auto s : {PipelineSchedule::one_f_one_b, PipelineSchedule::gpipe}) {
    PipelineOptions po;
    po.micro_batches = 4;
    po.schedule = s;
    trainAndCompare(3, po, /*rows=*/64, {}, /*segment_bytes=*/4096, /*width=*/64);
  }
}

TEST(Pipeline, OverTcp) {
  PipelineOptions po;
  po.micro_batches = 4;
  trainAndCompare(3, po, /*rows=*/64, {}, /*segment_bytes=*/0, /*width=*/64, "tcp");
}

// forward() on 2 ranks, the rank's part of the model from `part`, against the whole model: the output
// on the last stage, nothing elsewhere.
void forwardEqualsWholeModel(const std::function<std::vector<torch::nn::Sequential>(torch::nn::Sequential&, int)>& part,
                             PipelineOptions po, int64_t rows) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    auto model = makeModel();
    Pipeline pipe(part(model, rank), pg, po);
    auto [x, y] = batch(0, rows);
    at::Tensor out = pipe.forward(rank == 0 ? x : at::Tensor());
    if (rank == 1) {
      torch::NoGradGuard g;
      EXPECT_LE(relDiff(out, makeModel()->forward(x)), 1e-12);
    } else {
      EXPECT_FALSE(out.defined());
    }
  });
  expectAllOk(results);
}

TEST(Pipeline, ForwardOnlyEqualsWholeModel) {
  forwardEqualsWholeModel([](torch::nn::Sequential& m, int rank) { return std::vector{pipelineStage(m, rank, 2)}; },
                          PipelineOptions{3, PipelineSchedule::gpipe}, 7);
}

TEST(Pipeline, InterleavedForwardOnlyEqualsWholeModel) {
  forwardEqualsWholeModel([](torch::nn::Sequential& m, int rank) { return pipelineChunks(m, rank, 2, 2); },
                          PipelineOptions{4, PipelineSchedule::interleaved}, 9);
}

// Evaluation between training steps must not overwrite what the last step() measured: stats() and
// timeline() stay the step's, forwardStats() holds the forward's. (Caught: forward() resetting stats.)
TEST(Pipeline, StepStatsSurviveForward) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    auto model = makeModel();
    Pipeline pipe(pipelineStage(model, rank, 2), pg, PipelineOptions{4, PipelineSchedule::gpipe});
    auto [x, y] = batch(0, 8);
    pipe.step(rank == 0 ? x : at::Tensor(), rank == 1 ? y : at::Tensor(), lossFn);
    const PipelineStats step = pipe.stats();
    const size_t spans = pipe.timeline().size();
    ASSERT_EQ(step.peak_stored_activations, 4);
    ASSERT_GT(step.backward_ms, 0.0);
    ASSERT_EQ(spans, 8u);
    for (int i = 0; i < 2; ++i) pipe.forward(rank == 0 ? x : at::Tensor());
    const PipelineStats& after = pipe.stats();
    EXPECT_EQ(after.peak_stored_activations, step.peak_stored_activations);
    EXPECT_EQ(after.peak_activation_bytes, step.peak_activation_bytes);
    EXPECT_EQ(after.step_ms, step.step_ms);
    EXPECT_EQ(after.forward_ms, step.forward_ms);
    EXPECT_EQ(after.backward_ms, step.backward_ms);
    EXPECT_EQ(after.comm_ms, step.comm_ms);
    EXPECT_EQ(pipe.timeline().size(), spans);
    const PipelineStats& fwd = pipe.forwardStats();
    EXPECT_GT(fwd.step_ms, 0.0);
    EXPECT_GT(fwd.forward_ms, 0.0);
    EXPECT_EQ(fwd.backward_ms, 0.0);
    EXPECT_EQ(fwd.peak_stored_activations, 0);
    EXPECT_EQ(fwd.stage, rank);
    EXPECT_EQ(fwd.micro_batches, 4);
    // The next step measures afresh.
    pipe.step(rank == 0 ? x : at::Tensor(), rank == 1 ? y : at::Tensor(), lossFn);
    EXPECT_EQ(pipe.stats().peak_stored_activations, 4);
    EXPECT_EQ(pipe.timeline().size(), 8u);
  });
  expectAllOk(results);
}

// A world of one: the pipeline is gradient accumulation over micro-batches, with no communication.
TEST(Pipeline, OneStageIsGradientAccumulation) {
  auto pg = comm::ProcessGroup::create(nullptr, 0, 1);
  auto model = makeModel(), ref = makeModel();
  Pipeline pipe(model, pg, PipelineOptions{3, PipelineSchedule::one_f_one_b});
  auto [x, y] = batch(0, 7);
  double loss = pipe.step(x, y, lossFn);
  auto ref_loss = lossFn(ref->forward(x), y);
  ref_loss.backward();
  EXPECT_NEAR(loss, ref_loss.item<double>(), 1e-12);
  auto rp = ref->parameters(), pp = model->parameters();
  for (size_t i = 0; i < rp.size(); ++i) EXPECT_LE(relDiff(pp[i].grad(), rp[i].grad()), 1e-12);
  EXPECT_EQ(pipe.stats().peak_stored_activations, 1);
}

TEST(Pipeline, BalanceByParameters) {
  // Linear(6,16)=112, Tanh, Linear(16,16)=272, Tanh, Linear(16,12)=204, Tanh, Linear(12,3)=39 (+1 each)
  auto model = makeModel();
  EXPECT_EQ(balanceByParameters(model, 1), (std::vector<size_t>{0, 7}));
  EXPECT_EQ(balanceByParameters(model, 2), (std::vector<size_t>{0, 3, 7}));
  auto b3 = balanceByParameters(model, 3);
  ASSERT_EQ(b3.size(), 4u);
  EXPECT_EQ(b3.front(), 0u);
  EXPECT_EQ(b3.back(), 7u);
  auto stage = pipelineStage(model, 1, 2);
  EXPECT_EQ(stage->size(), 4u);
  EXPECT_TRUE(stage->named_parameters().contains("4.weight"));
  EXPECT_THROW(balanceByParameters(model, 8), InvalidArgument);
  EXPECT_THROW(pipelineStage(model, 0, 3, {4, 2}), InvalidArgument);
  // 1F1B never holds more than P - s micro-batches; every micro-batch gets one F and one B.
  for (int s = 0; s < 4; ++s) {
    auto order = pipelineOrder(PipelineSchedule::one_f_one_b, s, 4, 8);
    ASSERT_EQ(order.size(), 16u);
    int live = 0, peak = 0;
    for (auto& [k, m] : order) peak = std::max(peak, live += k == 'F' ? 1 : -1);
    EXPECT_EQ(peak, 4 - s);
  }
}

// Stage 1 of a model whose halves do not fit (16 features out, 12 expected in): both ranks fail
// promptly, and the error names the stage, the sender and the shapes.
TEST(PipelineErrors, ShapeMismatchNamesTheRanks) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    torch::manual_seed(1);
    torch::nn::Sequential stage;
    if (rank == 0) stage->push_back(torch::nn::Linear(6, 16));
    else stage->push_back(torch::nn::Linear(12, 3));
    stage->to(torch::kDouble);
    Pipeline pipe(stage, pg, PipelineOptions{2, PipelineSchedule::one_f_one_b});
    auto [x, y] = batch(0, 4);
    auto t0 = std::chrono::steady_clock::now();
    try {
      pipe.step(x, y, lossFn);
      ADD_FAILURE() << "step succeeded";
    } catch (const Error& e) {
      std::string m = e.what();
      printf("rank %d: %s\n", rank, m.c_str());
      EXPECT_NE(m.find("[rank 1] pipeline stage 1/2"), std::string::npos) << m;
      EXPECT_NE(m.find("forward of micro-batch 0"), std::string::npos) << m;
      if (rank == 0) {
        EXPECT_NE(m.find("[rank 0] pipeline stage 0/2"), std::string::npos) << m;
      }
      EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
    }
  });
  expectAllOk(results);
}

TEST(PipelineErrors, DtypeMismatchNamesTheSender) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    torch::nn::Sequential stage(torch::nn::Linear(6, 6));
    if (rank == 1) stage->to(torch::kDouble);  // rank 0 stays float32
    Pipeline pipe(stage, pg, PipelineOptions{2, PipelineSchedule::gpipe});
    try {
      pipe.step(at::randn({4, 6}), at::randint(0, 3, {4}, torch::kLong), lossFn);
      ADD_FAILURE() << "step succeeded";
    } catch (const Error& e) {
      std::string m = e.what();
      printf("rank %d: %s\n", rank, m.c_str());
      EXPECT_NE(m.find("rank 0 (stage 0) sends a Float activation of shape [2, 6], but this stage's parameters "
                       "are Double"),
                std::string::npos)
          << m;
    }
  });
  expectAllOk(results);
}

// Bad interleaved configurations fail in the constructor on every rank, naming what is wrong.
TEST(PipelineErrors, InterleavedConfigurations) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    auto model = makeModel();
    try {  // 3 micro-batches on 2 stages
      Pipeline pipe(pipelineChunks(model, rank, 2, 2), pg, PipelineOptions{3, PipelineSchedule::interleaved});
      ADD_FAILURE() << "constructed";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("multiple of the 2 stages, not 3"), std::string::npos) << e.what();
    }
    try {  // 2 chunks, but 1F1B
      Pipeline pipe(pipelineChunks(model, rank, 2, 2), pg, PipelineOptions{4, PipelineSchedule::one_f_one_b});
      ADD_FAILURE() << "constructed";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("one chunk per rank, not 2"), std::string::npos) << e.what();
    }
    // Rank 1 alone refuses its configuration (2 chunks under 1F1B): rank 0 learns it at once, not after
    // the group's 30 s timeout.
    const auto t0 = std::chrono::steady_clock::now();
    try {
      Pipeline pipe(pipelineChunks(model, rank, 2, 1 + rank), pg, PipelineOptions{4, PipelineSchedule::one_f_one_b});
      ADD_FAILURE() << "constructed";
    } catch (const InvalidArgument& e) {
      const std::string want = rank == 0 ? "[rank 0] Pipeline: rank(s) 1 refused their configuration"
                                         : "one chunk per rank, not 2";
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
    }
    // The ranks disagree on the chunk count.
    try {
      Pipeline pipe(pipelineChunks(model, rank, 2, 1 + rank), pg, PipelineOptions{2, PipelineSchedule::interleaved});
      ADD_FAILURE() << "constructed";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0: 2 micro-batches, interleaved; rank 1: 2 micro-batches, "
                                           "interleaved with 2 chunks"),
                std::string::npos)
          << e.what();
    }
    Pipeline pipe(pipelineChunks(model, rank, 2, 2), pg, PipelineOptions{2, PipelineSchedule::interleaved});
    // Refused before the pointer is looked at (never dereferenced here).
    EXPECT_THROW(pipe.attachDataParallel(reinterpret_cast<DistributedDataParallel*>(&pipe)), InvalidArgument);
  });
  expectAllOk(results);
}

// A stage that dies in the middle of a step (SIGKILL, its channels and group left as they were) is
// named by the other stages within the group's timeout, whichever channel they were waiting on; with the
// interleaved schedule rank 0 and rank 2 also talk round the ring.
TEST(PipelineErrors, AKilledStageIsNamedByTheOthers) {
  for (auto schedule : {PipelineSchedule::one_f_one_b, PipelineSchedule::interleaved}) {
    StoreServer server;
    auto results = runRanks(3, [&](int rank) {
      comm::GroupOptions o;
      o.timeout = std::chrono::seconds(5);
      auto pg = comm::ProcessGroup::create(server.client(), rank, 3, o);
      auto model = makeModel(64);
      const int chunks = schedule == PipelineSchedule::interleaved ? 2 : 1;
      Pipeline pipe(pipelineChunks(model, rank, 3, chunks), pg, PipelineOptions{6, schedule});
      auto [x, y] = batch(0, 600);
      auto step = [&] { pipe.step(rank == 0 ? x : at::Tensor(), rank == 2 ? y : at::Tensor(), lossFn); };
      step();
      if (rank == 1) {
        std::thread([] {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
          kill(getpid(), SIGKILL);
        }).detach();
      }
      const auto t0 = std::chrono::steady_clock::now();
      try {
        for (int i = 0; i < 100000; ++i) step();
        ADD_FAILURE() << "rank " << rank << ": steps kept succeeding after rank 1 was killed";
      } catch (const Error& e) {
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::string m = e.what();
        printf("%s rank %d after %.2fs: %s\n", scheduleName(schedule), rank, secs, m.c_str());
        // The dead stage by its pipeline number, not only the channel's own ranks (0 and 1).
        EXPECT_TRUE(m.find("from stage 1") != std::string::npos || m.find("to stage 1") != std::string::npos) << m;
        EXPECT_NE(m.find(fmt::format("[rank {}] pipeline stage {}/3", rank, rank)), std::string::npos) << m;
        EXPECT_LT(secs, 2.0 * 5) << m;
      }
    }, std::chrono::seconds(60));
    for (const auto& c : results) {
      if (c.rank == 1) EXPECT_EQ(c.signal, SIGKILL) << c.describe();
      else EXPECT_TRUE(c.ok()) << c.describe();
    }
  }
}

TEST(PipelineErrors, StagesDisagreeOnTheSchedule) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    auto pg = group(server, rank, 2);
    torch::nn::Sequential stage(torch::nn::Linear(6, 6));
    PipelineOptions po;
    po.micro_batches = rank == 0 ? 4 : 8;
    try {
      Pipeline pipe(stage, pg, po);
      ADD_FAILURE() << "constructed";
    } catch (const InvalidArgument& e) {
      std::string m = e.what();
      EXPECT_NE(m.find("rank 0: 4 micro-batches, 1f1b; rank 1: 8 micro-batches, 1f1b"), std::string::npos) << m;
    }
  });
  expectAllOk(results);
}

}  // namespace
}  // namespace dtrain::test
