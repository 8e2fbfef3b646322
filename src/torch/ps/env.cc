// The parameter server's environment: the job's store and a server process's role (see ps.h).
#include <fmt/format.h>

#include <climits>
#include <cstdlib>
#include <string>

#include "dtrain/comm/error.h"
#include "dtrain/comm/rendezvous.h"
#include "dtrain/ps.h"

namespace dtrain::ps {

namespace {
int envInt(const char* name, int def) {
  const char* v = std::getenv(name);
  if (!v || !*v) return def;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end != '\0' || x < 0 || x > INT_MAX) throw RendezvousError(fmt::format("{}='{}' is not a valid count", name, v));
  return static_cast<int>(x);
}
}  // namespace

std::shared_ptr<comm::Store> storeFromEnv(std::chrono::milliseconds timeout) {
  // The same address as dtrain::init() (MASTER_ADDR/MASTER_PORT checked at once, Slurm's first node).
  comm::StoreAddress where = comm::storeAddress(comm::InitOptions{});
  const std::string& host = where.host;
  const int port = where.port;
  int restart = envInt("DTRAIN_RESTART_COUNT", envInt("TORCHELASTIC_RESTART_COUNT", 0));
  std::shared_ptr<comm::Store> base;
  try {
    base = std::make_shared<comm::TcpStore>(host, static_cast<uint16_t>(port), timeout);
  } catch (const Error& e) {
    throw RendezvousError(fmt::format("ps: cannot reach the store at {}:{}: {}", host, port, e.what()));
  }
  return std::make_shared<comm::PrefixStore>(fmt::format("gen{}/ps", restart), base);
}

bool runServerIfRole(PSOptions opts) {
  const char* role = std::getenv("DTRAIN_ROLE");
  if (!role || std::string(role) != "server") return false;
  int index = envInt("DTRAIN_SERVER_INDEX", -1);
  int servers = envInt("DTRAIN_NUM_SERVERS", -1);
  // With local aggregation the servers' workers are the hosts.
  const char* count_var = opts.local_aggregation ? "DTRAIN_NUM_NODES" : "DTRAIN_NUM_WORKERS";
  int workers = envInt(count_var, -1);
  if (index < 0 || servers < 1 || workers < 1) {
    throw RendezvousError(fmt::format("ps: DTRAIN_ROLE=server needs DTRAIN_SERVER_INDEX, DTRAIN_NUM_SERVERS and {}",
                                      count_var));
  }
  Server server(storeFromEnv(), index, servers, workers, opts);
  server.run();
  return true;
}


}  // namespace dtrain::ps
