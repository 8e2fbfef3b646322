// SyncBatchNorm (see sync_batch_norm.h): a custom autograd Function whose forward allgathers each
// rank's per-channel (count, mean, M2) and merges them into the global batch statistics, and whose
// backward allreduces sum(dy) and sum(dy * (x - mean)), as torch/nn/modules/_functions.py does; plus
// the module and the BatchNorm -> SyncBatchNorm converter.
#include "dtrain/sync_batch_norm.h"

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "dtrain/comm/error.h"
#include "dtrain/tensor.h"
#include "torch/device/tensor_comm.h"
#include "torch/saved_group.h"

namespace dtrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Every dim but the channel dim (1): what per-channel statistics reduce over.
std::vector<int64_t> reduceDims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// [C] -> [1, C, 1, ...]: broadcasts a per-channel vector against x.
at::Tensor perChannel(const at::Tensor& v, const at::Tensor& x) {
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[1] = v.size(0);
  return v.view(shape);
}

// Statistics accumulate in double for double inputs and in float for the others (float, half, bf16).
c10::ScalarType accType(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

struct GlobalStats {
  at::Tensor mean, invstd, unbiased_var;  // [C], accType
  int64_t count = 0;                      // values per channel over the group
};

// Gathers every rank's (count, mean[C], M2[C]) (M2: sum of squared deviations from the rank's mean)
// and merges them (Chan, Golub, LeVeque): mean = sum n_j m_j / N, M2 = sum M2_j + sum n_j (m_j - mean)^2.
// Empty ranks send zeros and weigh nothing. Every rank sees the same gathered numbers, so the check on
// N throws on all ranks or on none.
GlobalStats gatherStats(const at::Tensor& x, double eps, comm::ProcessGroup& pg) {
  const int64_t channels = x.size(1);
  const int64_t local = channels ? x.numel() / channels : 0;
  const auto acc = accType(x);
  at::Tensor mine = at::zeros({2 * channels + 1}, x.options().dtype(acc));
  if (local > 0) {
    at::Tensor xf = x.to(acc);
    at::Tensor mean = xf.mean(reduceDims(x));
    at::Tensor m2 = (xf - perChannel(mean, x)).square().sum(reduceDims(x));
    mine = at::cat({at::full({1}, static_cast<double>(local), mean.options()), mean, m2});
  }
  const int world = pg.size();
  at::Tensor all = at::empty({world, 2 * channels + 1}, mine.options());
  device::allgather(pg, mine, all)->wait();

  at::Tensor counts = all.narrow(1, 0, 1);  // [W, 1]
  at::Tensor means = all.narrow(1, 1, channels), m2s = all.narrow(1, 1 + channels, channels);
  GlobalStats s;
  s.count = static_cast<int64_t>(counts.sum().item<double>());
  if (s.count <= 1) {
    std::string per_rank;
    for (int j = 0; j < world; ++j)
      per_rank += fmt::format("{}{}", j ? ", " : "", static_cast<int64_t>(counts[j][0].item<double>()));
    throw InvalidArgument(fmt::format(
        "[rank {}] SyncBatchNorm: expected more than 1 value per channel over the group when training, "
        "got {} (per rank: {}); input of rank {} has shape {}",
        pg.rank(), s.count, per_rank, pg.rank(), fmt::format("[{}]", fmt::join(x.sizes(), ", "))));
  }
  const double n = static_cast<double>(s.count);
  s.mean = (counts * means).sum(0) / n;
  at::Tensor m2 = m2s.sum(0) + (counts * (means - s.mean).square()).sum(0);
  s.invstd = (m2 / n + eps).rsqrt();
  s.unbiased_var = m2 / (n - 1);
  return s;
}

using detail::savedGroup;  // the module, or syncBatchNorm's caller, keeps the group alive (saved_group.h)

struct SyncBatchNormFn : torch::autograd::Function<SyncBatchNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias, const at::Tensor& running_mean, const at::Tensor& running_var,
                            double momentum, double eps, comm::ProcessGroup* pg) {
    at::Tensor x = input.contiguous();
    GlobalStats s = gatherStats(x, eps, *pg);
    if (running_mean.numel() > 0) {
      running_mean.mul_(1 - momentum).add_(s.mean.to(running_mean.scalar_type()) * momentum);
      running_var.mul_(1 - momentum).add_(s.unbiased_var.to(running_var.scalar_type()) * momentum);
    }
    at::Tensor y = (x.to(s.mean.scalar_type()) - perChannel(s.mean, x)) * perChannel(s.invstd, x);
    if (weight.numel() > 0) y = y * perChannel(weight.to(y.scalar_type()), x);
    if (bias.numel() > 0) y = y + perChannel(bias.to(y.scalar_type()), x);

    ctx->save_for_backward({x, weight, s.mean, s.invstd});
    detail::saveGroup(ctx, *pg);
    ctx->saved_data["count"] = s.count;
    return y.to(x.scalar_type());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    comm::ProcessGroup& pg = savedGroup(ctx);
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &mean = saved[2], &invstd = saved[3];
    const double n = static_cast<double>(ctx->saved_data.at("count").toInt());
    const int64_t channels = x.size(1);
    const auto acc = mean.scalar_type();

    at::Tensor sum_dy = at::zeros({channels}, mean.options()), sum_dy_xmu = at::zeros({channels}, mean.options());
    at::Tensor dy, xmu;
    if (x.numel() > 0) {
      dy = grads[0].contiguous().to(acc);
      xmu = x.to(acc) - perChannel(mean, x);
      sum_dy = dy.sum(reduceDims(x));
      sum_dy_xmu = (dy * xmu).sum(reduceDims(x));
    }
    at::Tensor grad_weight, grad_bias, grad_input;
    // This rank's part only: DDP averages parameter gradients (PyTorch does not reduce them here either).
    const bool affine = weight.numel() > 0;
    if (affine && ctx->needs_input_grad(1)) grad_weight = (sum_dy_xmu * invstd).to(weight.scalar_type());
    if (affine && ctx->needs_input_grad(2)) grad_bias = sum_dy.to(weight.scalar_type());

    if (ctx->needs_input_grad(0)) {
      // Every rank, empty or not, joins this allreduce: the peers wait for it.
      at::Tensor combined = at::cat({sum_dy, sum_dy_xmu});
      device::allreduce(pg, combined, comm::ReduceOp::sum)->wait();
      at::Tensor mean_dy = combined.narrow(0, 0, channels) / n;
      at::Tensor mean_dy_xmu = combined.narrow(0, channels, channels) / n;
      if (x.numel() > 0) {
        at::Tensor scale = affine ? invstd * weight.to(acc) : invstd;
        grad_input = (dy - perChannel(mean_dy, x) - xmu * perChannel(invstd.square() * mean_dy_xmu, x)) *
                     perChannel(scale, x);
        grad_input = grad_input.to(x.scalar_type());
      } else {
        grad_input = at::zeros_like(x);
      }
    }
    // One gradient per forward argument: input, weight, bias, then none for the rest.
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor syncBatchNorm(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                         const at::Tensor& running_mean, const at::Tensor& running_var, double momentum,
                         double eps, comm::ProcessGroup& pg) {
  DTRAIN_CHECK(input.defined() && input.dim() >= 2, InvalidArgument,
               "[rank {}] SyncBatchNorm: expected an input of at least 2 dims (N, C, *), got {} dims", pg.rank(),
               input.defined() ? input.dim() : 0);
  const int64_t channels = input.size(1);
  DTRAIN_CHECK(channels > 0, InvalidArgument, "[rank {}] SyncBatchNorm: the input has no channels (dim 1 is 0)",
               pg.rank());
  for (const auto* t : {&weight, &bias, &running_mean, &running_var})
    DTRAIN_CHECK(!t->defined() || t->numel() == channels, InvalidArgument,
                 "[rank {}] SyncBatchNorm: input has {} channels but a parameter or buffer has {} elements",
                 pg.rank(), channels, t->numel());
  DTRAIN_CHECK(running_mean.defined() == running_var.defined(), InvalidArgument,
               "[rank {}] SyncBatchNorm: running_mean and running_var must both be given or both be undefined",
               pg.rank());
  device::checkTensor(input.contiguous(), "SyncBatchNorm input");
  // A custom Function cannot take undefined tensors: absent ones travel as empty tensors.
  auto orEmpty = [&](const at::Tensor& t) { return t.defined() ? t : at::empty({0}, input.options()); };
  return SyncBatchNormFn::apply(input, orEmpty(weight), orEmpty(bias), orEmpty(running_mean), orEmpty(running_var),
                                momentum, eps, &pg);
}

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_,
                                     std::shared_ptr<comm::ProcessGroup> pg)
    : options(options_), pg_(std::move(pg)) {
  DTRAIN_CHECK(pg_ != nullptr, InvalidArgument, "SyncBatchNorm: the process group is null (pass dist.world())");
  reset();
}

namespace {
template <typename BN>
bool takeOver(const torch::nn::Module& m, torch::nn::BatchNormOptions& options,
              std::vector<at::Tensor>& tensors) {
  const auto* bn = dynamic_cast<const BN*>(&m);
  if (!bn) return false;
  options = bn->options;
  tensors = {bn->weight, bn->bias, bn->running_mean, bn->running_var, bn->num_batches_tracked};
  return true;
}
}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::Module& batch_norm, std::shared_ptr<comm::ProcessGroup> pg)
    : options(0), pg_(std::move(pg)) {
  DTRAIN_CHECK(pg_ != nullptr, InvalidArgument, "SyncBatchNorm: the process group is null (pass dist.world())");
  std::vector<at::Tensor> t;
  bool ok = takeOver<torch::nn::BatchNorm1dImpl>(batch_norm, options, t) ||
            takeOver<torch::nn::BatchNorm2dImpl>(batch_norm, options, t) ||
            takeOver<torch::nn::BatchNorm3dImpl>(batch_norm, options, t);
  DTRAIN_CHECK(ok, InvalidArgument, "[rank {}] SyncBatchNorm: can take over BatchNorm1d/2d/3d only, got {}",
               pg_->rank(), batch_norm.name());
  // reset() registers these tensors instead of new ones, once: a clone() must get tensors of its own.
  adopt_ = std::move(t);
  reset();
  adopt_.clear();
}

void SyncBatchNormImpl::reset() {
  const int64_t c = options.num_features();
  const bool affine = options.affine(), track = options.track_running_stats();
  auto make = [&](size_t i, bool on, const std::function<at::Tensor()>& fresh) {
    return !on ? at::Tensor() : adopt_.empty() ? fresh() : adopt_[i];
  };
  weight = register_parameter("weight", make(0, affine, [&] { return torch::ones({c}); }), affine);
  bias = register_parameter("bias", make(1, affine, [&] { return torch::zeros({c}); }), affine);
  running_mean = register_buffer("running_mean", make(2, track, [&] { return torch::zeros({c}); }));
  running_var = register_buffer("running_var", make(3, track, [&] { return torch::ones({c}); }));
  num_batches_tracked =
      register_buffer("num_batches_tracked", make(4, track, [] { return torch::tensor(0, torch::kLong); }));
}

void SyncBatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  torch::NoGradGuard g;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (!options.affine()) return;
  torch::NoGradGuard g;
  weight.fill_(1);
  bias.zero_();
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "dtrain::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum())
    stream << *options.momentum();
  else
    stream << "None";
  stream << ", affine=" << options.affine() << ", track_running_stats=" << options.track_running_stats()
         << ", group=" << pg_->options().name << " of " << pg_->size() << ")";
}

// The control flow of torch.nn.SyncBatchNorm.forward.
at::Tensor SyncBatchNormImpl::forward(const at::Tensor& input) {
  DTRAIN_CHECK(input.dim() >= 2 && input.size(1) == options.num_features(), InvalidArgument,
               "[rank {}] SyncBatchNorm: expected input (N, {}, *), got shape [{}]", pg_->rank(),
               options.num_features(), fmt::join(input.sizes(), ", "));
  double factor = options.momentum().value_or(0.0);
  if (is_training() && options.track_running_stats()) {
    num_batches_tracked.add_(1);
    if (!options.momentum()) factor = 1.0 / static_cast<double>(num_batches_tracked.item<int64_t>());
  }
  // Batch statistics in training, and in eval when there are no running statistics.
  const bool batch_stats = is_training() || !running_mean.defined();
  const bool use_running = !is_training() || options.track_running_stats();
  at::Tensor rm = use_running ? running_mean : at::Tensor(), rv = use_running ? running_var : at::Tensor();
  if (!(is_training() && pg_->size() > 1))
    return torch::batch_norm(input, weight, bias, rm, rv, batch_stats, factor, options.eps(), /*cudnn_enabled=*/false);
  return syncBatchNorm(input, weight, bias, rm, rv, factor, options.eps(), *pg_);
}

namespace {

bool isBatchNorm(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(&m) || dynamic_cast<const torch::nn::BatchNorm2dImpl*>(&m) ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(&m);
}

std::shared_ptr<torch::nn::Module> convert(const std::shared_ptr<torch::nn::Module>& m,
                                           const std::shared_ptr<comm::ProcessGroup>& pg);

// A Sequential calls its AnyModule list, not the registry: rebuild it with the same names when one of
// its children is a BatchNorm (the only kind of child conversion replaces that a Sequential can hold:
// containers have no forward; other children are converted in place).
std::shared_ptr<torch::nn::Module> convertSequential(const std::shared_ptr<torch::nn::Module>& m,
                                                     torch::nn::SequentialImpl& seq,
                                                     const std::shared_ptr<comm::ProcessGroup>& pg) {
  std::vector<std::shared_ptr<torch::nn::Module>> converted;
  bool changed = false;
  for (const auto& c : seq.children()) {
    converted.push_back(convert(c, pg));
    changed |= converted.back() != c;
  }
  if (!changed) return m;
  auto out = std::make_shared<torch::nn::SequentialImpl>();
  auto names = seq.named_children();
  size_t i = 0;
  for (auto it = seq.begin(); it != seq.end(); ++it, ++i) {
    if (converted[i] == it->ptr()) {
      out->push_back(names[i].key(), *it);
    } else {
      auto sync = std::dynamic_pointer_cast<SyncBatchNormImpl>(converted[i]);
      DTRAIN_CHECK(sync != nullptr, InvalidArgument, "convertSyncBatchNorm: cannot rebuild Sequential child '{}'",
                   names[i].key());
      out->push_back(names[i].key(), sync);
    }
  }
  return out;
}

std::shared_ptr<torch::nn::Module> convert(const std::shared_ptr<torch::nn::Module>& m,
                                           const std::shared_ptr<comm::ProcessGroup>& pg) {
  if (isBatchNorm(*m)) return std::make_shared<SyncBatchNormImpl>(*m, pg);
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(m.get())) return convertSequential(m, *seq, pg);
  if (auto* list = dynamic_cast<torch::nn::ModuleListImpl*>(m.get())) {
    std::vector<std::shared_ptr<torch::nn::Module>> items;
    bool changed = false;
    for (const auto& c : *list) {
      items.push_back(convert(c, pg));
      changed |= items.back() != c;
    }
    if (!changed) return m;
    auto out = std::make_shared<torch::nn::ModuleListImpl>();
    for (auto& c : items) out->push_back(c);
    return out;
  }
  auto* dict = dynamic_cast<torch::nn::ModuleDictImpl*>(m.get());
  for (const auto& item : m->named_children()) {
    auto converted = convert(item.value(), pg);
    if (converted == item.value()) continue;
    if (dict)
      dict->update({{item.key(), converted}});  // overwrites the key in its list and its registry
    else
      m->replace_module(item.key(), converted);
  }
  return m;
}

}  // namespace

std::shared_ptr<torch::nn::Module> convertSyncBatchNorm(std::shared_ptr<torch::nn::Module> module,
                                                        std::shared_ptr<comm::ProcessGroup> pg) {
  DTRAIN_CHECK(module != nullptr, InvalidArgument, "convertSyncBatchNorm: the module is null");
  DTRAIN_CHECK(pg != nullptr, InvalidArgument, "convertSyncBatchNorm: the process group is null (pass dist.world())");
  return convert(module, pg);
}

}  // namespace dtrain
