// assignBuckets (see buckets.h).
#include "buckets.h"

namespace dtrain::detail {

std::vector<std::vector<size_t>> assignBuckets(const std::vector<at::Tensor>& params, const std::vector<size_t>& order,
                                               const BucketSizes& sizes) {
  std::vector<std::vector<size_t>> groups;
  c10::ScalarType type = c10::ScalarType::Undefined;
  size_t bytes = 0;
  for (size_t i : order) {
    const auto& p = params.at(i);
    const size_t b = static_cast<size_t>(p.numel()) * p.element_size();
    const size_t cap = groups.size() <= 1 ? sizes.first_bucket_bytes : sizes.bucket_bytes;
    if (groups.empty() || type != p.scalar_type() || (bytes + b > cap && !groups.back().empty())) {
      groups.emplace_back();
      type = p.scalar_type();
      bytes = 0;
    }
    groups.back().push_back(i);
    bytes += b;
  }
  return groups;
}

std::vector<size_t> reverseOrder(size_t n) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = n - 1 - i;
  return order;
}

}  // namespace dtrain::detail
