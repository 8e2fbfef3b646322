// Optimizer state as PyTorch's state_dict entries (torch/optim_state.h), shared by ZeroRedundancyOptimizer
// (zero_state.cc) and FullyShardedDataParallel (fsdp_state.cc).
#include "torch/optim_state.h"

#include <fmt/format.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <cstring>
#include <filesystem>
#include <regex>

#include "dtrain/comm/error.h"
#include "dtrain/optim.h"
#include "torch/checkpoint_io.h"
#include "torch/pickle_save.h"

namespace dtrain::optim_state {

const char* kindName(Kind k) {
  switch (k) {
    case Kind::kAdam: return "Adam";
    case Kind::kAdamW: return "AdamW";
    case Kind::kSgd: return "SGD";
    case Kind::kLamb: return "Lamb";
    case Kind::kLars: return "Lars";
  }
  return "?";
}


Kind kindOf(const torch::optim::Optimizer& o) {
  if (dynamic_cast<const torch::optim::Adam*>(&o)) return Kind::kAdam;
  if (dynamic_cast<const torch::optim::AdamW*>(&o)) return Kind::kAdamW;
  if (dynamic_cast<const torch::optim::SGD*>(&o)) return Kind::kSgd;
  if (dynamic_cast<const optim::Lamb*>(&o)) return Kind::kLamb;
  if (dynamic_cast<const optim::Lars*>(&o)) return Kind::kLars;
  throw InvalidArgument(
      "the consolidated optimizer state supports torch::optim Adam, AdamW and SGD and dtrain's Lamb and Lars; this "
      "optimizer is none of them");
}

// ---- per-parameter state <-> {name: tensor} ----

// Saved state lives on the CPU, so that a checkpoint from GPUs loads anywhere; entry() moves it back
// to its parameter's device.
static at::Tensor onCpu(const at::Tensor& t) { return t.defined() && !t.device().is_cpu() ? t.to(at::kCPU) : t; }

template <typename S>
TensorDict moments(const S& s) {
  TensorDict d;
  d.insert("step", at::scalar_tensor(static_cast<double>(s.step()), at::kFloat));
  d.insert("exp_avg", onCpu(s.exp_avg()));
  d.insert("exp_avg_sq", onCpu(s.exp_avg_sq()));
  return d;
}

namespace {

template <typename S>
TensorDict withMax(const S& s) {
  TensorDict d = moments(s);
  if (s.max_exp_avg_sq().defined()) d.insert("max_exp_avg_sq", onCpu(s.max_exp_avg_sq()));
  return d;
}

}  // namespace

TensorDict toDict(Kind k, const OptimizerParamState& s) {
  switch (k) {
    case Kind::kAdam: return withMax(static_cast<const torch::optim::AdamParamState&>(s));
    case Kind::kAdamW: return withMax(static_cast<const torch::optim::AdamWParamState&>(s));
    case Kind::kLamb: return moments(static_cast<const optim::LambParamState&>(s));
    case Kind::kSgd: {
      TensorDict d;
      const auto& b = static_cast<const torch::optim::SGDParamState&>(s).momentum_buffer();
      if (b.defined()) d.insert("momentum_buffer", onCpu(b));
      return d;
    }
    case Kind::kLars: {
      TensorDict d;
      const auto& b = static_cast<const optim::LarsParamState&>(s).momentum_buffer();
      if (b.defined()) d.insert("momentum_buffer", onCpu(b));
      return d;
    }
  }
  return TensorDict();
}

namespace {

// The entry `name` of a parameter's saved state, checked against the parameter.
at::Tensor entry(const TensorDict& d, const char* name, const at::Tensor& param, size_t index, const std::string& path,
                 bool like_param = true) {
  auto it = d.find(name);
  if (it == d.end())
    throw InvalidArgument(fmt::format("{}: parameter {}'s state has no '{}'", path, index, name));
  at::Tensor t = it->value();
  if (like_param && t.sizes() != param.sizes())
    throw InvalidArgument(fmt::format("{}: parameter {}'s '{}' has shape {}, the parameter {}", path, index, name,
                                      c10::str(t.sizes()), c10::str(param.sizes())));
  return like_param ? t.to(param.device(), param.scalar_type()).clone() : t;
}

template <typename S>
std::unique_ptr<OptimizerParamState> momentsFrom(const TensorDict& d, const at::Tensor& p, size_t i,
                                                  const std::string& path, bool max) {
  auto s = std::make_unique<S>();
  s->step(static_cast<int64_t>(entry(d, "step", p, i, path, false).item<double>()));
  s->exp_avg(entry(d, "exp_avg", p, i, path));
  s->exp_avg_sq(entry(d, "exp_avg_sq", p, i, path));
  if constexpr (!std::is_same_v<S, optim::LambParamState>) {
    if (max && d.contains("max_exp_avg_sq")) s->max_exp_avg_sq(entry(d, "max_exp_avg_sq", p, i, path));
  }
  return s;
}

template <typename S>
std::unique_ptr<OptimizerParamState> bufferFrom(const TensorDict& d, const at::Tensor& p, size_t i,
                                                 const std::string& path) {
  auto s = std::make_unique<S>();
  if (d.contains("momentum_buffer")) s->momentum_buffer(entry(d, "momentum_buffer", p, i, path));
  return s;
}

}  // namespace

std::unique_ptr<OptimizerParamState> fromDict(Kind k, const TensorDict& d, const at::Tensor& p, size_t i,
                                              const std::string& path) {
  switch (k) {
    case Kind::kAdam: return momentsFrom<torch::optim::AdamParamState>(d, p, i, path, true);
    case Kind::kAdamW: return momentsFrom<torch::optim::AdamWParamState>(d, p, i, path, true);
    case Kind::kLamb: return momentsFrom<optim::LambParamState>(d, p, i, path, false);
    case Kind::kSgd: return bufferFrom<torch::optim::SGDParamState>(d, p, i, path);
    case Kind::kLars: return bufferFrom<optim::LarsParamState>(d, p, i, path);
  }
  return nullptr;
}

namespace {

// ---- group options <-> PyTorch's param_groups entries ----

c10::IValue pair(std::tuple<double, double> b) {
  return c10::ivalue::Tuple::create({std::get<0>(b), std::get<1>(b)});
}
double num(const c10::impl::GenericDict& g, const char* key, const std::string& path) {
  auto it = g.find(key);
  if (it == g.end()) throw InvalidArgument(fmt::format("{}: a parameter group has no '{}'", path, key));
  const auto& v = it->value();
  if (v.isInt()) return static_cast<double>(v.toInt());
  if (v.isDouble()) return v.toDouble();
  if (v.isBool()) return v.toBool() ? 1 : 0;
  throw InvalidArgument(fmt::format("{}: parameter group entry '{}' is a {}, not a number", path, key, v.tagKind()));
}
std::tuple<double, double> betas(const c10::impl::GenericDict& g, const std::string& path) {
  auto it = g.find("betas");
  if (it == g.end() || !it->value().isTuple() || it->value().toTupleRef().elements().size() != 2)
    throw InvalidArgument(fmt::format("{}: a parameter group has no 'betas' pair", path));
  const auto& e = it->value().toTupleRef().elements();
  return {e[0].toDouble(), e[1].toDouble()};
}

}  // namespace

c10::impl::GenericDict groupDict(Kind k, const torch::optim::OptimizerOptions& o) {
  c10::impl::GenericDict g(c10::StringType::get(), c10::AnyType::get());
  auto adamLike = [&](const auto& a, bool adamw) {
    g.insert("lr", a.lr());
    g.insert("betas", pair(a.betas()));
    g.insert("eps", a.eps());
    g.insert("weight_decay", a.weight_decay());
    g.insert("amsgrad", a.amsgrad());
    g.insert("maximize", false);
    g.insert("foreach", c10::IValue());
    g.insert("capturable", false);
    if (!adamw) {
      g.insert("differentiable", false);
      g.insert("fused", false);
    }
  };
  switch (k) {
    case Kind::kAdam: adamLike(static_cast<const torch::optim::AdamOptions&>(o), false); break;
    case Kind::kAdamW: adamLike(static_cast<const torch::optim::AdamWOptions&>(o), true); break;
    case Kind::kSgd: {
      const auto& s = static_cast<const torch::optim::SGDOptions&>(o);
      g.insert("lr", s.lr());
      g.insert("momentum", s.momentum());
      g.insert("dampening", s.dampening());
      g.insert("weight_decay", s.weight_decay());
      g.insert("nesterov", s.nesterov());
      g.insert("maximize", false);
      g.insert("foreach", c10::IValue());
      g.insert("differentiable", false);
      break;
    }
    case Kind::kLamb: {
      const auto& l = static_cast<const optim::LambOptions&>(o);
      g.insert("lr", l.lr());
      g.insert("betas", pair(l.betas()));
      g.insert("eps", l.eps());
      g.insert("weight_decay", l.weight_decay());
      g.insert("bias_correction", l.bias_correction());
      g.insert("adapt", l.adapt());
      g.insert("trust_min", l.trust_min());
      g.insert("trust_max", l.trust_max());
      g.insert("max_grad_norm", l.max_grad_norm());
      break;
    }
    case Kind::kLars: {
      const auto& l = static_cast<const optim::LarsOptions&>(o);
      g.insert("lr", l.lr());
      g.insert("momentum", l.momentum());
      g.insert("weight_decay", l.weight_decay());
      g.insert("trust_coefficient", l.trust_coefficient());
      g.insert("eps", l.eps());
      g.insert("adapt", l.adapt());
      break;
    }
  }
  return g;
}


void applyGroupDict(Kind k, torch::optim::OptimizerOptions& o, const c10::impl::GenericDict& g, const std::string& p) {
  switch (k) {
    case Kind::kAdam: {
      auto& a = static_cast<torch::optim::AdamOptions&>(o);
      a.lr(num(g, "lr", p)).betas(betas(g, p)).eps(num(g, "eps", p)).weight_decay(num(g, "weight_decay", p));
      a.amsgrad(num(g, "amsgrad", p) != 0);
      break;
    }
    case Kind::kAdamW: {
      auto& a = static_cast<torch::optim::AdamWOptions&>(o);
      a.lr(num(g, "lr", p)).betas(betas(g, p)).eps(num(g, "eps", p)).weight_decay(num(g, "weight_decay", p));
      a.amsgrad(num(g, "amsgrad", p) != 0);
      break;
    }
    case Kind::kSgd: {
      auto& s = static_cast<torch::optim::SGDOptions&>(o);
      s.lr(num(g, "lr", p)).momentum(num(g, "momentum", p)).dampening(num(g, "dampening", p));
      s.weight_decay(num(g, "weight_decay", p)).nesterov(num(g, "nesterov", p) != 0);
      break;
    }
    case Kind::kLamb: {
      auto& l = static_cast<optim::LambOptions&>(o);
      l.lr(num(g, "lr", p)).betas(betas(g, p)).eps(num(g, "eps", p)).weight_decay(num(g, "weight_decay", p));
      l.bias_correction(num(g, "bias_correction", p) != 0).adapt(num(g, "adapt", p) != 0);
      l.trust_min(num(g, "trust_min", p)).trust_max(num(g, "trust_max", p)).max_grad_norm(num(g, "max_grad_norm", p));
      break;
    }
    case Kind::kLars: {
      auto& l = static_cast<optim::LarsOptions&>(o);
      l.lr(num(g, "lr", p)).momentum(num(g, "momentum", p)).weight_decay(num(g, "weight_decay", p));
      l.trust_coefficient(num(g, "trust_coefficient", p)).eps(num(g, "eps", p)).adapt(num(g, "adapt", p) != 0);
      break;
    }
  }
}

TensorDict tensorDict(const c10::IValue& v, const std::string& path, int64_t index) {
  if (!v.isGenericDict()) throw InvalidArgument(fmt::format("{}: the state of parameter {} is not a dict", path, index));
  TensorDict d;
  for (const auto& e : v.toGenericDict()) {
    if (e.key().isString() && e.value().isNone()) continue;  // (PyTorch's SGD without momentum: momentum_buffer None)
    if (!e.key().isString() || !e.value().isTensor())
      throw InvalidArgument(fmt::format("{}: the state of parameter {} holds a {} -> {} entry, not name -> tensor",
                                        path, index, e.key().tagKind(), e.value().tagKind()));
    d.insert(e.key().toStringRef(), e.value().toTensor());
  }
  return d;
}


at::Tensor bytesTensor(const std::vector<char>& bytes) {
  at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

std::vector<char> tensorBytes(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const auto* p = static_cast<const char*>(c.data_ptr());
  return std::vector<char>(p, p + c.numel());
}

c10::impl::GenericDict consolidatedRoot(Kind k, const c10::Dict<int64_t, TensorDict>& state,
                                        const c10::impl::GenericList& groups) {
  c10::impl::GenericDict root(c10::StringType::get(), c10::AnyType::get());
  root.insert("state", state);
  root.insert("param_groups", groups);
  root.insert("dtrain_optimizer", std::string(kindName(k)));
  return root;
}

void writeConsolidated(const std::string& path, const c10::impl::GenericDict& root) {
  const auto p = std::filesystem::path(path);
  detail::writeFileAtomically(p.has_parent_path() ? p.parent_path().string() : std::string("."), p.filename().string(),
                              detail::torchSave(root));
}

c10::impl::GenericDict readStateDict(const std::string& path, Kind k) {
  c10::IValue root;
  try {
    root = torch::pickle_load(detail::readFile(path));
  } catch (const std::exception& e) {
    throw InvalidArgument(fmt::format("{} is not a consolidated optimizer state (torch.load-able dict): {}", path,
                                      e.what()));
  }
  DTRAIN_CHECK(root.isGenericDict(), InvalidArgument, "{}: the root is a {}, not a dict", path, root.tagKind());
  auto dict = root.toGenericDict();
  DTRAIN_CHECK(dict.contains("state") && dict.contains("param_groups"), InvalidArgument,
               "{}: not an optimizer state_dict (no 'state' and 'param_groups')", path);
  if (dict.contains("dtrain_optimizer")) {
    const auto saved = dict.at("dtrain_optimizer").toStringRef();
    DTRAIN_CHECK(saved == kindName(k), InvalidArgument, "{} holds the state of {}, this optimizer is {}", path, saved,
                 kindName(k));
  }
  return dict;
}

}  // namespace dtrain::optim_state
