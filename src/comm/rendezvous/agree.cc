// The ranks agree on the world before any group is built.
//
// Each process counts itself in "rendezvous/arrived", claims its rank with an atomic counter (a second
// process with the same rank is caught before it publishes anything), publishes its View (world size,
// node, local rank and size, job, host) under "rendezvous/view/<rank>", and counts itself in
// "rendezvous/joined". Then it polls, with
// a growing interval: an "rendezvous/error" key set by a rank that found a disagreement fails everyone
// at once; rank 0's view is compared as soon as it exists (most disagreements are with it); when the
// join count reaches the world size, every view is read and compared. Every rank runs the same
// comparison on the same views and so reports the same disagreement. A failing rank 0 that serves the
// store waits (at most 3 s) until every process that arrived has read the error. At the deadline the
// ranks that have not joined are named with what to check. Nothing here waits without a deadline.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <sstream>
#include <thread>

#include "comm/rendezvous/internal.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm::rendezvous {

namespace {

using Clock = std::chrono::steady_clock;

std::string viewKey(int rank) { return fmt::format("rendezvous/view/{}", rank); }
const char* kErrorKey = "rendezvous/error";
const char* kJoinedKey = "rendezvous/joined";
const char* kErrorSeenKey = "rendezvous/error_seen";
const char* kArrivedKey = "rendezvous/arrived";  // processes that started, duplicates of a rank too

std::string nodeName(const View& v) {
  return v.world.node >= 0 ? fmt::format("node {} ({})", v.world.node, v.hostname) : fmt::format("host {}", v.hostname);
}

// "ranks 1, 2, 5" or "rank 3"; long lists are cut.
std::string rankList(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < 16; ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > 16) s += fmt::format(" and {} more", ranks.size() - 16);
  return s;
}

std::string secondsText(std::chrono::milliseconds d) {
  return d.count() % 1000 == 0 ? fmt::format("{}s", d.count() / 1000) : fmt::format("{}ms", d.count());
}

}  // namespace

std::string View::encode() const {
  return fmt::format("rank={}\nsize={}\nlocal_rank={}\nlocal_size={}\nnode={}\nnum_nodes={}\nsource={}\njob={}\n"
                     "host_id={}\nhostname={}\n",
                     world.rank, world.size, world.local_rank, world.local_size, world.node, world.num_nodes,
                     world.source, world.job, host_id, hostname);
}

View View::decode(const std::string& text, int rank) {
  std::map<std::string, std::string> kv;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    auto eq = line.find('=');
    if (eq != std::string::npos) kv[line.substr(0, eq)] = line.substr(eq + 1);
  }
  auto num = [&](const char* k) {
    auto it = kv.find(k);
    if (it == kv.end()) throw ProtocolError(fmt::format("rank {}'s rendezvous view lacks '{}': '{}'", rank, k, text));
    return std::atoi(it->second.c_str());
  };
  View v;
  v.world.rank = num("rank");
  v.world.size = num("size");
  v.world.local_rank = num("local_rank");
  v.world.local_size = num("local_size");
  v.world.node = num("node");
  v.world.num_nodes = num("num_nodes");
  v.world.source = kv["source"];
  v.world.job = kv["job"];
  v.host_id = kv["host_id"];
  v.hostname = kv["hostname"];
  if (v.world.rank != rank) {
    throw RendezvousError(fmt::format("the view published as rank {} says rank {} (two processes with one rank?)",
                                      rank, v.world.rank));
  }
  return v;
}

std::vector<std::vector<int>> nodesOf(const std::vector<View>& views) {
  // Known node indices first in index order, then hosts in order of their first rank.
  std::map<int, std::vector<int>> by_index;
  std::vector<std::pair<std::string, std::vector<int>>> by_host;
  for (const auto& v : views) {
    if (v.world.node >= 0) {
      by_index[v.world.node].push_back(v.world.rank);
      continue;
    }
    auto it = std::find_if(by_host.begin(), by_host.end(), [&](const auto& h) { return h.first == v.host_id; });
    if (it == by_host.end()) it = by_host.insert(by_host.end(), {v.host_id, {}});
    it->second.push_back(v.world.rank);
  }
  std::vector<std::vector<int>> nodes;
  for (auto& [i, ranks] : by_index) nodes.push_back(ranks);
  for (auto& [h, ranks] : by_host) nodes.push_back(ranks);
  for (auto& ranks : nodes) {
    std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) {
      return views[static_cast<size_t>(a)].world.local_rank < views[static_cast<size_t>(b)].world.local_rank;
    });
  }
  return nodes;
}

// The facts every rank must share, rank 0's view against another's; "" when they agree.
std::string compareWorldFacts(const View& v0, const View& v) {
  const WorldInfo &w0 = v0.world, &w = v.world;
  if (w.size != w0.size) {
    return fmt::format("ranks disagree about the world size: rank 0 has {} ({} variables), rank {} has {} ({})",
                       w0.size, w0.source, w.rank, w.size, w.source);
  }
  if (w.source != w0.source) {
    return fmt::format("ranks found their rank in different places: rank 0 in {} variables, rank {} in {}",
                       w0.source, w.rank, w.source);
  }
  if (w.job != w0.job) {
    return fmt::format("ranks belong to different jobs: rank 0 to {}, rank {} to {} (do two jobs share one store "
                       "address?)",
                       w0.job.empty() ? "none" : w0.job, w.rank, w.job.empty() ? "none" : w.job);
  }
  if (w.num_nodes != w0.num_nodes) {
    return fmt::format("ranks disagree about the number of nodes: rank 0 counts {}, rank {} counts {}", w0.num_nodes,
                       w.rank, w.num_nodes);
  }
  return "";
}

std::string findDisagreement(const std::vector<View>& views) {
  for (const auto& v : views) {
    std::string d = compareWorldFacts(views[0], v);
    if (!d.empty()) return d;
  }
  std::vector<std::vector<int>> nodes = nodesOf(views);
  for (const auto& ranks : nodes) {
    const View& first = views[static_cast<size_t>(ranks.front())];
    const int n = static_cast<int>(ranks.size());
    for (int r : ranks) {
      const View& v = views[static_cast<size_t>(r)];
      if (v.host_id != first.host_id) {
        return fmt::format("{} has ranks on different hosts: rank {} on {} and rank {} on {}", nodeName(first),
                           first.world.rank, first.hostname, r, v.hostname);
      }
      if (v.world.local_size != n) {
        return fmt::format("ranks disagree about who is on {}: it has {} ({}) but rank {} says its node has {} "
                           "(local size)",
                           nodeName(first), n == 1 ? "1 rank" : fmt::format("{} ranks", n), rankList(ranks), r,
                           v.world.local_size);
      }
    }
    for (int i = 0; i < n; ++i) {
      const View& v = views[static_cast<size_t>(ranks[static_cast<size_t>(i)])];
      if (v.world.local_rank != i) {
        // Sorted by local rank: a gap or a repeat shows at the first index that does not match.
        const View& prev = views[static_cast<size_t>(ranks[static_cast<size_t>(std::max(0, i - 1))])];
        if (i > 0 && prev.world.local_rank == v.world.local_rank) {
          return fmt::format("ranks {} and {} both have local rank {} on {}", prev.world.rank, v.world.rank,
                             v.world.local_rank, nodeName(first));
        }
        return fmt::format("no rank has local rank {} on {} ({} with local ranks up to {})", i, nodeName(first),
                           rankList(ranks), views[static_cast<size_t>(ranks.back())].world.local_rank);
      }
    }
  }
  const int num_nodes = views.at(0).world.num_nodes;
  if (num_nodes >= 0 && static_cast<int>(nodes.size()) != num_nodes) {
    return fmt::format("ranks disagree about the nodes: every rank counts {} nodes but the ranks name {}", num_nodes,
                       nodes.size());
  }
  return "";
}

std::vector<std::vector<int>> agreeOnWorld(Store& store, const View& mine, const std::string& where,
                                           std::chrono::milliseconds timeout, bool hosts_store) {
  const int rank = mine.world.rank, size = mine.world.size;
  const auto deadline = Clock::now() + timeout;
  // A failing rank that hosts the store stays until every process that arrived has read the error (or
  // a few seconds), so that they report the disagreement rather than a lost store.
  auto linger = [&] {
    if (!hosts_store) return;
    const auto until = std::min(deadline, Clock::now() + std::chrono::seconds(3));
    try {
      while (Clock::now() < until && store.add(kErrorSeenKey, 0) < store.add(kArrivedKey, 0)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    } catch (const Error&) {
    }
  };
  auto fail = [&](const std::string& what) {
    try {
      store.set(kErrorKey, toBytes(fmt::format("rank {} found: {}", rank, what)));
      store.add(kErrorSeenKey, 1);
    } catch (const Error&) {
      // The others will time out instead; this rank's own message says why.
    }
    linger();
    throw RendezvousError(fmt::format("[rank {}] {}", rank, what));
  };
  std::optional<View> rank0;  // rank 0's view, once it exists
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(viewKey(r));
  try {
    store.add(kArrivedKey, 1);
    // Claim the rank before publishing, so that a second claimant cannot overwrite the first's view.
    if (store.add(fmt::format("rendezvous/claim/{}", rank), 1) > 1) {
      fail(fmt::format("another process already joined as rank {} ({}): ranks must be unique", rank,
                       mine.world.source));
    }
    store.set(viewKey(rank), toBytes(mine.encode()));
    store.add(kJoinedKey, 1);
    auto pause = std::chrono::milliseconds(1);
    while (true) {
      if (store.check({kErrorKey})) {
        std::string error = toString(store.get(kErrorKey));
        store.add(kErrorSeenKey, 1);
        linger();
        throw RendezvousError(fmt::format("[rank {}] {}", rank, error));
      }
      if (!rank0 && store.check({viewKey(0)})) {
        rank0 = View::decode(toString(store.get(viewKey(0))), 0);
        // The world-wide facts at once; who is on which node waits for every view.
        std::string d = compareWorldFacts(*rank0, mine);
        if (!d.empty()) fail(d);
      }
      // At the deadline, one last look: everyone may have joined just now.
      const bool last = Clock::now() >= deadline;
      if (last || store.add(kJoinedKey, 0) >= size) {
        if (store.check(keys)) {
          std::vector<View> all;
          for (int r = 0; r < size; ++r) all.push_back(View::decode(toString(store.get(viewKey(r))), r));
          std::string d = findDisagreement(all);
          if (!d.empty()) fail(d);
          return nodesOf(all);
        }
      }
      if (last) break;
      std::this_thread::sleep_for(std::min(pause, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                      deadline - Clock::now() + std::chrono::milliseconds(1))));
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
    std::vector<int> missing;
    for (int r = 0; r < size; ++r)
      if (!store.check({viewKey(r)})) missing.push_back(r);
    throw RendezvousError(fmt::format(
        "[rank {}] rendezvous: {} of {} {} not joined the store at {} after {}. Check that every rank has the same "
        "store address (MASTER_ADDR and MASTER_PORT, or DTRAIN_INIT_METHOD), that {} processes were started (the "
        "world size comes from {} variables), that the missing ranks did not fail at start-up, and that no firewall "
        "blocks the port",
        rank, rankList(missing), size, missing.size() == 1 ? "has" : "have", where, secondsText(timeout), size,
        mine.world.source));
  } catch (const RendezvousError&) {
    throw;
  } catch (const Error& e) {
    throw RendezvousError(fmt::format("[rank {}] rendezvous: the store at {} failed: {}", rank, where, e.what()));
  }
}

}  // namespace dtrain::comm::rendezvous
