// assignBuckets (see buckets.h): PyTorch 1.13's compute_bucket_assignment_by_size, with the
// parameters' indices given in the order their gradients are expected.
#include "buckets.h"

#include <algorithm>

namespace dtrain::detail {

namespace {
// The last-bucket rule (see buckets.h): the bucket holding `last` is split after its head.
void splitLast(std::vector<std::vector<size_t>>& groups, const std::vector<at::Tensor>& params, size_t last,
               size_t cap) {
  auto it = std::find_if(groups.begin(), groups.end(), [&](const std::vector<size_t>& g) { return g.back() == last; });
  if (it == groups.end() || it->size() < 2) return;
  size_t total = 0;
  for (size_t i : *it) total += params.at(i).nbytes();
  if (total <= cap) return;
  // From the last parameter back, up to the one that reaches the cap; the head keeps one at least.
  size_t bytes = 0, tail = it->size();
  while (tail > 1 && bytes < cap) bytes += params.at((*it)[--tail]).nbytes();
  if (total - bytes < cap) return;  // what would go first is smaller than the cap: nothing gained
  std::vector<size_t> back(it->begin() + static_cast<std::ptrdiff_t>(tail), it->end());
  it->resize(tail);
  groups.insert(it + 1, std::move(back));
}
}  // namespace

std::vector<std::vector<size_t>> assignBuckets(const std::vector<at::Tensor>& params, const std::vector<size_t>& order,
                                               const BucketSizes& sizes) {
  struct Open {
    c10::ScalarType type;
    std::vector<size_t> indices;
    size_t bytes = 0;
    size_t closed = 0;  // buckets of this dtype closed so far: the first has the first bucket's cap
    size_t first_at = 0;  // position in `order` of its first parameter (orders the leftovers)
  };
  std::vector<std::vector<size_t>> groups;
  std::vector<Open> open;  // one accumulating bucket per dtype
  for (size_t pos = 0; pos < order.size(); ++pos) {
    const size_t i = order[pos];
    const auto& p = params.at(i);
    auto it = std::find_if(open.begin(), open.end(), [&](const Open& o) { return o.type == p.scalar_type(); });
    if (it == open.end()) it = open.insert(open.end(), Open{p.scalar_type(), {}, 0, 0, 0});
    if (it->indices.empty()) it->first_at = pos;
    it->indices.push_back(i);
    it->bytes += p.nbytes();
    const size_t cap = it->closed == 0 ? sizes.first_bucket_bytes : sizes.bucket_bytes;
    if (it->bytes >= cap) {  // closed on reaching its cap, with the parameter that reached it
      groups.push_back(std::move(it->indices));
      it->indices.clear();
      it->bytes = 0;
      ++it->closed;
    }
  }
  std::sort(open.begin(), open.end(), [](const Open& a, const Open& b) { return a.first_at < b.first_at; });
  for (auto& o : open)
    if (!o.indices.empty()) groups.push_back(std::move(o.indices));
  if (sizes.last_bucket_bytes > 0 && !order.empty()) splitLast(groups, params, order.back(), sizes.last_bucket_bytes);
  return groups;
}

std::vector<size_t> reverseOrder(size_t n) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = n - 1 - i;
  return order;
}

}  // namespace dtrain::detail
