// The top-k DDP hook with error feedback and DGC's momentum correction (see dtrain/topk.h).
#include "dtrain/topk.h"

#include <torch/torch.h>

#include <cmath>
#include <map>

#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/tensor.h"
#include "torch/device/tensor_comm.h"

namespace dtrain {

double topKRatioAt(const TopKOptions& o, int64_t step) {
  const int64_t stage = step / o.steps_per_stage;
  if (stage >= o.warmup_stages) return o.ratio;
  const double c = std::pow(o.ratio, 1.0 / (o.warmup_stages + 1));
  return std::max(std::pow(c, static_cast<double>(stage + 1)), o.ratio);
}

namespace {

class TopKHook : public CommHook {
 public:
  explicit TopKHook(TopKOptions o) : o_(o) {
    DTRAIN_CHECK(o.ratio > 0 && o.ratio <= 1, InvalidArgument, "topKHook: ratio {} is not in (0, 1]", o.ratio);
    DTRAIN_CHECK(o.momentum >= 0 && o.momentum < 1, InvalidArgument, "topKHook: momentum {} is not in [0, 1)",
                 o.momentum);
    DTRAIN_CHECK(o.clip_norm >= 0, InvalidArgument, "topKHook: clip_norm {} is negative", o.clip_norm);
    DTRAIN_CHECK(o.warmup_stages >= 0, InvalidArgument, "topKHook: warmup_stages {} is negative", o.warmup_stages);
    DTRAIN_CHECK(o.steps_per_stage >= 1, InvalidArgument, "topKHook: steps_per_stage {} is below 1",
                 o.steps_per_stage);
    DTRAIN_CHECK(o.min_compress_numel >= 0, InvalidArgument, "topKHook: min_compress_numel {} is negative",
                 o.min_compress_numel);
  }

  std::string name() const override { return "topk"; }

  // On autograd's thread: accumulate, select and launch the two allgathers; the continuation (on
  // DDP's hook thread) adds every rank's pairs into the bucket.
  comm::WorkPtr run(comm::ProcessGroup& pg, GradBucket& b) override {
    torch::NoGradGuard no_grad;
    const int64_t n = b.flat.numel();
    toCommDType(b.flat.scalar_type(), "DDP bucket");  // refuses a dtype that cannot travel
    if (n < o_.min_compress_numel) return device::allreduce(pg, b.flat, comm::ReduceOp::avg);
    at::Tensor& v = accumulate(pg.size(), b);
    State& st = state_[b.index];
    const int64_t k = std::min<int64_t>(n, static_cast<int64_t>(std::ceil(topKRatioAt(o_, st.steps++) * n)));
    at::Tensor idx = std::get<1>(v.abs().topk(k, 0, /*largest=*/true, /*sorted=*/false)).contiguous();
    at::Tensor vals = v.index_select(0, idx).contiguous();
    v.index_fill_(0, idx, 0);
    if (o_.momentum > 0) st.u.index_fill_(0, idx, 0);
    const auto world = static_cast<int64_t>(pg.size());
    at::Tensor all_vals = at::empty({world * k}, vals.options());
    at::Tensor all_idx = at::empty({world * k}, idx.options());
    device::allgather(pg, vals, all_vals);
    // Ops on a group complete in issue order: the second's completion covers the first.
    auto gathered = device::allgather(pg, idx, all_idx);
    return b.then(gathered, [&b, vals, idx, all_vals, all_idx, world] {
      b.flat.zero_();
      b.flat.index_put_({all_idx}, all_vals, /*accumulate=*/true);
      b.flat.div_(static_cast<double>(world));
      return comm::WorkPtr();
    });
  }

 private:
  struct State {
    std::vector<size_t> params;  // the bucket's layout the state belongs to
    at::Tensor u, v;             // momentum and residual, the bucket's shape
    int64_t steps = 0;
  };

  // Clips, applies momentum correction and adds into the residual v (returned).
  at::Tensor& accumulate(int world, const GradBucket& b) {
    State& st = state_[b.index];
    if (st.params != b.params || !st.v.defined() || st.v.numel() != b.flat.numel()) {
      const int64_t steps = st.steps;
      st = State{b.params, at::zeros_like(b.flat), at::zeros_like(b.flat), steps};
    }
    at::Tensor g = b.flat;
    if (o_.clip_norm > 0) {  // torch::nn::utils::clip_grad_norm_'s rule, threshold scaled by world^(-1/2)
      const double max_norm = o_.clip_norm / std::sqrt(static_cast<double>(world));
      const double norm = g.norm().item<double>();
      const double coef = max_norm / (norm + 1e-6);
      if (coef < 1) g = g * coef;
    }
    if (o_.momentum <= 0) {
      st.v.add_(g);
    } else if (o_.nesterov) {
      st.u.add_(g).mul_(o_.momentum);
      st.v.add_(st.u).add_(g);
    } else {
      st.u.mul_(o_.momentum).add_(g);
      st.v.add_(st.u);
    }
    return st.v;
  }

  TopKOptions o_;
  std::map<int, State> state_;  // by bucket index; used on autograd's thread only
};

}  // namespace

std::shared_ptr<CommHook> topKHook(TopKOptions options) { return std::make_shared<TopKHook>(options); }

}  // namespace dtrain
