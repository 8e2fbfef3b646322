// The parameter server's view of the environment (internal; the public functions are in ps.h): what
// dtrain-run --servers S tells each process, parsed from a plain Environment (comm/rendezvous/
// environment.h) so it is tested without setenv.
#pragma once
#include <chrono>
#include <memory>

#include "comm/rendezvous/environment.h"
#include "dtrain/comm/store.h"
#include "dtrain/ps.h"

namespace dtrain::ps {

// The launcher's variables; -1 where unset.
struct LaunchRoles {
  bool server = false;    // DTRAIN_ROLE=server
  int server_index = -1;  // DTRAIN_SERVER_INDEX (>= 0)
  int num_servers = -1;   // DTRAIN_NUM_SERVERS (>= 1)
  int num_workers = -1;   // DTRAIN_NUM_WORKERS (>= 1)
  int num_nodes = -1;     // DTRAIN_NUM_NODES (>= 1): the servers' workers under local aggregation
};
// RendezvousError naming a malformed variable.
LaunchRoles launchRoles(const comm::rendezvous::Environment& env);

// The job's store under "gen<restart count>/ps", set up as initWorld() sets up the world's (the init
// method's FileStore or TcpStore, else the TcpStore at storeAddress()), never hosted here.
std::shared_ptr<comm::Store> storeFrom(const comm::rendezvous::Environment& env, std::chrono::milliseconds timeout);

// runServerIfRole() on a given environment.
bool runServerIfRole(const comm::rendezvous::Environment& env, const PSOptions& opts);

}  // namespace dtrain::ps
