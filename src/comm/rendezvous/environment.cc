// Environment (see environment.h): the one place in src/ that reads the process environment, and the
// list of every variable dtrain reads.
#include "comm/rendezvous/environment.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "dtrain/comm/error.h"

namespace dtrain::comm::rendezvous {

namespace {

// Every variable dtrain reads. Names follow torchrun where one exists; dtrain's own start with DTRAIN_.
constexpr const char* kVariables[] = {
    // torchrun (and dtrain-run, which sets the same)
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    // OpenMPI
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "OMPI_MCA_ess_base_jobid",
    // Slurm
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURMD_NODENAME",
    "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_LAUNCH_NODE_IPADDR",
    // the store and the process group
    "DTRAIN_INIT_METHOD", "DTRAIN_RESTART_COUNT", "DTRAIN_USE_AGENT_STORE", "DTRAIN_TIMEOUT", "DTRAIN_TRANSPORT",
    "DTRAIN_SEGMENT_BYTES", "DTRAIN_SPIN_US", "DTRAIN_DEBUG", "DTRAIN_IFNAME", "DTRAIN_CUDA_COMM",
    // NCCL 2.30+ accepting ranks that share a GPU (src/torch/device/path.cc: ncclSharesGpus)
    "NCCL_MULTI_RANK_GPU_ENABLE",
    // the job secret connections prove (src/comm/net/auth.cc)
    "DTRAIN_SECRET", "DTRAIN_SECRET_FILE",
    // the dtrain-run agents' stores of in-memory snapshots (dtrain/snapshot.h)
    "DTRAIN_SNAPSHOT_STORES",
    // the allreduce algorithm (collectives/select.cc); DTRAIN_HOST_ID is a test hook (prepended to this
    // host's id, so ranks on one machine can pretend to be on different hosts: transport::hostId())
    "DTRAIN_ALGO", "DTRAIN_HOST_ID",
    // the timeline (docs/OBSERVABILITY.md); DTRAIN_TIMELINE_SKEW_US is a test hook (a fixed offset added to
    // this rank's timestamps, which dtrain-trace merge must recover)
    "DTRAIN_TIMELINE", "DTRAIN_TIMELINE_SKEW_US",
    // output through dtrain-run's pipes
    "DTRAIN_LINE_BUFFERED",
    // the parameter server's roles (dtrain-run --servers S)
    "DTRAIN_ROLE", "DTRAIN_SERVER_INDEX", "DTRAIN_NUM_SERVERS", "DTRAIN_NUM_WORKERS", "DTRAIN_NUM_NODES",
    // the flight recorder (src/comm/trace/flight_recorder.cc); TMPDIR for its default dump directory
    "DTRAIN_TRACE_BUFFER", "DTRAIN_FLIGHT_DIR", "DTRAIN_FLIGHT_PROGRESS", "TMPDIR",
    // DDP's bucket-size tuning (src/torch/ddp_tune.cc) and where it caches its choices
    "DTRAIN_TUNE", "DTRAIN_TUNE_CACHE", "XDG_CACHE_HOME", "HOME"};

void checkKnown(const std::string& name) {
  for (const char* v : kVariables)
    if (name == v) return;
  throw Error(fmt::format("environment variable {} is not one dtrain reads (add it to kVariables in environment.cc)",
                          name));
}

// dtrain-run reads stdout through a pipe, which makes it block-buffered: what a worker printed last
// would be lost when the launcher stops it. With DTRAIN_LINE_BUFFERED=1 (set by dtrain-run) stdout is
// line-buffered before main() runs, for printf and std::cout (which writes through stdout unless
// sync_with_stdio(false)) alike. Every program that forms a group links this file (initWorld() reads the
// environment through it).
[[maybe_unused]] const bool kLineBuffered =
    Environment::read().flag("DTRAIN_LINE_BUFFERED") && std::setvbuf(stdout, nullptr, _IOLBF, 0) == 0;

}  // namespace

Environment Environment::read() {
  std::map<std::string, std::string> values;
  for (const char* name : kVariables) {
    const char* v = std::getenv(name);
    if (v && *v) values[name] = v;
  }
  return of(std::move(values));
}

Environment Environment::of(std::map<std::string, std::string> values) {
  for (const auto& kv : values) checkKnown(kv.first);
  Environment env;
  env.values_ = std::move(values);
  return env;
}

const char* Environment::get(const char* name) const {
  checkKnown(name);
  auto it = values_.find(name);
  return it == values_.end() || it->second.empty() ? nullptr : it->second.c_str();
}

int Environment::integer(const char* name, int dflt, int min_value) const {
  const char* v = get(name);
  if (!v) return dflt;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (!end || *end != 0 || x < min_value || x > 1 << 24) {
    throw RendezvousError(fmt::format("environment variable {}='{}' is not an integer >= {}", name, v, min_value));
  }
  return static_cast<int>(x);
}

bool Environment::flag(const char* name) const {
  const char* v = get(name);
  return v && std::strcmp(v, "1") == 0;
}

std::string Environment::rankPrefix() const {
  for (const char* v : {"RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"}) {
    const char* r = get(v);
    if (!r) continue;
    bool digits = std::strlen(r) <= 9;
    for (const char* c = r; *c; ++c) digits = digits && *c >= '0' && *c <= '9';
    return digits ? fmt::format("[rank {}] ", r) : "";
  }
  return "";
}

}  // namespace dtrain::comm::rendezvous
