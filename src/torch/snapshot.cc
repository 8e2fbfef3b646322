// In-memory snapshots in the dtrain-run agents' stores (dtrain/snapshot.h).
//
// Keys of each agent's store (every value is text but the data):
//   snap/seq                     entries written so far (add)
//   snap/e/<n>                   entry n: "<round> <world size> <part> <step>" of a snapshot part stored here
//   snap/d/<round>/<part>/<step> the part: a pickled CheckpointState (checkpoint_io.h's dict, with "rank"
//                                and "world_size"), written before its entry
// A writer deletes its own data and entry keys beyond its two newest per store. A loader lists the
// entries (snap/seq, then each entry that still exists) and keeps those whose data exists.
#include "dtrain/snapshot.h"

#include <algorithm>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "checkpoint_io.h"
#include "comm/rendezvous/environment.h"
#include "comm/rendezvous/internal.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/store.h"
#include "dtrain/distributed.h"
#include "dtrain/trace.h"

namespace dtrain {

namespace {

using Clock = std::chrono::steady_clock;

struct Endpoint {
  std::string host;
  uint16_t port = 0;
  std::string name() const { return fmt::format("{}:{}", host, port); }
};

std::vector<Endpoint> parseStores(const std::string& list, const std::string& origin) {
  std::vector<Endpoint> out;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto colon = item.rfind(':');
    int port = -1;
    if (colon != std::string::npos && colon > 0) {
      try {
        port = std::stoi(item.substr(colon + 1));
      } catch (const std::exception&) {
        port = -1;
      }
    }
    DTRAIN_CHECK(port > 0 && port <= 65535, InvalidArgument,
                 "{} '{}': '{}' is not HOST:PORT (expected host:port,host:port,... by node)", origin, list, item);
    out.push_back({item.substr(0, colon), static_cast<uint16_t>(port)});
  }
  return out;
}

// One part stored somewhere: where it is.
struct Entry {
  int64_t round = 0, step = 0;
  int world = 0, part = 0;
  int store = 0;     // index into the endpoints
  int64_t seq = 0;   // its entry number there
};

std::string dataKey(int64_t round, int part, int64_t step) { return fmt::format("snap/d/{}/{}/{}", round, part, step); }
std::string entryKey(int64_t n) { return fmt::format("snap/e/{}", n); }

}  // namespace

struct PeerSnapshots::Impl {
  const Distributed* dist = nullptr;
  SnapshotOptions o;
  std::vector<Endpoint> endpoints;
  std::string secret;
  int64_t round = 0;
  int node = 0;
  bool writes = false;
  std::vector<int> targets;  // the stores this rank writes to

  std::mutex mu;  // guards stores (created lazily from both threads)
  std::map<int, std::shared_ptr<comm::Store>> stores;

  std::thread sender;
  std::exception_ptr failure;
  // Per target store: this rank's entries there, oldest first (entry number, data key).
  std::map<int, std::vector<std::pair<int64_t, std::string>>> written;
  mutable std::mutex stats_mu;  // the sender updates stats while the caller may read them
  Stats stats;

  comm::Store& store(int i) {
    std::lock_guard<std::mutex> lock(mu);
    auto& s = stores[i];
    if (!s) {
      try {
        s = std::make_shared<comm::TcpStore>(endpoints[static_cast<size_t>(i)].host, endpoints[static_cast<size_t>(i)].port,
                                             o.timeout, secret);
      } catch (const Error& e) {
        throw Error(fmt::format("peer snapshots: the store of node {} ({}) cannot be reached: {}", i,
                                endpoints[static_cast<size_t>(i)].name(), e.what()));
      }
    }
    return *s;
  }

  // The background thread's work: the part into every target store, then older parts deleted.
  void send(const CheckpointState& state) {
    const auto t0 = Clock::now();
    const int world = dist->size();
    const int part = o.replicated ? 0 : dist->rank();
    const std::vector<char> pickled = detail::pickleState(state, part, world);
    const comm::Bytes bytes(pickled.begin(), pickled.end());
    const std::string key = dataKey(round, part, state.step);
    const std::string entry = fmt::format("{} {} {} {}", round, world, part, state.step);
    for (int t : targets) {
      comm::Store& s = store(t);
      try {
        s.set(key, bytes);
        const int64_t n = s.add("snap/seq", 1);
        s.set(entryKey(n), comm::toBytes(entry));
        auto& mine = written[t];
        mine.emplace_back(n, key);
        while (mine.size() > 2) {
          s.deleteKey(mine.front().second);
          s.deleteKey(entryKey(mine.front().first));
          mine.erase(mine.begin());
        }
      } catch (const Error& e) {
        throw Error(fmt::format("peer snapshots: rank {} could not store step {} in node {}'s store ({}): {}",
                                dist->rank(), state.step, t, endpoints[static_cast<size_t>(t)].name(), e.what()));
      }
    }
    std::lock_guard<std::mutex> lock(stats_mu);
    stats.last_bytes = static_cast<int64_t>(bytes.size());
    stats.send_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
    ++stats.snapshots;
  }

  void join() {
    if (sender.joinable()) sender.join();
    if (failure) std::rethrow_exception(std::exchange(failure, nullptr));
  }

  // Every entry of every store whose data still exists.
  std::vector<Entry> list() {
    std::vector<Entry> out;
    for (int i = 0; i < static_cast<int>(endpoints.size()); ++i) {
      comm::Store& s = store(i);
      const int64_t n = s.add("snap/seq", 0);
      for (int64_t k = 1; k <= n; ++k) {
        const std::string ek = entryKey(k);
        if (!s.check({ek})) continue;
        Entry e;
        std::istringstream in(comm::toString(s.get(ek)));
        if (!(in >> e.round >> e.world >> e.part >> e.step)) continue;
        e.store = i;
        e.seq = k;
        if (s.check({dataKey(e.round, e.part, e.step)})) out.push_back(e);
      }
    }
    return out;
  }

  // Rank 0's choice: {found, round, step, world, store of part 0, ..., store of part world-1}. Every
  // other snapshot in the stores is deleted: none can become complete or newer (their writers are gone),
  // so the stores hold the chosen one and what this round's writers add.
  std::vector<int64_t> choose() {
    const auto entries = list();
    auto out = pick(entries);
    for (const auto& e : entries) {
      if (out[0] == 1 && e.round == out[1] && e.step == out[2] && e.world == out[3]) continue;
      comm::Store& s = store(e.store);
      s.deleteKey(dataKey(e.round, e.part, e.step));
      s.deleteKey(entryKey(e.seq));
    }
    return out;
  }

  std::vector<int64_t> pick(const std::vector<Entry>& entries) const {
    std::map<std::tuple<int64_t, int64_t, int>, std::map<int, int>> found;  // (step, round, world) -> part -> store
    for (const auto& e : entries) {
      auto& parts = found[{e.step, e.round, e.world}];
      // Prefer this rank's own node's store, then the lowest index.
      auto it = parts.find(e.part);
      if (it == parts.end() || (e.store == node && it->second != node)) parts[e.part] = e.store;
    }
    for (auto it = found.rbegin(); it != found.rend(); ++it) {
      const auto& [id, parts] = *it;
      const auto& [step, rnd, world] = id;
      const int needed = o.replicated ? 1 : world;
      bool complete = true;
      for (int p = 0; p < needed && complete; ++p) complete = parts.count(p) > 0;
      if (!complete) continue;
      std::vector<int64_t> out = {1, rnd, step, world};
      for (int p = 0; p < needed; ++p) out.push_back(parts.at(p));
      return out;
    }
    return {0, 0, 0, 0};
  }
};

PeerSnapshots::PeerSnapshots(const Distributed& dist, SnapshotOptions o) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.dist = &dist;
  m.o = std::move(o);
  const auto env = comm::rendezvous::Environment::read();
  std::string origin = "SnapshotOptions::stores";
  std::string list = m.o.stores;
  if (list.empty() && env.get("DTRAIN_SNAPSHOT_STORES")) {
    list = env.get("DTRAIN_SNAPSHOT_STORES");
    origin = "DTRAIN_SNAPSHOT_STORES";
  }
  if (list.empty()) return;
  m.endpoints = parseStores(list, origin);
  const int nodes = dist.info().num_nodes;
  m.node = std::max(0, dist.info().node);
  DTRAIN_CHECK(m.node < static_cast<int>(m.endpoints.size()), InvalidArgument,
               "{} '{}' lists {} store(s); this rank is on node {} of {}: one store per node is needed", origin, list,
               m.endpoints.size(), m.node, nodes);
  m.secret = comm::rendezvous::jobSecret(env);
  m.round = m.o.round >= 0 ? m.o.round : comm::rendezvous::restartCount(env);
  m.writes = !m.o.replicated || dist.localRank() == 0;
  if (m.writes) {
    m.targets.push_back(m.node);
    const int next = (m.node + 1) % static_cast<int>(m.endpoints.size());
    if (!m.o.replicated && next != m.node) m.targets.push_back(next);
  }
}

PeerSnapshots::~PeerSnapshots() {
  if (!impl_) return;
  if (impl_->sender.joinable()) impl_->sender.join();
}

bool PeerSnapshots::enabled() const { return !impl_->endpoints.empty(); }
bool PeerSnapshots::writes() const { return enabled() && impl_->writes; }

void PeerSnapshots::save(CheckpointState state) {
  Impl& m = *impl_;
  if (!writes()) return;
  const auto t0 = Clock::now();
  DTRAIN_SPAN("snapshot.save", "checkpoint");
  m.join();
  m.sender = std::thread([&m, s = std::move(state)] {
    try {
      m.send(s);
    } catch (...) {
      m.failure = std::current_exception();
    }
  });
  std::lock_guard<std::mutex> lock(m.stats_mu);
  m.stats.save_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
}

void PeerSnapshots::flush() { impl_->join(); }

std::optional<Snapshot> PeerSnapshots::loadLatest() {
  Impl& m = *impl_;
  if (!enabled()) return std::nullopt;
  flush();
  auto& pg = *m.dist->world();
  // Rank 0 lists the stores and chooses; the others learn its choice (a failure to list is every rank's).
  std::vector<int64_t> head(4, 0);
  std::vector<int64_t> choice;
  std::string error;
  if (m.dist->isMain()) {
    try {
      choice = m.choose();
      std::copy(choice.begin(), choice.begin() + 4, head.begin());
    } catch (const Error& e) {
      error = e.what();
      head[0] = -1;
    }
  }
  pg.broadcast(head.data(), head.size(), comm::DType::i64, 0)->wait();
  if (head[0] < 0) {
    throw Error(m.dist->isMain() ? error
                                 : "peer snapshots: rank 0 could not list the snapshots in the stores (its error says why)");
  }
  if (head[0] == 0) return std::nullopt;
  Snapshot snap;
  snap.round = head[1];
  snap.step = head[2];
  snap.world_size = static_cast<int>(head[3]);
  const size_t parts = m.o.replicated ? 1 : static_cast<size_t>(snap.world_size);
  std::vector<int64_t> where(parts);
  if (m.dist->isMain()) std::copy(choice.begin() + 4, choice.end(), where.begin());
  pg.broadcast(where.data(), where.size(), comm::DType::i64, 0)->wait();
  for (size_t p = 0; p < parts; ++p) {
    const int s = static_cast<int>(where[p]);
    const std::string src = m.endpoints[static_cast<size_t>(s)].name();
    const std::string what = fmt::format("the snapshot of round {} step {} part {} in {}", snap.round, snap.step, p, src);
    const comm::Bytes bytes = m.store(s).get(dataKey(snap.round, static_cast<int>(p), snap.step));
    const std::vector<char> raw(bytes.begin(), bytes.end());
    snap.parts.push_back(detail::unpickleState(what, detail::loadCheckpointDict(what, raw, detail::kCheckpointFormat)));
    snap.sources.push_back(src);
  }
  return snap;
}

PeerSnapshots::Stats PeerSnapshots::stats() const {
  std::lock_guard<std::mutex> lock(impl_->stats_mu);
  return impl_->stats;
}

}  // namespace dtrain
