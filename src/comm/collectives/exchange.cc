// Collectives whose data moves directly between each pair: alltoall, gather, scatter; and barrier.
//
// alltoall posts all sends and receives at once (the transport overlaps them), block b of the input
// going to rank b. gather and scatter let the root post one receive or send per rank at once.
// barrier is the dissemination algorithm: in round k every rank signals rank + 2^k and waits for
// rank - 2^k; after ceil(log2(size)) rounds every rank has heard, transitively, from every other.
#include <cstring>

#include "comm/collectives/collectives.h"

namespace dtrain::comm::algo {

using transport::Op;

void alltoall(Context& c, const void* in, void* out, size_t count, DType t) {
  const size_t bytes = count * dtypeSize(t);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  // In-place alltoall: stage the input, since blocks sent and received alias.
  if (in == out && c.size > 1 && bytes) {  // (no bytes: nothing to stage, and scratch may be null)
    char* tmp = static_cast<char*>(c.scratch(bytes * c.size));
    std::memcpy(tmp, in, bytes * c.size);
    src = tmp;
  }
  if (bytes) std::memmove(dst + c.rank * bytes, src + c.rank * bytes, bytes);
  std::vector<Op> ops;
  for (int s = 1; s < c.size; ++s) {
    int to = (c.rank + s) % c.size, from = (c.rank - s + c.size) % c.size;
    ops.push_back(transport::sendOp(to, 0, src + to * bytes, bytes));
    ops.push_back(transport::recvOp(from, 0, dst + from * bytes, bytes));
  }
  if (!ops.empty()) c.run(ops);
}

void gather(Context& c, const void* in, void* out, size_t count, DType t, int root) {
  const size_t bytes = count * dtypeSize(t);
  std::vector<Op> ops;
  if (c.rank == root) {
    char* dst = static_cast<char*>(out);
    if (bytes && dst + root * bytes != in) std::memmove(dst + root * bytes, in, bytes);
    for (int p = 0; p < c.size; ++p)
      if (p != root) ops.push_back(transport::recvOp(p, 0, dst + p * bytes, bytes));
  } else {
    ops.push_back(transport::sendOp(root, 0, in, bytes));
  }
  if (!ops.empty()) c.run(ops);
}

void scatter(Context& c, const void* in, void* out, size_t count, DType t, int root) {
  const size_t bytes = count * dtypeSize(t);
  std::vector<Op> ops;
  if (c.rank == root) {
    const char* src = static_cast<const char*>(in);
    if (bytes && src + root * bytes != out) std::memmove(out, src + root * bytes, bytes);
    for (int p = 0; p < c.size; ++p)
      if (p != root) ops.push_back(transport::sendOp(p, 0, src + p * bytes, bytes));
  } else {
    ops.push_back(transport::recvOp(root, 0, out, bytes));
  }
  if (!ops.empty()) c.run(ops);
}

void barrier(Context& c) {
  std::vector<Op> ops(2);
  for (int k = 1, round = 0; k < c.size; k <<= 1, ++round) {
    ops[0] = transport::sendOp((c.rank + k) % c.size, round, nullptr, 0);
    ops[1] = transport::recvOp((c.rank - k + c.size) % c.size, round, nullptr, 0);
    c.run(ops);
  }
}

}  // namespace dtrain::comm::algo
