// Optimizer state in PyTorch's state_dict layout (internal): per-parameter entries as {name: tensor}
// (Adam/AdamW "step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"; SGD/Lars "momentum_buffer"; Lamb as
// Adam), a group's options as PyTorch's param_groups entry, and back. ZeroRedundancyOptimizer and
// FullyShardedDataParallel write and read consolidated files with them.
#pragma once
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <vector>

#include "dtrain/checkpoint.h"
#include "dtrain/compat.h"  // optimizerStateKey: the callers find their entries in Optimizer::state() with it

namespace dtrain::optim_state {

using torch::optim::OptimizerParamState;
using TensorDict = c10::Dict<std::string, at::Tensor>;

enum class Kind { kAdam, kAdamW, kSgd, kLamb, kLars };
const char* kindName(Kind k);
// InvalidArgument unless o is torch::optim Adam, AdamW, SGD or dtrain's Lamb or Lars.
Kind kindOf(const torch::optim::Optimizer& o);

TensorDict toDict(Kind k, const OptimizerParamState& s);
// The state of parameter p (global index i, for messages) from its entries; InvalidArgument naming
// `path` when one is missing or shaped unlike p.
std::unique_ptr<OptimizerParamState> fromDict(Kind k, const TensorDict& d, const at::Tensor& p, size_t i,
                                              const std::string& path);
c10::impl::GenericDict groupDict(Kind k, const torch::optim::OptimizerOptions& o);
void applyGroupDict(Kind k, torch::optim::OptimizerOptions& o, const c10::impl::GenericDict& g, const std::string& path);
// A {name: tensor} dict as pickle_load returns it (untyped when Python wrote it).
TensorDict tensorDict(const c10::IValue& v, const std::string& path, int64_t index);
// Bytes (a pickle) as a uint8 tensor, for a checkpoint's tensor map, and back.
at::Tensor bytesTensor(const std::vector<char>& bytes);
std::vector<char> tensorBytes(const at::Tensor& t);
// The root of a consolidated file: {"state", "param_groups", "dtrain_optimizer"} (callers may add more),
// and its atomic write (a temporary file renamed into place).
c10::impl::GenericDict consolidatedRoot(Kind k, const c10::Dict<int64_t, TensorDict>& state,
                                        const c10::impl::GenericList& groups);
void writeConsolidated(const std::string& path, const c10::impl::GenericDict& root);
// A consolidated file's root dict, checked: a dict with "state" and "param_groups", of optimizer kind k.
c10::impl::GenericDict readStateDict(const std::string& path, Kind k);

}  // namespace dtrain::optim_state
