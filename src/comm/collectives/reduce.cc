// Reduce to root.
//
// Small buffers: a binomial tree toward the root. With vr = rank - root, in round k a rank whose bit k
// is set sends its partial result to vr - 2^k and stops; otherwise it reduces what vr + 2^k sends
// (as it arrives) into its accumulator. ceil(log2(size)) rounds.
// Large buffers: a ring reduce-scatter leaves rank b with the reduced block b, then every rank sends
// its block to the root (a gather): each link carries about one buffer in all.
#include <cstring>

#include "comm/collectives/collectives.h"
#include "comm/collectives/kernels.h"

namespace dtrain::comm::algo {

using transport::Op;

void reduceTree(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op, int root) {
  const int n = c.size, r = c.rank;
  const size_t bytes = count * dtypeSize(t);
  std::vector<Op> ops;
  // The root accumulates in out; others in scratch.
  void* acc = r == root ? out : c.scratch(bytes);
  if (acc != in && bytes) std::memmove(acc, in, bytes);
  const int vr = (r - root + n) % n;
  for (int mask = 1; mask < n; mask <<= 1) {
    if (vr & mask) {
      ops = {transport::sendOp((vr - mask + root) % n, 0, acc, bytes)};
      c.run(ops);
      return;
    }
    if (vr + mask < n) {
      ops = {recvReduceOp((vr + mask + root) % n, 0, acc, bytes, t, op)};
      c.run(ops);
    }
  }
  if (op == ReduceOp::avg) divideBy(out, count, t, n);
}

void reduceRing(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op, int root) {
  const int n = c.size, r = c.rank;
  const size_t es = dtypeSize(t);
  const size_t bytes = count * es;
  std::vector<Op> ops;
  auto counts = evenBlocks(count, n);
  auto off = prefixOffsets(counts);
  // Reduce-scatter in place on a scratch copy (the root may use out itself).
  char* work = static_cast<char*>(r == root ? out : c.scratch(bytes));
  if (work != in) std::memmove(work, in, bytes);
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  ops.resize(2);
  for (int s = 0; s < n - 1; ++s) {
    int sb = (r - s - 1 + 2 * n) % n;
    int rb = (r - s - 2 + 2 * n) % n;
    ops[0] = transport::sendOp(right, s, work + off[sb] * es, counts[sb] * es);
    ops[1] = recvReduceOp(left, s, work + off[rb] * es, counts[rb] * es, t, op);
    c.run(ops);
  }
  ops.clear();
  if (r == root) {
    for (int b = 0; b < n; ++b)
      if (b != root) ops.push_back(transport::recvOp(b, n, work + off[b] * es, counts[b] * es));
  } else {
    ops.push_back(transport::sendOp(root, n, work + off[r] * es, counts[r] * es));
  }
  c.run(ops);
  if (r == root && op == ReduceOp::avg) divideBy(out, count, t, n);
}

}  // namespace dtrain::comm::algo
