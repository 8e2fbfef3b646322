// FullyShardedDataParallel's consolidated file (dtrain/fsdp.h): the gathered model and the optimizer's
// state over the shards, unflattened into one entry per parameter, in ZeroRedundancyOptimizer's layout
// (torch/optim_state.h); read back at any world size by slicing each unit's flat state anew.
#include <fmt/format.h>
#include <torch/serialize.h>

#include <unordered_map>

#include "dtrain/checkpoint.h"
#include "dtrain/comm/error.h"
#include "torch/device/tensor_comm.h"
#include "torch/fsdp_impl.h"
#include "torch/optim_state.h"
#include "torch/pickle_save.h"

namespace dtrain {

namespace {

using namespace optim_state;  // NOLINT(google-build-using-namespace): this file's vocabulary

// The per-parameter entries a state may have, in a fixed order (every rank walks them alike).
const char* const kEntries[] = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"};

// The optimizer group of each unit's shard; InvalidArgument for a shard the optimizer does not have.
std::vector<size_t> groupOfUnits(const std::vector<fsdp_detail::Unit>& units, const torch::optim::Optimizer& opt) {
  std::unordered_map<const c10::TensorImpl*, size_t> group;
  for (size_t g = 0; g < opt.param_groups().size(); ++g)
    for (const auto& p : opt.param_groups()[g].params()) group[p.unsafeGetTensorImpl()] = g;
  std::vector<size_t> out;
  for (size_t k = 0; k < units.size(); ++k) {
    auto it = group.find(units[k].shard.unsafeGetTensorImpl());
    DTRAIN_CHECK(it != group.end(), InvalidArgument,
                 "FSDP consolidated state: the optimizer does not step unit {}'s shard (give it fsdp.shards())", k);
    out.push_back(it->second);
  }
  return out;
}

}  // namespace

void FullyShardedDataParallel::saveConsolidated(const std::string& path, const torch::optim::Optimizer& optimizer, int to) {
  Impl& m = *impl_;
  const int rank = m.pg->rank(), world = m.pg->size();
  DTRAIN_CHECK(to >= 0 && to < world, InvalidArgument, "saveConsolidated: rank {} is not in a group of {}", to, world);
  const Kind k = kindOf(optimizer);
  const auto group_of = groupOfUnits(m.units, optimizer);
  c10::Dict<int64_t, TensorDict> state;
  c10::Dict<std::string, at::Tensor> model;
  c10::List<std::string> names;
  std::vector<std::vector<int64_t>> group_params(optimizer.param_groups().size());
  torch::NoGradGuard no_grad;
  int64_t index = 0;
  for (size_t u = 0; u < m.units.size(); ++u) {
    auto& unit = m.units[u];
    const bool was = unit.gathered;
    m.ensure(unit);
    for (size_t i = 0; i < unit.params.size(); ++i) {
      if (rank == to) model.insert(unit.names[i], unit.params[i].detach().clone());
      names.push_back(unit.names[i]);
      group_params[group_of[u]].push_back(index + static_cast<int64_t>(i));
    }
    if (!was) m.release(unit);
    auto it = optimizer.state().find(compat::optimizerStateKey(unit.shard));
    int64_t has[2] = {it != optimizer.state().end(), it != optimizer.state().end()};
    m.pg->allreduce(&has[0], 1, comm::DType::i64, comm::ReduceOp::min)->wait();
    m.pg->allreduce(&has[1], 1, comm::DType::i64, comm::ReduceOp::max)->wait();
    DTRAIN_CHECK(has[0] == has[1], InvalidArgument, "[rank {}] FSDP saveConsolidated: unit {}'s shard has optimizer "
                 "state on some ranks and not on others (did every rank step?)", rank, u);
    if (has[0]) {
      const TensorDict mine = toDict(k, *it->second);
      std::vector<TensorDict> per(unit.params.size());
      for (const char* e : kEntries) {
        if (!mine.contains(e)) continue;
        const at::Tensor t = mine.at(e);
        if (std::string(e) == "step") {  // a scalar (Adam's step): the same for every parameter of the unit
          for (auto& d : per) d.insert(e, t.clone());
          continue;
        }
        at::Tensor full = at::empty({unit.chunk * world}, t.options());
        device::allgather(*m.pg, t.contiguous(), full)->wait();
        for (size_t i = 0; i < unit.params.size(); ++i)
          per[i].insert(e, full.narrow(0, unit.offsets[i], unit.params[i].numel()).view(unit.params[i].sizes()).clone());
      }
      if (rank == to)
        for (size_t i = 0; i < per.size(); ++i) state.insert(index + static_cast<int64_t>(i), per[i]);
    }
    index += static_cast<int64_t>(unit.params.size());
  }
  if (rank == to) {
    c10::impl::GenericList groups(c10::AnyType::get());
    for (size_t g = 0; g < group_params.size(); ++g) {
      auto gd = groupDict(k, optimizer.param_groups()[g].options());
      gd.insert("params", c10::List<int64_t>(group_params[g]));
      groups.push_back(c10::IValue(gd));
    }
    auto root = consolidatedRoot(k, state, groups);
    root.insert("model", model);
    root.insert("parameter_names", names);
    writeConsolidated(path, root);
  }
  m.pg->barrier()->wait();
}

void FullyShardedDataParallel::loadConsolidated(const std::string& path, torch::optim::Optimizer& optimizer) {
  Impl& m = *impl_;
  const int rank = m.pg->rank();
  const Kind k = kindOf(optimizer);
  groupOfUnits(m.units, optimizer);  // (checks that the optimizer steps the shards)
  auto dict = readStateDict(path, k);
  DTRAIN_CHECK(dict.contains("model") && dict.contains("parameter_names"), InvalidArgument,
               "{}: no 'model' and 'parameter_names' (an FSDP consolidated file has both)", path);
  auto model = dict.at("model").toGenericDict();
  std::unordered_map<std::string, int64_t> index_of;
  {
    auto names = dict.at("parameter_names").toList();
    for (size_t i = 0; i < names.size(); ++i) index_of[names.get(i).toStringRef()] = static_cast<int64_t>(i);
  }
  auto state = dict.at("state").toGenericDict();
  auto groups = dict.at("param_groups").toList();
  DTRAIN_CHECK(groups.size() == optimizer.param_groups().size(), InvalidArgument,
               "{} has {} parameter group(s), this optimizer {}", path, groups.size(), optimizer.param_groups().size());
  for (size_t g = 0; g < groups.size(); ++g) applyGroupDict(k, optimizer.param_groups()[g].options(), groups.get(g).toGenericDict(), path);
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < m.units.size(); ++u) {
    auto& unit = m.units[u];
    m.release(unit);
    at::Tensor full = at::zeros({unit.chunk * m.pg->size()}, unit.shard.options().requires_grad(false));
    std::vector<TensorDict> entries;  // per parameter; empty: no state (never stepped: no gradient yet)
    size_t with_state = 0;
    for (size_t i = 0; i < unit.params.size(); ++i) {
      const auto& name = unit.names[i];
      auto it = model.find(name);
      DTRAIN_CHECK(it != model.end() && index_of.count(name), InvalidArgument, "{} has no parameter '{}'", path, name);
      const at::Tensor t = it->value().toTensor();
      DTRAIN_CHECK(t.sizes() == unit.params[i].sizes(), InvalidArgument, "{}: '{}' has shape {}, the model's is {}",
                   path, name, c10::str(t.sizes()), c10::str(unit.params[i].sizes()));
      full.narrow(0, unit.offsets[i], t.numel()).copy_(t.reshape(-1));
      auto st = state.find(index_of[name]);
      entries.emplace_back();
      if (st != state.end()) {
        entries.back() = tensorDict(st->value(), path, index_of[name]);
        ++with_state;
      }
    }
    unit.shard.copy_(full.narrow(0, rank * unit.chunk, unit.chunk));
    optimizer.state().erase(compat::optimizerStateKey(unit.shard));
    if (with_state == 0) continue;  // never stepped
    // The unit's shard is one tensor to the optimizer: one step count. A parameter without state (a file
    // from one process or DDP in which it never had a gradient) starts from zeros, which is what the
    // shard holds for it when it had none; its steps are the others'.
    const TensorDict* first = nullptr;
    for (const auto& d : entries) {
      if (d.size() == 0) continue;
      if (!first) first = &d;
      if (!d.contains("step") || !first->contains("step")) continue;
      DTRAIN_CHECK(d.at("step").item<double>() == first->at("step").item<double>(), InvalidArgument,
                   "{}: unit {}'s parameters were stepped {} and {} times; FSDP keeps one step count per unit (give "
                   "parameters that are not always used a unit of their own)",
                   path, u, first->at("step").item<double>(), d.at("step").item<double>());
    }
    TensorDict mine;
    for (const char* e : kEntries) {
      if (!first->contains(e)) continue;
      if (std::string(e) == "step") {
        mine.insert(e, first->at(e));
        continue;
      }
      at::Tensor flat = at::zeros({unit.chunk * m.pg->size()}, unit.shard.options().requires_grad(false));
      for (size_t i = 0; i < entries.size(); ++i)
        if (entries[i].contains(e))
          flat.narrow(0, unit.offsets[i], unit.params[i].numel()).copy_(entries[i].at(e).reshape(-1));
      mine.insert(e, flat.narrow(0, rank * unit.chunk, unit.chunk).clone());
    }
    optimizer.state()[compat::optimizerStateKey(unit.shard)] = fromDict(k, mine, unit.shard, u, path);
  }
}

namespace {

// One unit's tensor `entry` from every old rank's file, put together (the unit's numel first elements),
// and this rank's part of it at the new world size.
at::Tensor reslice(const std::vector<CheckpointState>& files, const std::string& key, const fsdp_detail::Unit& u,
                   int rank, int world, const std::string& dir) {
  std::vector<at::Tensor> parts;
  for (size_t r = 0; r < files.size(); ++r) {
    auto it = files[r].sharded.find(key);
    DTRAIN_CHECK(it != files[r].sharded.end(), InvalidArgument, "{}: rank {}'s file has no '{}'", dir, r, key);
    parts.push_back(it->second.reshape(-1));
  }
  at::Tensor whole = at::cat(parts);
  DTRAIN_CHECK(whole.numel() >= u.numel, InvalidArgument, "{}: '{}' holds {} elements, the unit {}", dir, key,
               whole.numel(), u.numel);
  at::Tensor padded = at::zeros({u.chunk * world}, whole.options());
  padded.narrow(0, 0, u.numel).copy_(whole.narrow(0, 0, u.numel));
  return padded.narrow(0, rank * u.chunk, u.chunk).clone();
}

}  // namespace

void FullyShardedDataParallel::captureSharded(CheckpointState& s, const torch::optim::Optimizer& optimizer) const {
  const Impl& m = *impl_;
  const std::string& pre = m.opts.checkpoint_prefix;
  const Kind k = kindOf(optimizer);
  const auto group_of = groupOfUnits(m.units, optimizer);
  for (size_t u = 0; u < m.units.size(); ++u) {
    const auto& unit = m.units[u];
    s.sharded[fmt::format("{}.{}.shard", pre, u)] = unit.shard.detach().clone();
    auto it = optimizer.state().find(compat::optimizerStateKey(unit.shard));
    if (it == optimizer.state().end()) continue;
    for (const auto& e : toDict(k, *it->second)) s.sharded[fmt::format("{}.{}.{}", pre, u, e.key())] = e.value().detach().clone();
  }
  c10::impl::GenericList groups(c10::AnyType::get());
  for (size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    auto gd = groupDict(k, optimizer.param_groups()[g].options());
    c10::List<int64_t> units;
    for (size_t u = 0; u < group_of.size(); ++u)
      if (group_of[u] == g) units.push_back(static_cast<int64_t>(u));
    gd.insert("units", units);
    groups.push_back(c10::IValue(gd));
  }
  s.sharded[pre + ".param_groups"] = bytesTensor(detail::torchSave(groups));
}

void FullyShardedDataParallel::restoreSharded(const std::string& checkpoint_dir, torch::optim::Optimizer& optimizer) {
  restoreSharded(Checkpointer::loadRanks(checkpoint_dir), optimizer, checkpoint_dir);
}

void FullyShardedDataParallel::restoreSharded(const std::vector<CheckpointState>& parts,
                                              torch::optim::Optimizer& optimizer, const std::string& what) {
  Impl& m = *impl_;
  const Kind k = kindOf(optimizer);
  const std::string& pre = m.opts.checkpoint_prefix;
  groupOfUnits(m.units, optimizer);  // (checks that the optimizer steps the shards)
  DTRAIN_CHECK(!parts.empty(), InvalidArgument, "{}: no rank's state to restore FSDP's from", what);
  auto g = parts[0].sharded.find(pre + ".param_groups");
  DTRAIN_CHECK(g != parts[0].sharded.end(), InvalidArgument,
               "{}: rank 0's state holds no FSDP state (no '{}.param_groups'; saved with captureSharded?)", what,
               pre);
  auto groups = torch::pickle_load(tensorBytes(g->second)).toList();
  DTRAIN_CHECK(groups.size() == optimizer.param_groups().size(), InvalidArgument,
               "{} has {} parameter group(s), this optimizer {}", what, groups.size(), optimizer.param_groups().size());
  for (size_t i = 0; i < groups.size(); ++i)
    applyGroupDict(k, optimizer.param_groups()[i].options(), groups.get(i).toGenericDict(), what);
  const int rank = m.pg->rank(), world = m.pg->size();
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < m.units.size(); ++u) {
    auto& unit = m.units[u];
    m.release(unit);
    unit.shard.copy_(reslice(parts, fmt::format("{}.{}.shard", pre, u), unit, rank, world, what));
    optimizer.state().erase(compat::optimizerStateKey(unit.shard));
    TensorDict mine;
    for (const char* e : kEntries) {
      const std::string key = fmt::format("{}.{}.{}", pre, u, e);
      auto it = parts[0].sharded.find(key);
      if (it == parts[0].sharded.end()) continue;
      mine.insert(e, std::string(e) == "step" ? it->second : reslice(parts, key, unit, rank, world, what));
    }
    if (mine.size() > 0) optimizer.state()[compat::optimizerStateKey(unit.shard)] = fromDict(k, mine, unit.shard, u, what);
  }
}

}  // namespace dtrain
