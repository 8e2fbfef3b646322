// ZeroRedundancyOptimizer (dtrain/zero.h): PyTorch 1.13's partition, the local optimizer over the
// owned parameters, the owners' broadcasts after each step, clipping across ranks. The consolidated
// state (PyTorch's state_dict layout) is zero_state.cc.
#include "dtrain/zero.h"

#include <fmt/format.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <unordered_set>

#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/compat.h"
#include "dtrain/tensor.h"
#include "torch/device/tensor_comm.h"
#include "torch/sharding.h"
#include "torch/zero_impl.h"

namespace dtrain {

std::vector<int> zeroPartition(const std::vector<std::vector<int64_t>>& numels_per_group, int world_size) {
  DTRAIN_CHECK(world_size >= 1, InvalidArgument, "zeroPartition: world size {} (must be at least 1)", world_size);
  std::vector<int> owner;
  std::vector<int64_t> sizes(static_cast<size_t>(world_size), 0);
  for (const auto& group : numels_per_group) {
    const size_t base = owner.size();
    owner.resize(base + group.size(), 0);
    std::vector<size_t> order(group.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return group[a] > group[b]; });
    for (size_t i : order) {
      const auto least = std::min_element(sizes.begin(), sizes.end());  // the first minimum
      owner[base + i] = static_cast<int>(least - sizes.begin());
      *least += group[i];
    }
  }
  return owner;
}

std::vector<std::pair<std::string, at::Tensor>> uniqueParameters(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : module.named_parameters(/*recurse=*/true))
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) out.emplace_back(item.key(), item.value());
  return out;
}

namespace {

// What every rank must agree on: the parameters' sizes and dtypes, group by group.
uint64_t signature(const std::vector<size_t>& group_sizes, const std::vector<at::Tensor>& params) {
  uint64_t h = 14695981039346656037ull;
  auto mix = [&](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  for (size_t n : group_sizes) mix(n);
  for (const auto& p : params) {
    mix(static_cast<uint64_t>(p.numel()));
    mix(static_cast<uint64_t>(p.scalar_type()));
  }
  return h;
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                                                 MakeOptimizer make, std::shared_ptr<comm::ProcessGroup> pg,
                                                 ZeroOptions options)
    : impl_(std::make_unique<Impl>()) {
  DTRAIN_CHECK(pg != nullptr, InvalidArgument, "ZeroRedundancyOptimizer: process group is null");
  DTRAIN_CHECK(make != nullptr, InvalidArgument, "ZeroRedundancyOptimizer: no function to make the local optimizer");
  DTRAIN_CHECK(options.broadcast_bucket_bytes > 0, InvalidArgument,
               "ZeroRedundancyOptimizer: broadcast_bucket_bytes must be positive");
  Impl& m = *impl_;
  m.pg = std::move(pg);
  m.opts = options;
  // Each tensor once, at its first place (tied weights).
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<std::vector<int64_t>> numels;
  for (auto& g : groups) {
    std::vector<at::Tensor> kept;
    numels.emplace_back();
    for (const auto& p : g.params()) {
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      device::checkTensor(p, fmt::format("ZeroRedundancyOptimizer parameter {}", m.params.size()).c_str());
      if (!m.params.empty())
        device::checkSameDevice(m.params[0], "0", p, std::to_string(m.params.size()), "ZeroRedundancyOptimizer");
      kept.push_back(p);
      m.params.push_back(p);
      m.group_of.push_back(m.groups.size());
      numels.back().push_back(p.numel());
    }
    torch::optim::OptimizerParamGroup copy(kept);
    if (g.has_options()) copy.set_options(g.options().clone());
    m.groups.push_back(std::move(copy));
  }
  const int rank = m.pg->rank(), world = m.pg->size();
  std::vector<size_t> group_sizes;
  for (const auto& g : m.groups) group_sizes.push_back(g.params().size());
  std::vector<int64_t> sigs(static_cast<size_t>(world));
  const auto mine = static_cast<int64_t>(signature(group_sizes, m.params));
  m.pg->allgather(&mine, sigs.data(), 1, comm::DType::i64)->wait();
  for (int r = 0; r < world; ++r)
    DTRAIN_CHECK(sigs[static_cast<size_t>(r)] == mine, InvalidArgument,
                 "ZeroRedundancyOptimizer: rank {} was given other parameters than rank {} (their number, groups, "
                 "sizes or dtypes differ); every rank must pass the same list",
                 r, rank);
  m.owner = zeroPartition(numels, world);
  m.owned_by.assign(static_cast<size_t>(world), {});
  for (size_t i = 0; i < m.params.size(); ++i) m.owned_by[static_cast<size_t>(m.owner[i])].push_back(i);
  // The local optimizer: the caller's groups with the owned parameters only.
  std::vector<torch::optim::OptimizerParamGroup> local;
  for (size_t k = 0; k < m.groups.size(); ++k) {
    std::vector<at::Tensor> mine_k;
    for (size_t i : m.owned_by[static_cast<size_t>(rank)])
      if (m.group_of[i] == k) mine_k.push_back(m.params[i]);
    torch::optim::OptimizerParamGroup g(mine_k);
    if (m.groups[k].has_options()) g.set_options(m.groups[k].options().clone());
    local.push_back(std::move(g));
  }
  m.local = make(std::move(local));
  DTRAIN_CHECK(m.local != nullptr && m.local->param_groups().size() == m.groups.size(), InvalidArgument,
               "ZeroRedundancyOptimizer: the local optimizer must keep the {} parameter group(s) it is given",
               m.groups.size());
  // Groups without options take the optimizer's defaults, as the local ones did.
  for (size_t k = 0; k < m.groups.size(); ++k)
    if (!m.groups[k].has_options()) m.groups[k].set_options(m.local->param_groups()[k].options().clone());
  // Batches of small parameters are packed here, on the parameters' device.
  m.staging = at::empty({static_cast<int64_t>(m.opts.broadcast_bucket_bytes)},
                        at::TensorOptions().dtype(at::kByte).device(m.params.empty() ? at::Device(at::kCPU) : m.params[0].device()));
}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<at::Tensor> params, MakeOptimizer make,
                                                 std::shared_ptr<comm::ProcessGroup> pg, ZeroOptions options)
    : ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(
                                  std::move(params))},
                              std::move(make), std::move(pg), options) {}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::Impl::broadcastFrom(int root, const std::vector<size_t>& batch, size_t bytes) {
  if (batch.empty()) return;
  const bool mine = root == pg->rank();
  if (batch.size() == 1) {  // alone: in place
    auto& p = params[batch[0]];
    device::broadcast(*pg, p, root)->wait();
    return;
  }
  if (!staging.is_cpu()) {  // on a GPU: packed and unpacked by the device, sent by the device path
    at::NoGradGuard no_grad;
    at::Tensor packed = staging.narrow(0, 0, static_cast<int64_t>(bytes));
    int64_t off = 0;
    if (mine)
      for (size_t i : batch) {
        const auto n = static_cast<int64_t>(params[i].nbytes());
        packed.narrow(0, off, n).copy_(params[i].detach().reshape({-1}).view(at::kByte));
        off += n;
      }
    device::broadcast(*pg, packed, root)->wait();
    if (mine) return;
    off = 0;
    for (size_t i : batch) {
      const auto n = static_cast<int64_t>(params[i].nbytes());
      params[i].detach().reshape({-1}).view(at::kByte).copy_(packed.narrow(0, off, n));
      off += n;
    }
    return;
  }
  auto* buf = static_cast<char*>(staging.data_ptr());
  size_t at = 0;
  if (mine)
    for (size_t i : batch) {
      std::memcpy(buf + at, params[i].data_ptr(), params[i].nbytes());
      at += params[i].nbytes();
    }
  pg->broadcast(buf, bytes, comm::DType::u8, root)->wait();
  if (mine) return;
  at = 0;
  for (size_t i : batch) {
    std::memcpy(params[i].data_ptr(), buf + at, params[i].nbytes());
    at += params[i].nbytes();
  }
}

void ZeroRedundancyOptimizer::Impl::broadcastOwned() {
  const size_t cap = opts.broadcast_bucket_bytes;
  for (int r = 0; r < pg->size(); ++r) {
    std::vector<size_t> batch;
    size_t bytes = 0;
    auto flush = [&] {
      broadcastFrom(r, batch, bytes);
      batch.clear();
      bytes = 0;
    };
    for (size_t i : owned_by[static_cast<size_t>(r)]) {
      const size_t n = params[i].nbytes();
      if (n >= cap) {  // large: on its own, without a copy
        flush();
        batch.push_back(i);
        bytes = n;
        flush();
        continue;
      }
      if (bytes + n > cap) flush();
      batch.push_back(i);
      bytes += n;
    }
    flush();
  }
}

void ZeroRedundancyOptimizer::step() {
  Impl& m = *impl_;
  for (size_t k = 0; k < m.groups.size(); ++k) m.local->param_groups()[k].set_options(m.groups[k].options().clone());
  {
    torch::NoGradGuard no_grad;
    m.local->step();
    m.broadcastOwned();
  }
}

void ZeroRedundancyOptimizer::zeroGrad() { zeroGrad(compat::kZeroGradSetsToNone); }

void ZeroRedundancyOptimizer::zeroGrad(bool set_to_none) {
  for (auto& p : impl_->params) {
    if (!p.mutable_grad().defined()) continue;
    if (set_to_none) {
      p.mutable_grad().reset();
      continue;
    }
    p.mutable_grad().detach_();
    p.mutable_grad().zero_();
  }
}

double ZeroRedundancyOptimizer::clipGradNorm(double max_norm) {
  Impl& m = *impl_;
  std::vector<at::Tensor> owned;
  for (size_t i : m.owned_by[static_cast<size_t>(m.pg->rank())]) owned.push_back(m.params[i]);
  return clipGradNormAcross(*m.pg, owned, m.params, max_norm, "ZeroRedundancyOptimizer::clipGradNorm");
}

std::vector<torch::optim::OptimizerParamGroup>& ZeroRedundancyOptimizer::paramGroups() { return impl_->groups; }
const std::vector<at::Tensor>& ZeroRedundancyOptimizer::parameters() const { return impl_->params; }
int ZeroRedundancyOptimizer::ownerOf(size_t index) const {
  DTRAIN_CHECK(index < impl_->params.size(), InvalidArgument,
               "ZeroRedundancyOptimizer::ownerOf: parameter {} of {}", index, impl_->params.size());
  return impl_->owner[index];
}
torch::optim::Optimizer& ZeroRedundancyOptimizer::local() { return *impl_->local; }

ZeroRedundancyOptimizer::Memory ZeroRedundancyOptimizer::memory() const {
  Memory out;
  for (const auto& p : impl_->params) {
    out.parameters += static_cast<int64_t>(p.nbytes());
    if (p.grad().defined()) out.gradients += static_cast<int64_t>(p.grad().nbytes());
  }
  for (const auto& t : optimizerStateTensors(*impl_->local)) out.optimizer_state += static_cast<int64_t>(t.nbytes());
  return out;
}

}  // namespace dtrain
