// The one update rule of the parameter server (see update_rule.h).
#include "update_rule.h"

#include <algorithm>
#include <cmath>

// Every operation below is rounded on its own, as ATen's kernels round them; the fused multiply-adds
// are written out (std::fma) where ATen fuses. Contracting a*b+c on our own would change the results.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace dtrain::ps {

int64_t stateSlots(const PSOptions& o) {
  if (o.update == PSOptions::Update::adam) return 3;
  if (o.update == PSOptions::Update::sgd && o.momentum != 0) return 2;
  return 1;
}

namespace {

// y[i] = fma(a, x[i], y[i]). Without FMA in the compiler's target (x86-64's baseline has none), std::fma
// is a call into libm per element, a third of the server's time on a sparse push (perf); where the
// CPU has FMA the loop is compiled for it (the same fused result, 8 lanes at a time).
void fmaLoopPortable(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__FMA__)
__attribute__((target("avx2,fma"))) void fmaLoopAvx2(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::fma(a, x[i], y[i]);
}
const bool kCpuHasFma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
void fmaLoop(float a, const float* x, float* y, int64_t n) {
  if (kCpuHasFma) fmaLoopAvx2(a, x, y, n);
  else fmaLoopPortable(a, x, y, n);
}
#else
void fmaLoop(float a, const float* x, float* y, int64_t n) { fmaLoopPortable(a, x, y, n); }
#endif

UpdateRule::Kind kindOf(const PSOptions& o, bool assign_sums) {
  switch (o.update) {
    case PSOptions::Update::sum_only:
      return assign_sums ? UpdateRule::Kind::assign : UpdateRule::Kind::accumulate;
    case PSOptions::Update::sgd:
      return o.momentum != 0 ? UpdateRule::Kind::sgd_momentum : UpdateRule::Kind::sgd;
    case PSOptions::Update::adam:
      return UpdateRule::Kind::adam;
  }
  return UpdateRule::Kind::sgd;
}
}  // namespace

UpdateRule::UpdateRule(const PSOptions& o, bool assign_sums)
    : kind_(kindOf(o, assign_sums)),
      // ATen turns a double Scalar into the float tensor's own type before it computes.
      lr_(static_cast<float>(o.lr)),
      momentum_(static_cast<float>(o.momentum)),
      beta1_(static_cast<float>(o.beta1)),
      beta2_(static_cast<float>(o.beta2)),
      eps_(static_cast<float>(o.eps)),
      beta1d_(o.beta1),
      beta2d_(o.beta2),
      lrd_(o.lr) {}

int64_t UpdateRule::slots() const {
  switch (kind_) {
    case Kind::adam: return 3;
    case Kind::sgd_momentum: return 2;
    default: return 1;
  }
}

void UpdateRule::apply(float* state, int64_t slot_stride, const float* grad, int64_t n, int64_t& step) const {
  float* p = state;
  switch (kind_) {
    case Kind::assign:
      std::copy(grad, grad + n, p);
      return;
    case Kind::accumulate:
      for (int64_t i = 0; i < n; ++i) p[i] += grad[i];
      return;
    case Kind::sgd:  // p.add_(grad, -lr)
      fmaLoop(-lr_, grad, p, n);
      return;
    case Kind::sgd_momentum: {
      float* buf = state + slot_stride;
      if (step++ == 0) {
        std::copy(grad, grad + n, buf);  // buf = grad.clone()
      } else {
        for (int64_t i = 0; i < n; ++i) buf[i] = buf[i] * momentum_ + grad[i];  // buf.mul_(momentum).add_(grad)
      }
      fmaLoop(-lr_, buf, p, n);  // p.add_(buf, -lr)
      return;
    }
    case Kind::adam: {
      float* m = state + slot_stride;
      float* v = state + 2 * slot_stride;
      ++step;
      const double bc1 = 1 - std::pow(beta1d_, static_cast<double>(step));
      const double bc2 = 1 - std::pow(beta2d_, static_cast<double>(step));
      const auto one_minus_b1 = static_cast<float>(1 - beta1d_), one_minus_b2 = static_cast<float>(1 - beta2d_);
      const auto sqrt_bc2 = static_cast<float>(std::sqrt(bc2));
      const auto neg_step_size = static_cast<float>(-(lrd_ / bc1));
      for (int64_t i = 0; i < n; ++i) {
        const float g = grad[i];
        m[i] = std::fma(one_minus_b1, g, m[i] * beta1_);     // m.mul_(beta1).add_(g, 1 - beta1)
        v[i] = v[i] * beta2_ + one_minus_b2 * g * g;         // v.mul_(beta2).addcmul_(g, g, 1 - beta2)
        const float denom = std::sqrt(v[i]) / sqrt_bc2 + eps_;  // (v.sqrt() / sqrt(bc2)).add_(eps)
        p[i] = p[i] + neg_step_size * m[i] / denom;          // p.addcdiv_(m, denom, -lr / bc1)
      }
      return;
    }
  }
}

}  // namespace dtrain::ps
