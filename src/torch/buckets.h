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
};

// Groups params[i] for i in `order` (each index once) into buckets as PyTorch 1.13's DDP does
// (compute_bucket_assignment_by_size): each dtype has its own open bucket (a bucket is one flat tensor);
// a parameter joins its dtype's bucket, and the bucket closes once it holds at least its cap, so the
// parameter that reaches the cap is still in it (a parameter larger than the cap closes a bucket of
// its own, or with what was open). The cap is first_bucket_bytes for a dtype's first bucket and
// bucket_bytes after. Buckets come in the order they closed, then the ones left open in the order of
// their first parameter. Returns parameter indices per bucket, each in the given order.
std::vector<std::vector<size_t>> assignBuckets(const std::vector<at::Tensor>& params, const std::vector<size_t>& order,
                                               const BucketSizes& sizes);

// n-1, n-2, ..., 0: backward produces the last registered parameters' gradients first.
std::vector<size_t> reverseOrder(size_t n);

}  // namespace dtrain::detail
