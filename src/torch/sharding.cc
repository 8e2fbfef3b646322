// Helpers shared by the sharded-state classes and recomputation (torch/sharding.h).
#include "torch/sharding.h"

#include <cmath>

#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"

namespace dtrain {

double clipGradNormAcross(comm::ProcessGroup& pg, const std::vector<at::Tensor>& counted,
                          const std::vector<at::Tensor>& scaled, double max_norm, const char* who) {
  DTRAIN_CHECK(max_norm > 0 && std::isfinite(max_norm), InvalidArgument,
               "{}: max_norm {} (must be positive and finite)", who, max_norm);
  double sq = 0;
  for (const auto& t : counted)
    if (t.grad().defined()) sq += t.grad().to(at::kDouble).pow(2).sum().item<double>();
  pg.allreduce(&sq, 1, comm::DType::f64, comm::ReduceOp::sum)->wait();
  const double total = std::sqrt(sq), coef = max_norm / (total + 1e-6);
  if (coef < 1) {
    at::NoGradGuard no_grad;
    for (const auto& t : scaled)
      if (t.grad().defined()) t.mutable_grad().mul_(coef);
  }
  return total;
}

SegmentFn childrenOf(torch::nn::Sequential seq, int from, int to) {
  return [seq, from, to](const std::vector<at::Tensor>& in) mutable {
    at::Tensor y = in[0];
    for (int i = from; i < to; ++i) y = (seq->begin() + i)->forward(y);
    return std::vector<at::Tensor>{y};
  };
}

}  // namespace dtrain
