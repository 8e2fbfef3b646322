// Differentiable collectives (see autograd.h): custom autograd Functions whose forward and backward
// are dtrain::comm collectives on the tensors' own storage.
#include "dtrain/autograd.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "dtrain/comm/error.h"
#include "dtrain/tensor.h"
#include "torch/device/tensor_comm.h"
#include "torch/errors.h"
#include "torch/saved_group.h"

namespace dtrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using detail::saveGroup;  // the group reaches backward as its address (saved_group.h)
using detail::savedGroup;
using detail::shapeText;

// What allGather learns about every rank's input before moving data.
struct GatherLayout {
  std::vector<int64_t> rows;  // dim-0 size of each rank's input
  int64_t row_numel = 1;      // elements per row (product of the other dims, equal on all ranks)
};

// Exchanges (dtype, ndim, rows) and then the trailing dims, and checks that only dim 0 differs. Every
// rank sees the same gathered metadata, so either all ranks throw or none does: the collectives
// that follow stay matched.
GatherLayout exchangeLayout(const at::Tensor& x, comm::ProcessGroup& pg) {
  const int n = pg.size();
  const std::array<int64_t, 3> mine{static_cast<int64_t>(x.scalar_type()), x.dim(), x.size(0)};
  std::vector<int64_t> meta(3 * static_cast<size_t>(n));
  pg.allgather(mine.data(), meta.data(), mine.size(), comm::DType::i64)->wait();

  bool consistent = true;
  for (int j = 0; j < n; ++j) consistent &= meta[3 * j] == mine[0] && meta[3 * j + 1] == mine[1];

  const int64_t trailing = x.dim() - 1;
  std::vector<int64_t> dims;  // rank j's trailing dims at [j * trailing, (j + 1) * trailing)
  if (consistent && trailing > 0) {
    dims.resize(static_cast<size_t>(trailing) * n);
    pg.allgather(x.sizes().data() + 1, dims.data(), trailing, comm::DType::i64)->wait();
    for (int j = 0; j < n; ++j)
      consistent &= std::equal(dims.begin() + j * trailing, dims.begin() + (j + 1) * trailing, x.sizes().begin() + 1);
  }

  if (!consistent) {
    std::string shapes;
    for (int j = 0; j < n; ++j) {
      auto type = static_cast<c10::ScalarType>(meta[3 * j]);
      int64_t ndim = meta[3 * j + 1], rows = meta[3 * j + 2];
      std::string shape;
      if (dims.empty()) {
        shape = fmt::format("{} dims, {} rows", ndim, rows);
      } else {
        std::vector<int64_t> s{rows};
        s.insert(s.end(), dims.begin() + j * trailing, dims.begin() + (j + 1) * trailing);
        shape = shapeText(s);
      }
      shapes += fmt::format("{}rank {}: {} {}", j ? "; " : "", j, c10::toString(type), shape);
    }
    throw InvalidArgument(fmt::format(
        "[rank {}] allGather: inputs must match in dtype and in every dim but dim 0 on all ranks; got {}",
        pg.rank(), shapes));
  }

  GatherLayout layout;
  layout.rows.resize(n);
  for (int j = 0; j < n; ++j) layout.rows[j] = meta[3 * j + 2];
  for (int64_t d = 1; d < x.dim(); ++d) layout.row_numel *= x.size(d);
  return layout;
}

std::vector<size_t> elementCounts(const std::vector<int64_t>& rows, int64_t row_numel) {
  std::vector<size_t> counts(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) counts[j] = static_cast<size_t>(rows[j] * row_numel);
  return counts;
}

// Same sizes as t, except dim 0.
std::vector<int64_t> withRows(const at::Tensor& t, int64_t rows) {
  std::vector<int64_t> s(t.sizes().begin(), t.sizes().end());
  s[0] = rows;
  return s;
}

struct AllGatherFn : torch::autograd::Function<AllGatherFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::ProcessGroup* pg, AllGatherGrad mode) {
    GatherLayout layout = exchangeLayout(x, *pg);
    const int64_t total = std::accumulate(layout.rows.begin(), layout.rows.end(), int64_t{0});
    at::Tensor out = at::empty(withRows(x, total), x.options());
    const auto counts = elementCounts(layout.rows, layout.row_numel);
    const auto dt = toCommDType(x.scalar_type());
    device::onHost(*pg, x, out, [&](const void* in, void* o) { return pg->allgatherv(in, o, counts, dt); })->wait();

    saveGroup(ctx, *pg);
    ctx->saved_data["mode"] = static_cast<int64_t>(mode);
    ctx->saved_data["rows"] = layout.rows;
    ctx->saved_data["row_numel"] = layout.row_numel;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    comm::ProcessGroup& pg = savedGroup(ctx);
    const auto mode = static_cast<AllGatherGrad>(ctx->saved_data.at("mode").toInt());
    const std::vector<int64_t> rows = ctx->saved_data.at("rows").toIntVector();
    const int64_t row_numel = ctx->saved_data.at("row_numel").toInt();
    const int r = pg.rank();
    at::Tensor g = grads[0].contiguous();

    at::Tensor gx;
    if (mode == AllGatherGrad::local) {
      // A view of this rank's rows: no copy, no communication.
      const int64_t offset = std::accumulate(rows.begin(), rows.begin() + r, int64_t{0});
      gx = g.narrow(0, offset, rows[r]);
    } else {
      device::checkTensor(g, "allGather backward: incoming gradient");
      gx = at::empty(withRows(g, rows[r]), g.options());
      const auto counts = elementCounts(rows, row_numel);
      const auto dt = toCommDType(g.scalar_type());
      device::onHost(pg, g, gx, [&](const void* in, void* o) {
        return pg.reduceScatterv(in, o, counts, dt, comm::ReduceOp::sum);
      })->wait();
    }
    // One gradient per forward argument; the group and the mode get none.
    return {gx, at::Tensor(), at::Tensor()};
  }
};

struct AllReduceFn : torch::autograd::Function<AllReduceFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, comm::ProcessGroup* pg, comm::ReduceOp op) {
    at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
    device::allreduce(*pg, x, y, op)->wait();
    saveGroup(ctx, *pg);
    ctx->saved_data["op"] = static_cast<int64_t>(op);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    comm::ProcessGroup& pg = savedGroup(ctx);
    const auto op = static_cast<comm::ReduceOp>(ctx->saved_data.at("op").toInt());
    // y = sum_j x_j gives d(sum_j L_j)/dx_r = sum_j g_j; y = (1/W) sum_j x_j gives (1/W) sum_j g_j:
    // the backward of sum is a sum, the backward of avg an avg. min/max/prod would need the inputs
    // of every rank (argmin masks, products of the others), which nobody keeps here.
    DTRAIN_CHECK(op == comm::ReduceOp::sum || op == comm::ReduceOp::avg, InvalidArgument,
                 "[rank {}] allReduce({}) is not differentiable: only sum and avg have a backward", pg.rank(),
                 comm::reduceOpName(op));
    at::Tensor g = grads[0].contiguous();
    device::checkTensor(g, "allReduce backward: incoming gradient");
    // Out of place: the engine may hand the same gradient buffer to other consumers.
    at::Tensor gx = at::empty_like(g, at::MemoryFormat::Contiguous);
    device::allreduce(pg, g, gx, op)->wait();
    return {gx, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor allGather(const at::Tensor& x, comm::ProcessGroup& pg, AllGatherGrad mode) {
  DTRAIN_CHECK(x.defined() && x.dim() >= 1, InvalidArgument,
               "[rank {}] allGather: input needs at least one dimension (gathered along dim 0)", pg.rank());
  // contiguous() is itself differentiable, so gradients still reach a strided x.
  at::Tensor xc = x.contiguous();
  device::checkTensor(xc, "allGather input");
  return AllGatherFn::apply(xc, &pg, mode);
}

at::Tensor allReduce(const at::Tensor& x, comm::ProcessGroup& pg, comm::ReduceOp op) {
  DTRAIN_CHECK(x.defined(), InvalidArgument, "[rank {}] allReduce: undefined input", pg.rank());
  at::Tensor xc = x.contiguous();
  device::checkTensor(xc, "allReduce input");
  return AllReduceFn::apply(xc, &pg, op);
}

}  // namespace dtrain
