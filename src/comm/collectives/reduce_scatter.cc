// Reduce-scatter with equal or uneven block sizes: a ring.
//
// In step s (0 .. size-2) every rank sends block (rank - s - 1) to the right and receives block
// (rank - s - 2) from the left, adding its own input's block to it as it arrives into an accumulator;
// the block it sends in step s is the one it accumulated in step s-1 (its own input's in step 0). The
// last step's block is the rank's own, received straight into the output. Every link carries
// (size-1)/size of the input: the bandwidth lower bound. Memory: one or two blocks of scratch, alternately
// written and sent (not a copy of the whole input: FSDP reduce-scatters whole units of parameters'
// gradients, and a unit-sized scratch would be resident for good).
#include <algorithm>
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
  const char* input = static_cast<const char*>(in);
  if (n == 1) {
    if (in != out && off[n]) std::memmove(out, in, off[n] * es);
    return;
  }
  // Step s accumulates into acc[s % 2], the last step into out. When out can hold any block (even
  // blocks: FSDP's) and is not in's own block, out is one of the two: one block of scratch is enough.
  const size_t block = *std::max_element(counts.begin(), counts.end()) * es;
  char* acc[2] = {nullptr, nullptr};
  if (n > 2) {
    const char* o = static_cast<const char*>(out);
    const bool in_place = o >= input && o < input + off[n] * es;  // (then in's block r is needed to the end)
    const bool out_fits = block == counts[r] * es && !in_place;
    char* scratch = static_cast<char*>(c.scratch(out_fits ? block : 2 * block));
    const int last = (n - 2) % 2;  // acc[last] is out's when it fits
    acc[last] = out_fits ? static_cast<char*>(out) : scratch + block;
    acc[1 - last] = scratch;
  }
  const int right = (r + 1) % n, left = (r - 1 + n) % n;
  std::vector<Op> ops(2);
  const char* sending = nullptr;
  for (int s = 0; s < n - 1; ++s) {
    const int sb = (r - s - 1 + 2 * n) % n;
    const int rb = (r - s - 2 + 2 * n) % n;
    char* into = s == n - 2 ? static_cast<char*>(out) : acc[s % 2];
    if (s == 0) sending = input + off[sb] * es;
    ops[0] = transport::sendOp(right, s, sending, counts[sb] * es);
    ops[1] = recvReduceOp(left, s, into, counts[rb] * es, t, op, input + off[rb] * es);
    c.run(ops);
    sending = into;
  }
  if (op == ReduceOp::avg) divideBy(out, counts[r], t, n);
}

}  // namespace dtrain::comm::algo
