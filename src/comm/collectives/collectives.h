// Collective algorithms over a Transport. Each is a synchronous free function run by a ProcessGroup's
// worker thread; the algorithm files explain how each works. Counts are in elements.
//
// The entry points (allreduce, broadcast, reduce, ...) pick an algorithm in select.cc, the one place
// where sizes, transports and topology decide; the algorithms themselves (allreduce_ring.cc,
// allreduce_rd.cc, allreduce_direct.cc, broadcast.cc, ...) never choose.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/collectives/kernels.h"
#include "comm/trace/trace_internal.h"
#include "comm/transport/transport.h"
#include "dtrain/comm/types.h"

namespace dtrain::comm::algo {

// Payload bytes this process sent through Context::run (comm::bytesSent(); src/comm/group/counters.cc).
extern std::atomic<uint64_t> bytes_sent;

// A group's hosts, for the hierarchical algorithms (hierarchical.cc): made at group creation when the
// group spans more than one host, owned by the group, used by one op at a time.
struct Hierarchy {
  std::vector<std::vector<int>> hosts;  // the group ranks of each host, hosts in order of their lowest rank
  int host = 0;                         // this rank's host (index into hosts)
  int local_rank = 0;                   // this rank's index on its host
  int shards = 1;                       // the most ranks on any host: the buffer is cut into this many shards
  std::shared_ptr<Store> local_store;
  std::unique_ptr<transport::Transport> local;  // shm among this host's ranks; null when alone on its host
  std::vector<uint8_t> local_scratch, cross_scratch, shard, packed;
  bool someHostShared() const { return shards > 1; }
};

// Publishes this rank's transport::hostId() and the group's allreduce algorithm under "host/<rank>" and
// returns every rank's host id, in rank order. need_one_host (DTRAIN_TRANSPORT=shm): RendezvousError
// naming the ranks on other hosts, if any. Ranks that force different algorithms: InvalidArgument
// naming both (they would otherwise wait for each other in different algorithms until the deadline).
std::vector<std::string> exchangeHostIds(Store& store, int rank, int size, bool need_one_host,
                                         AllreduceAlgorithm group_algo);
// Groups the ranks by host id (every rank's, in rank order) and connects this host's ranks over shm
// (through `store`, under "hier/host<k>/"); nullptr when all ranks are on one host.
std::unique_ptr<Hierarchy> makeHierarchy(const std::shared_ptr<Store>& store, int rank,
                                         const std::vector<std::string>& host_ids,
                                         const transport::TransportOptions& opts);

// The size thresholds of the automatic allreduce choice (select.cc): these defaults, or a group's own
// after DTRAIN_TUNE probed them (src/comm/group/tune.cc).
struct Thresholds {
  // Messages (no staging area): recursive doubling up to this many bytes, the ring above.
  size_t rd_max_bytes = 32u << 10;
  // A staging area with more ranks than cores: recursive doubling up to this many bytes, direct above
  // (4 ranks on 2 cores, 4 KiB: 39 us against 47).
  size_t direct_oversubscribed_min_bytes = 16u << 10;
};

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
  // The algorithm the entry point chose (select.cc), for traces and the flight recorder.
  const char* algorithm = "";
  // The group's hosts when it spans several (see Hierarchy); null otherwise and in the stages' contexts.
  Hierarchy* hier = nullptr;
  // The group's thresholds; null: the defaults.
  const Thresholds* thresholds = nullptr;

  // A stage's context (hierarchical.cc): its ranks as the group's, so that traces name the real peers.
  const std::vector<int>* group_ranks = nullptr;

  void run(std::vector<transport::Op>& ops) {
    const bool traced = trace::timeline::on();  // flow events: this rank's sends meet the peers' receives
    std::vector<transport::Op> named;
    if (traced && group_ranks) {
      named = ops;
      for (auto& op : named) op.peer = (*group_ranks)[static_cast<size_t>(op.peer)];
    }
    const std::vector<transport::Op>& seen = group_ranks ? named : ops;
    if (traced) trace::timeline::sending(seen);
    tx->run(ops, deadline, label);
    if (traced) trace::timeline::received(seen);
    uint64_t sent = 0;
    for (const auto& op : ops) sent += op.kind == transport::Op::kSend ? op.bytes : 0;
    bytes_sent.fetch_add(sent, std::memory_order_relaxed);
  }
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

// A receive that reduces its payload into `data` (see transport::Op::reduce) with dtrain's kernels:
// data[i] = operand[i] (op) payload[i], operand defaulting to data (in place).
inline transport::Op recvReduceOp(int peer, uint32_t tag, void* data, size_t bytes, DType t, ReduceOp r,
                                  const void* operand = nullptr) {
  return transport::Op{transport::Op::kRecv, peer, tag, data, bytes, &reduceTo, t, r, operand};
}

// ---- Entry points: choose (select.cc), then run one of the algorithms below. ----
// `algo` is what the caller asked for; automatic, or direct where the transport has no staging area,
// leaves the choice to select.cc.
void allreduce(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op,
               AllreduceAlgorithm algo = AllreduceAlgorithm::automatic);
void broadcast(Context& c, void* buf, size_t count, DType t, int root);
void reduce(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op, int root);
// The algorithm allreduce runs for this call on this group (the same on every rank).
AllreduceAlgorithm chooseAllreduce(const Context& c, size_t count, DType t, AllreduceAlgorithm asked);
// DTRAIN_ALGO's value: auto, ring, recursive_doubling (or rd), direct, hierarchical; InvalidArgument
// naming the variable otherwise.
AllreduceAlgorithm parseAllreduceAlgorithm(const std::string& s);

// ---- Algorithms. in == out is in place; out of place never copies in to out. ----
void allreduceRing(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op);
void allreduceRecursiveDoubling(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op);
void allreduceDirect(Context& c, transport::Staging& st, const void* in, void* out, size_t count, DType t,
                     ReduceOp op);
void allreduceHierarchical(Context& c, Hierarchy& h, const void* in, void* out, size_t count, DType t, ReduceOp op);
void broadcastHierarchical(Context& c, Hierarchy& h, void* buf, size_t count, DType t, int root);
void broadcastTree(Context& c, void* buf, size_t count, DType t, int root);
void broadcastScatterAllgather(Context& c, void* buf, size_t count, DType t, int root);
void reduceTree(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op, int root);
void reduceRing(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op, int root);
// out receives every rank's block in rank order; counts[r] is rank r's element count. An entry point
// (select.cc): the ring, or hierarchical across hosts.
void allgatherv(Context& c, const void* in, void* out, const std::vector<size_t>& counts, DType t);
void allgathervRing(Context& c, const void* in, void* out, const std::vector<size_t>& counts, DType t);
void allgathervHierarchical(Context& c, Hierarchy& h, const void* in, void* out, const std::vector<size_t>& counts,
                            DType t);
// Ring allgather of blocks already in place in buf (rank r owns block r); used by several algorithms.
void ringAllgatherInPlace(Context& c, void* buf, const std::vector<size_t>& counts, DType t, uint32_t tag0);
// in holds sum(counts) elements; out receives the reduced block of this rank (counts[rank] elements).
// An entry point (select.cc): the ring, or hierarchical across hosts.
void reduceScatterv(Context& c, const void* in, void* out, const std::vector<size_t>& counts, DType t, ReduceOp op);
void reduceScattervRing(Context& c, const void* in, void* out, const std::vector<size_t>& counts, DType t, ReduceOp op);
void reduceScattervHierarchical(Context& c, Hierarchy& h, const void* in, void* out, const std::vector<size_t>& counts,
                                DType t, ReduceOp op);
void alltoall(Context& c, const void* in, void* out, size_t count_per_rank, DType t);
void gather(Context& c, const void* in, void* out, size_t count, DType t, int root);
void scatter(Context& c, const void* in, void* out, size_t count, DType t, int root);
void barrier(Context& c);

}  // namespace dtrain::comm::algo
