// The store a job's processes share: one set-up for initWorld() and the parameter server. Where the
// TcpStore is (storeAddress), which init method applies, and the restart generation of its keys.
#include <cstdlib>

#include "comm/rendezvous/internal.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm {

namespace rendezvous {

namespace {

// A store that keeps the TcpStore server it talks to alive (rank 0 hosts it for the job's lifetime).
class HostedStore : public PrefixStore {
 public:
  HostedStore(std::string prefix, std::shared_ptr<Store> base, std::shared_ptr<TcpStoreServer> server)
      : PrefixStore(std::move(prefix), std::move(base)), server_(std::move(server)) {}

 private:
  std::shared_ptr<TcpStoreServer> server_;
};

// The address of a "tcp://host:port" init method; `given` says whether InitOptions named it.
StoreAddress tcpMethodAddress(const Environment& env, const std::string& method, bool given) {
  std::string hp = method.substr(6);
  auto colon = hp.rfind(':');
  if (colon == std::string::npos) {
    throw InvalidArgument(fmt::format("init_method '{}': expected tcp://host:port", method));
  }
  StoreAddress addr;
  addr.host = hp.substr(0, colon);
  addr.port = parsePort(env, hp.substr(colon + 1), fmt::format("the port of init_method '{}'", method));
  addr.origin = given ? "InitOptions::init_method" : "DTRAIN_INIT_METHOD";
  checkResolves(env, addr.host, fmt::format("the host of init_method '{}'", method));
  return addr;
}

}  // namespace

int restartCount(const Environment& env) {
  return env.integer("DTRAIN_RESTART_COUNT", env.integer("TORCHELASTIC_RESTART_COUNT", 0, 0), 0);
}

StoreAddress storeAddress(const Environment& env, const InitOptions& o) {
  StoreAddress a;
  std::string host_origin, port_origin;
  std::optional<SlurmStore> slurm;
  bool slurm_tried = false;
  auto fromSlurm = [&]() -> const SlurmStore* {
    if (!slurm_tried) slurm = slurmStore(env);
    slurm_tried = true;
    return slurm ? &*slurm : nullptr;
  };
  if (!o.master_addr.empty()) {
    a.host = o.master_addr;
    host_origin = "InitOptions::master_addr";
  } else if (env.get("MASTER_ADDR")) {
    a.host = env.get("MASTER_ADDR");
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
    a.port = parsePort(env, std::to_string(o.master_port), "InitOptions::master_port");
    port_origin = "InitOptions::master_port";
  } else if (env.get("MASTER_PORT")) {
    a.port = parsePort(env, env.get("MASTER_PORT"), "MASTER_PORT");
    port_origin = "MASTER_PORT";
  } else if (const SlurmStore* s = fromSlurm()) {
    a.port = s->port;
    port_origin = s->port_origin;
  } else {
    a.port = 29500;
    port_origin = "the default port";
  }
  checkResolves(env, a.host, host_origin);
  a.origin = host_origin == "MASTER_ADDR" && port_origin == "MASTER_PORT"
                 ? "MASTER_ADDR:MASTER_PORT"
                 : fmt::format("{} and {}", host_origin, port_origin);
  return a;
}

JobStore openJobStore(const Environment& env, const InitOptions& o, const JobStoreRequest& r) {
  std::string method = o.init_method;
  if (method.empty() && env.get("DTRAIN_INIT_METHOD")) method = env.get("DTRAIN_INIT_METHOD");
  const std::string prefix = fmt::format("gen{}/{}", restartCount(env), r.scope);
  const std::string who = (r.rank >= 0 ? fmt::format("[rank {}] ", r.rank) : env.rankPrefix()) + r.user;
  JobStore js;
  if (method.rfind("file://", 0) == 0) {
    js.store = std::make_shared<PrefixStore>(prefix, std::make_shared<FileStore>(method.substr(7), r.timeout));
    js.where = method;
    return js;
  }
  if (!method.empty() && method != "env://" && method.rfind("tcp://", 0) != 0) {
    throw InvalidArgument(fmt::format("init_method '{}': expected env://, tcp://host:port or file:///path", method));
  }
  const std::string secret = jobSecret(env);
  const StoreAddress addr =
      method.rfind("tcp://", 0) == 0 ? tcpMethodAddress(env, method, !o.init_method.empty()) : storeAddress(env, o);
  js.address = addr;
  js.where = fmt::format("{}:{} ({})", addr.host, addr.port, addr.origin);
  std::shared_ptr<TcpStoreServer> server;
  if (r.may_host && r.rank == 0 && !env.flag("DTRAIN_USE_AGENT_STORE")) {
    try {
      // A derived address is a node name: listen on every interface, not wherever the name resolves here.
      server = std::make_shared<TcpStoreServer>(addr.derived ? "0.0.0.0" : addr.host, static_cast<uint16_t>(addr.port),
                                                secret);
    } catch (const Error& e) {
      throw RendezvousError(fmt::format(
          "[rank 0] cannot host the store on {}: {}; is another job or program using the port? Set MASTER_PORT to "
          "another port on every rank",
          js.where, e.what()));
    }
  }
  std::shared_ptr<Store> client;
  try {
    client = std::make_shared<TcpStore>(addr.host, static_cast<uint16_t>(addr.port), r.timeout, secret);
  } catch (const Error& e) {
    throw RendezvousError(fmt::format(
        "{}cannot reach the store at {}: {}. Check that {} is running with the same store address "
        "(MASTER_ADDR:MASTER_PORT) and that no firewall blocks the port",
        who, js.where, e.what(), r.may_host ? "rank 0" : "the process that hosts it (dtrain-run)"));
  }
  js.hosted = server != nullptr;
  js.store = std::make_shared<HostedStore>(prefix, client, server);
  return js;
}

}  // namespace rendezvous

StoreAddress storeAddress(const InitOptions& opts) {
  return rendezvous::storeAddress(rendezvous::Environment::read(), opts);
}

}  // namespace dtrain::comm
