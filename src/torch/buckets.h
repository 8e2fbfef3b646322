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

// Groups params[i] for i in `order` (each index once) into buckets, keeping that order: a parameter
// starts a new bucket when its dtype differs from the bucket's (a bucket is one flat tensor) or when
// it would take a non-empty bucket past its cap (first_bucket_bytes for bucket 0, bucket_bytes after).
// A parameter larger than the cap gets a bucket of its own. Returns parameter indices per bucket.
std::vector<std::vector<size_t>> assignBuckets(const std::vector<at::Tensor>& params, const std::vector<size_t>& order,
                                               const BucketSizes& sizes);

// n-1, n-2, ..., 0: backward produces the last registered parameters' gradients first.
std::vector<size_t> reverseOrder(size_t n);

}  // namespace dtrain::detail
