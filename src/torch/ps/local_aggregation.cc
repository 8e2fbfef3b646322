// Local aggregation: the workers of one host sum their gradients (and gather their rows) over the
// local group before the host's local rank 0 talks to the servers (see include/dtrain/ps.h).
#include <ATen/ATen.h>

#include <vector>

#include "worker_impl.h"

namespace dtrain::ps {

// The sum (on local rank 0) of the local workers' g; the mean unless the update is sum_only.
at::Tensor localSum(comm::ProcessGroup& local, const at::Tensor& g, const PSOptions& o) {
  const bool root = local.rank() == 0;
  at::Tensor sum = root ? at::empty_like(g) : at::Tensor();
  local.reduce(g.data_ptr<float>(), root ? sum.data_ptr<float>() : nullptr, static_cast<size_t>(g.numel()),
               DType::f32, comm::ReduceOp::sum, 0)->wait();
  if (root && o.update != PSOptions::Update::sum_only) sum.div_(static_cast<double>(local.size()));
  return sum;
}
at::Tensor localUsed(comm::ProcessGroup& local, const at::Tensor& used) {
  const bool root = local.rank() == 0;
  auto mine = used.to(at::kFloat).contiguous();
  at::Tensor sum = root ? at::empty_like(mine) : at::Tensor();
  local.reduce(mine.data_ptr<float>(), root ? sum.data_ptr<float>() : nullptr, static_cast<size_t>(mine.numel()),
               DType::f32, comm::ReduceOp::sum, 0)->wait();
  return root ? sum.gt(0).to(at::kByte) : at::Tensor();
}

// Every local worker's rows (and, with grads, their rows' gradients), concatenated in local-rank order.
// Returns the offset of this worker's rows.
int64_t localRows(comm::ProcessGroup& local, const at::Tensor& ids, const at::Tensor* grads, int64_t dim,
                  at::Tensor& all_ids, at::Tensor* all_grads) {
  const size_t L = static_cast<size_t>(local.size());
  int64_t n = ids.numel();
  std::vector<int64_t> counts(L);
  local.allgather(&n, counts.data(), 1, DType::i64)->wait();
  std::vector<size_t> c(L), cd(L);
  int64_t total = 0, offset = 0;
  for (size_t r = 0; r < L; ++r) {
    if (static_cast<int>(r) == local.rank()) offset = total;
    c[r] = static_cast<size_t>(counts[r]);
    cd[r] = static_cast<size_t>(counts[r] * dim);
    total += counts[r];
  }
  all_ids = at::empty({total}, at::kLong);
  local.allgatherv(ids.data_ptr<int64_t>(), all_ids.data_ptr<int64_t>(), c, DType::i64)->wait();
  if (grads) {
    *all_grads = at::empty({total, dim}, at::kFloat);
    local.allgatherv(grads->data_ptr<float>(), all_grads->data_ptr<float>(), cd, DType::f32)->wait();
  }
  return offset;
}

}  // namespace dtrain::ps
