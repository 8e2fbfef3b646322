// The server's optimizer maths (internal): ONE update rule over spans of floats, serving dense
// partitions and sparse rows alike.
//
// A parameter's state is `slots` spans of n floats, `slot_stride` floats apart: the value, then the
// momentum buffer (sgd with momentum) or Adam's m and v. A dense partition is a [slots, n] tensor
// (slot_stride = n); a sparse row stores value|state back to back (n = dim, slot_stride = dim).
#pragma once
#include <cstdint>

#include "dtrain/ps.h"

namespace dtrain::ps {

// Floats of state per element: the value, then the momentum buffer or Adam's m and v.
int64_t stateSlots(const PSOptions& o);

class UpdateRule {
 public:
  enum class Kind {
    assign,        // sum_only on a bsp dense partition: the value becomes the step's summed gradient
    accumulate,    // sum_only elsewhere: value += push
    sgd,           // value -= lr * grad
    sgd_momentum,  // buf = momentum * buf + grad (buf = grad at the first step); value -= lr * buf
    adam,          // torch::optim::Adam (no weight decay, no amsgrad)
  };
  // The rule of opts.update; `assign_sums`: sum_only replaces the value (bsp dense) instead of adding.
  UpdateRule(const PSOptions& opts, bool assign_sums);

  Kind kind() const { return kind_; }
  int64_t slots() const;

  // One optimizer step on n elements: state = slot 0 (the value) and the optimizer's slots, slot_stride
  // floats apart; grad: n floats. `step` counts the updates applied to this state (Adam's t; for
  // momentum, 0 = no buffer yet) and is advanced by the rules that use it.
  //
  // The arithmetic is torch::optim's on a float tensor, op by op in float with ATen's rounding (its
  // `x.add_(y, alpha)` is one fused multiply-add), so a dense partition stepped here matches
  // torch::optim::SGD to the bit and Adam to within an ulp or so.
  void apply(float* state, int64_t slot_stride, const float* grad, int64_t n, int64_t& step) const;

 private:
  Kind kind_;
  float lr_, momentum_, beta1_, beta2_, eps_;
  double beta1d_, beta2d_, lrd_;  // bias corrections are computed in double, as torch::optim does
};

}  // namespace dtrain::ps
