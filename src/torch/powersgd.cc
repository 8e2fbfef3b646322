// PowerSGD comm hooks (see dtrain/powersgd.h), following PyTorch 1.13's powerSGD_hook.py and
// batched_powerSGD_hook step by step, as DDP comm-hook chains:
//
//   run() (autograd's thread, bucket order): error feedback, choose what to compress, Q (random or
//         warm), P = M·Q; issue the uncompressed tensors' allreduce and P's allreduce on DDP's group.
//   then: unpack the uncompressed mean; orthogonalise P; Q = Mᵀ·P; allreduce Q on the chain group.
//   then: Q /= world; error = M - P·Qᵀ, then M = P·Qᵀ (error feedback fused into the decompression;
//         PyTorch subtracts the output from a copy of the input); drop the memories without warm start.
//
// State per bucket is keyed by the bucket's index, as PyTorch keys error_dict / p_memory_dict /
// q_memory_dict; one seed generator (numpy's RandomState) serves all buckets in launch order.
#include "dtrain/powersgd.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/tensor.h"
#include "torch/device/tensor_comm.h"

namespace dtrain {
namespace {

// numpy.random.RandomState(seed).randint(1_000_000_000): MT19937 seeded like std::mt19937, each draw
// masked to 30 bits and redrawn while above the bound (numpy's legacy bounded integers).
class NumpySeeds {
 public:
  explicit NumpySeeds(uint32_t seed) : g_(seed) {}
  uint64_t next() {
    uint32_t v;
    do v = static_cast<uint32_t>(g_()) & 0x3FFFFFFFu;
    while (v > 999999999u);
    return v;
  }

 private:
  std::mt19937 g_;
};

// PyTorch's _orthogonalize_gram_schmidt on one (n, r) matrix, in place.
void orthogonalize(const at::Tensor& m, double eps) {
  const int64_t cols = m.size(1);
  for (int64_t i = 0; i < cols; ++i) {
    auto col = m.narrow(1, i, 1);
    auto norm = at::norm(col, 2, {0}, /*keepdim=*/true);
    if (eps != 0) norm.add_(eps);
    col.div_(norm);
    if (i + 1 < cols) {
      auto rest = m.narrow(1, i + 1, cols - i - 1);
      rest.sub_(at::sum(col * rest, {0}, /*keepdim=*/true) * col);
    }
  }
}

// What both hooks share: the options, the step count, the seeds, the plain steps before compression.
class PowerSGDBase : public PowerSGDHook {
 public:
  PowerSGDBase(const PowerSGDOptions& o, const char* name) : o_(o), seeds_(o.random_seed), name_(name) {
    DTRAIN_CHECK(o.matrix_approximation_rank >= 1, InvalidArgument,
                 "{}: matrix_approximation_rank must be at least 1 (got {})", name, o.matrix_approximation_rank);
    DTRAIN_CHECK(o.min_compression_rate >= 0, InvalidArgument, "{}: min_compression_rate must be >= 0 (got {})", name,
                 o.min_compression_rate);
    DTRAIN_CHECK(o.orthogonalization_epsilon >= 0, InvalidArgument,
                 "{}: orthogonalization_epsilon must be >= 0 (got {})", name, o.orthogonalization_epsilon);
    DTRAIN_CHECK(!(o.use_error_feedback || o.warm_start) || o.start_powerSGD_iter > 1, InvalidArgument,
                 "{}: start_powerSGD_iter must be > 1 (got {}) with use_error_feedback or warm_start: DDP rebuilds "
                 "its buckets after the first step, which would mismatch the memorised tensors",
                 name, o.start_powerSGD_iter);
  }
  std::string name() const override { return name_; }
  bool chainsCollectives() const override { return true; }
  Compression compressionStats() const override { return last_; }
  int64_t iteration() const override { return iter_; }

  comm::WorkPtr run(comm::ProcessGroup& pg, GradBucket& b) override {
    if (iter_ < o_.start_powerSGD_iter) {
      if (b.last) ++iter_;
      return device::allreduce(pg, b.flat, comm::ReduceOp::avg);
    }
    if (b.index == 0) counting_ = {};
    auto w = compress(pg, b);
    if (b.last) {
      last_ = counting_;
      ++iter_;
    }
    return w;
  }

 protected:
  virtual comm::WorkPtr compress(comm::ProcessGroup& pg, GradBucket& b) = 0;

  // A random (rows, rank) matrix per shape, drawn as PyTorch does: one seed from the RandomState,
  // then torch.randn from a generator in that state (PyTorch reseeds the global one inside fork_rng;
  // a private generator gives the same numbers and leaves the global one alone).
  at::Generator seededGenerator() { return at::make_generator<at::CPUGeneratorImpl>(seeds_.next()); }

  // Error feedback, first half: the input gets back what compression lost last step. The buffer lives
  // as long as the bucket (a fresh model-sized tensor per step costs its page faults every step); every
  // element is written again by the second half.
  void addError(at::Tensor& error, const at::Tensor& input) {
    if (!o_.use_error_feedback) return;
    if (error.defined() && error.numel() == input.numel()) input.add_(error);
    else error = at::empty_like(input);
  }
  // Decompression, with the second half of error feedback fused in: error = M - P·Qᵀ (one addmm that
  // reads M), then M = P·Qᵀ. PyTorch keeps a copy of the input and subtracts the output from it
  // afterwards; this saves three passes over the gradient (the copy's two and one of the subtraction's).
  void decompress(at::Tensor m, const at::Tensor& p, const at::Tensor& q, at::Tensor error) {
    if (o_.use_error_feedback) at::addmm_out(error, m, p, q.t(), /*beta=*/1, /*alpha=*/-1);
    at::mm_out(m, p, q.t());
  }
  // The part of a bucket-shaped buffer (error) that holds `g`, a view of the bucket, shaped as g.
  static at::Tensor partOf(const at::Tensor& buffer, const GradBucket& b, const at::Tensor& g) {
    const auto off = (static_cast<const char*>(g.data_ptr()) - static_cast<const char*>(b.flat.data_ptr())) /
                     static_cast<std::ptrdiff_t>(g.element_size());
    return buffer.narrow(0, off, g.numel()).view_as(g);
  }

  static comm::WorkPtr allreduceSum(comm::ProcessGroup& pg, at::Tensor& t) {
    return device::allreduce(pg, t, comm::ReduceOp::sum);
  }

  PowerSGDOptions o_;
  NumpySeeds seeds_;
  int64_t iter_ = 0;
  Compression counting_, last_;

 private:
  const char* name_;
};

// powerSGD_hook: one low-rank pair per compressible gradient.
class LayerwiseHook : public PowerSGDBase {
 public:
  explicit LayerwiseHook(const PowerSGDOptions& o) : PowerSGDBase(o, "powerSGD") {}

 private:
  struct Bucket {
    at::Tensor error, p, q;  // error feedback and the P / Q memories, kept across steps
    // This step's:
    at::Tensor unc_flat;
    std::vector<at::Tensor> mats, ps, qs, unc;
  };

  void split(Bucket& s, GradBucket& b, int64_t* p_total, int64_t* q_total);
  void initQ(Bucket& s, bool fresh);
  comm::WorkPtr secondStage(GradBucket& b, Bucket& s, int world);
  void finish(Bucket& s);

  comm::WorkPtr compress(comm::ProcessGroup& pg, GradBucket& b) override {
    Bucket& s = buckets_[b.index];
    addError(s.error, b.flat);
    int64_t p_total = 0, q_total = 0;
    split(s, b, &p_total, &q_total);
    const bool fresh = !o_.warm_start || !s.p.defined();
    if (fresh) {
      s.p = at::empty({p_total}, b.flat.options());
      s.q = at::empty({q_total}, b.flat.options());
    }
    s.ps.clear();
    s.qs.clear();
    int64_t po = 0, qo = 0;
    for (const auto& m : s.mats) {
      const int64_t n = m.size(0), k = m.size(1), r = std::min<int64_t>({n, k, o_.matrix_approximation_rank});
      s.ps.push_back(s.p.narrow(0, po, n * r).view({n, r}));
      s.qs.push_back(s.q.narrow(0, qo, k * r).view({k, r}));
      po += n * r;
      qo += k * r;
    }
    initQ(s, fresh);
    for (size_t i = 0; i < s.mats.size(); ++i) at::mm_out(s.ps[i], s.mats[i], s.qs[i]);
    const int world = pg.size();
    comm::WorkPtr unc, p;
    if (s.unc_flat.numel() > 0) unc = allreduceSum(pg, s.unc_flat);
    if (p_total > 0) p = allreduceSum(pg, s.p);
    auto second = [this, &b, &s, world] { return secondStage(b, s, world); };
    if (!unc) return b.then(p, second);
    return b.then(unc, [this, &b, &s, p, second, world]() -> comm::WorkPtr {
      s.unc_flat.div_(world);
      int64_t off = 0;
      for (auto& t : s.unc) {
        auto avg = s.unc_flat.narrow(0, off, t.numel()).view_as(t);
        if (o_.use_error_feedback) {  // error = input - output
          auto e = partOf(s.error, b, t);
          at::sub_out(e, t, avg);
        }
        t.copy_(avg);
        off += t.numel();
      }
      if (p) return b.then(p, second);
      finish(s);
      return nullptr;
    });
  }

  std::map<int, Bucket> buckets_;
};

// Which gradients are compressed; those, grouped by shape in order of first appearance, become
// s.mats (the order of the P / Q memories), the others s.unc and their concatenation s.unc_flat.
void LayerwiseHook::split(Bucket& s, GradBucket& b, int64_t* p_total, int64_t* q_total) {
  std::vector<std::pair<std::vector<int64_t>, std::vector<at::Tensor>>> by_shape;
  s.unc.clear();
  for (const auto& g : b.grads) {
    DTRAIN_CHECK(g.dim() >= 1, InvalidArgument, "powerSGD hook: bucket {} holds a 0-dimensional gradient",
                 b.index);
    auto m = g.view({g.size(0), -1});
    const int64_t n = m.size(0), k = m.size(1), r = std::min<int64_t>({n, k, o_.matrix_approximation_rank});
    counting_.before += n * k;
    if (double((n + k) * r) * o_.min_compression_rate < double(n * k)) {
      counting_.after += (n + k) * r;
      *p_total += n * r;
      *q_total += k * r;
      std::vector<int64_t> shape{n, k};
      auto it = std::find_if(by_shape.begin(), by_shape.end(), [&](const auto& e) { return e.first == shape; });
      if (it == by_shape.end()) by_shape.push_back({shape, {m}});
      else it->second.push_back(m);
    } else {
      counting_.after += n * k;
      s.unc.push_back(g);
    }
  }
  s.mats.clear();
  for (auto& e : by_shape)
    for (auto& m : e.second) s.mats.push_back(m);
  std::vector<at::Tensor> flat;
  for (const auto& t : s.unc) flat.push_back(t.reshape({-1}));
  s.unc_flat = flat.empty() ? at::empty({0}, b.flat.options()) : at::cat(flat);
}

void LayerwiseHook::initQ(Bucket& s, bool fresh) {
  if (!fresh) {
    for (auto& q : s.qs) orthogonalize(q, o_.orthogonalization_epsilon);
    return;
  }
  auto gen = seededGenerator();
  for (auto& q : s.qs) {
    q.copy_(at::randn(q.sizes(), gen, q.options().device(at::kCPU)));  // on a GPU too: the CPU's numbers
    orthogonalize(q, o_.orthogonalization_epsilon);
  }
}

// After P's allreduce: orthogonalise P, Q = Mᵀ·P, allreduce Q on the chain group.
comm::WorkPtr LayerwiseHook::secondStage(GradBucket& b, Bucket& s, int world) {
  for (auto& p : s.ps) orthogonalize(p, o_.orthogonalization_epsilon);
  for (size_t i = 0; i < s.mats.size(); ++i) at::mm_out(s.qs[i], s.mats[i].t(), s.ps[i]);
  auto q = allreduceSum(b.chainGroup(), s.q);
  return b.then(q, [this, &b, &s, world]() -> comm::WorkPtr {
    s.q.div_(world);
    for (size_t i = 0; i < s.mats.size(); ++i)
      decompress(s.mats[i], s.ps[i], s.qs[i],
                 o_.use_error_feedback ? partOf(s.error, b, s.mats[i]) : at::Tensor());
    finish(s);
    return nullptr;
  });
}

void LayerwiseHook::finish(Bucket& s) {
  if (!o_.warm_start) s.p = s.q = at::Tensor();
  s.unc_flat = at::Tensor();
}

// batched_powerSGD_hook: the bucket as one square matrix.
class BatchedHook : public PowerSGDBase {
 public:
  explicit BatchedHook(const PowerSGDOptions& o) : PowerSGDBase(o, "batched_powerSGD") {}

 private:
  struct Bucket {
    at::Tensor error, q, p, padded;
  };

  comm::WorkPtr compress(comm::ProcessGroup& pg, GradBucket& b) override {
    Bucket& s = buckets_[b.index];
    const int64_t len = b.flat.numel();
    const auto side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(len))));
    const int64_t r = std::min<int64_t>(side, o_.matrix_approximation_rank);
    counting_.before += len;
    counting_.after += 2 * side * r;
    if (!s.padded.defined() || s.padded.numel() != side * side) s.padded = at::zeros({side * side}, b.flat.options());
    s.padded.narrow(0, 0, len).copy_(b.flat);
    s.padded.narrow(0, len, side * side - len).zero_();  // the last step's output wrote the padding too
    addError(s.error, s.padded);
    if (!o_.warm_start || !s.q.defined()) {
      auto gen = seededGenerator();
      s.q = at::randn({side, r}, gen, b.flat.options().device(at::kCPU)).to(b.flat.device());
    }
    const double eps = o_.orthogonalization_epsilon;
    orthogonalize(s.q, eps);
    auto m = s.padded.view({side, side});
    s.p = at::mm(m, s.q);
    auto p = allreduceSum(pg, s.p);
    const int world = pg.size();
    return b.then(p, [this, &b, &s, m, eps, world]() -> comm::WorkPtr {
      orthogonalize(s.p, eps);
      at::mm_out(s.q, m.t(), s.p);
      auto q = allreduceSum(b.chainGroup(), s.q);
      return b.then(q, [this, &b, &s, m, world]() -> comm::WorkPtr {
        s.q.div_(world);
        decompress(m, s.p, s.q, o_.use_error_feedback ? s.error.view_as(m) : at::Tensor());
        if (!o_.warm_start) s.q = at::Tensor();
        b.flat.copy_(s.padded.narrow(0, 0, b.flat.numel()));
        return nullptr;
      });
    });
  }

  std::map<int, Bucket> buckets_;
};

}  // namespace

std::shared_ptr<PowerSGDHook> powerSGDHook(const PowerSGDOptions& options) {
  return std::make_shared<LayerwiseHook>(options);
}
std::shared_ptr<PowerSGDHook> batchedPowerSGDHook(const PowerSGDOptions& options) {
  return std::make_shared<BatchedHook>(options);
}

}  // namespace dtrain
