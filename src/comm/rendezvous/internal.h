// Pieces of the rendezvous shared by init.cc, slurm.cc and agree.cc (not part of the public API).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/rendezvous.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm::rendezvous {

// The variable's value, or nullptr when it is unset or empty.
const char* env(const char* name);
// An integer variable in [min_value, 2^24]; `dflt` when unset; RendezvousError naming it otherwise.
int envInt(const char* name, int dflt, int min_value);
// "[rank r] " from the first of RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID that is set, for messages
// written before the world is known; "" when none is.
std::string rankPrefix();
// A port: digits only, 1-65535; InvalidArgument naming `what` and the text otherwise.
int parsePort(const std::string& text, const std::string& what);

// Slurm's world when SLURM_PROCID and a task count are set (the task of an srun step), else nullopt.
std::optional<WorldInfo> detectSlurm();
// Slurm's store host and port when this is a Slurm task, else nullopt (see storeAddress()).
struct SlurmStore {
  std::string host, host_origin;
  int port = 0;
  std::string port_origin;
};
std::optional<SlurmStore> slurmStore();
// Another node of this Slurm step (the next in its node list), or nullopt on one node: the route to it
// picks the interface peers on other nodes reach this one through (a node's own name may resolve to
// 127.0.1.1 on it, as Debian's /etc/hosts does).
std::optional<std::string> slurmPeerNode();

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
