// A post-hook on a parameter's gradient accumulator, shared by DDP, FSDP and the parameter server's
// DistributedModule (internal; not installed). It runs once per backward pass that reaches the parameter,
// after the gradient is accumulated (unlike a tensor hook, not again when dtrain::recompute's
// recomputation computes the same gradient), and calls fn(owner, incoming, arrived): incoming is the
// gradient that flowed in, arrived whether one did (autograd may run the node with an undefined one, e.g.
// for an output that no loss used, or through recompute for a parameter the segment did not use). The
// owner's pointer is shared with the hooks and cleared when the owner goes: a hook that outlives it (the
// accumulator may) does nothing.
#pragma once
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "dtrain/compat.h"

namespace dtrain::detail {

template <class Owner>
class AccumulatorHook : public torch::autograd::FunctionPostHook {
 public:
  using Fn = std::function<void(Owner& owner, const at::Tensor& incoming, bool arrived)>;
  AccumulatorHook(std::shared_ptr<std::atomic<Owner*>> owner, Fn fn) : owner_(std::move(owner)), fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& inputs) override {
    if (auto* m = owner_->load())
      fn_(*m, inputs.empty() ? at::Tensor() : inputs[0], inputs.empty() || inputs[0].defined());
    return outputs;
  }

 private:
  std::shared_ptr<std::atomic<Owner*>> owner_;
  Fn fn_;
};

// Adds an AccumulatorHook to param's gradient accumulator; the node (which holds the hook) goes into
// `nodes` to stay alive; returns the key that del_post_hook takes.
template <class Owner>
uintptr_t addAccumulatorHook(const at::Tensor& param, std::shared_ptr<std::atomic<Owner*>> owner,
                             typename AccumulatorHook<Owner>::Fn fn, std::vector<compat::GradAccumulatorPtr>& nodes) {
  auto acc = torch::autograd::impl::grad_accumulator(param);
  const auto key = acc->add_post_hook(std::make_unique<AccumulatorHook<Owner>>(std::move(owner), std::move(fn)));
  nodes.push_back(std::move(acc));
  return key;
}

}  // namespace dtrain::detail
