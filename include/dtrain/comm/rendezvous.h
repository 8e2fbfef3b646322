/// @file
/// initWorld(): how a process finds the others and builds the world ProcessGroup.
///
/// \code
///   auto world = dtrain::comm::initWorld();   // under dtrain-run, torchrun, mpirun or srun; or alone
///   if (world->rank() == 0) ...
/// \endcode
///
/// This is the comm layer's entry point. A training program built on the torch layer calls
/// dtrain::init() (distributed.h) instead: it calls initWorld() and adds the node's group, in a
/// Distributed; dtrain::ps::init() (ps.h) builds on dtrain::init() for a parameter-server job.
///
/// initWorld() reads the environment once, when it is called: the options structs below are plain
/// data, and an option given in them wins over its variable.
///
/// Where the rank and world size come from, in order: explicit options; torchrun's variables (RANK,
/// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT); OpenMPI's
/// (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE); Slurm's (SLURM_PROCID, the step's task
/// count, SLURM_LOCALID, and the local size and node index from SLURM_STEP_TASKS_PER_NODE, e.g.
/// "2(x3),1", and the node's place in SLURM_STEP_NODELIST). With none of them the process is a world
/// of one that opens no socket: the same program runs unchanged alone.
///
/// The store: init_method "file:///shared/path" uses a FileStore; otherwise a TcpStore at
/// storeAddress() (MASTER_ADDR:MASTER_PORT; under srun the step's first node and a port derived from
/// the job and step ids; else 127.0.0.1:29500), hosted by rank 0, or by the launcher when
/// DTRAIN_USE_AGENT_STORE=1 (dtrain-run sets it). Keys are prefixed by the restart count
/// (DTRAIN_RESTART_COUNT, else torchrun's TORCHELASTIC_RESTART_COUNT), so a restarted job never reads a
/// previous attempt's keys. The parameter server's store (ps::storeFromEnv) is found the same way.
///
/// At rendezvous every rank publishes what it believes about the world (size, its node and local
/// rank, the node's size, the job, its host) and compares everyone's: any disagreement fails every
/// rank at start-up with a RendezvousError naming it, and ranks that never join are named when the
/// deadline (DTRAIN_TIMEOUT) passes, with what to check.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dtrain/comm/process_group.h"

namespace dtrain::comm {

/// Options of initWorld(): what is not set comes from the environment.
struct InitOptions {
  int rank = -1;        ///< -1: from the environment
  int world_size = -1;  ///< -1: from the environment
  int local_rank = -1;  ///< -1: from the environment
  int local_world_size = -1;  ///< -1: from the environment
  std::string master_addr;  ///< empty: see storeAddress()
  int master_port = -1;     ///< -1: see storeAddress()
  std::string init_method;  ///< "", "env://", "tcp://host:port" or "file:///path"; default DTRAIN_INIT_METHOD
  /// The world group's options. Unset: GroupOptions::fromEnv() (DTRAIN_TIMEOUT, DTRAIN_TRANSPORT, ...).
  /// Given: used as they are, except that an empty listen_host is filled as fromEnv() would. To change
  /// one option and keep the environment's others, start from GroupOptions::fromEnv().
  std::optional<GroupOptions> group;
};

/// What a process learnt about the world at start-up: ranks, sizes, nodes, where they came from.
struct WorldInfo {
  int rank = 0;  ///< this process's rank in the world
  int size = 1;  ///< the world size
  int local_rank = 0;  ///< this process's rank on its node
  int local_size = 1;  ///< the number of processes on its node
  std::string source = "none";  ///< "explicit", "torchrun", "openmpi", "slurm" or "none"
  int node = 0;                 ///< this rank's node, 0 .. num_nodes-1; -1: unknown (initWorld() groups by host)
  int num_nodes = 1;            ///< -1: unknown
  std::string job;              ///< the job and step ranks must share, e.g. "slurm job 12 step 0"
  /// Filled by initWorld(): every node's world ranks in local-rank order, the same on every rank.
  std::vector<std::vector<int>> nodes;
};

/// Reads the rank and sizes as initWorld() would; RendezvousError naming a malformed or inconsistent
/// variable (InvalidArgument for a malformed Slurm list).
WorldInfo detectWorld(const InitOptions& opts = {});

/// Where the TcpStore is. `origin` says where host and port came from, for messages.
struct StoreAddress {
  std::string host;  ///< the store's host
  int port = 0;  ///< the store's port
  std::string origin;    ///< e.g. "MASTER_ADDR:MASTER_PORT", "the first node of SLURM_STEP_NODELIST ..."
  bool derived = false;  ///< not given by the user (Slurm): rank 0 then listens on every interface
};
/// In order: opts.master_addr/master_port, MASTER_ADDR/MASTER_PORT, Slurm (the first host of
/// SLURM_STEP_NODELIST or SLURM_JOB_NODELIST, else SLURM_LAUNCH_NODE_IPADDR; port slurmStorePort()),
/// else 127.0.0.1:29500. Host and port are chosen independently (MASTER_PORT alone keeps Slurm's host).
/// InvalidArgument naming the variable for a port outside 1-65535 or a host that does not resolve.
StoreAddress storeAddress(const InitOptions& opts = {});

/// A port for the store of Slurm job `job_id`, step `step_id`: deterministic (every task computes the
/// same), in [20000, 32768) below Linux's ephemeral range, and different for different steps of a job
/// and for any two of 768 consecutive jobs, so jobs sharing a node do not collide.
int slurmStorePort(uint64_t job_id, uint64_t step_id);

/// Slurm's compressed host lists: "node[01-03,07],gpu-a,rack[1-2]-n[1-2]" -> node01 node02 node03
/// node07 gpu-a rack1-n1 rack1-n2 rack2-n1 rack2-n2 (zero padding kept). InvalidArgument quoting
/// `what`='list' and the fault for malformed input (unbalanced brackets, empty names or ranges,
/// descending ranges, non-digits in a range, more than a million hosts).
std::vector<std::string> expandSlurmNodeList(const std::string& list, const std::string& what = "node list");

/// Slurm's task counts per node: "2(x3),1" -> 2 2 2 1. InvalidArgument quoting `what`='counts' and
/// the fault for malformed input (empty items, zero or negative counts, "(x" without ")", junk).
std::vector<int> expandSlurmTasksPerNode(const std::string& counts, const std::string& what = "task counts");

/// Builds the world group (collective over all ranks) after the ranks agreed on the world. `info`, if
/// given, receives the agreed WorldInfo with `nodes` filled.
std::shared_ptr<ProcessGroup> initWorld(InitOptions opts = {}, WorldInfo* info = nullptr);

/// The group of this rank's node (info.nodes from initWorld()). Collective: every rank of `world` calls it,
/// and it creates every node's group in node order. For a world of one, the world itself.
std::shared_ptr<ProcessGroup> newNodeGroup(const std::shared_ptr<ProcessGroup>& world, const WorldInfo& info);

}  // namespace dtrain::comm
