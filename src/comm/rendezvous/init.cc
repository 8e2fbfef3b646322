// Rendezvous: the world's detection, the group options from the environment, and initWorld() (see
// rendezvous.h). The job's store is set up in job_store.cc, Slurm's lists are in slurm.cc, the
// agreement in agree.cc; every one of them reads the environment through an Environment.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "comm/net/socket.h"
#include "comm/rendezvous/internal.h"
#include "comm/trace/timeline_start.h"
#include "comm/trace/trace_internal.h"
#include "comm/transport/transport.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm {

namespace rendezvous {

int parsePort(const Environment& env, const std::string& text, const std::string& what) {
  bool digits = !text.empty() && text.size() <= 5;
  for (char c : text) digits = digits && c >= '0' && c <= '9';
  int port = digits ? std::atoi(text.c_str()) : -1;
  if (port < 1 || port > 65535) {
    throw InvalidArgument(fmt::format("{}{}='{}' is not a port number (1-65535)", env.rankPrefix(), what, text));
  }
  return port;
}

void checkResolves(const Environment& env, const std::string& host, const std::string& what) {
  try {
    net::resolve(host, 1);
  } catch (const Error& e) {
    throw InvalidArgument(
        fmt::format("{}{}='{}' is not a usable address: {}", env.rankPrefix(), what, host, e.what()));
  }
}

GroupOptions groupOptions(const Environment& env) {
  GroupOptions o;
  if (const char* t = env.get("DTRAIN_TIMEOUT")) {
    char* end = nullptr;
    double secs = std::strtod(t, &end);
    DTRAIN_CHECK(end && *end == 0 && secs > 0, InvalidArgument,
                 "DTRAIN_TIMEOUT='{}' is not a positive number of seconds", t);
    o.timeout = std::chrono::milliseconds(static_cast<int64_t>(secs * 1000));
  }
  if (const char* c = env.get("DTRAIN_CUDA_COMM")) o.cuda_path = c;
  DTRAIN_CHECK(o.cuda_path == "auto" || o.cuda_path == "nccl" || o.cuda_path == "staged", InvalidArgument,
               "DTRAIN_CUDA_COMM='{}' (expected auto, nccl or staged)", o.cuda_path);
  if (const char* t = env.get("DTRAIN_TRANSPORT")) o.transport = t;
  DTRAIN_CHECK(o.transport == "auto" || o.transport == "tcp" || o.transport == "shm" || o.transport == "mpi",
               InvalidArgument, "DTRAIN_TRANSPORT='{}' (expected auto, tcp, shm or mpi)", o.transport);
  if (const char* s = env.get("DTRAIN_SEGMENT_BYTES")) {
    char* end = nullptr;
    long long v = std::strtoll(s, &end, 10);
    DTRAIN_CHECK(end && *end == 0 && v > 0, InvalidArgument, "DTRAIN_SEGMENT_BYTES='{}' is not a positive integer", s);
    o.segment_bytes = static_cast<size_t>(v);
  }
  o.spin_us = env.integer("DTRAIN_SPIN_US", -1, 0);
  const char* debug = env.get("DTRAIN_DEBUG");
  o.check_fingerprints = debug && std::strcmp(debug, "detail") == 0;
  o.secret = jobSecret(env);
  return o;
}

std::string jobSecret(const Environment& env) {
  return jobSecretFrom(env.get("DTRAIN_SECRET"), env.get("DTRAIN_SECRET_FILE"));
}

void checkStoreVariables(const Environment& env) {
  if (const char* p = env.get("MASTER_PORT")) parsePort(env, p, "MASTER_PORT");
  if (const char* a = env.get("MASTER_ADDR")) checkResolves(env, a, "MASTER_ADDR");
}

std::string listenHost(const Environment& env) {
  if (const char* ifname = env.get("DTRAIN_IFNAME")) return net::interfaceAddress(ifname);
  if (const char* master = env.get("MASTER_ADDR")) return net::localAddressFor(master);
  return "";
}

WorldInfo detectWorld(const Environment& env, const InitOptions& o) {
  WorldInfo w;
  auto finish = [&](const char* what) {
    if (w.size < 1 || w.rank < 0 || w.rank >= w.size) {
      throw RendezvousError(fmt::format("{}: rank {} is not within a world of {}", what, w.rank, w.size));
    }
    if (w.local_size < 1) w.local_size = 1;
    if (w.local_rank < 0 || w.local_rank >= w.local_size) {
      throw RendezvousError(fmt::format("{}: local rank {} is not within a local world of {}", what, w.local_rank,
                                        w.local_size));
    }
  };
  // Ranks numbered node by node, as torchrun and dtrain-run number them.
  auto blockNode = [&] { return (w.rank - w.local_rank) / w.local_size; };
  if (o.rank >= 0 || o.world_size > 0) {
    if (o.rank < 0 || o.world_size < 1) {
      throw RendezvousError(fmt::format("InitOptions: give both rank and world_size (got {} and {})", o.rank, o.world_size));
    }
    w.rank = o.rank;
    w.size = o.world_size;
    w.local_rank = o.local_rank >= 0 ? o.local_rank : o.rank;
    w.local_size = o.local_world_size > 0 ? o.local_world_size : o.world_size;
    w.source = "explicit";
    w.num_nodes = -1;
    finish("InitOptions");
    w.node = blockNode();
    return w;
  }
  if (env.get("RANK") || env.get("WORLD_SIZE")) {
    if (!env.get("RANK") || !env.get("WORLD_SIZE")) {
      throw RendezvousError("RANK and WORLD_SIZE must be set together (torchrun convention)");
    }
    w.rank = env.integer("RANK", 0, 0);
    w.size = env.integer("WORLD_SIZE", 1, 1);
    w.local_rank = env.integer("LOCAL_RANK", w.rank, 0);
    w.local_size = env.integer("LOCAL_WORLD_SIZE", w.size, 1);
    w.num_nodes = env.integer("GROUP_WORLD_SIZE", -1, 1);
    if (const char* id = env.get("TORCHELASTIC_RUN_ID")) w.job = fmt::format("torchrun run {}", id);
    w.source = "torchrun";
    finish("RANK/WORLD_SIZE");
    w.node = env.get("GROUP_RANK") ? env.integer("GROUP_RANK", 0, 0) : blockNode();
    return w;
  }
  if (env.get("OMPI_COMM_WORLD_RANK") && env.get("OMPI_COMM_WORLD_SIZE")) {
    w.rank = env.integer("OMPI_COMM_WORLD_RANK", 0, 0);
    w.size = env.integer("OMPI_COMM_WORLD_SIZE", 1, 1);
    w.local_rank = env.integer("OMPI_COMM_WORLD_LOCAL_RANK", w.rank, 0);
    w.local_size = env.integer("OMPI_COMM_WORLD_LOCAL_SIZE", w.size, 1);
    if (const char* id = env.get("OMPI_MCA_ess_base_jobid")) w.job = fmt::format("openmpi job {}", id);
    w.source = "openmpi";
    finish("OMPI_COMM_WORLD_*");
    w.node = w.num_nodes = -1;  // mpirun maps ranks to hosts in many ways: group them by host at rendezvous
    return w;
  }
  if (auto slurm = detectSlurm(env)) {
    w = *slurm;
    finish("SLURM_*");
    return w;
  }
  return w;
}

}  // namespace rendezvous

using namespace rendezvous;

GroupOptions GroupOptions::fromEnv() {
  const Environment env = Environment::read();
  checkStoreVariables(env);
  GroupOptions o = groupOptions(env);
  o.listen_host = listenHost(env);
  return o;
}

WorldInfo detectWorld(const InitOptions& o) { return detectWorld(Environment::read(), o); }

std::shared_ptr<ProcessGroup> initWorld(InitOptions o, WorldInfo* info) {
  // The environment is read here, once; configuration errors fail before anything else happens.
  const Environment env = Environment::read();
  checkStoreVariables(env);
  GroupOptions group = o.group ? *o.group : groupOptions(env);
  if (group.listen_host.empty()) group.listen_host = listenHost(env);
  if (group.secret.empty()) group.secret = jobSecret(env);  // (a given GroupOptions too: the store has it)
  if (group.name.empty()) group.name = "world";
  const trace::timeline::Config timeline = trace::timeline::configFrom(env);
  WorldInfo w = detectWorld(env, o);
  if (!trace::threadHasName()) dtrain::trace::setThreadName("main");
  if (w.size == 1) {
    if (w.source == "none") {
      std::fprintf(stderr,
                   "dtrain: no RANK/WORLD_SIZE, OMPI_COMM_WORLD_* or SLURM_* variables: distributed training "
                   "disabled (a world of one)\n");
    }
    w.nodes = {{0}};
    if (info) *info = w;
    auto world = ProcessGroup::create(nullptr, 0, 1, group);
    trace::timeline::startWorld(timeline, *world, nullptr, net::hostName());
    return world;
  }
  JobStore js = openJobStore(env, o, {"world", w.rank, "", /*may_host=*/true, group.timeout});
  // Peers on other nodes must reach this rank's TCP transport: listen where the route to another node
  // of the step leaves (on one node, where the store's host is reached).
  if (js.address && js.address->derived && group.listen_host.empty()) {
    std::optional<std::string> peer = slurmPeerNode(env);
    group.listen_host = net::localAddressFor(peer ? *peer : js.address->host);
  }
  View mine;
  mine.world = w;
  mine.host_id = transport::hostId();
  mine.hostname = net::hostName();
  w.nodes = agreeOnWorld(*js.store, mine, js.where, group.timeout, js.hosted);
  if (info) *info = w;
  auto world = ProcessGroup::create(js.store, w.rank, w.size, group);
  trace::timeline::startWorld(timeline, *world, js.store.get(), mine.hostname);
  return world;
}

std::shared_ptr<ProcessGroup> newNodeGroup(const std::shared_ptr<ProcessGroup>& world, const WorldInfo& info) {
  if (world->size() == 1) return world;
  DTRAIN_CHECK(!info.nodes.empty(), InvalidArgument,
               "[rank {}] newNodeGroup: the WorldInfo has no nodes (take it from initWorld(opts, &info))",
               world->rank());
  std::shared_ptr<ProcessGroup> mine;
  for (const auto& ranks : info.nodes) {
    auto g = world->newGroup(ranks);
    if (g) mine = g;
  }
  DTRAIN_CHECK(mine != nullptr, InvalidArgument, "[rank {}] newNodeGroup: this rank is on no node of the WorldInfo",
               world->rank());
  return mine;
}

}  // namespace dtrain::comm
