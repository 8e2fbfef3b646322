// Pieces of the rendezvous shared by its files (not part of the public API). Every function that
// depends on the environment takes an Environment (environment.h), read once by its caller.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/rendezvous/environment.h"
#include "dtrain/comm/rendezvous.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm::rendezvous {

// A port: digits only, 1-65535; InvalidArgument naming `what` and the text (after env.rankPrefix())
// otherwise.
int parsePort(const Environment& env, const std::string& text, const std::string& what);
// InvalidArgument naming `what` unless host resolves to an address.
void checkResolves(const Environment& env, const std::string& host, const std::string& what);

// ---- What the public functions of rendezvous.h compute, from a given environment ----

// The group options from DTRAIN_TIMEOUT, DTRAIN_TRANSPORT, DTRAIN_SEGMENT_BYTES and DTRAIN_DEBUG over
// GroupOptions' defaults (listen_host is left empty); InvalidArgument naming a malformed value.
GroupOptions groupOptions(const Environment& env);
// The job secret of DTRAIN_SECRET or DTRAIN_SECRET_FILE (jobSecretFrom in store.h); "" when neither.
std::string jobSecret(const Environment& env);
// MASTER_PORT (1-65535) and MASTER_ADDR (it must resolve), when set: InvalidArgument naming the variable.
void checkStoreVariables(const Environment& env);
// Where the TCP transport listens when GroupOptions::listen_host is empty: DTRAIN_IFNAME's address,
// else the address that routes to MASTER_ADDR, else "" (the transport's 127.0.0.1).
std::string listenHost(const Environment& env);
// DTRAIN_RESTART_COUNT, else TORCHELASTIC_RESTART_COUNT, else 0.
int restartCount(const Environment& env);
WorldInfo detectWorld(const Environment& env, const InitOptions& o);
StoreAddress storeAddress(const Environment& env, const InitOptions& o);

// ---- The store a job's processes share ----

struct JobStore {
  std::shared_ptr<Store> store;          // keys under "gen<restartCount()>/<scope>/"
  std::string where;                     // the store and where its address came from, for messages
  bool hosted = false;                   // this process serves the TcpStore (rank 0 of initWorld())
  std::optional<StoreAddress> address;   // a TcpStore's address; nullopt for a FileStore
};
struct JobStoreRequest {
  std::string scope;     // "world" for initWorld(), "ps" for the parameter server
  int rank = -1;         // this process's rank; -1: unknown (messages then take it from the environment)
  std::string user;      // who asks, after the rank in messages: "" for initWorld(), "ps: " for the parameter server
  bool may_host = false; // rank 0 hosts the TcpStore unless DTRAIN_USE_AGENT_STORE=1 (the launcher does)
  Duration timeout = std::chrono::seconds(60);
};
// The one store set-up: the init method (o.init_method, else DTRAIN_INIT_METHOD) "file:///path" gives
// a FileStore there; "tcp://host:port" a TcpStore at that address; "", "env://" a TcpStore at
// storeAddress(env, o). InvalidArgument for another method or a malformed address; RendezvousError
// when the store cannot be reached or hosted, naming it and where its address came from.
JobStore openJobStore(const Environment& env, const InitOptions& o, const JobStoreRequest& r);

// ---- Slurm (slurm.cc) ----

// Slurm's world when SLURM_PROCID and a task count are set (the task of an srun step), else nullopt.
std::optional<WorldInfo> detectSlurm(const Environment& env);
// Slurm's store host and port when this is a Slurm task, else nullopt (see storeAddress()).
struct SlurmStore {
  std::string host, host_origin;
  int port = 0;
  std::string port_origin;
};
std::optional<SlurmStore> slurmStore(const Environment& env);
// Another node of this Slurm step (the next in its node list), or nullopt on one node: the route to it
// picks the interface peers on other nodes reach this one through (a node's own name may resolve to
// 127.0.1.1 on it, as Debian's /etc/hosts does).
std::optional<std::string> slurmPeerNode(const Environment& env);

// ---- The agreement on the world (agree.cc) ----

// What one rank believes about the world, as published at rendezvous.
struct View {
  WorldInfo world;
  std::string host_id;   // transport::hostId(): ranks with equal ids share memory
  std::string hostname;  // for messages
  std::string encode() const;
  static View decode(const std::string& text, int rank);
};

// rank 0's view against another's: world size, source, job, node count; "" when they agree.
std::string compareWorldFacts(const View& v0, const View& v);
// The first disagreement between the views (indexed by rank; every rank computes the same one), or "".
std::string findDisagreement(const std::vector<View>& views);
// Every node's ranks in local-rank order: by node index, or by host where the index is unknown (-1).
std::vector<std::vector<int>> nodesOf(const std::vector<View>& views);

// Publishes `mine` under `store`, waits (until `timeout`) for every rank's view, and compares them.
// Returns the nodes. RendezvousError on every rank for a disagreement (naming it) or, at the deadline,
// naming the ranks that have not joined `where` (the store's address and where it came from).
// `hosts_store`: this process serves the store, so it waits (briefly) for the others to read an error.
std::vector<std::vector<int>> agreeOnWorld(Store& store, const View& mine, const std::string& where,
                                           std::chrono::milliseconds timeout, bool hosts_store);

}  // namespace dtrain::comm::rendezvous
