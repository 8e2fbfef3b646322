// Every algorithm choice of the collectives, in one place: which algorithm runs for a call, given its
// size, the group and the transport. Every rank computes the same answer from the same inputs (sizes
// and the transport's properties, which the ranks agreed on when it was built), so all ranks run the
// same algorithm. Where a forced choice cannot apply (direct without a staging area), the automatic
// choice among the others is made instead. New families (compressed) join here.
#include <cstring>

#include "dtrain/comm/error.h"

#include "comm/collectives/collectives.h"

namespace dtrain::comm::algo {

namespace {

// Allreduce over messages: up to Thresholds::rd_max_bytes, recursive doubling (latency: log2(n) rounds
// of the whole buffer); above it, the ring (bandwidth: 2(n-1)/n of the buffer per link). Direct allreduce
// over a staging area: always, except when ranks outnumber cores and the buffer is at most
// Thresholds::direct_oversubscribed_min_bytes, where recursive doubling's log2(n) exchanges beat three
// rounds of waiting on every rank. (collectives.h has the defaults; DTRAIN_TUNE probes a group's own.)
const Thresholds kDefaultThresholds;
// Broadcast and reduce: at most this many bytes, a binomial tree; above, scatter/reduce-scatter + ring.
constexpr size_t kTreeMaxBytes = 64u << 10;

bool smallForTree(const Context& c, size_t count, DType t) {
  return count * dtypeSize(t) <= kTreeMaxBytes || count < static_cast<size_t>(c.size);
}

}  // namespace

AllreduceAlgorithm chooseAllreduce(const Context& c, size_t count, DType t, AllreduceAlgorithm asked) {
  const size_t bytes = count * dtypeSize(t);
  const Thresholds& limits = c.thresholds ? *c.thresholds : kDefaultThresholds;
  // A group across hosts: in stages (shm within each host, tcp across) whenever some host has more than
  // one rank, since then the stages keep (L-1)/L of the flat ring's cross-host traffic inside the hosts
  // and their latency is log2(hosts) tcp rounds instead of log2(ranks). Forced, it runs on any layout
  // across hosts (one rank per host: the cross-host stage alone).
  if (c.hier && (asked == AllreduceAlgorithm::hierarchical ||
                 (asked == AllreduceAlgorithm::automatic && c.hier->someHostShared()))) {
    return AllreduceAlgorithm::hierarchical;
  }
  if (asked == AllreduceAlgorithm::ring || asked == AllreduceAlgorithm::recursive_doubling) return asked;
  if (c.tx && c.tx->staging() &&
      (asked == AllreduceAlgorithm::direct || !c.tx->oversubscribed() || bytes > limits.direct_oversubscribed_min_bytes)) {
    return AllreduceAlgorithm::direct;
  }
  return bytes <= limits.rd_max_bytes || count < static_cast<size_t>(c.size)
             ? AllreduceAlgorithm::recursive_doubling
             : AllreduceAlgorithm::ring;
}

void allreduce(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op, AllreduceAlgorithm algo) {
  if (c.size == 1) {
    if (in != out && count) std::memmove(out, in, count * dtypeSize(t));  // avg over one rank: identity
    return;
  }
  switch (chooseAllreduce(c, count, t, algo)) {
    case AllreduceAlgorithm::direct:
      c.algorithm = "direct";
      return allreduceDirect(c, *c.tx->staging(), in, out, count, t, op);
    case AllreduceAlgorithm::hierarchical:
      c.algorithm = "hierarchical";
      return allreduceHierarchical(c, *c.hier, in, out, count, t, op);
    case AllreduceAlgorithm::ring:
      c.algorithm = "ring";
      return allreduceRing(c, in, out, count, t, op);
    default:
      c.algorithm = "recursive_doubling";
      return allreduceRecursiveDoubling(c, in, out, count, t, op);
  }
}

AllreduceAlgorithm parseAllreduceAlgorithm(const std::string& s) {
  for (auto a : {AllreduceAlgorithm::automatic, AllreduceAlgorithm::ring, AllreduceAlgorithm::recursive_doubling,
                 AllreduceAlgorithm::direct, AllreduceAlgorithm::hierarchical}) {
    if (s == allreduceAlgorithmName(a)) return a;
  }
  if (s == "recursive_doubling") return AllreduceAlgorithm::recursive_doubling;
  throw InvalidArgument(
      fmt::format("DTRAIN_ALGO='{}' (expected auto, ring, recursive_doubling (or rd), direct or hierarchical)", s));
}

void broadcast(Context& c, void* buf, size_t count, DType t, int root) {
  if (c.size == 1) return;
  // Across hosts with several ranks on some host: the root's data crosses to each other host once, then
  // spreads within each host over shm (the tree's and the scatter-allgather's cross-host rounds and
  // bytes both shrink).
  if (c.hier && c.hier->someHostShared()) {
    c.algorithm = "hierarchical";
    broadcastHierarchical(c, *c.hier, buf, count, t, root);
    return;
  }
  if (smallForTree(c, count, t)) {
    c.algorithm = "tree";
    broadcastTree(c, buf, count, t, root);
  } else {
    c.algorithm = "scatter_allgather";
    broadcastScatterAllgather(c, buf, count, t, root);
  }
}

void allgatherv(Context& c, const void* in, void* out, const std::vector<size_t>& counts, DType t) {
  // Across hosts with several ranks on some host: each host's blocks cross the host links once as one
  // bundle (a host link carries (hosts-1)/hosts of the output instead of the flat ring's (n-1)/n).
  if (c.hier && c.hier->someHostShared()) {
    c.algorithm = "hierarchical";
    allgathervHierarchical(c, *c.hier, in, out, counts, t);
    return;
  }
  c.algorithm = "ring";
  allgathervRing(c, in, out, counts, t);
}

void reduceScatterv(Context& c, const void* in, void* out, const std::vector<size_t>& counts, DType t, ReduceOp op) {
  // Across hosts with several ranks on some host: the host links carry (hosts-1)/hosts of the input
  // instead of (n-1)/n. (Stages within a host, c.hier null, take the ring.)
  if (c.hier && c.hier->someHostShared()) {
    c.algorithm = "hierarchical";
    reduceScattervHierarchical(c, *c.hier, in, out, counts, t, op);
    return;
  }
  c.algorithm = "ring";
  reduceScattervRing(c, in, out, counts, t, op);
}

void reduce(Context& c, const void* in, void* out, size_t count, DType t, ReduceOp op, int root) {
  if (c.size == 1) {
    if (in != out && count) std::memmove(out, in, count * dtypeSize(t));
    return;
  }
  if (smallForTree(c, count, t)) {
    c.algorithm = "tree";
    reduceTree(c, in, out, count, t, op, root);
  } else {
    c.algorithm = "ring";
    reduceRing(c, in, out, count, t, op, root);
  }
}

}  // namespace dtrain::comm::algo
