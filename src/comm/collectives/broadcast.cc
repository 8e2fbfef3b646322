// Broadcast from root.
//
// Small buffers: a binomial tree. With ranks renumbered so the root is 0 (vr = rank - root), a rank
// receives from vr minus its lowest set bit, then forwards to vr + 2^k for each smaller power of two:
// ceil(log2(size)) rounds, each sending the whole buffer.
// Large buffers: scatter, then allgather (van de Geijn). The root sends block b to rank b, then a ring
// allgather completes every copy. The root sends about one buffer in all instead of log2(size), and
// every link carries (size-1)/size of it.
#include "comm/collectives/collectives.h"

namespace dtrain::comm::algo {

using transport::Op;

void broadcastTree(Context& c, void* buf, size_t count, DType t, int root) {
  const int n = c.size, r = c.rank;
  const size_t bytes = count * dtypeSize(t);
  std::vector<Op> ops;
  const int vr = (r - root + n) % n;
  int mask = 1;
  while (mask < n) {
    if (vr & mask) {
      ops = {transport::recvOp((vr - mask + root) % n, 0, buf, bytes)};
      c.run(ops);
      break;
    }
    mask <<= 1;
  }
  ops.clear();
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (vr + mask < n) ops.push_back(transport::sendOp((vr + mask + root) % n, 0, buf, bytes));
  }
  if (!ops.empty()) c.run(ops);
}

void broadcastScatterAllgather(Context& c, void* buf, size_t count, DType t, int root) {
  const int n = c.size, r = c.rank;
  const size_t es = dtypeSize(t);
  std::vector<Op> ops;
  auto counts = evenBlocks(count, n);
  auto off = prefixOffsets(counts);
  char* base = static_cast<char*>(buf);
  if (r == root) {
    for (int b = 0; b < n; ++b)
      if (b != root) ops.push_back(transport::sendOp(b, 0, base + off[b] * es, counts[b] * es));
  } else {
    ops.push_back(transport::recvOp(root, 0, base + off[r] * es, counts[r] * es));
  }
  c.run(ops);
  ringAllgatherInPlace(c, buf, counts, t, 1);
}

}  // namespace dtrain::comm::algo
