// Direct allreduce over a transport's staging area (shared memory), chunk by chunk, with
// Staging::slots() chunks in flight:
//   1. each rank copies its input chunk into its staging chunk, except its own slice, which nobody
//      else reads, and marks it ready;
//   2. when every rank's chunk is staged, rank r reduces slice r: its own input slice op every
//      other rank's staged slice, written to its output and to the shared result chunk;
//   3. when every slice is reduced, each rank copies the other slices of the result to its output.
// A rank moves about (4(n-1)/n + 1 + 2/n) chunk-sizes of memory per chunk, against ~9(n-1)/n for a
// ring over the pair queues, and waits twice per chunk instead of 2(n-1) times in a chain, which
// matters most when ranks outnumber cores. Each slice has a single reducer, so every rank ends with
// the same bits. The first wait on staged inputs also compares every rank's call (Staging::waitFor
// with calls): nothing was written to an output before it, so a mismatch leaves every output untouched.
//
// Small buffers (at most kOneShotMaxBytes, one chunk) take a one-wait path instead: every rank stages
// its whole input and, once all are staged, reduces all n of them itself in rank order, so every rank
// computes the same bits. One wait per call instead of two and no result chunk: at these sizes the
// waits are the cost (each is a cache line crossing cores, or a wake-up), not the n-fold reduction.
#include <algorithm>
#include <cstring>

#include "comm/collectives/collectives.h"
#include "comm/collectives/kernels.h"

namespace dtrain::comm::algo {

using transport::Staging;

namespace {

// 4 KiB at world 2 on the 2-core VM: see docs/PERFORMANCE.md, "Small-message tails".
constexpr size_t kOneShotMaxBytes = 16u << 10;

void allreduceOneShot(Context& c, Staging& st, const void* in, void* out, size_t count, DType t, ReduceOp op) {
  const int n = c.size;
  const size_t bytes = count * dtypeSize(t);
  const uint64_t g = st.nextChunk();
  const uint64_t slots = st.slots();
  const uint64_t slot = (g - 1) % slots;
  if (g > slots) st.waitFor(Staging::kDone, g - slots, c.deadline, c.label, "to finish an earlier chunk");
  std::memcpy(st.chunk(slot, c.rank), in, bytes);
  st.publish(Staging::kInReady, g);
  st.waitFor(Staging::kInReady, g, c.deadline, c.label, "to stage its input", /*calls=*/true);
  reduceTo(out, st.chunk(slot, 0), st.chunk(slot, 1), count, t, op);
  for (int q = 2; q < n; ++q) reduceTo(out, out, st.chunk(slot, q), count, t, op);
  if (op == ReduceOp::avg) divideBy(out, count, t, n);
  st.publish(Staging::kDone, g);
  // What the peers read of this rank's: its staged input, once each.
  bytes_sent.fetch_add(bytes * static_cast<size_t>(n - 1), std::memory_order_relaxed);
}

}  // namespace

void allreduceDirect(Context& c, Staging& st, const void* in, void* out, size_t count, DType t, ReduceOp op) {
  const size_t es = dtypeSize(t);
  if (count > 0 && count * es <= std::min(kOneShotMaxBytes, st.chunkBytes())) {
    return allreduceOneShot(c, st, in, out, count, t, op);
  }
  const int n = c.size, me = c.rank;
  const size_t chunk_elems = std::max<size_t>(st.chunkBytes() / es, 1);
  const uint64_t slots = st.slots();
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  std::vector<size_t> sl(n + 1);
  bool first_wait = true;
  // What the peers read of this rank's (bytesSent()): its staged input but its own slice, and its
  // reduced slice once per peer; 2 (n - 1) / n of the buffer, as a ring sends.
  size_t shared = 0;
  for (size_t off = 0; off < count; off += chunk_elems) {
    const size_t len = std::min(chunk_elems, count - off);
    const uint64_t g = st.nextChunk();
    const uint64_t slot = (g - 1) % slots;
    for (int q = 0; q <= n; ++q) sl[q] = len * q / n;  // slice q is [sl[q], sl[q+1])
    char* result = st.chunk(slot, n);
    // 1. The slot is free once every rank finished chunk g - slots.
    if (g > slots) st.waitFor(Staging::kDone, g - slots, c.deadline, c.label, "to finish an earlier chunk");
    const char* mine = src + off * es;
    char* staged_mine = st.chunk(slot, me);
    std::memcpy(staged_mine, mine, sl[me] * es);
    std::memcpy(staged_mine + sl[me + 1] * es, mine + sl[me + 1] * es, (len - sl[me + 1]) * es);
    st.publish(Staging::kInReady, g);
    // 2. Reduce my slice once every rank's input is staged (and, the first time, its call compared).
    st.waitFor(Staging::kInReady, g, c.deadline, c.label, "to stage its input", first_wait);
    first_wait = false;
    const size_t a = sl[me], cnt = sl[me + 1] - sl[me];
    shared += (len - cnt + static_cast<size_t>(n - 1) * cnt) * es;
    char* res = dst + (off + a) * es;
    bool first = true;
    for (int q = 0; q < n; ++q) {
      if (q == me) continue;
      reduceTo(res, first ? mine + a * es : res, st.chunk(slot, q) + a * es, cnt, t, op);
      first = false;
    }
    if (op == ReduceOp::avg) divideBy(res, cnt, t, n);
    std::memcpy(result + a * es, res, cnt * es);
    st.publish(Staging::kOutReady, g);
    // 3. Gather the other slices.
    st.waitFor(Staging::kOutReady, g, c.deadline, c.label, "to reduce its slice");
    char* o = dst + off * es;
    std::memcpy(o, result, a * es);
    std::memcpy(o + sl[me + 1] * es, result + sl[me + 1] * es, (len - sl[me + 1]) * es);
    st.publish(Staging::kDone, g);
  }
  bytes_sent.fetch_add(shared, std::memory_order_relaxed);
}

}  // namespace dtrain::comm::algo
