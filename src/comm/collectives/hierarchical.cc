// Hierarchical allreduce: shared memory within each host, TCP across hosts (docs/SLOW-LINKS.md).
//
// The group's ranks are grouped by host at creation (hosts are known at rendezvous: every rank
// publishes transport::hostId()). Each host with more than one rank gets its own shm transport among
// its ranks (the "local" transport); the cross-host stage runs on the group's TCP mesh through a view
// that renumbers a few of its ranks as a group of their own (no new connection).
//
// The buffer is cut into S shards, S the largest number of ranks on any host (evenBlocks). On a host
// of L ranks, local rank i owns the contiguous shards [i*S/L, (i+1)*S/L) (at least one each, as S >= L),
// so hosts of different sizes (2+1) own the same shards through different ranks. Then:
//   1. within each host, a reduce-scatter leaves each rank the host's sum of the shards it owns;
//   2. for every shard, the ranks that own it (one per host) allreduce it over TCP; the shards of
//      different local ranks travel at the same time; a rank that owns several shards (on a smaller
//      host) runs them one after another, in shard order (the same order on every rank: no deadlock);
//   3. within each host, an allgather hands every rank every shard.
// avg reduces as sum and the owners divide their shards once, by the group size, before the allgather:
// every rank ends bit-identical, and integers equal the flat algorithms exactly.
//
// Errors: every stage shares the op's deadline; a failure in any stage fails the op, and the group then
// aborts both transports (process_group.cc), so ranks waiting in the other stage fail too. Errors of the
// local (shm) transport name ranks by their index on the host: they are rewritten to group ranks.
#include <algorithm>
#include <cctype>
#include <cstring>
#include <functional>

#include <fmt/ranges.h>

#include "comm/collectives/collectives.h"
#include "comm/collectives/kernels.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm::algo {

namespace {

// Some ranks of a transport, renumbered 0..n-1 in the order given, with a tag offset so that the
// frames of consecutive shards between the same two ranks never pass for each other.
class SubsetView final : public transport::Transport {
 public:
  SubsetView(transport::Transport& base, std::vector<int> ranks, int me, uint32_t tag_base)
      : Transport(me, static_cast<int>(ranks.size())), base_(base), ranks_(std::move(ranks)), tag_base_(tag_base) {}
  const char* name() const override { return base_.name(); }
  void run(std::vector<transport::Op>& ops, transport::Deadline deadline, const transport::Label& label) override {
    std::vector<transport::Op> mapped = ops;
    for (auto& op : mapped) {
      op.peer = ranks_.at(static_cast<size_t>(op.peer));
      op.tag += tag_base_;
    }
    base_.run(mapped, deadline, label);
  }
  void abort(const std::exception&) noexcept override {}  // the group aborts the base transport
  std::string peerName(int peer) const override { return base_.peerName(ranks_.at(static_cast<size_t>(peer))); }

 private:
  transport::Transport& base_;
  std::vector<int> ranks_;
  uint32_t tag_base_;
};

// The local transport's message with its ranks (indices on this host) renamed to group ranks, up to the
// first message it quotes from another rank (those already name group ranks).
std::string toGroupRanks(const std::string& msg, const std::vector<int>& local_to_group) {
  size_t quoted = msg.find("[rank", 1);
  if (quoted == std::string::npos) quoted = msg.size();
  std::string out;
  size_t i = 0;
  while (i < quoted) {
    size_t k = msg.find("rank ", i);
    if (k == std::string::npos || k >= quoted) break;
    size_t d = k + 5, e = d;
    while (e < msg.size() && std::isdigit(static_cast<unsigned char>(msg[e]))) ++e;
    out.append(msg, i, d - i);
    if (e > d && e - d < 6) {
      size_t local = std::stoul(msg.substr(d, e - d));
      out += local < local_to_group.size() ? std::to_string(local_to_group[local]) : msg.substr(d, e - d);
    } else {
      out.append(msg, d, e - d);
    }
    i = e;
  }
  out.append(msg, i, std::string::npos);
  return out;
}

[[noreturn]] void rethrowAsGroup(const std::exception& e, const std::vector<int>& local_to_group) {
  transport::throwOfKind(transport::errorKindOf(e), toGroupRanks(e.what(), local_to_group));
}

// Shard s's owner on a host of `local` ranks when there are `shards` shards: shards [i*S/L, (i+1)*S/L)
// belong to local rank i.
int ownerOf(size_t s, int local, int shards) {
  int i = 0;
  while (i + 1 < local && static_cast<size_t>((i + 1) * shards / local) <= s) ++i;
  return i;
}

}  // namespace

std::vector<std::string> exchangeHostIds(Store& store, int rank, int size, bool need_one_host,
                                         AllreduceAlgorithm group_algo) {
  const std::string mine = transport::hostId();
  store.set(fmt::format("host/{}", rank), toBytes(fmt::format("{}\n{}", allreduceAlgorithmName(group_algo), mine)));
  std::vector<std::string> ids;
  std::vector<int> elsewhere;
  std::string first_algo;
  for (int r = 0; r < size; ++r) {
    const std::string v = toString(store.get(fmt::format("host/{}", r)));
    const size_t nl = v.find('\n');
    const std::string algo = v.substr(0, nl);
    ids.push_back(nl == std::string::npos ? "" : v.substr(nl + 1));
    if (ids.back() != mine) elsewhere.push_back(r);
    if (r == 0) first_algo = algo;
    if (algo != first_algo) {  // the ranks would run different algorithms and wait for each other
      throw InvalidArgument(fmt::format("[rank {}] ranks force different allreduce algorithms (DTRAIN_ALGO or "
                                        "GroupOptions::allreduce_algorithm): rank 0 {}, rank {} {}",
                                        rank, first_algo, r, algo));
    }
  }
  if (need_one_host && !elsewhere.empty()) {
    throw RendezvousError(fmt::format("[rank {}] DTRAIN_TRANSPORT=shm but ranks {} run on another host", rank,
                                      fmt::join(elsewhere, ", ")));
  }
  return ids;
}

std::unique_ptr<Hierarchy> makeHierarchy(const std::shared_ptr<Store>& store, int rank, const std::vector<std::string>& host_ids,
                                         const transport::TransportOptions& opts) {
  auto h = std::make_unique<Hierarchy>();
  std::vector<std::string> seen;  // hosts in order of their lowest rank
  for (int r = 0; r < static_cast<int>(host_ids.size()); ++r) {
    auto it = std::find(seen.begin(), seen.end(), host_ids[r]);
    if (it == seen.end()) {
      seen.push_back(host_ids[r]);
      h->hosts.emplace_back();
      it = seen.end() - 1;
    }
    const int index = static_cast<int>(it - seen.begin());
    if (r == rank) {
      h->host = index;
      h->local_rank = static_cast<int>(h->hosts[index].size());
    }
    h->hosts[index].push_back(r);
  }
  if (h->hosts.size() < 2) return nullptr;  // one host: the flat algorithms (over shm) are the choice
  for (const auto& ranks : h->hosts) h->shards = std::max(h->shards, static_cast<int>(ranks.size()));
  const auto& mine = h->hosts[h->host];
  if (mine.size() > 1) {
    h->local_store = std::make_shared<PrefixStore>(fmt::format("hier/host{}", h->host), store);
    h->local = transport::createTransport("shm", *h->local_store, h->local_rank, static_cast<int>(mine.size()), opts);
  }
  return h;
}

namespace {

// A stage's label: the op's, its text saying which stage (errors name the stage).
transport::Label stageLabel(const Context& c, const Hierarchy& h, bool local) {
  transport::Label l = c.label;
  if (local) {
    l.what += fmt::format(" (hierarchical, within host {} of ranks {})", h.host, fmt::join(h.hosts[h.host], ", "));
  } else {
    l.what += " (hierarchical, across hosts)";
  }
  return l;
}

}  // namespace

// Broadcast: the root sends to one rank of every other host over tcp (the lowest; on the root's host
// the root itself), then each of them broadcasts within its host over shm. The cross-host links carry
// the buffer once per host instead of once per rank.
void broadcastHierarchical(Context& c, Hierarchy& h, void* buf, size_t count, DType t, int root) {
  std::vector<int> leaders;
  int root_host = 0;
  for (int k = 0; k < static_cast<int>(h.hosts.size()); ++k) {
    const auto& ranks = h.hosts[static_cast<size_t>(k)];
    const bool has_root = std::find(ranks.begin(), ranks.end(), root) != ranks.end();
    if (has_root) root_host = k;
    leaders.push_back(has_root ? root : ranks[0]);
  }
  const int leader = leaders[static_cast<size_t>(h.host)];
  if (leader == c.rank) {
    SubsetView view(*c.tx, leaders, h.host, 0);
    Context xc{&view, h.host, static_cast<int>(leaders.size()), stageLabel(c, h, false), c.deadline, h.cross_scratch};
    xc.group_ranks = &leaders;
    broadcast(xc, buf, count, t, root_host);
  }
  if (!h.local) return;
  const transport::Label ll = stageLabel(c, h, true);
  const auto& mine = h.hosts[static_cast<size_t>(h.host)];
  const int local_root = static_cast<int>(std::find(mine.begin(), mine.end(), leader) - mine.begin());
  try {
    Context lc{h.local.get(), h.local_rank, static_cast<int>(mine.size()), ll, c.deadline, h.local_scratch};
    lc.guard_output = h.local->beginCollective(ll, c.deadline);
    lc.group_ranks = &mine;
    broadcast(lc, buf, count, t, local_root);
    h.local->compareCalls(ll, c.deadline);
  } catch (const std::exception& e) {
    rethrowAsGroup(e, mine);
  }
}

// Allgather: each host's ranks hand their blocks to the host's lowest rank (shm); those exchange one
// bundle per host over tcp (a ring), place every block in rank order, and broadcast the whole output
// within their host (shm).
void allgathervHierarchical(Context& c, Hierarchy& h, const void* in, void* out, const std::vector<size_t>& counts,
                            DType t) {
  const size_t es = dtypeSize(t);
  const std::vector<size_t> off = prefixOffsets(counts);
  const auto& mine = h.hosts[static_cast<size_t>(h.host)];
  std::vector<int> leaders;
  std::vector<size_t> bundle;
  for (const auto& ranks : h.hosts) {
    leaders.push_back(ranks[0]);
    bundle.push_back(0);
    for (int r : ranks) bundle.back() += counts[static_cast<size_t>(r)];
  }
  const std::vector<size_t> bundle_off = prefixOffsets(bundle);
  const bool leader = h.local_rank == 0;
  char* bundles = leader ? static_cast<char*>(c.scratch(off.back() * es)) : nullptr;
  const transport::Label ll = stageLabel(c, h, true);
  Context lc{h.local.get(), h.local_rank, static_cast<int>(mine.size()), ll, c.deadline, h.local_scratch};
  lc.group_ranks = &mine;
  // Errors of the shm stages name ranks by their index on the host: rewritten to group ranks.
  auto local = [&](const std::function<void()>& stage) {
    try {
      stage();
    } catch (const std::exception& e) {
      rethrowAsGroup(e, mine);
    }
  };
  local([&] {
    std::vector<transport::Op> ops;
    size_t at = bundle_off[static_cast<size_t>(h.host)];
    for (size_t i = 0; leader && i < mine.size(); at += counts[static_cast<size_t>(mine[i])], ++i) {
      const size_t bytes = counts[static_cast<size_t>(mine[i])] * es;
      if (i == 0 && bytes) std::memcpy(bundles + at * es, in, bytes);
      if (i > 0) ops.push_back(transport::recvOp(static_cast<int>(i), 0, bundles + at * es, bytes));
      if (i > 0) ops.back().to_scratch = true;
    }
    if (!leader) ops.push_back(transport::sendOp(0, 0, in, counts[static_cast<size_t>(c.rank)] * es));
    if (h.local) lc.guard_output = h.local->beginCollective(ll, c.deadline);
    if (!ops.empty()) lc.run(ops);
  });
  if (leader) {
    SubsetView view(*c.tx, leaders, h.host, 0);
    Context xc{&view, h.host, static_cast<int>(leaders.size()), stageLabel(c, h, false), c.deadline, h.cross_scratch};
    xc.group_ranks = &leaders;
    ringAllgatherInPlace(xc, bundles, bundle, t, 0);
    if (h.local) local([&] { h.local->compareCalls(ll, c.deadline); });  // before this rank writes the output
    for (size_t k = 0; k < h.hosts.size(); ++k) {
      size_t from = bundle_off[k];
      for (int r : h.hosts[k]) {
        const size_t n = counts[static_cast<size_t>(r)];
        if (n) std::memcpy(static_cast<char*>(out) + off[static_cast<size_t>(r)] * es, bundles + from * es, n * es);
        from += n;
      }
    }
  }
  if (h.local) {
    local([&] {
      broadcast(lc, out, off.back(), t, 0);
      h.local->compareCalls(ll, c.deadline);
    });
  }
}

// The local and cross-host stages are described in the labels of their frames and errors.
void allreduceHierarchical(Context& c, Hierarchy& h, const void* in, void* out, size_t count, DType t, ReduceOp op) {
  const size_t es = dtypeSize(t);
  const ReduceOp stage_op = op == ReduceOp::avg ? ReduceOp::sum : op;
  const std::vector<int>& host_ranks = h.hosts[h.host];
  const int local_size = static_cast<int>(host_ranks.size());
  const std::vector<size_t> shard_counts = evenBlocks(count, h.shards);
  const std::vector<size_t> shard_off = prefixOffsets(shard_counts);
  // This host's split of the buffer: local rank i's region is the shards it owns.
  std::vector<size_t> region(static_cast<size_t>(local_size), 0);
  for (int s = 0; s < h.shards; ++s) region[static_cast<size_t>(ownerOf(s, local_size, h.shards))] += shard_counts[s];
  const std::vector<size_t> region_off = prefixOffsets(region);
  const size_t mine = region[static_cast<size_t>(h.local_rank)];
  if (h.shard.size() < mine * es) h.shard.resize(mine * es);
  char* shard = reinterpret_cast<char*>(h.shard.data());

  const transport::Label local_label = stageLabel(c, h, true);
  Context lc{h.local.get(), h.local_rank, local_size, local_label, c.deadline, h.local_scratch};
  lc.group_ranks = &host_ranks;
  // 1. Within the host: each rank gets the host's reduction of its region.
  if (h.local) {
    try {
      lc.guard_output = h.local->beginCollective(local_label, c.deadline);
      reduceScatterv(lc, in, shard, region, t, stage_op);
    } catch (const std::exception& e) {
      rethrowAsGroup(e, host_ranks);
    }
  } else if (mine) {
    std::memcpy(shard, in, mine * es);
  }
  // 2. Across hosts, shard by shard: the owners of each shard (one per host) allreduce it.
  const transport::Label cross_label = stageLabel(c, h, false);
  const int hosts = static_cast<int>(h.hosts.size());
  for (int s = 0; s < h.shards; ++s) {
    if (ownerOf(s, local_size, h.shards) != h.local_rank || shard_counts[s] == 0) continue;
    std::vector<int> owners;
    for (const auto& ranks : h.hosts)
      owners.push_back(ranks[static_cast<size_t>(ownerOf(s, static_cast<int>(ranks.size()), h.shards))]);
    SubsetView view(*c.tx, owners, h.host, static_cast<uint32_t>(s + 1) << 16);
    Context xc{&view, h.host, hosts, cross_label, c.deadline, h.cross_scratch};
    xc.group_ranks = &owners;
    char* p = shard + (shard_off[s] - region_off[static_cast<size_t>(h.local_rank)]) * es;
    allreduce(xc, p, p, shard_counts[s], t, stage_op, AllreduceAlgorithm::automatic);
  }
  if (op == ReduceOp::avg) divideBy(shard, mine, t, c.size);
  // 3. Within the host: every rank gets every region.
  if (!h.local) {
    if (mine) std::memcpy(out, shard, mine * es);
    return;
  }
  try {
    allgatherv(lc, shard, out, region, t);
    h.local->compareCalls(local_label, c.deadline);
  } catch (const std::exception& e) {
    rethrowAsGroup(e, host_ranks);
  }
}

// Reduce-scatter: every rank's block is cut into S shards (S as for allreduce); on each host, local
// rank i owns the same shards of every block. 1. Within the host, a reduce-scatter hands each owner the
// host's sum of its shards of all blocks (packed by owner, then shard, then block in host order). 2. For
// each shard, its owners (one per host) reduce-scatter it so that each gets the sum of that shard of
// its own host's blocks: a host link carries (hosts-1)/hosts of the input instead of the flat ring's
// (n-1)/n. 3. Within the host, each owner sends every local rank its shards.
void reduceScattervHierarchical(Context& c, Hierarchy& h, const void* in, void* out, const std::vector<size_t>& counts,
                                DType t, ReduceOp op) {
  const size_t es = dtypeSize(t);
  const ReduceOp stage_op = op == ReduceOp::avg ? ReduceOp::sum : op;
  const auto& mine = h.hosts[static_cast<size_t>(h.host)];
  const int L = static_cast<int>(mine.size()), S = h.shards;
  const std::vector<size_t> off = prefixOffsets(counts);
  std::vector<int> order;  // the blocks in host order
  for (const auto& ranks : h.hosts) order.insert(order.end(), ranks.begin(), ranks.end());
  std::vector<std::vector<size_t>> piece(counts.size()), piece_off(counts.size());  // [rank][shard]
  for (size_t r = 0; r < counts.size(); ++r) {
    piece[r] = evenBlocks(counts[r], S);
    piece_off[r] = prefixOffsets(piece[r]);
  }
  auto shardTotal = [&](int s, const std::vector<int>& ranks) {
    size_t n = 0;
    for (int r : ranks) n += piece[static_cast<size_t>(r)][static_cast<size_t>(s)];
    return n;
  };
  // 1. Pack by owner, shard, block; reduce-scatter within the host.
  std::vector<size_t> region(static_cast<size_t>(L), 0);
  if (h.packed.size() < off.back() * es) h.packed.resize(off.back() * es);
  char* packed = reinterpret_cast<char*>(h.packed.data());
  size_t at = 0;
  for (int i = 0; i < L; ++i)
    for (int s = 0; s < S; ++s) {
      if (ownerOf(static_cast<size_t>(s), L, S) != i) continue;
      for (int r : order) {
        const size_t n = piece[static_cast<size_t>(r)][static_cast<size_t>(s)];
        if (n) std::memcpy(packed + at * es, static_cast<const char*>(in) + (off[r] + piece_off[r][s]) * es, n * es);
        at += n;
        region[static_cast<size_t>(i)] += n;
      }
    }
  const transport::Label ll = stageLabel(c, h, true);
  Context lc{h.local.get(), h.local_rank, L, ll, c.deadline, h.local_scratch};
  lc.group_ranks = &mine;
  const size_t my_region = region[static_cast<size_t>(h.local_rank)];
  if (h.shard.size() < my_region * es) h.shard.resize(my_region * es);
  char* shard = h.local ? reinterpret_cast<char*>(h.shard.data()) : packed;
  if (h.local) {
    try {
      lc.guard_output = h.local->beginCollective(ll, c.deadline);
      reduceScatterv(lc, packed, shard, region, t, stage_op);
    } catch (const std::exception& e) {
      rethrowAsGroup(e, mine);
    }
  }
  // 2. Across hosts, shard by shard; the results (this host's blocks' pieces) go back into `packed`.
  const int hosts = static_cast<int>(h.hosts.size());
  std::vector<size_t> result_at(static_cast<size_t>(S), 0);
  size_t from = 0, to = 0;
  for (int s = 0; s < S; ++s) {
    if (ownerOf(static_cast<size_t>(s), L, S) != h.local_rank) continue;
    std::vector<int> owners;
    std::vector<size_t> per_host;
    for (const auto& ranks : h.hosts) {
      owners.push_back(ranks[static_cast<size_t>(ownerOf(static_cast<size_t>(s), static_cast<int>(ranks.size()), S))]);
      per_host.push_back(shardTotal(s, ranks));
    }
    SubsetView view(*c.tx, owners, h.host, static_cast<uint32_t>(s + 1) << 16);
    Context xc{&view, h.host, hosts, stageLabel(c, h, false), c.deadline, h.cross_scratch};
    xc.group_ranks = &owners;
    result_at[static_cast<size_t>(s)] = to;
    reduceScatterv(xc, shard + from * es, packed + to * es, per_host, t, stage_op);
    from += shardTotal(s, order);
    to += per_host[static_cast<size_t>(h.host)];
  }
  // 3. Within the host: each rank's pieces from their owners (its own last, once calls are compared).
  auto deliver = [&](bool own) {
    std::vector<transport::Op> ops;
    for (int s = 0; s < S; ++s) {
      const int owner = ownerOf(static_cast<size_t>(s), L, S);
      size_t at = result_at[static_cast<size_t>(s)];
      for (int j = 0; j < L; ++j) {
        const int r = mine[static_cast<size_t>(j)];
        const size_t bytes = piece[static_cast<size_t>(r)][static_cast<size_t>(s)] * es;
        char* dst = static_cast<char*>(out) + piece_off[static_cast<size_t>(r)][static_cast<size_t>(s)] * es;
        if (owner == h.local_rank && j == h.local_rank && own && bytes) std::memcpy(dst, packed + at * es, bytes);
        if (owner == h.local_rank && j != h.local_rank && !own && bytes)
          ops.push_back(transport::sendOp(j, static_cast<uint32_t>(s), packed + at * es, bytes));
        if (owner != h.local_rank && j == h.local_rank && !own && bytes)
          ops.push_back(transport::recvOp(owner, static_cast<uint32_t>(s), dst, bytes));
        at += bytes / es;
      }
    }
    if (!ops.empty()) lc.run(ops);
  };
  if (h.local) {
    try {
      deliver(false);
      h.local->compareCalls(ll, c.deadline);
    } catch (const std::exception& e) {
      rethrowAsGroup(e, mine);
    }
  }
  deliver(true);
  if (op == ReduceOp::avg) divideBy(out, counts[static_cast<size_t>(c.rank)], t, c.size);
}

}  // namespace dtrain::comm::algo
