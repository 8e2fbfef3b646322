// ZeroRedundancyOptimizer's consolidated state (dtrain/zero.h): every rank's optimizer state in
// PyTorch's state_dict layout with global parameter indices, one file that torch.load reads and that
// loadConsolidated reads back at any world size.
#include <fmt/format.h>
#include <torch/serialize.h>

#include <cstring>
#include <map>

#include "dtrain/checkpoint.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "torch/optim_state.h"
#include "torch/pickle_save.h"
#include "torch/zero_impl.h"

namespace dtrain {

namespace {

using namespace optim_state;  // NOLINT(google-build-using-namespace): this file's vocabulary

// This rank's entries: {global index: {name: tensor}}, as torch::pickle_save bytes.
std::vector<char> ownedState(const torch::optim::Optimizer& local, const std::vector<at::Tensor>& params,
                             const std::vector<size_t>& owned, Kind k) {
  c10::Dict<int64_t, TensorDict> mine;
  const auto& state = local.state();
  for (size_t i : owned) {
    auto it = state.find(compat::optimizerStateKey(params[i]));
    if (it != state.end()) mine.insert(static_cast<int64_t>(i), toDict(k, *it->second));
  }
  return detail::torchSave(mine);
}

}  // namespace

std::vector<at::Tensor> optimizerStateTensors(const torch::optim::Optimizer& opt) {
  std::vector<at::Tensor> out;
  Kind k;
  try {
    k = kindOf(opt);
  } catch (const InvalidArgument&) {
    return out;  // another optimizer: its state is not counted
  }
  for (const auto& [key, s] : opt.state())
    for (const auto& e : toDict(k, *s)) out.push_back(e.value());
  return out;
}

namespace {

// PyTorch's param_groups: each group's options and its parameters' global indices.
c10::impl::GenericList groupsOf(const ZeroRedundancyOptimizer::Impl& m, Kind k) {
  c10::impl::GenericList groups(c10::AnyType::get());
  size_t first = 0;
  for (const auto& grp : m.groups) {
    auto g = groupDict(k, grp.options());
    c10::List<int64_t> ids;
    for (size_t i = 0; i < grp.params().size(); ++i) ids.push_back(static_cast<int64_t>(first + i));
    first += grp.params().size();
    g.insert("params", ids);
    groups.push_back(c10::IValue(g));
  }
  return groups;
}

// The entries of every parameter (global index -> {entry: tensor}) and the groups' options, whatever
// they were read from: each rank keeps its owned parameters'.
void applyState(ZeroRedundancyOptimizer::Impl& m, Kind k, const c10::impl::GenericDict& state,
                const c10::List<c10::IValue>& groups, const std::string& path) {
  DTRAIN_CHECK(groups.size() == m.groups.size(), InvalidArgument, "{} has {} parameter group(s), this optimizer {}",
               path, groups.size(), m.groups.size());
  for (size_t g = 0; g < m.groups.size(); ++g) {
    auto gd = groups.get(g).toGenericDict();
    const auto n = gd.contains("params") ? gd.at("params").toList().size() : 0;
    DTRAIN_CHECK(n == m.groups[g].params().size(), InvalidArgument,
                 "{}: parameter group {} has {} parameter(s), this optimizer's {}", path, g, n,
                 m.groups[g].params().size());
    applyGroupDict(k, m.groups[g].options(), gd, path);
    m.local->param_groups()[g].set_options(m.groups[g].options().clone());
  }
  auto& local_state = m.local->state();
  local_state.clear();
  for (size_t i : m.owned_by[static_cast<size_t>(m.pg->rank())]) {
    auto it = state.find(static_cast<int64_t>(i));
    if (it == state.end()) continue;  // never stepped (an unused parameter)
    local_state[compat::optimizerStateKey(m.params[i])] = fromDict(k, tensorDict(it->value(), path, static_cast<int64_t>(i)), m.params[i], i, path);
  }
}

}  // namespace

void ZeroRedundancyOptimizer::saveConsolidated(const std::string& path, int to) {
  Impl& m = *impl_;
  const int rank = m.pg->rank(), world = m.pg->size();
  DTRAIN_CHECK(to >= 0 && to < world, InvalidArgument, "saveConsolidated: rank {} is not in a group of {}", to, world);
  const Kind k = kindOf(*m.local);
  std::vector<char> mine = ownedState(*m.local, m.params, m.owned_by[static_cast<size_t>(rank)], k);
  if (rank != to) {
    int64_t n = static_cast<int64_t>(mine.size());
    m.pg->send(&n, 1, comm::DType::i64, to)->wait();
    m.pg->send(mine.data(), mine.size(), comm::DType::u8, to)->wait();
    m.pg->barrier()->wait();  // the file is written when saveConsolidated returns, everywhere
    return;
  }
  c10::Dict<int64_t, TensorDict> state;
  for (int r = 0; r < world; ++r) {
    std::vector<char> bytes;
    if (r == rank) {
      bytes = std::move(mine);
    } else {
      int64_t n = 0;
      m.pg->recv(&n, 1, comm::DType::i64, r)->wait();
      bytes.resize(static_cast<size_t>(n));
      m.pg->recv(bytes.data(), bytes.size(), comm::DType::u8, r)->wait();
    }
    for (const auto& e : torch::pickle_load(bytes).toGenericDict())
      state.insert(e.key().toInt(), tensorDict(e.value(), fmt::format("rank {}'s state", r), e.key().toInt()));
  }
  const auto groups = groupsOf(m, k);
  writeConsolidated(path, consolidatedRoot(k, state, groups));
  m.pg->barrier()->wait();
}


void ZeroRedundancyOptimizer::loadConsolidated(const std::string& path) {
  Impl& m = *impl_;
  const Kind k = kindOf(*m.local);
  auto dict = readStateDict(path, k);
  applyState(m, k, dict.at("state").toGenericDict(), dict.at("param_groups").toList(), path);
}

void ZeroRedundancyOptimizer::captureSharded(CheckpointState& s) const {
  const Impl& m = *impl_;
  const Kind k = kindOf(*m.local);
  const auto& state = m.local->state();
  for (size_t i : m.owned_by[static_cast<size_t>(m.pg->rank())]) {
    auto it = state.find(compat::optimizerStateKey(m.params[i]));
    if (it == state.end()) continue;
    for (const auto& e : toDict(k, *it->second))
      s.sharded[fmt::format("zero.state.{}.{}", i, e.key())] = e.value().detach().clone();
  }
  s.sharded["zero.param_groups"] = bytesTensor(detail::torchSave(groupsOf(m, k)));
}

void ZeroRedundancyOptimizer::restoreSharded(const std::string& checkpoint_dir) {
  restoreSharded(Checkpointer::loadRanks(checkpoint_dir), checkpoint_dir);
}

void ZeroRedundancyOptimizer::restoreSharded(const std::vector<CheckpointState>& parts, const std::string& what) {
  Impl& m = *impl_;
  const Kind k = kindOf(*m.local);
  DTRAIN_CHECK(!parts.empty(), InvalidArgument, "{}: no rank's state to restore ZeRO's from", what);
  std::map<int64_t, TensorDict> entries;
  for (const auto& f : parts)
    for (const auto& [name, t] : f.sharded) {
      if (name.rfind("zero.state.", 0) != 0) continue;
      const auto rest = name.substr(std::strlen("zero.state."));
      const auto dot = rest.find('.');
      DTRAIN_CHECK(dot != std::string::npos, InvalidArgument, "{}: a ZeRO entry named '{}'", what, name);
      auto& d = entries.try_emplace(std::stoll(rest.substr(0, dot))).first->second;
      d.insert(rest.substr(dot + 1), t);
    }
  auto g = parts[0].sharded.find("zero.param_groups");
  DTRAIN_CHECK(g != parts[0].sharded.end(), InvalidArgument,
               "{}: rank 0's file holds no ZeRO state (no 'zero.param_groups'; saved with captureSharded?)", what);
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  for (auto& [i, d] : entries) state.insert(i, d);
  applyState(m, k, state, torch::pickle_load(tensorBytes(g->second)).toList(), what);
}

}  // namespace dtrain
