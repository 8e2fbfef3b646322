// Rendezvous: environment detection, the store's address, the store, the ranks' agreement on the
// world and the world group (see rendezvous.h). Slurm's lists are in slurm.cc, the agreement in agree.cc.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "comm/net/socket.h"
#include "comm/rendezvous/internal.h"
#include "comm/transport/transport.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm {

namespace rendezvous {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int envInt(const char* name, int dflt, int min_value) {
  const char* v = env(name);
  if (!v) return dflt;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (!end || *end != 0 || x < min_value || x > 1 << 24) {
    throw RendezvousError(fmt::format("environment variable {}='{}' is not an integer >= {}", name, v, min_value));
  }
  return static_cast<int>(x);
}

std::string rankPrefix() {
  for (const char* v : {"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"}) {
    const char* r = env(v);
    if (!r) continue;
    bool digits = std::strlen(r) <= 9;
    for (const char* c = r; *c; ++c) digits = digits && *c >= '0' && *c <= '9';
    return digits ? fmt::format("[rank {}] ", r) : "";
  }
  return "";
}

int parsePort(const std::string& text, const std::string& what) {
  bool digits = !text.empty() && text.size() <= 5;
  for (char c : text) digits = digits && c >= '0' && c <= '9';
  int port = digits ? std::atoi(text.c_str()) : -1;
  if (port < 1 || port > 65535) {
    throw InvalidArgument(fmt::format("{}{}='{}' is not a port number (1-65535)", rankPrefix(), what, text));
  }
  return port;
}

}  // namespace rendezvous

using namespace rendezvous;

namespace {

// InvalidArgument naming `what` unless host resolves to an address.
void checkResolves(const std::string& host, const std::string& what) {
  try {
    net::resolve(host, 1);
  } catch (const Error& e) {
    throw InvalidArgument(fmt::format("{}{}='{}' is not a usable address: {}", rankPrefix(), what, host, e.what()));
  }
}

// dtrain-run reads stdout through a pipe, which makes it block-buffered: what a worker printed last
// would be lost when the launcher stops it. With DTRAIN_LINE_BUFFERED=1 (set by dtrain-run) stdout is
// line-buffered before main() runs, for printf and std::cout (which writes through stdout unless
// sync_with_stdio(false)) alike. Every program that forms a group links this file.
[[maybe_unused]] const bool kLineBuffered = [] {
  const char* v = std::getenv("DTRAIN_LINE_BUFFERED");
  return v && std::strcmp(v, "1") == 0 && std::setvbuf(stdout, nullptr, _IOLBF, 0) == 0;
}();

// A store that keeps the TcpStore server it talks to alive (rank 0 hosts it for the job's lifetime).
class HostedStore : public PrefixStore {
 public:
  HostedStore(std::string prefix, std::shared_ptr<Store> base, std::shared_ptr<TcpStoreServer> server)
      : PrefixStore(std::move(prefix), std::move(base)), server_(std::move(server)) {}

 private:
  std::shared_ptr<TcpStoreServer> server_;
};

std::string hostname() {
  char h[256] = {0};
  gethostname(h, sizeof h - 1);
  return h;
}

}  // namespace

GroupOptions groupOptionsFromEnv() {
  if (const char* p = env("MASTER_PORT")) parsePort(p, "MASTER_PORT");
  if (const char* a = env("MASTER_ADDR")) checkResolves(a, "MASTER_ADDR");
  return GroupOptions::fromEnv();
}

WorldInfo detectWorld(const InitOptions& o) {
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
  if (env("RANK") || env("WORLD_SIZE")) {
    if (!env("RANK") || !env("WORLD_SIZE")) {
      throw RendezvousError("RANK and WORLD_SIZE must be set together (torchrun convention)");
    }
    w.rank = envInt("RANK", 0, 0);
    w.size = envInt("WORLD_SIZE", 1, 1);
    w.local_rank = envInt("LOCAL_RANK", w.rank, 0);
    w.local_size = envInt("LOCAL_WORLD_SIZE", w.size, 1);
    w.num_nodes = envInt("GROUP_WORLD_SIZE", -1, 1);
    if (const char* id = env("TORCHELASTIC_RUN_ID")) w.job = fmt::format("torchrun run {}", id);
    w.source = "torchrun";
    finish("RANK/WORLD_SIZE");
    w.node = env("GROUP_RANK") ? envInt("GROUP_RANK", 0, 0) : blockNode();
    return w;
  }
  if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    w.rank = envInt("OMPI_COMM_WORLD_RANK", 0, 0);
    w.size = envInt("OMPI_COMM_WORLD_SIZE", 1, 1);
    w.local_rank = envInt("OMPI_COMM_WORLD_LOCAL_RANK", w.rank, 0);
    w.local_size = envInt("OMPI_COMM_WORLD_LOCAL_SIZE", w.size, 1);
    if (const char* id = env("OMPI_MCA_ess_base_jobid")) w.job = fmt::format("openmpi job {}", id);
    w.source = "openmpi";
    finish("OMPI_COMM_WORLD_*");
    w.node = w.num_nodes = -1;  // mpirun maps ranks to hosts in many ways: group them by host at rendezvous
    return w;
  }
  if (auto slurm = detectSlurm()) {
    w = *slurm;
    finish("SLURM_*");
    return w;
  }
  return w;
}

StoreAddress storeAddress(const InitOptions& o) {
  StoreAddress a;
  std::string host_origin, port_origin;
  std::optional<SlurmStore> slurm;
  bool slurm_tried = false;
  auto fromSlurm = [&]() -> const SlurmStore* {
    if (!slurm_tried) slurm = slurmStore();
    slurm_tried = true;
    return slurm ? &*slurm : nullptr;
  };
  if (!o.master_addr.empty()) {
    a.host = o.master_addr;
    host_origin = "InitOptions::master_addr";
  } else if (env("MASTER_ADDR")) {
    a.host = env("MASTER_ADDR");
    host_origin = "MASTER_ADDR";
  } else if (const SlurmStore* s = fromSlurm()) {
    a.host = s->host;
    host_origin = s->host_origin;
    a.derived = true;
  } else {
    a.host = "127.0.0.1";
    host_origin = "the default host";
  }
  if (o.master_port >= 0) {
    a.port = parsePort(std::to_string(o.master_port), "InitOptions::master_port");
    port_origin = "InitOptions::master_port";
  } else if (env("MASTER_PORT")) {
    a.port = parsePort(env("MASTER_PORT"), "MASTER_PORT");
    port_origin = "MASTER_PORT";
  } else if (const SlurmStore* s = fromSlurm()) {
    a.port = s->port;
    port_origin = s->port_origin;
  } else {
    a.port = 29500;
    port_origin = "the default port";
  }
  checkResolves(a.host, host_origin);
  a.origin = host_origin == "MASTER_ADDR" && port_origin == "MASTER_PORT"
                 ? "MASTER_ADDR:MASTER_PORT"
                 : fmt::format("{} and {}", host_origin, port_origin);
  return a;
}

std::shared_ptr<ProcessGroup> init(InitOptions o, WorldInfo* info) {
  WorldInfo w = detectWorld(o);
  if (w.size == 1) {
    if (w.source == "none") {
      std::fprintf(stderr,
                   "dtrain: no RANK/WORLD_SIZE, OMPI_COMM_WORLD_* or SLURM_* variables: distributed training "
                   "disabled (a world of one)\n");
    }
    w.nodes = {{0}};
    if (info) *info = w;
    return ProcessGroup::create(nullptr, 0, 1, o.group);
  }
  std::string method = o.init_method;
  if (method.empty() && env("DTRAIN_INIT_METHOD")) method = env("DTRAIN_INIT_METHOD");
  int restart = envInt("DTRAIN_RESTART_COUNT", envInt("TORCHELASTIC_RESTART_COUNT", 0, 0), 0);
  std::string prefix = fmt::format("gen{}/world", restart);
  std::shared_ptr<Store> store;
  std::string where;  // the store and where its address came from, for messages
  bool hosts_store = false;
  if (method.rfind("file://", 0) == 0) {
    store = std::make_shared<PrefixStore>(prefix, std::make_shared<FileStore>(method.substr(7), o.group.timeout));
    where = method;
  } else if (!method.empty() && method != "env://" && method.rfind("tcp://", 0) != 0) {
    throw InvalidArgument(fmt::format("init_method '{}': expected env://, tcp://host:port or file:///path", method));
  } else {
    StoreAddress addr;
    if (method.rfind("tcp://", 0) == 0) {
      std::string hp = method.substr(6);
      auto colon = hp.rfind(':');
      if (colon == std::string::npos) {
        throw InvalidArgument(fmt::format("init_method '{}': expected tcp://host:port", method));
      }
      addr.host = hp.substr(0, colon);
      addr.port = parsePort(hp.substr(colon + 1), fmt::format("the port of init_method '{}'", method));
      addr.origin = o.init_method.empty() ? "DTRAIN_INIT_METHOD" : "InitOptions::init_method";
      checkResolves(addr.host, fmt::format("the host of init_method '{}'", method));
    } else {
      addr = storeAddress(o);
    }
    // Peers on other nodes must reach this rank's TCP transport: listen where the route to another node
    // of the step leaves (on one node, where the store's host is reached).
    if (addr.derived && o.group.listen_host.empty()) {
      std::optional<std::string> peer = slurmPeerNode();
      o.group.listen_host = net::localAddressFor(peer ? *peer : addr.host);
    }
    where = fmt::format("{}:{} ({})", addr.host, addr.port, addr.origin);
    std::shared_ptr<TcpStoreServer> server;
    bool agent = env("DTRAIN_USE_AGENT_STORE") && std::string(env("DTRAIN_USE_AGENT_STORE")) == "1";
    if (w.rank == 0 && !agent) {
      try {
        // A derived address is a node name: listen on every interface, not wherever the name resolves here.
        server = std::make_shared<TcpStoreServer>(addr.derived ? "0.0.0.0" : addr.host,
                                                  static_cast<uint16_t>(addr.port));
      } catch (const Error& e) {
        throw RendezvousError(fmt::format(
            "[rank 0] cannot host the store on {}: {}; is another job or program using the port? Set MASTER_PORT to "
            "another port on every rank",
            where, e.what()));
      }
    }
    std::shared_ptr<Store> client;
    try {
      client = std::make_shared<TcpStore>(addr.host, static_cast<uint16_t>(addr.port), o.group.timeout);
    } catch (const Error& e) {
      throw RendezvousError(fmt::format(
          "[rank {}] cannot reach the store at {}: {}. Check that rank 0 is running with the same store address "
          "(MASTER_ADDR:MASTER_PORT) and that no firewall blocks the port",
          w.rank, where, e.what()));
    }
    hosts_store = server != nullptr;
    store = std::make_shared<HostedStore>(prefix, client, server);
  }
  View mine;
  mine.world = w;
  mine.host_id = transport::hostId();
  mine.hostname = hostname();
  w.nodes = agreeOnWorld(*store, mine, where, o.group.timeout, hosts_store);
  if (info) *info = w;
  return ProcessGroup::create(store, w.rank, w.size, o.group);
}

std::shared_ptr<ProcessGroup> newNodeGroup(const std::shared_ptr<ProcessGroup>& world, const WorldInfo& info) {
  if (world->size() == 1) return world;
  DTRAIN_CHECK(!info.nodes.empty(), InvalidArgument,
               "[rank {}] newNodeGroup: the WorldInfo has no nodes (take it from init(opts, &info))", world->rank());
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
