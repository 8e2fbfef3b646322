// init(): how a process finds the others and builds the world ProcessGroup.
//
// \code
//   auto world = dtrain::comm::init();   // under dtrain-run, torchrun, mpirun or srun; or alone
//   if (world->rank() == 0) ...
// \endcode
//
// Where the rank and world size come from, in order: explicit options; torchrun's variables (RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); OpenMPI's (OMPI_COMM_WORLD_RANK,
// _SIZE, _LOCAL_RANK, _LOCAL_SIZE); Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID). With none of
// them the process is a world of one that opens no socket: the same program runs unchanged alone.
//
// The store: init_method "file:///shared/path" uses a FileStore; otherwise a TcpStore at MASTER_ADDR
// (default 127.0.0.1) : MASTER_PORT (default 29500), hosted by rank 0, or by the launcher when
// DTRAIN_USE_AGENT_STORE=1 (dtrain-run sets it). Keys are prefixed by the restart count
// (DTRAIN_RESTART_COUNT), so a restarted job never reads a previous attempt's keys.
#pragma once
#include <memory>
#include <string>

#include "dtrain/comm/process_group.h"

namespace dtrain::comm {

struct InitOptions {
  int rank = -1;        // -1: from the environment
  int world_size = -1;
  int local_rank = -1;
  int local_world_size = -1;
  std::string master_addr;  // empty: MASTER_ADDR or 127.0.0.1
  int master_port = -1;     // -1: MASTER_PORT or 29500
  std::string init_method;  // "", "env://", "tcp://host:port" or "file:///path"; default DTRAIN_INIT_METHOD
  GroupOptions group = GroupOptions::fromEnv();
};

struct WorldInfo {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  std::string source = "none";  // "explicit", "torchrun", "openmpi", "slurm" or "none"
};

// Reads the rank and sizes as init() would; RendezvousError naming a malformed or inconsistent variable.
WorldInfo detectWorld(const InitOptions& opts = {});

// Builds the world group (collective over all ranks). Also records the WorldInfo for worldInfo().
std::shared_ptr<ProcessGroup> init(InitOptions opts = {});

}  // namespace dtrain::comm
