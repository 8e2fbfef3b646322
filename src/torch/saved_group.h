// The process group an autograd Function's backward runs on. ctx->saved_data holds IValues only, so the
// group travels as its address (an int64); whoever builds the graph keeps the group alive for as long as
// the graph may run backward (autograd.h documents it for the public ops). Internal to the torch layer.
#pragma once
#include <torch/torch.h>

#include <cstdint>

#include "dtrain/comm/process_group.h"

namespace dtrain::detail {

inline void saveGroup(torch::autograd::AutogradContext* ctx, comm::ProcessGroup& pg) {
  ctx->saved_data["pg"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(&pg));
}

inline comm::ProcessGroup& savedGroup(torch::autograd::AutogradContext* ctx) {
  return *reinterpret_cast<comm::ProcessGroup*>(static_cast<intptr_t>(ctx->saved_data.at("pg").toInt()));
}

}  // namespace dtrain::detail
