// Rendezvous: environment detection, store choice and the world group (see rendezvous.h).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "dtrain/comm/error.h"
#include "dtrain/comm/rendezvous.h"

namespace dtrain::comm {

namespace {

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

}  // namespace

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
    return w;
  };
  if (o.rank >= 0 || o.world_size > 0) {
    if (o.rank < 0 || o.world_size < 1) {
      throw RendezvousError(fmt::format("InitOptions: give both rank and world_size (got {} and {})", o.rank, o.world_size));
    }
    w = {o.rank, o.world_size, o.local_rank >= 0 ? o.local_rank : o.rank,
         o.local_world_size > 0 ? o.local_world_size : o.world_size, "explicit"};
    return finish("InitOptions");
  }
  if (env("RANK") || env("WORLD_SIZE")) {
    if (!env("RANK") || !env("WORLD_SIZE")) {
      throw RendezvousError("RANK and WORLD_SIZE must be set together (torchrun convention)");
    }
    w.rank = envInt("RANK", 0, 0);
    w.size = envInt("WORLD_SIZE", 1, 1);
    w.local_rank = envInt("LOCAL_RANK", w.rank, 0);
    w.local_size = envInt("LOCAL_WORLD_SIZE", w.size, 1);
    w.source = "torchrun";
    return finish("RANK/WORLD_SIZE");
  }
  if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    w.rank = envInt("OMPI_COMM_WORLD_RANK", 0, 0);
    w.size = envInt("OMPI_COMM_WORLD_SIZE", 1, 1);
    w.local_rank = envInt("OMPI_COMM_WORLD_LOCAL_RANK", w.rank, 0);
    w.local_size = envInt("OMPI_COMM_WORLD_LOCAL_SIZE", w.size, 1);
    w.source = "openmpi";
    return finish("OMPI_COMM_WORLD_*");
  }
  if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    w.rank = envInt("SLURM_PROCID", 0, 0);
    w.size = envInt("SLURM_NTASKS", 1, 1);
    w.local_rank = envInt("SLURM_LOCALID", 0, 0);
    // SLURM_NTASKS_PER_NODE is only set with --ntasks-per-node; otherwise the local size is unknown.
    w.local_size = envInt("SLURM_NTASKS_PER_NODE", w.local_rank + 1, 1);
    w.source = "slurm";
    return finish("SLURM_*");
  }
  return w;
}

std::shared_ptr<ProcessGroup> init(InitOptions o) {
  WorldInfo w = detectWorld(o);
  if (w.size == 1) {
    if (w.source == "none") {
      std::fprintf(stderr,
                   "dtrain: no RANK/WORLD_SIZE, OMPI_COMM_WORLD_* or SLURM_* variables: distributed training "
                   "disabled (a world of one)\n");
    }
    return ProcessGroup::create(nullptr, 0, 1, o.group);
  }
  std::string method = o.init_method;
  if (method.empty() && env("DTRAIN_INIT_METHOD")) method = env("DTRAIN_INIT_METHOD");
  std::string host = !o.master_addr.empty() ? o.master_addr : (env("MASTER_ADDR") ? env("MASTER_ADDR") : "127.0.0.1");
  int port = o.master_port >= 0 ? o.master_port : envInt("MASTER_PORT", 29500, 1);
  if (method.rfind("tcp://", 0) == 0) {
    std::string hp = method.substr(6);
    auto colon = hp.rfind(':');
    if (colon == std::string::npos) {
      throw RendezvousError(fmt::format("init_method '{}': expected tcp://host:port", method));
    }
    host = hp.substr(0, colon);
    port = std::atoi(hp.c_str() + colon + 1);
  }
  int restart = envInt("DTRAIN_RESTART_COUNT", envInt("TORCHELASTIC_RESTART_COUNT", 0, 0), 0);
  std::string prefix = fmt::format("gen{}/world", restart);
  std::shared_ptr<Store> store;
  if (method.rfind("file://", 0) == 0) {
    store = std::make_shared<PrefixStore>(prefix, std::make_shared<FileStore>(method.substr(7), o.group.timeout));
  } else if (!method.empty() && method != "env://" && method.rfind("tcp://", 0) != 0) {
    throw RendezvousError(fmt::format("init_method '{}': expected env://, tcp://host:port or file:///path", method));
  } else {
    std::shared_ptr<TcpStoreServer> server;
    bool agent = env("DTRAIN_USE_AGENT_STORE") && std::string(env("DTRAIN_USE_AGENT_STORE")) == "1";
    if (w.rank == 0 && !agent) {
      try {
        server = std::make_shared<TcpStoreServer>(host, static_cast<uint16_t>(port));
      } catch (const Error& e) {
        throw RendezvousError(fmt::format("[rank 0] cannot host the store on {}:{}: {}", host, port, e.what()));
      }
    }
    std::shared_ptr<Store> client;
    try {
      client = std::make_shared<TcpStore>(host, static_cast<uint16_t>(port), o.group.timeout);
    } catch (const Error& e) {
      throw RendezvousError(fmt::format("[rank {}] cannot reach the store at {}:{} (MASTER_ADDR:MASTER_PORT): {}",
                                        w.rank, host, port, e.what()));
    }
    store = std::make_shared<HostedStore>(prefix, client, server);
  }
  return ProcessGroup::create(store, w.rank, w.size, o.group);
}

}  // namespace dtrain::comm
