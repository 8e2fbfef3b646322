// dtrain-run in elastic mode: the rendezvous store, and the loop over rounds (elastic.h).
#include <unistd.h>

#include <thread>

#include <fmt/format.h>

#include "dtrain/comm/error.h"
#include "dtrain/comm/etcd.h"
#include "dtrain/comm/store.h"
#include "elastic.h"
#include "launcher.h"
#include "output.h"

namespace dtrain::run {

namespace {
std::pair<std::string, int> hostPort(const std::string& endpoint, const char* what) {
  const auto colon = endpoint.rfind(':');
  int port = -1;
  if (colon != std::string::npos && colon > 0) {
    try {
      port = std::stoi(endpoint.substr(colon + 1));
    } catch (const std::exception&) {
      port = -1;
    }
  }
  if (port <= 0 || port > 65535) throw InvalidArgument(fmt::format("{} '{}': expected HOST:PORT", what, endpoint));
  return {endpoint.substr(0, colon), port};
}

// The host of the (first) rendezvous endpoint: this node advertises the address that routes to it.
std::string rdzvHost(const Options& o) {
  std::string e = o.rdzv_endpoint.substr(0, o.rdzv_endpoint.find(','));
  if (const auto scheme = e.find("://"); scheme != std::string::npos) e = e.substr(scheme + 3);
  e = e.substr(0, e.find('/'));
  return e.substr(0, e.rfind(':'));
}

std::string nodeId() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  return fmt::format("{}-{}", host, getpid());
}
}  // namespace

void checkElasticOptions(const Options& o) {
  auto require = [](bool ok, const std::string& why) {
    if (!ok) throw InvalidArgument(why);
  };
  require(o.min_nodes >= 1 && o.max_nodes >= o.min_nodes,
          fmt::format("--nnodes {}:{}: expected MIN:MAX with 1 <= MIN <= MAX", o.min_nodes, o.max_nodes));
  require(!o.rdzv_endpoint.empty(), "--nnodes MIN:MAX needs --rdzv-endpoint (HOST:PORT of the rendezvous store)");
  require(o.rdzv_backend == "c10d" || o.rdzv_backend == "etcd",
          fmt::format("--rdzv-backend '{}': expected c10d or etcd", o.rdzv_backend));
  require(!o.standalone, "--standalone runs a single node; it cannot be combined with --nnodes MIN:MAX");
  require(o.num_servers == 0, "--servers (parameter servers) cannot be combined with --nnodes MIN:MAX");
  require(o.heartbeat_timeout.count() > 0, "--heartbeat-timeout must be > 0");
  if (o.rdzv_backend == "c10d") hostPort(o.rdzv_endpoint, "--rdzv-endpoint");
}

// The rendezvous store: etcd (its members outlive any node), or with c10d dtrain-run's own, served by
// the agent on the endpoint's host (the first there to bind its port); every agent is a client.
void Launcher::setUpElastic() {
  if (opts_.rdzv_backend == "etcd") {
    // Requests fail after the heartbeat timeout: an agent cut off from etcd stops its workers.
    rdzv_store_ = comm::makeEtcdStore(opts_.rdzv_endpoint, "/dtrain/elastic/" + opts_.rdzv_id + "/",
                                      std::max(opts_.heartbeat_timeout, std::chrono::milliseconds(10000)));
    return;
  }
  const auto [host, port] = hostPort(opts_.rdzv_endpoint, "--rdzv-endpoint");
  if (routeTo(host) == host || host == "127.0.0.1" || host == "localhost") {
    try {
      store_ = std::make_unique<comm::TcpStoreServer>(host, static_cast<uint16_t>(port), opts_.secret);
      say("hosting the rendezvous store on {}:{}", host, port);
    } catch (const Error&) {
      // another agent of this host serves it
    }
  }
  // Store requests fail after the heartbeat timeout: an agent that lost the store stops its workers.
  rdzv_store_ = std::make_shared<comm::PrefixStore>(
      "elastic/" + opts_.rdzv_id,
      std::make_shared<comm::TcpStore>(host, static_cast<uint16_t>(port),
                                       std::max(opts_.heartbeat_timeout, std::chrono::milliseconds(10000)),
                                       opts_.secret));
}

int Launcher::runElastic() {
  ElasticOptions eo;
  eo.min_nodes = opts_.min_nodes;
  eo.max_nodes = opts_.max_nodes;
  eo.node_id = nodeId();
  eo.heartbeat_timeout = opts_.heartbeat_timeout;
  eo.heartbeat = std::max(std::chrono::milliseconds(100), opts_.heartbeat_timeout / 10);
  eo.last_call = opts_.last_call;
  eo.address = routeTo(rdzvHost(opts_));
  snapshot_store_ = std::make_unique<comm::TcpStoreServer>(eo.address, 0, opts_.secret);
  eo.snapshot_store = fmt::format("{}:{}", eo.address, snapshot_store_->port());
  ElasticRendezvous rdzv(rdzv_store_, eo);
  say("elastic: node {} at {} joins job '{}' ({}:{} nodes, rendezvous {} {})", eo.node_id, eo.address, opts_.rdzv_id,
      eo.min_nodes, eo.max_nodes, opts_.rdzv_backend, opts_.rdzv_endpoint);
  for (;;) {
    Round rd;
    try {
      rd = rdzv.join();
    } catch (const ElasticRendezvous::JobFinished&) {
      say("the job finished without this node");
      return 0;
    }
    // The round's workers rendezvous through a store of their own, on node 0 of the round.
    std::unique_ptr<comm::TcpStoreServer> round_store;
    if (rd.node_rank == 0) {
      round_store = std::make_unique<comm::TcpStoreServer>(eo.address, 0, opts_.secret);
      rdzv.publishMaster(fmt::format("{}:{}", eo.address, round_store->port()));
    }
    const auto [mhost, mport] = hostPort(rdzv.master(), "round store");
    opts_.nnodes = rd.nnodes;
    opts_.node_rank = rd.node_rank;
    opts_.master_addr = mhost;
    opts_.snapshot_stores = fmt::format("{}", fmt::join(rd.snapshot_stores, ","));
    master_port_ = static_cast<uint16_t>(mport);
    say("round {}: {} node(s), world size {}; this node is node {}", rd.number, rd.nnodes,
        rd.nnodes * opts_.nproc_per_node, rd.node_rank);
    // The round number is every node's restart count: the workers' store keys depend on it, and a node
    // that joined later has restarted fewer times than the others.
    Outcome o = runOnce(static_cast<int>(rd.number), [&] { return rdzv.poll(); });
    if (!o.ended_by.empty()) {
      say("round {} ends: {}; workers stopped", rd.number, o.ended_by);
      if (o.ended_by.rfind("the job failed", 0) == 0) return 1;
      rdzv.endRound();
      continue;
    }
    if (!o.restartable) {
      if (o.exit_code != 0) return o.exit_code;  // the launcher itself was stopped
      if (rdzv.finish()) {
        say("round {}: every node's workers succeeded", rd.number);
        if (store_) rdzv.waitForAllToLeave(std::chrono::seconds(10));
        return 0;
      }
      say("round {} ended before every node finished; joining the next one", rd.number);
      continue;
    }
    // A worker failed. A lost node explains it (its peers' collectives fail at once): that is a
    // membership change, not a failure counted against --max-restarts.
    std::string why;
    const auto until = std::chrono::steady_clock::now() + opts_.heartbeat_timeout + std::chrono::seconds(1);
    while (why.empty() && std::chrono::steady_clock::now() < until) {
      why = rdzv.poll();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!why.empty()) {
      say("worker failure in round {} follows a membership change ({}): not counted", rd.number, why);
      if (why.rfind("the job failed", 0) == 0) return o.exit_code;
      rdzv.endRound();
      continue;
    }
    const int64_t failures = rdzv.countFailure();
    if (failures > opts_.max_restarts) {
      say("{} failure(s), more than --max-restarts {}; the job fails", failures, opts_.max_restarts);
      rdzv.fail(fmt::format("a worker on node {} failed with code {} after {} failure(s) (--max-restarts {})",
                            eo.node_id, o.exit_code, failures, opts_.max_restarts));
      return o.exit_code;
    }
    say("failure {} of --max-restarts {}; starting a new round", failures, opts_.max_restarts);
    rdzv.endRound();
  }
}

}  // namespace dtrain::run
