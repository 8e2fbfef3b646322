// The server's optimizer updates: on a dense partition (tensor ops) and on one sparse row.
#include <ATen/ATen.h>

#include <cmath>

#include "server_state.h"

namespace dtrain::ps {

// The optimizer step on a dense partition (lock held).
void Server::State::apply(Dense& d, const at::Tensor& grad) {
  switch (opts.update) {
    case PSOptions::Update::sum_only:
      if (opts.consistency == Consistency::bsp) {
        d.value.copy_(grad);
      } else {
        d.value.add_(grad);
      }
      break;
    case PSOptions::Update::sgd:
      if (opts.momentum != 0) {
        if (!d.buf.defined()) {
          d.buf = grad.clone();
        } else {
          d.buf.mul_(opts.momentum).add_(grad);
        }
        d.value.add_(d.buf, -opts.lr);
      } else {
        d.value.add_(grad, -opts.lr);
      }
      break;
    case PSOptions::Update::adam: {
      if (!d.m.defined()) {
        d.m = at::zeros_like(d.value);
        d.v = at::zeros_like(d.value);
      }
      ++d.t;
      d.m.mul_(opts.beta1).add_(grad, 1 - opts.beta1);
      d.v.mul_(opts.beta2).addcmul_(grad, grad, 1 - opts.beta2);
      double bc1 = 1 - std::pow(opts.beta1, static_cast<double>(d.t));
      double bc2 = 1 - std::pow(opts.beta2, static_cast<double>(d.t));
      auto denom = (d.v.sqrt() / std::sqrt(bc2)).add_(opts.eps);
      d.value.addcdiv_(d.m, denom, -opts.lr / bc1);
      break;
    }
  }
  ++d.version;
}

void Server::State::prefetchRow(Rows& t, int64_t pos) {
  if (pos < 0) return;
  const char* p = reinterpret_cast<const char*>(t.at(pos));
  for (int64_t b = 0; b < t.stride * 4; b += 64) __builtin_prefetch(p + b);
}

// The update of one sparse row (its table's rw lock held exclusively). Each push is applied at once.
void Server::State::applyRow(Rows& t, int64_t pos, const float* g) {
  const int64_t dim = t.dim;
  float* p = t.at(pos);
  int64_t& step = t.steps[static_cast<size_t>(pos)];
  switch (opts.update) {
    case PSOptions::Update::sum_only:
      for (int64_t i = 0; i < dim; ++i) p[i] += g[i];
      break;
    case PSOptions::Update::sgd:
      if (opts.momentum != 0) {
        float* b = p + dim;
        const bool first = step++ == 0;
        const auto mom = static_cast<float>(opts.momentum), lr = static_cast<float>(opts.lr);
        for (int64_t i = 0; i < dim; ++i) {
          b[i] = first ? g[i] : mom * b[i] + g[i];
          p[i] -= lr * b[i];
        }
      } else {
        const auto lr = static_cast<float>(opts.lr);
        for (int64_t i = 0; i < dim; ++i) p[i] -= lr * g[i];
      }
      break;
    case PSOptions::Update::adam: {
      float* m = p + dim;
      float* v = p + 2 * dim;
      ++step;
      double bc1 = 1 - std::pow(opts.beta1, static_cast<double>(step));
      double bc2 = 1 - std::pow(opts.beta2, static_cast<double>(step));
      for (int64_t i = 0; i < dim; ++i) {
        m[i] = static_cast<float>(opts.beta1 * m[i] + (1 - opts.beta1) * g[i]);
        v[i] = static_cast<float>(opts.beta2 * v[i] + (1 - opts.beta2) * g[i] * g[i]);
        double denom = std::sqrt(v[i]) / std::sqrt(bc2) + opts.eps;
        p[i] = static_cast<float>(p[i] - opts.lr / bc1 * m[i] / denom);
      }
      break;
    }
  }
}

}  // namespace dtrain::ps
