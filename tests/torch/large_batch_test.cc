// LARS, LAMB and the linear scaling rule (dtrain/optim.h): each optimizer against a reference written
// here from the papers' algorithms over plain tensors (weight decay on, the BERT-excluded group, LAMB
// clipping on and off, φ clamped), on 1 process and on 3 ranks with DDP against 1 process on the
// global batch; the trust ratio's zero-norm cases; a checkpoint round trip that continues bit for bit;
// bad options; the schedule's values.
#include <gtest/gtest.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <sstream>
#include <tuple>

#include <unistd.h>

#include "ddp_test_util.h"
#include "dtrain/checkpoint.h"
#include "dtrain/comm/error.h"
#include "dtrain/ddp.h"
#include "dtrain/optim.h"
#include "harness.h"

namespace dtrain::test {
namespace {

using dtrain::optim::Lamb;
using dtrain::optim::LambOptions;
using dtrain::optim::Lars;
using dtrain::optim::LarsOptions;
using dtrain::optim::LinearScaling;
using dtrain::optim::LinearScalingOptions;

double norm2(const torch::Tensor& t) { return std::sqrt((t * t).sum().item<double>()); }

// ---- references, from the papers over plain tensors (not sharing code with src/) ----

// LARS, You et al. 2017 Algorithm 1: v ← m·v + γ·λ·(g + βw); w ← w − v, λ = η‖w‖/(‖g‖ + β‖w‖ + eps),
// λ = 1 when a norm is zero; excluded parameters: β = 0 and λ = 1.
struct RefLars {
  double lr = 0, momentum = 0.9, beta = 0.01, eta = 0.02, eps = 1e-8;
  std::vector<torch::Tensor> v;
  void step(const std::vector<torch::Tensor>& params, const std::vector<bool>& excluded) {
    torch::NoGradGuard no_grad;
    if (v.empty())
      for (auto& p : params) v.push_back(torch::zeros_like(p));
    for (size_t i = 0; i < params.size(); ++i) {
      auto w = params[i].clone(), g = params[i].grad();
      double b = excluded[i] ? 0.0 : beta, local = 1.0;
      double wn = norm2(w), gn = norm2(g);
      if (!excluded[i] && wn != 0 && gn != 0) local = eta * wn / (gn + b * wn + eps);
      v[i] = momentum * v[i] + lr * local * (g + b * w);
      params[i].copy_(w - v[i]);
    }
  }
};

// LAMB, You et al. 2019 Algorithm 2 with bias correction, FusedLAMB's clipping by the global norm:
// g ← g·min(1, max_norm/‖G‖); u = m̂/(√v̂ + eps) + λw; w ← w − lr·φ(‖w‖)/‖u‖·u (ratio 1 at a zero norm).
struct RefLamb {
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-6, wd = 0.01, max_norm = 0;
  double trust_min = 0, trust_max = std::numeric_limits<double>::infinity();
  bool bias_correction = true;
  int t = 0;
  std::vector<torch::Tensor> m, v;
  double last_norm = 0;
  void step(const std::vector<torch::Tensor>& params, const std::vector<bool>& excluded) {
    torch::NoGradGuard no_grad;
    if (m.empty())
      for (auto& p : params) m.push_back(torch::zeros_like(p)), v.push_back(torch::zeros_like(p));
    double sq = 0;
    for (auto& p : params) sq += (p.grad() * p.grad()).sum().item<double>();
    last_norm = std::sqrt(sq);
    double scale = max_norm > 0 && last_norm > max_norm ? max_norm / last_norm : 1.0;
    ++t;
    for (size_t i = 0; i < params.size(); ++i) {
      auto w = params[i].clone(), g = params[i].grad() * scale;
      m[i] = beta1 * m[i] + (1 - beta1) * g;
      v[i] = beta2 * v[i] + (1 - beta2) * g * g;
      auto mhat = bias_correction ? m[i] / (1 - std::pow(beta1, t)) : m[i];
      auto vhat = bias_correction ? v[i] / (1 - std::pow(beta2, t)) : v[i];
      auto u = mhat / (vhat.sqrt() + eps) + (excluded[i] ? 0.0 : wd) * w;
      double phi = std::min(std::max(norm2(w), trust_min), trust_max), un = norm2(u);
      double ratio = !excluded[i] && phi != 0 && un != 0 ? phi / un : 1.0;
      params[i].copy_(w - lr * ratio * u);
    }
  }
};

// 1-D parameters are the biases here: the reference's own reading of the BERT rule.
std::vector<bool> excludedOf(Net& n, bool split) {
  std::vector<bool> out;
  for (auto& p : n->parameters()) out.push_back(split && p.dim() == 1);
  return out;
}

// `steps` steps of cross-entropy on the global batch of 12 rows; update(step) after each backward.
void train(Net& n, int steps, const std::function<void(int)>& update) {
  for (int s = 0; s < steps; ++s) {
    n->zero_grad();
    auto [x, y] = batch(s, 3);
    torch::nn::functional::cross_entropy(n->forward(x), y).backward();
    update(s);
  }
}

LinearScaling schedule(double base_lr) {
  LinearScalingOptions o;
  o.base_lr = base_lr;
  o.base_batch = kPerRank;
  o.global_batch = 3 * kPerRank;
  o.warmup_steps = 3;
  o.decay = optim::Decay::kCosine;
  o.total_steps = 8;
  return LinearScaling(o);
}

template <typename Options>
std::vector<torch::optim::OptimizerParamGroup> groupsFor(Net& n, const Options& o, bool split) {
  if (split) return optim::decayGroups(*n, o);
  return {torch::optim::OptimizerParamGroup(n->parameters(), std::make_unique<Options>(o))};
}

// ---- against the references, one process ----

class LargeBatchLars : public ::testing::TestWithParam<std::tuple<bool, double>> {};  // BERT split, momentum

TEST_P(LargeBatchLars, EqualsPaperAlgorithm) {
  auto [split, momentum] = GetParam();
  Net model = makeNet(), ref = makeNet();
  auto o = LarsOptions(0).momentum(momentum).weight_decay(0.01).trust_coefficient(0.02);
  Lars opt(groupsFor(model, o, split), o);
  RefLars r;
  r.momentum = momentum;
  auto sched = schedule(0.5);
  auto excluded = excludedOf(ref, split);
  train(model, 6, [&](int s) { sched.apply(opt, s), opt.step(); });
  train(ref, 6, [&](int s) { r.lr = sched.lr(s), r.step(ref->parameters(), excluded); });
  expectClose(*model, *ref, 1e-6, fmt::format("LARS split={} momentum={}", split, momentum));
  // The trust ratio matters here: plain momentum SGD would be far away.
  EXPECT_GT((model->fc2->weight - makeNet()->fc2->weight).abs().max().item<double>(), 1e-4);
}
INSTANTIATE_TEST_SUITE_P(Groups, LargeBatchLars,
                         ::testing::Combine(::testing::Values(false, true), ::testing::Values(0.9, 0.0)),
                         [](const ::testing::TestParamInfo<std::tuple<bool, double>>& info) {
                           return fmt::format("{}_{}", std::get<0>(info.param) ? "BiasesExcluded" : "OneGroup",
                                              std::get<1>(info.param) > 0 ? "Momentum" : "NoMomentum");
                         });

struct LambCase {
  bool split;
  double max_norm;
  double trust_max;
  bool bias_correction = true;
};

void PrintTo(const LambCase& c, std::ostream* os) {
  *os << "split=" << c.split << " max_norm=" << c.max_norm << " trust_max=" << c.trust_max
      << " bias_correction=" << c.bias_correction;
}

class LargeBatchLamb : public ::testing::TestWithParam<LambCase> {};

TEST_P(LargeBatchLamb, EqualsPaperAlgorithm) {
  auto c = GetParam();
  Net model = makeNet(), ref = makeNet();
  auto o = LambOptions(0).weight_decay(0.01).max_grad_norm(c.max_norm).trust_max(c.trust_max).bias_correction(
      c.bias_correction);
  Lamb opt(groupsFor(model, o, c.split), o);
  RefLamb r;
  r.max_norm = c.max_norm;
  r.trust_max = c.trust_max;
  r.bias_correction = c.bias_correction;
  auto sched = schedule(0.01);
  auto excluded = excludedOf(ref, c.split);
  bool clipped = false;
  train(model, 6, [&](int s) { sched.apply(opt, s), opt.step(); });
  train(ref, 6, [&](int s) {
    r.lr = sched.lr(s);
    r.step(ref->parameters(), excluded);
    clipped = clipped || (c.max_norm > 0 && r.last_norm > c.max_norm);
  });
  EXPECT_EQ(clipped, c.max_norm > 0) << "the case must exercise clipping exactly when it is on";
  EXPECT_NEAR(opt.lastGradNorm(), r.last_norm, 1e-9);
  expectClose(*model, *ref, 1e-6, fmt::format("LAMB split={} max_norm={}", c.split, c.max_norm));
}
INSTANTIATE_TEST_SUITE_P(Cases, LargeBatchLamb,
                         ::testing::Values(LambCase{false, 0.0, std::numeric_limits<double>::infinity()},
                                           LambCase{true, 0.0, std::numeric_limits<double>::infinity()},
                                           LambCase{true, 0.1, std::numeric_limits<double>::infinity()},
                                           LambCase{false, 0.1, 0.5},
                                           LambCase{true, 0.1, std::numeric_limits<double>::infinity(), false}),
                         [](const ::testing::TestParamInfo<LambCase>& info) {
                           const auto& c = info.param;
                           return fmt::format("{}_{}_{}{}", c.split ? "Split" : "OneGroup",
                                              c.max_norm > 0 ? "Clipped" : "Unclipped",
                                              std::isinf(c.trust_max) ? "PhiIdentity" : "PhiClamped",
                                              c.bias_correction ? "" : "_NoBiasCorrection");
                         });

// ---- against PyTorch (python3-torch), a second reference written in Python ----

// A quadratic problem: grad = scale·(w − target), for a 3x4 weight (decayed, adapted) and a
// 4-vector bias (excluded). The Python side writes the same algorithms as PyTorch code, with its own
// warm-up + cosine schedule, and prints the final values.
constexpr const char* kPythonReference = R"PY(
import math, torch
torch.set_default_dtype(torch.float64)
@DATA@
def lr_at(s, base):  # warm-up 3 steps from base to 3*base, cosine to 0 at step 8
    peak = 3 * base
    if s < 3:
        return base + (peak - base) * s / 3
    return peak * (1 + math.cos(math.pi * (min(s, 8) - 3) / 5)) / 2
def grads(ws):
    return [sc * (w - t) for w, t, sc in zip(ws, T, S)]
def lamb(ws, b1=0.9, b2=0.999, eps=1e-6, wd=0.01, max_norm=0.5):
    m = [torch.zeros_like(w) for w in ws]; v = [torch.zeros_like(w) for w in ws]
    for s in range(6):
        gs = grads(ws)
        gnorm = torch.norm(torch.stack([g.norm() for g in gs])).item()
        gs = [g / (gnorm / max_norm if gnorm > max_norm else 1.0) for g in gs]
        for i, (w, g) in enumerate(zip(ws, gs)):
            m[i].mul_(b1).add_(g, alpha=1 - b1); v[i].mul_(b2).addcmul_(g, g, value=1 - b2)
            u = (m[i] / (1 - b1 ** (s + 1))) / ((v[i] / (1 - b2 ** (s + 1))).sqrt() + eps)
            ratio = 1.0
            if not EXCLUDED[i]:
                u = u + wd * w
                wn, un = w.norm().item(), u.norm().item()
                ratio = wn / un if wn > 0 and un > 0 else 1.0
            w.sub_(lr_at(s, 0.01) * ratio * u)
    return ws
def lars(ws, mom=0.9, wd=0.01, eta=0.02, eps=1e-8):
    buf = [None] * len(ws)
    for s in range(6):
        gs = grads(ws)
        for i, (w, g) in enumerate(zip(ws, gs)):
            decay = 0.0 if EXCLUDED[i] else wd
            local = 1.0
            wn, gn = w.norm().item(), g.norm().item()
            if not EXCLUDED[i] and wn > 0 and gn > 0:
                local = eta * wn / (gn + decay * wn + eps)
            d = lr_at(s, 0.5) * local * (g + decay * w)
            buf[i] = d.clone() if buf[i] is None else buf[i].mul_(mom).add_(d)
            w.sub_(buf[i])
    return ws
out = lamb([w.clone() for w in W0]) + lars([w.clone() for w in W0])
print(" ".join("%.17g" % x for w in out for x in w.flatten().tolist()))
)PY";

std::string pyList(const torch::Tensor& t) {
  std::string out = "torch.tensor([";
  auto flat = t.flatten();
  for (int64_t i = 0; i < flat.numel(); ++i) out += fmt::format("{:.17g},", flat[i].item<double>());
  return out + fmt::format("]).reshape({})", fmt::join(t.sizes(), ","));
}

TEST(LargeBatch, EqualsPyTorchWrittenReference) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(42);
  std::vector<torch::Tensor> w0 = {at::randn({3, 4}, g, torch::kDouble), at::randn({4}, g, torch::kDouble)};
  std::vector<torch::Tensor> target = {at::randn({3, 4}, g, torch::kDouble), at::randn({4}, g, torch::kDouble)};
  std::vector<double> scale = {1.0, 2.0};
  std::string data = fmt::format("W0 = [{}, {}]\nT = [{}, {}]\nS = [1.0, 2.0]\nEXCLUDED = [False, True]",
                                 pyList(w0[0]), pyList(w0[1]), pyList(target[0]), pyList(target[1]));
  std::string code = kPythonReference;
  code.replace(code.find("@DATA@"), 6, data);
  std::string printed = runPython(code);
  ASSERT_FALSE(printed.empty());
  std::vector<double> want;
  std::istringstream is(printed);
  for (double x; is >> x;) want.push_back(x);

  auto run = [&](auto make, double base_lr) {
    std::vector<torch::Tensor> ws = {w0[0].clone(), w0[1].clone()};
    auto opt = make(ws);
    auto sched = schedule(base_lr);  // warm-up 3 steps to 3x, cosine to 0 at step 8, as the Python side
    for (int s = 0; s < 6; ++s) {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < ws.size(); ++i) ws[i].mutable_grad() = scale[i] * (ws[i] - target[i]);
      sched.apply(*opt, s);
      opt->step();
    }
    return torch::cat({ws[0].flatten(), ws[1].flatten()});
  };
  auto lamb = run([](auto& ws) {
    auto o = LambOptions(0).weight_decay(0.01).max_grad_norm(0.5);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{ws[0]}, std::make_unique<LambOptions>(o));
    groups.emplace_back(std::vector<torch::Tensor>{ws[1]},
                        std::make_unique<LambOptions>(LambOptions(o).weight_decay(0).adapt(false)));
    return std::make_unique<Lamb>(groups, o);
  }, 0.01);
  auto lars = run([](auto& ws) {
    auto o = LarsOptions(0).momentum(0.9).weight_decay(0.01).trust_coefficient(0.02);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<torch::Tensor>{ws[0]}, std::make_unique<LarsOptions>(o));
    groups.emplace_back(std::vector<torch::Tensor>{ws[1]},
                        std::make_unique<LarsOptions>(LarsOptions(o).weight_decay(0).adapt(false)));
    return std::make_unique<Lars>(groups, o);
  }, 0.5);
  auto got = torch::cat({lamb, lars});
  ASSERT_EQ(static_cast<int64_t>(want.size()), got.numel()) << printed;
  auto expected = torch::tensor(want, torch::kDouble);
  double diff = (got - expected).abs().max().item<double>();
  EXPECT_LE(diff, 1e-6) << "LAMB then LARS against the Python reference\ngot " << got << "\nwant " << expected;
  EXPECT_GT((lamb - torch::cat({w0[0].flatten(), w0[1].flatten()})).abs().max().item<double>(), 1e-3);
}

// ---- zero norms: the trust ratio is 1 ----

TEST(LargeBatch, ZeroNormsGiveTrustRatioOne) {
  torch::NoGradGuard no_grad;
  auto w = torch::zeros({3, 2}, torch::kDouble), g = torch::full({3, 2}, 0.5, torch::kDouble);
  w.mutable_grad() = g.clone();
  Lars lars(std::vector<torch::Tensor>{w}, LarsOptions(0.1).weight_decay(0.1));
  lars.step();  // ‖w‖ = 0: λ = 1, v = lr·g
  EXPECT_TRUE(torch::allclose(w, -0.1 * g, 0, 1e-15)) << w;

  auto w2 = torch::ones({2, 2}, torch::kDouble);
  w2.mutable_grad() = torch::zeros({2, 2}, torch::kDouble);
  Lars lars2(std::vector<torch::Tensor>{w2}, LarsOptions(0.1).weight_decay(0.1));
  lars2.step();  // ‖g‖ = 0: λ = 1, v = lr·β·w
  EXPECT_TRUE(torch::allclose(w2, torch::full({2, 2}, 1 - 0.01, torch::kDouble), 0, 1e-15)) << w2;

  auto w3 = torch::zeros({4}, torch::kDouble);
  w3.mutable_grad() = torch::tensor({1.0, -2.0, 0.0, 4.0}, torch::kDouble);
  Lamb lamb(std::vector<torch::Tensor>{w3}, LambOptions(0.1).max_grad_norm(0));
  lamb.step();  // ‖w‖ = 0: ratio 1, u = m̂/(√v̂ + eps) = g/(|g| + eps)
  auto g3 = w3.grad();
  EXPECT_TRUE(torch::allclose(w3, -0.1 * g3 / (g3.abs() + 1e-6), 0, 1e-12)) << w3;
}

TEST(LargeBatch, StepWithClosureReturnsItsLoss) {
  Net n = makeNet();
  Lamb lamb(n->parameters(), LambOptions(0.01));
  Lars lars(n->parameters(), LarsOptions(0.1));
  auto [x, y] = batch(0, 3);
  std::vector<torch::optim::Optimizer*> opts = {&lamb, &lars};
  for (auto* opt : opts) {
    auto before = n->fc1->weight.clone();
    auto loss = opt->step([&] {
      opt->zero_grad();
      auto l = torch::nn::functional::cross_entropy(n->forward(x), y);
      l.backward();  // the closure runs with gradients on, although step() itself does not track them
      return l;
    });
    ASSERT_TRUE(loss.defined());
    EXPECT_GT(loss.item<double>(), 0);
    EXPECT_FALSE(torch::equal(before, n->fc1->weight));
  }
}

// ---- the BERT split ----

TEST(LargeBatch, DecayGroupsExcludeBiasesAndNormWeights) {
  Net n = makeNet(/*bn=*/true);
  auto groups = optim::decayGroups(*n, LambOptions(1e-3).weight_decay(0.05));
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].params().size(), 3u);  // fc1..fc3 weights
  EXPECT_EQ(groups[1].params().size(), 5u);  // fc biases, bn weight and bias
  const auto& kept = static_cast<const LambOptions&>(groups[0].options());
  const auto& excl = static_cast<const LambOptions&>(groups[1].options());
  EXPECT_EQ(kept.weight_decay(), 0.05);
  EXPECT_TRUE(kept.adapt());
  EXPECT_EQ(excl.weight_decay(), 0);
  EXPECT_FALSE(excl.adapt());
  EXPECT_TRUE(optim::excludedFromDecay("encoder.proj_bias", torch::zeros({2, 2})));
  EXPECT_FALSE(optim::excludedFromDecay("encoder.weight", torch::zeros({2, 2})));
  EXPECT_TRUE(optim::excludedFromDecay("ln.weight", torch::zeros({2})));
}

// ---- checkpoint round trip ----

template <typename Opt, typename Options>
void roundTrip(const Options& o, const std::string& what) {
  Net a = makeNet();
  Opt opt_a(optim::decayGroups(*a, o), o);
  train(a, 3, [&](int) { opt_a.step(); });
  CheckpointState state;
  state.captureModel(*a);
  state.captureOptimizer(opt_a);
  auto dir = std::filesystem::temp_directory_path() / fmt::format("large_batch_test_{}_{}", what, getpid());
  Checkpointer ckpt(dir.string());
  ckpt.save(state);
  auto loaded = ckpt.loadLatest();
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(loaded.has_value());
  Net b = makeNet();
  b->zero_grad();
  loaded->restoreModel(*b);
  Opt opt_b(optim::decayGroups(*b, o), o);
  loaded->restoreOptimizer(opt_b);
  // Both continue on the same batches (steps 3..5): bit for bit.
  auto cont = [](Net& n, torch::optim::Optimizer& opt) {
    for (int s = 3; s < 6; ++s) {
      n->zero_grad();
      auto [x, y] = batch(s, 3);
      torch::nn::functional::cross_entropy(n->forward(x), y).backward();
      opt.step();
    }
  };
  cont(a, opt_a);
  cont(b, opt_b);
  auto pa = a->named_parameters(), pb = b->named_parameters();
  for (const auto& item : pa)
    EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << what << ": " << item.key() << " differs";
}

TEST(LargeBatch, CheckpointRoundTripContinuesBitForBit) {
  roundTrip<Lars>(LarsOptions(0.5).weight_decay(0.01).trust_coefficient(0.02), "lars");
  roundTrip<Lamb>(LambOptions(0.01).max_grad_norm(0.1).trust_max(5), "lamb");
}

TEST(LargeBatch, LoadingAnotherOptimizersStateIsAClearError) {
  Net n = makeNet();
  Lamb lamb(n->parameters(), LambOptions(0.01));
  train(n, 1, [&](int) { lamb.step(); });
  CheckpointState state;
  state.captureOptimizer(lamb);
  Lars lars(n->parameters(), LarsOptions(0.1));
  try {
    state.restoreOptimizer(lars);
    FAIL() << "LAMB state loaded into LARS";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("Lars::load: the archive holds Lamb state"), std::string::npos) << e.what();
  }
  torch::optim::Adam adam(n->parameters(), torch::optim::AdamOptions(0.01));
  train(n, 1, [&](int) { adam.step(); });
  state.captureOptimizer(adam);
  try {
    state.restoreOptimizer(lamb);
    FAIL() << "Adam state loaded into LAMB";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no dtrain tag"), std::string::npos) << e.what();
  }
}

// ---- bad options ----

template <typename F>
void expectInvalid(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << needle;
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(LargeBatch, BadOptionsAreClearErrors) {
  Net n = makeNet();
  auto ps = n->parameters();
  expectInvalid([&] { (void)Lars(ps, LarsOptions(-0.1)); }, "Lars: lr must be >= 0 (got -0.1) in the defaults");
  expectInvalid([&] { (void)Lars(ps, LarsOptions(0.1).eps(0)); }, "eps must be > 0");
  expectInvalid([&] { (void)Lars(ps, LarsOptions(0.1).momentum(1)); }, "momentum must be in [0, 1)");
  expectInvalid([&] { (void)Lars(ps, LarsOptions(0.1).trust_coefficient(0)); }, "trust_coefficient must be > 0");
  expectInvalid([&] { (void)Lars(ps, LarsOptions(0.1).weight_decay(-1)); }, "weight_decay must be >= 0");
  expectInvalid([&] { (void)Lamb(ps, LambOptions(-1)); }, "Lamb: lr must be >= 0");
  expectInvalid([&] { (void)Lamb(ps, LambOptions(0.1).eps(-1e-6)); }, "eps must be > 0");
  expectInvalid([&] { (void)Lamb(ps, LambOptions(0.1).betas({0.9, 1.0})); }, "betas[1] must be in [0, 1)");
  expectInvalid([&] { (void)Lamb(ps, LambOptions(0.1).trust_min(2).trust_max(1)); }, "trust_max must be > 0 and >= trust_min");
  expectInvalid([&] { (void)Lamb(ps, LambOptions(0.1).max_grad_norm(-1)); }, "max_grad_norm must be >= 0");
  // A bad group, and an lr set wrong after construction, are caught too (naming the group).
  auto groups = optim::decayGroups(*n, LambOptions(0.1));
  static_cast<LambOptions&>(groups[1].options()).eps(0);
  expectInvalid([&] { (void)Lamb(groups, LambOptions(0.1)); }, "in parameter group 1");
  Lars lars(ps, LarsOptions(0.1));
  lars.param_groups()[0].options().set_lr(-1);
  expectInvalid([&] { lars.step(); }, "lr must be >= 0 (got -1) in parameter group 0");
}

// ---- the schedule ----

TEST(LargeBatch, LinearScalingSchedule) {
  LinearScalingOptions o;
  o.base_lr = 0.1;
  o.base_batch = 256;
  o.global_batch = 1024;
  o.warmup_steps = 4;
  LinearScaling constant(o);
  EXPECT_DOUBLE_EQ(constant.peakLr(), 0.4);
  std::vector<double> want = {0.1, 0.175, 0.25, 0.325, 0.4, 0.4};
  for (int s = 0; s < 6; ++s) EXPECT_NEAR(constant.lr(s), want[s], 1e-15) << "step " << s;
  o.warmup_start_lr = 0.0;
  o.decay = optim::Decay::kCosine;
  o.total_steps = 8;
  o.final_lr = 0.0;
  LinearScaling cosine(o);
  EXPECT_NEAR(cosine.lr(0), 0.0, 1e-15);
  EXPECT_NEAR(cosine.lr(2), 0.2, 1e-15);
  EXPECT_NEAR(cosine.lr(6), 0.2, 1e-15);  // halfway through the decay
  EXPECT_NEAR(cosine.lr(8), 0.0, 1e-15);
  EXPECT_NEAR(cosine.lr(100), 0.0, 1e-15);
  o.decay = optim::Decay::kPolynomial;
  EXPECT_NEAR(LinearScaling(o).lr(6), 0.4 * 0.25, 1e-15);
  o.decay = optim::Decay::kStep;
  o.milestones = {5, 7};
  LinearScaling stepped(o);
  EXPECT_NEAR(stepped.lr(4), 0.4, 1e-15);
  EXPECT_NEAR(stepped.lr(5), 0.04, 1e-15);
  EXPECT_NEAR(stepped.lr(7), 0.004, 1e-15);
  // apply() sets every group of any torch::optim optimizer.
  Net n = makeNet();
  torch::optim::Adam adam({torch::optim::OptimizerParamGroup({n->fc1->weight}),
                           torch::optim::OptimizerParamGroup({n->fc1->bias})},
                          torch::optim::AdamOptions(1));
  EXPECT_NEAR(stepped.apply(adam, 6), 0.04, 1e-15);
  for (auto& g : adam.param_groups()) EXPECT_NEAR(g.options().get_lr(), 0.04, 1e-15);

  o.decay = optim::Decay::kCosine;
  o.total_steps = 4;
  expectInvalid([&] { LinearScaling{o}; }, "total_steps > warmup_steps");
  o.base_lr = -1;
  expectInvalid([&] { LinearScaling{o}; }, "base_lr must be > 0 (got -1)");
  o.base_lr = 0.1;
  o.global_batch = 0;
  expectInvalid([&] { LinearScaling{o}; }, "global_batch must be > 0");
  o.global_batch = 8;
  o.decay = optim::Decay::kStep;
  o.milestones = {5, 5};
  expectInvalid([&] { LinearScaling{o}; }, "milestones must increase");
}

// ---- 3 ranks with DDP against 1 process on the global batch ----

template <typename Opt, typename Options>
void ddpEqualsOneProcess(const Options& o, double base_lr, const std::string& what) {
  constexpr int kWorld = 3;
  StoreServer server;
  auto results = runRanks(kWorld, [&](int rank) {
    auto pg = group(server, rank, kWorld);
    Net model = makeNet(), ref = makeNet();
    DDPOptions d;
    d.bucket_bytes = d.first_bucket_bytes = 256;
    DistributedDataParallel ddp(model.ptr(), pg, d);
    Opt opt(optim::decayGroups(*model, o), o), ref_opt(optim::decayGroups(*ref, o), o);
    auto sched = schedule(base_lr);
    for (int s = 0; s < 6; ++s) {
      sched.apply(opt, s);
      sched.apply(ref_opt, s);
      opt.zero_grad();
      auto [x, y] = batch(s, kWorld);
      auto xs = x.narrow(0, rank * kPerRank, kPerRank), ys = y.narrow(0, rank * kPerRank, kPerRank);
      torch::nn::functional::cross_entropy(ddp.forward(model, xs), ys).backward();
      opt.step();
      ref_opt.zero_grad();
      torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
      ref_opt.step();
    }
    expectClose(*model, *ref, 1e-6, fmt::format("{} rank {} of {}", what, rank, kWorld));
  });
  expectAllOk(results);
}

TEST(LargeBatch, LarsOnThreeRanksEqualsOneProcess) {
  ddpEqualsOneProcess<Lars>(LarsOptions(0).weight_decay(0.01).trust_coefficient(0.02), 0.5, "LARS");
}

TEST(LargeBatch, LambOnThreeRanksEqualsOneProcess) {
  ddpEqualsOneProcess<Lamb>(LambOptions(0).weight_decay(0.01).max_grad_norm(0.1), 0.01, "LAMB");
}

}  // namespace
}  // namespace dtrain::test
