// Gradient buckets: which parameters travel together. One rule for DistributedDataParallel and
// ps::DistributedModule (internal; not installed).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstddef>
#include <vector>

namespace dtrain::detail {

struct BucketSizes {
  size_t bucket_bytes = 25u << 20;
  size_t first_bucket_bytes = 1u << 20;  // the first bucket's cap: small, so communication starts early
  // The last bucket's (0: none, PyTorch's rule): small, so little is left to reduce after backward.
  size_t last_bucket_bytes = 0;
};

// Groups params[i] for i in `order` (each index once) into buckets as PyTorch 1.13's DDP does
// (compute_bucket_assignment_by_size): each dtype has its own open bucket (a bucket is one flat tensor);
// a parameter joins its dtype's bucket, and the bucket closes once it holds at least its cap, so the
// parameter that reaches the cap is still in it (a parameter larger than the cap closes a bucket of
// its own, or with what was open). The cap is first_bucket_bytes for a dtype's first bucket and
// bucket_bytes after. Buckets come in the order they closed, then the ones left open in the order of
// their first parameter. Returns parameter indices per bucket, each in the given order.
// With last_bucket_bytes, the bucket that holds the last parameter of `order` (whose gradient comes
// last), if larger than that, is split in two, as the first bucket's cap is applied but from the end:
// its tail (from the last parameter back, up to the one that reaches last_bucket_bytes; the rest keeps
// one at least) becomes a bucket of its own right after the rest, when the rest holds at least
// last_bucket_bytes too. The rest is then reduced while the tail's gradients are computed, instead of
// after backward. (A tail cut within the cap instead would
// often be a lone bias: a layer's bias and weight gradients come in either order.)
std::vector<std::vector<size_t>> assignBuckets(const std::vector<at::Tensor>& params, const std::vector<size_t>& order,
                                               const BucketSizes& sizes);

// n-1, n-2, ..., 0: backward produces the last registered parameters' gradients first.
std::vector<size_t> reverseOrder(size_t n);

}  // namespace dtrain::detail
