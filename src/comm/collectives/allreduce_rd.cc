// Recursive-doubling allreduce, for small buffers (latency).
//
// Recursive doubling (latency-optimal, log2(size) rounds): with p2 the largest power of two <= size,
// the `size - p2` extra ranks first fold their data into a partner (rank - p2) and wait. The p2 ranks
// then run log2(p2) rounds; in round k rank r exchanges its whole buffer with r XOR 2^k and reduces.
// Finally each partner hands the result back to its extra rank. IEEE addition is commutative, so both
// sides of an exchange compute the same bits and every rank ends bit-identical.
#include <cstring>

#include "comm/collectives/collectives.h"
#include "comm/collectives/kernels.h"

namespace dtrain::comm::algo {

using transport::Op;

void allreduceRecursiveDoubling(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op) {
  const int n = c.size, r = c.rank;
  const size_t bytes = count * dtypeSize(t);
  int p2 = 1;
  while (p2 * 2 <= n) p2 *= 2;
  const int extra = n - p2;
  constexpr uint32_t kFoldTag = 1000, kUnfoldTag = 1001;
  std::vector<Op> ops;
  // Where the transport guards outputs (shm), the partial sums live in scratch and reach `out` only at
  // the end: by then this rank has heard, through its partners, from every rank, so comparing every
  // rank's call (which must come before any output is written) costs no wait, and a mismatch leaves
  // `out` untouched. Elsewhere they accumulate in `out` directly.
  if (r >= p2) {  // an extra rank: contribute, then receive the result
    ops = {transport::sendOp(r - p2, kFoldTag, in, bytes)};
    c.run(ops);
    ops = {transport::recvOp(r - p2, kUnfoldTag, out, bytes)};
    c.run(ops);
    return;
  }
  char* acc = c.guard_output ? static_cast<char*>(c.scratch(2 * bytes)) : static_cast<char*>(out);
  char* tmp = c.guard_output ? acc + bytes : static_cast<char*>(c.scratch(bytes));
  const void* mine = in;
  if (r < extra) {
    ops = {recvReduceOp(r + p2, kFoldTag, acc, bytes, t, op, in)};
    ops[0].to_scratch = true;
    c.run(ops);
    mine = acc;
  }
  for (int mask = 1, round = 0; mask < p2; mask <<= 1, ++round) {
    int partner = r ^ mask;
    ops = {transport::sendOp(partner, round, mine, bytes), transport::recvOp(partner, round, tmp, bytes)};
    ops[1].to_scratch = true;
    c.run(ops);
    reduceTo(acc, mine, tmp, count, t, op);
    mine = acc;
  }
  if (op == ReduceOp::avg) divideBy(acc, count, t, n);
  if (r < extra) {
    ops = {transport::sendOp(r + p2, kUnfoldTag, acc, bytes)};
    c.run(ops);
  }
  if (acc != out) {
    c.compareCalls();
    if (bytes) std::memcpy(out, acc, bytes);
  }
}

}  // namespace dtrain::comm::algo
