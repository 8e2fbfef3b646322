// Collective algorithms over a Transport. Each is a synchronous free function run by a ProcessGroup's
// worker thread; the algorithm files explain how each works. Counts are in elements.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "comm/transport/transport.h"
#include "dtrain/comm/types.h"

namespace dtrain::comm::algo {

// Everything an algorithm needs: the transport, who we are, the op's label and deadline, and a
// scratch buffer owned by the group (reused across ops).
struct Context {
  transport::Transport* tx;  // null in a world of one, where no algorithm sends anything
  int rank;
  int size;
  transport::Label label;
  transport::Deadline deadline;
  std::vector<uint8_t>& scratch_store;
  // The transport delivers no payload into a user buffer before every rank's call is compared (shm):
  // algorithms that write the output themselves do so only after compareCalls().
  bool guard_output = false;

  void run(std::vector<transport::Op>& ops) { tx->run(ops, deadline, label); }
  // Before writing the output from data received into scratch: every rank's call is this one.
  void compareCalls() { tx->compareCalls(label, deadline); }
  void* scratch(size_t bytes) {
    if (scratch_store.size() < bytes) scratch_store.resize(bytes);
    return scratch_store.data();
  }
};

// Splits count elements into size blocks as evenly as possible (the first count % size get one more).
std::vector<size_t> evenBlocks(size_t count, int size);
std::vector<size_t> prefixOffsets(const std::vector<size_t>& counts);

enum class AllreduceAlgo { kAuto, kRing, kRecursiveDoubling, kDirect };
const char* allreduceAlgoName(AllreduceAlgo a);
// Below this many bytes allreduce uses recursive doubling (latency), above it the ring (bandwidth).
inline constexpr size_t kSmallAllreduceBytes = 32u << 10;

void allreduce(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op,
               AllreduceAlgo algo = AllreduceAlgo::kAuto);
// in == out is in place; out of place never copies in to out.
void allreduceRing(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op);
void allreduceRecursiveDoubling(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op);

void broadcast(Context& c, void* buf, size_t count, DType t, int root);
void reduce(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op, int root);
// out receives every rank's block in rank order; counts[r] is rank r's element count.
void allgatherv(Context& c, const void* in, void* out, const std::vector<size_t>& counts, DType t);
// Ring allgather of blocks already in place in buf (rank r owns block r); used by several algorithms.
void ringAllgatherInPlace(Context& c, void* buf, const std::vector<size_t>& counts, DType t, uint32_t tag0);
// in holds sum(counts) elements; out receives the reduced block of this rank (counts[rank] elements).
void reduceScatterv(Context& c, const void* in, void* out, const std::vector<size_t>& counts, DType t, ReduceOp op);
void alltoall(Context& c, const void* in, void* out, size_t count_per_rank, DType t);
void gather(Context& c, const void* in, void* out, size_t count, DType t, int root);
void scatter(Context& c, const void* in, void* out, size_t count, DType t, int root);
void barrier(Context& c);

}  // namespace dtrain::comm::algo
