// PowerSGD hooks: parity with PyTorch's powerSGD_hook (Gloo DDP runs of tests/torch/powersgd_reference.py
// on the same model, data, bucket layout and seed, with the torch of pythonPath(): the wheel's 2.x or
// Debian's 1.13) at ranks 1, 2 and 4 with and without warm start and error feedback, at world sizes 1, 2
// and 4 (each dtrain rank against PyTorch's ranks on the same slices of the batch); the batched hook
// against the script's hand-written reference; 2 and 3 ranks against one rank on the mean gradient;
// bytes sent per step.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "ddp_test_util.h"
#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "dtrain/powersgd.h"
#include "harness.h"

namespace dtrain::test {
namespace {

// powersgd_reference.py's Net: a 4-D weight, matrices of shapes A B A in one bucket, biases.
// No conv bias: PyTorch's rebuilt buckets would hold the conv weight before its bias (arrival order),
// dtrain's one-rank buckets the bias first (reverse registration order).
struct PsgdNetImpl : torch::nn::Module {
  PsgdNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 8, 3).bias(false)));
    fc1 = register_module("fc1", torch::nn::Linear(32, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 32));
    fc3 = register_module("fc3", torch::nn::Linear(32, 64));
    fc4 = register_module("fc4", torch::nn::Linear(64, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(conv->forward(x)).flatten(1);
    x = torch::tanh(fc1->forward(x));
    x = torch::tanh(fc2->forward(x));
    x = torch::tanh(fc3->forward(x));
    return fc4->forward(x);
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, fc4{nullptr};
};
TORCH_MODULE(PsgdNet);

constexpr int kSteps = 8, kStart = 2, kBatch = 12;
// Bucket sizes where dtrain's rule (close before exceeding) and PyTorch's (close on reaching) agree:
// [fc4], [fc3 fc2 fc1] (weights of shapes A B A), [conv].
constexpr size_t kFirstBucket = 2600, kBucket = 25216;
constexpr double kLr = 0.1;

struct Case {
  int rank = 1;
  bool warm = true, ef = true, batched = false;
  uint32_t seed = 0;
  std::string name() const {
    return fmt::format("{} rank {} warm_start {} error_feedback {}", batched ? "batched" : "layerwise", rank, warm, ef);
  }
};

PowerSGDOptions optionsOf(const Case& c) {
  PowerSGDOptions o;
  o.matrix_approximation_rank = c.rank;
  o.start_powerSGD_iter = kStart;
  o.warm_start = c.warm;
  o.use_error_feedback = c.ef;
  o.random_seed = c.seed;
  return o;
}

std::pair<at::Tensor, at::Tensor> data(int steps, int batch) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(42);
  return {at::randn({steps, batch, 4, 4, 4}, g), at::randint(0, 10, {steps, batch}, g, at::kLong)};
}

PsgdNet makeModel() {
  torch::manual_seed(3);
  return PsgdNet();
}

at::Tensor flatGrads(PsgdNet& m) {
  std::vector<at::Tensor> g;
  for (auto& p : m->parameters()) g.push_back(p.grad().reshape({-1}));
  return at::cat(g);
}

struct Trained {
  std::vector<at::Tensor> grads;  // per step, after the hook, in registration order
  std::vector<std::vector<size_t>> layout;
  std::vector<uint64_t> bytes;  // per step
  PowerSGDHook::Compression compression;
};

// Trains `steps` steps of DDP with the case's hook on rank's slice of each step's batch.
Trained train(const std::shared_ptr<comm::ProcessGroup>& pg, const Case& c, int world_batch) {
  auto model = makeModel();
  DDPOptions o;
  o.first_bucket_bytes = kFirstBucket;
  o.bucket_bytes = kBucket;
  DistributedDataParallel ddp(model.ptr(), pg, o);
  auto hook = c.batched ? batchedPowerSGDHook(optionsOf(c)) : powerSGDHook(optionsOf(c));
  ddp.registerCommHook(hook);
  torch::optim::SGD opt(model->parameters(), kLr);
  auto [x, y] = data(kSteps, world_batch);
  const int per = world_batch / pg->size();
  Trained r;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    auto xs = x[s].narrow(0, pg->rank() * per, per), ys = y[s].narrow(0, pg->rank() * per, per);
    torch::nn::functional::cross_entropy(model->forward(xs), ys).backward();
    r.grads.push_back(flatGrads(model).clone());
    r.bytes.push_back(ddp.lastStats().bytes_sent);
    opt.step();
  }
  r.layout = ddp.bucketLayout();
  r.compression = hook->compressionStats();
  return r;
}

std::shared_ptr<comm::ProcessGroup> soloGroup(const StoreServer& server) { return group(server, 0, 1); }

// Per parameter and step: max |a - b| / max |b| <= tol. Returns the worst ratio.
double compare(PsgdNet& shapes, const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, double tol,
               const std::string& what, bool expect = true) {
  double worst = 0;
  for (size_t s = 0; s < a.size(); ++s) {
    int64_t off = 0;
    for (const auto& item : shapes->named_parameters()) {
      const int64_t n = item.value().numel();
      auto x = a[s].narrow(0, off, n), y = b[s].narrow(0, off, n);
      off += n;
      double diff = (x - y).abs().max().item<double>(), scale = std::max(1e-12, y.abs().max().item<double>());
      worst = std::max(worst, diff / scale);
      if (expect) {
        EXPECT_LE(diff / scale, tol) << what << ", step " << s << ", " << item.key() << ": differs by " << diff;
      }
    }
  }
  return worst;
}

void writeFile(const std::string& path, const at::Tensor& t) {
  auto c = t.contiguous();
  std::ofstream(path, std::ios::binary).write(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
}

at::Tensor readFloats(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  auto bytes = static_cast<int64_t>(in.tellg());
  auto t = at::empty({bytes / 4}, at::kFloat);
  in.seekg(0);
  in.read(static_cast<char*>(t.data_ptr()), bytes);
  return t;
}

// The python side's input for one case, in dir.
void writeCase(const std::string& dir, const Case& c) {
  auto model = makeModel();
  std::vector<at::Tensor> ps;
  for (auto& p : model->parameters()) ps.push_back(p.detach().reshape({-1}));
  writeFile(dir + "/params.bin", at::cat(ps));
  auto [x, y] = data(kSteps, kBatch);
  writeFile(dir + "/x.bin", x);
  writeFile(dir + "/y.bin", y);
  nlohmann::json cfg = {{"rank", c.rank},
                        {"start", kStart},
                        {"warm_start", c.warm},
                        {"error_feedback", c.ef},
                        {"epsilon", 0},
                        {"seed", c.seed},
                        {"min_compression_rate", 2},
                        {"steps", kSteps},
                        {"batch", kBatch},
                        {"first_bucket_bytes", kFirstBucket},
                        {"bucket_bytes", kBucket},
                        {"lr", kLr},
                        {"batched", c.batched}};
  std::ofstream(dir + "/config.json") << cfg.dump();
}

// The cases of the parity tests: every rank, warm start and error feedback, batched, another seed.
std::vector<Case> parityCases() {
  std::vector<Case> cases;
  for (int rank : {1, 2, 4})
    for (bool warm : {true, false})
      for (bool ef : {true, false}) cases.push_back({rank, warm, ef, false});
  cases.push_back({1, true, true, true});
  cases.push_back({2, true, true, true});
  cases.push_back({2, false, false, true});
  cases.push_back({3, true, true, false, 1234});
  return cases;
}

// PyTorch's DDP with powerSGD_hook on `world` Gloo ranks (one python run per world computes every case:
// its start-up dominates), then dtrain's on `world` ranks: each rank's gradients, step after step, equal
// PyTorch's. At world 1 also: another seed gives other gradients (the test can fail).
void matchesPyTorch(int world) {
  const std::vector<Case> cases = parityCases();
  TempDir tmp;
  std::string dirs;
  for (size_t k = 0; k < cases.size(); ++k) {
    auto dir = fmt::format("{}/case{}", tmp.path(), k);
    ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
    writeCase(dir, cases[k]);
    dirs += " " + dir;
  }
  auto [status, out] = runCommand("env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 " + pythonPath() + " " +
                                      std::string(DTRAIN_SOURCE_DIR) + "/tests/torch/powersgd_reference.py --world " +
                                      std::to_string(world) + dirs,
                                  240);
  ASSERT_EQ(status, 0) << pythonPath() << " at world " << world << ": " << out;
  StoreServer server;
  auto shapes = makeModel();
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    SCOPED_TRACE(c.name());
    auto dir = fmt::format("{}/case{}", tmp.path(), k);
    auto ref = readFloats(dir + "/grads.bin").view({kSteps, -1});
    std::vector<at::Tensor> want = ref.unbind(0);
    auto layouts = nlohmann::json::parse(std::ifstream(dir + "/layout.json"));
    ASSERT_EQ(layouts.size(), size_t(kSteps - kStart));
    if (world > 1) {
      StoreServer fresh;  // one rendezvous per group of `world` ranks
      auto results = runRanks(world, [&](int rank) {
        Trained got = train(group(fresh, rank, world), c, kBatch);
        for (const auto& l : layouts) EXPECT_EQ(l.get<std::vector<std::vector<size_t>>>(), got.layout);
        auto mine = makeModel();
        // Four ranks' sums are associated differently by Gloo's ring and dtrain's reduction, and PowerSGD's
        // orthogonalisation carries those last bits on through error feedback and warm start: 1.3e-5 seen
        // at step 7. A real difference is far larger: another seed gives 1e-3 and more (checked at world 1).
        const double tol = world > 2 ? 1e-4 : 1e-5;
        compare(mine, got.grads, want, tol, fmt::format("{}, rank {} of {}", c.name(), rank, world));
      });
      expectAllOk(results);
      continue;
    }
    Trained got = train(soloGroup(server), c, kBatch);
    for (const auto& l : layouts) EXPECT_EQ(l.get<std::vector<std::vector<size_t>>>(), got.layout);
    // One process: the same arithmetic as PyTorch's hook in another order of ops, whose last bits PowerSGD
    // carries on (1.05e-5 at step 7 of layerwise rank 3 with error feedback, on one VM's CPU); another
    // seed differs by 1e-3 and more (below).
    compare(shapes, got.grads, want, 3e-5, c.name());
    if (k == 0) {  // the test can fail: another seed gives other gradients past the start
      Case other = c;
      other.seed = 1;
      Trained wrong = train(soloGroup(server), other, kBatch);
      std::vector<at::Tensor> a(wrong.grads.begin() + kStart, wrong.grads.end()),
          b(want.begin() + kStart, want.end());
      EXPECT_GT(compare(shapes, a, b, 0, "", false), 1e-3) << "random_seed does not change the gradients";
    }
  }
}

TEST(PowerSGD, MatchesPyTorch) { matchesPyTorch(1); }
// The multi-rank path against PyTorch's multi-rank path: a bug shared by dtrain's ranks and its own
// one-rank reference (error feedback switched off on every rank, say) shows here and not above.
TEST(PowerSGD, MatchesPyTorchAtWorld2) { matchesPyTorch(2); }
TEST(PowerSGD, MatchesPyTorchAtWorld4) { matchesPyTorch(4); }

// 2 and 3 ranks equal one rank on the mean gradient (the global batch), step after step.
void multiRank(int world, bool batched) {
  Case c{2, true, true, batched};
  const int batch = 12;
  Trained solo;
  {
    StoreServer server;
    solo = train(soloGroup(server), c, batch);
  }
  StoreServer server;
  auto results = runRanks(world, [&](int rank) {
    Trained got = train(group(server, rank, world), c, batch);
    auto shapes = makeModel();
    // The ranks' sum of per-rank gradients is rounded otherwise than one process's gradient of the whole
    // batch, and PowerSGD carries those last bits on through error feedback and warm start: 1.1e-5 to
    // 3.1e-5 at steps 6-7 on one VM's CPU (1.13's OpenBLAS). Another seed differs by 1e-3 and more.
    compare(shapes, got.grads, solo.grads, 1e-4, fmt::format("rank {} of {}", rank, world));
    EXPECT_EQ(got.layout, solo.layout);
    // Bytes: the plain steps send the whole model, the compressed ones far less.
    EXPECT_GT(got.bytes[0], 0u);
    for (int s = kStart; s < kSteps; ++s)
      EXPECT_LT(got.bytes[s] * 2, got.bytes[0]) << "step " << s << ": " << got.bytes[s] << " vs " << got.bytes[0];
    EXPECT_GT(got.compression.rate(), 2.0);
  });
  expectAllOk(results);
}

TEST(PowerSGD, TwoRanksEqualOneOnTheMean) { multiRank(2, false); }
TEST(PowerSGD, ThreeRanksEqualOneOnTheMean) { multiRank(3, false); }
TEST(PowerSGD, BatchedThreeRanksEqualOneOnTheMean) { multiRank(3, true); }

TEST(PowerSGD, RejectsBadOptions) {
  PowerSGDOptions o;
  o.start_powerSGD_iter = 1;
  EXPECT_NE(errorOf([&] { powerSGDHook(o); }).find("start_powerSGD_iter must be > 1"), std::string::npos);
  o.use_error_feedback = o.warm_start = false;
  EXPECT_NO_THROW(powerSGDHook(o));
  o.matrix_approximation_rank = 0;
  EXPECT_NE(errorOf([&] { batchedPowerSGDHook(o); }).find("matrix_approximation_rank"), std::string::npos);
}

}  // namespace
}  // namespace dtrain::test
