// The parameter server's environment: the job's store and a server process's role (see ps.h, env.h).
#include "env.h"

#include <fmt/format.h>

#include <cstring>
#include <string>

#include "comm/rendezvous/internal.h"
#include "dtrain/comm/error.h"

namespace dtrain::ps {

using comm::rendezvous::Environment;

LaunchRoles launchRoles(const Environment& env) {
  LaunchRoles r;
  const char* role = env.get("DTRAIN_ROLE");
  r.server = role && std::strcmp(role, "server") == 0;
  r.server_index = env.integer("DTRAIN_SERVER_INDEX", -1, 0);
  r.num_servers = env.integer("DTRAIN_NUM_SERVERS", -1, 1);
  r.num_workers = env.integer("DTRAIN_NUM_WORKERS", -1, 1);
  r.num_nodes = env.integer("DTRAIN_NUM_NODES", -1, 1);
  return r;
}

std::shared_ptr<comm::Store> storeFrom(const Environment& env, std::chrono::milliseconds timeout) {
  comm::rendezvous::JobStoreRequest r;
  r.scope = "ps";
  r.user = "ps: ";
  r.may_host = false;  // dtrain-run hosts it (DTRAIN_USE_AGENT_STORE=1)
  r.timeout = timeout;
  return comm::rendezvous::openJobStore(env, comm::InitOptions{}, r).store;
}

std::shared_ptr<comm::Store> storeFromEnv(std::chrono::milliseconds timeout) {
  return storeFrom(Environment::read(), timeout);
}

bool runServerIfRole(const Environment& env, const PSOptions& opts) {
  const LaunchRoles roles = launchRoles(env);
  if (!roles.server) return false;
  // With local aggregation the servers' workers are the hosts.
  const char* count_var = opts.local_aggregation ? "DTRAIN_NUM_NODES" : "DTRAIN_NUM_WORKERS";
  const int workers = opts.local_aggregation ? roles.num_nodes : roles.num_workers;
  if (roles.server_index < 0 || roles.num_servers < 1 || workers < 1) {
    throw RendezvousError(fmt::format("ps: DTRAIN_ROLE=server needs DTRAIN_SERVER_INDEX, DTRAIN_NUM_SERVERS and {}",
                                      count_var));
  }
  // The store's connection deadline is storeFromEnv()'s default (ps.h).
  Server server(storeFrom(env, std::chrono::seconds(60)), roles.server_index, roles.num_servers, workers, opts);
  server.run();
  return true;
}

bool runServerIfRole(PSOptions opts) { return runServerIfRole(Environment::read(), opts); }

}  // namespace dtrain::ps
