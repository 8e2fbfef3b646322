// Activation recomputation (dtrain/recompute.h) as a custom autograd function whose tensor inputs are the
// segment's inputs and its parameters: forward runs the segment without grad and keeps them; backward
// runs it again with grad and returns the gradients of both through the outer pass.
#include "dtrain/recompute.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include <utility>

#include "dtrain/comm/error.h"
#include "torch/sharding.h"

namespace dtrain {

namespace {

// What backward needs besides tensors: the function, how many tensors are inputs, the RNG state.
struct Segment : torch::CustomClassHolder {
  SegmentFn fn;
  size_t num_inputs = 0;
  at::Tensor rng;
};

struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const c10::intrusive_ptr<Segment>& seg, at::TensorList all) {
    seg->rng = at::detail::getDefaultCPUGenerator().get_state();
    ctx->saved_data["segment"] = c10::IValue::make_capsule(seg);
    ctx->save_for_backward(all.vec());  // inputs, then parameters (leaves: no copies)
    std::vector<at::Tensor> inputs(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(seg->num_inputs));
    return seg->fn(inputs);  // (autograd is off inside forward)
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto seg = c10::static_intrusive_pointer_cast<Segment>(ctx->saved_data["segment"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    const size_t n_in = seg->num_inputs;
    std::vector<at::Tensor> inputs, wrt;
    std::vector<size_t> where;  // wrt[k] is forward's tensor input where[k]
    for (size_t i = 0; i < n_in; ++i) {
      inputs.push_back(saved[i].detach().requires_grad_(saved[i].requires_grad()));
      if (saved[i].requires_grad()) {
        wrt.push_back(inputs.back());
        where.push_back(i);
      }
    }
    for (size_t i = n_in; i < saved.size(); ++i) {
      wrt.push_back(saved[i]);
      where.push_back(i);
    }
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    const at::Tensor now = gen.get_state();
    gen.set_state(seg->rng);  // the same dropout masks as in forward
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode on(true);
      outputs = seg->fn(inputs);
    }
    gen.set_state(now);
    std::vector<at::Tensor> outs, grads;
    for (size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i)
      if (outputs[i].requires_grad() && grad_outputs[i].defined()) {
        outs.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    torch::autograd::variable_list result(1 + saved.size());  // (the first: the segment, not a tensor)
    if (outs.empty() || wrt.empty()) return result;
    auto got = torch::autograd::grad(outs, wrt, grads, /*retain_graph=*/false, /*create_graph=*/false,
                                     /*allow_unused=*/true);
    for (size_t k = 0; k < got.size(); ++k) result[1 + where[k]] = got[k];
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> recompute(const SegmentFn& fn, const std::vector<at::Tensor>& inputs,
                                  const std::vector<at::Tensor>& params) {
  DTRAIN_CHECK(fn != nullptr, InvalidArgument, "recompute: no function");
  bool any = false;
  for (const auto& x : inputs) any |= x.defined() && x.requires_grad();
  std::vector<at::Tensor> all(inputs);
  for (const auto& p : params)
    if (p.defined() && p.requires_grad()) {
      all.push_back(p);
      any = true;
    }
  if (!any || !at::GradMode::is_enabled()) return fn(inputs);  // nothing to differentiate: just run it
  auto seg = c10::make_intrusive<Segment>();
  seg->fn = fn;
  seg->num_inputs = inputs.size();
  return RecomputeFunction::apply(seg, at::TensorList(all));
}

at::Tensor recomputeSequential(torch::nn::Sequential& seq, int segments, const at::Tensor& x) {
  const auto children = seq->children();
  const int n = static_cast<int>(children.size());
  DTRAIN_CHECK(segments >= 1 && segments <= n, InvalidArgument,
               "recomputeSequential: {} segment(s) for a Sequential of {} module(s)", segments, n);
  at::Tensor h = x;
  const int per = n / segments, extra = n % segments;  // the first `extra` segments take one more
  int at = 0;
  for (int s = 0; s < segments; ++s) {
    const int len = per + (s < extra ? 1 : 0);
    const int from = at, to = at + len;
    at = to;
    std::vector<at::Tensor> params;
    for (int i = from; i < to; ++i)
      for (const auto& p : children[static_cast<size_t>(i)]->parameters()) params.push_back(p);
    const SegmentFn fn = childrenOf(seq, from, to);
    h = s + 1 < segments ? recompute(fn, {h}, params)[0] : fn({h})[0];
  }
  return h;
}

}  // namespace dtrain
