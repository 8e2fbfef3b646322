// Ring allreduce (bandwidth-optimal for large buffers).
//
// The buffer is cut into `size` blocks. Phase 1, reduce-scatter: in step s (0 .. size-2) every rank
// sends block (rank - s - 1) to its right neighbour and reduces the block (rank - s - 2) arriving from
// its left neighbour into its own copy; after size-1 steps rank r holds the fully reduced block r.
// Phase 2, allgather: in step s every rank sends block (rank - s) to the right and stores the block
// (rank - s - 1) arriving from the left. Each rank sends and receives 2 (size-1)/size of the buffer,
// the lower bound. Receives reduce as bytes arrive (the transport pipelines them), so a step costs
// about one pass over a block. For avg each rank divides its own reduced block once, before phase 2,
// so every rank ends with bit-identical results.
#include "comm/collectives/collectives.h"
#include "comm/collectives/kernels.h"

namespace dtrain::comm::algo {

using transport::Op;

std::vector<size_t> evenBlocks(size_t count, int size) {
  std::vector<size_t> b(size, count / size);
  for (size_t i = 0; i < count % size; ++i) ++b[i];
  return b;
}

std::vector<size_t> prefixOffsets(const std::vector<size_t>& counts) {
  std::vector<size_t> off(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) off[i + 1] = off[i] + counts[i];
  return off;
}

void ringAllgatherInPlace(Context& c, void* buf, const std::vector<size_t>& counts, DType t, uint32_t tag0) {
  const int n = c.size, r = c.rank;
  const size_t es = dtypeSize(t);
  auto off = prefixOffsets(counts);
  char* base = static_cast<char*>(buf);
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  std::vector<Op> ops(2);
  for (int s = 0; s < n - 1; ++s) {
    int sb = (r - s + n) % n;
    int rb = (r - s - 1 + 2 * n) % n;
    ops[0] = transport::sendOp(right, tag0 + s, base + off[sb] * es, counts[sb] * es);
    ops[1] = transport::recvOp(left, tag0 + s, base + off[rb] * es, counts[rb] * es);
    c.run(ops);
  }
}

void allreduceRing(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op) {
  const int n = c.size, r = c.rank;
  const size_t es = dtypeSize(t);
  auto counts = evenBlocks(count, n);
  auto off = prefixOffsets(counts);
  char* base = static_cast<char*>(out);
  const char* src = static_cast<const char*>(in);
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  std::vector<Op> ops(2);
  // Out of place, the input is never copied to the output: step 0 sends straight from the input, and
  // each receive reduces (input block op arriving block) into the output block. Each rank receives
  // every block but (rank - 1) exactly once here, and the allgather overwrites all blocks but its own.
  for (int s = 0; s < n - 1; ++s) {
    int sb = (r - s - 1 + 2 * n) % n;
    int rb = (r - s - 2 + 2 * n) % n;
    const char* from = s == 0 ? src : base;
    ops[0] = transport::sendOp(right, s, from + off[sb] * es, counts[sb] * es);
    ops[1] = recvReduceOp(left, s, base + off[rb] * es, counts[rb] * es, t, op, src + off[rb] * es);
    c.run(ops);
  }
  if (op == ReduceOp::avg) divideBy(base + off[r] * es, counts[r], t, n);
  ringAllgatherInPlace(c, out, counts, t, static_cast<uint32_t>(n));
}

}  // namespace dtrain::comm::algo
