// Reduce-scatter with equal or uneven block sizes: a ring.
//
// On a scratch copy of the input, in step s (0 .. size-2) every rank sends block (rank - s - 1) to
// the right and reduces block (rank - s - 2) arriving from the left into its copy. After size-1 steps
// rank r holds the fully reduced block r, which it copies out. Every link carries (size-1)/size of
// the input: the bandwidth lower bound.
#include <cstring>

#include "comm/collectives/collectives.h"
#include "comm/collectives/kernels.h"

namespace dtrain::comm::algo {

using transport::Op;

void reduceScattervRing(Context& c, const void* in, void* out, const std::vector<size_t>& counts, DType t,
                    ReduceOp op) {
  const int n = c.size, r = c.rank;
  const size_t es = dtypeSize(t);
  auto off = prefixOffsets(counts);
  const size_t total = off[n] * es;
  if (n == 1) {
    if (in != out && total) std::memmove(out, in, total);
    return;
  }
  char* work = static_cast<char*>(c.scratch(total));
  if (total) std::memcpy(work, in, total);
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  std::vector<Op> ops(2);
  for (int s = 0; s < n - 1; ++s) {
    int sb = (r - s - 1 + 2 * n) % n;
    int rb = (r - s - 2 + 2 * n) % n;
    ops[0] = transport::sendOp(right, s, work + off[sb] * es, counts[sb] * es);
    ops[1] = recvReduceOp(left, s, work + off[rb] * es, counts[rb] * es, t, op);
    c.run(ops);
  }
  if (op == ReduceOp::avg) divideBy(work + off[r] * es, counts[r], t, n);
  if (counts[r]) std::memcpy(out, work + off[r] * es, counts[r] * es);
}

}  // namespace dtrain::comm::algo
