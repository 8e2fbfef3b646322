// dtrain-run's engine: starts N worker processes per node with torchrun's environment, hosts the
// rendezvous store on node 0, prefixes their output, and tears the whole group down (or restarts it)
// as soon as one worker fails.
//
// \code
//   dtrain::run::Options opts;
//   opts.nproc_per_node = 4;
//   opts.standalone = true;
//   opts.command = {"./train", "--epochs", "3"};
//   dtrain::run::checkOptions(opts);          // InvalidArgument on bad usage
//   return dtrain::run::Launcher(opts).run();  // the exit code to return from main()
// \endcode
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dtrain::comm {
class Store;
class TcpStoreServer;
}

namespace dtrain::run {

struct Options {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // 0: a free port (only when every worker is on this node)
  bool standalone = false;  // one node, store on a free local port
  bool job_secret = false;  // --job-secret: make a secret for this job (one node) and give it to the workers
  std::string secret;       // the job secret (the user's DTRAIN_SECRET(_FILE), or the one made); "": none
  int max_restarts = 0;
  int num_servers = 0;  // parameter-server processes, started on node 0 only
  // --gpu-per-worker: each worker sees one GPU, CUDA_VISIBLE_DEVICES set to the LOCAL_RANK-th entry (modulo
  // their number) of the launcher's own CUDA_VISIBLE_DEVICES, or to LOCAL_RANK when that is unset.
  bool gpu_per_worker = false;
  std::vector<std::string> gpu_ids;  // the launcher's CUDA_VISIBLE_DEVICES, split at commas (main.cc)
  bool prefix_output = true;
  // torchrun's --redirects and --tee: "0".."3" (none, stdout, stderr, both) for every local rank,
  // or per local rank ("0:3,1:2"). Redirected streams go to
  // <log_dir>/node<R>_XXXXXX/attempt_<restart>/<local_rank>/{stdout,stderr}.log instead of the
  // console; teed ones to both. Parameter servers (server<i>/) follow a single value only.
  std::string redirects = "0";
  std::string tee = "0";
  std::string log_dir;  // empty: a new directory under ${TMPDIR:-/tmp} when anything is redirected
  std::chrono::milliseconds grace_period{5000};  // SIGTERM -> SIGKILL
  // --hang-timeout: stop the job (after collecting flight-recorder dumps and printing the diagnosis)
  // when no worker of this node completes an op for this long; 0: never (hang.h).
  std::chrono::milliseconds hang_timeout{0};
  std::vector<std::string> command;              // PROGRAM ARGS...

  // Elastic membership (--nnodes MIN:MAX with --rdzv-backend/--rdzv-endpoint; elastic.h): rounds of
  // between min_nodes and max_nodes nodes agreed through the rendezvous store; nnodes, node_rank and
  // master_addr then come from each round.
  int min_nodes = 0;             // 0: not elastic
  int max_nodes = 0;
  std::string rdzv_backend;      // "c10d" (dtrain-run's own store, hosted on the endpoint's host) or "etcd"
  std::string rdzv_endpoint;     // host:port (c10d) or etcd's client URLs, comma-separated
  std::string rdzv_id = "dtrain";  // the job's id: its keys in the store
  std::chrono::milliseconds heartbeat_timeout{5000};
  std::chrono::milliseconds last_call{2000};
  bool elastic() const { return min_nodes > 0; }

  // The agents' stores of in-memory snapshots (dtrain/snapshot.h), "host:port,..." by node, given to
  // the workers as DTRAIN_SNAPSHOT_STORES: elastic rounds' nodes, or this agent's alone on one node.
  std::string snapshot_stores;
};

// Checks the combinations a parser cannot see alone; throws dtrain::InvalidArgument naming the problem.
void checkOptions(const Options& opts);
void checkElasticOptions(const Options& opts);  // the elastic ones (elastic_launch.cc)

class SignalWatcher;

// Usable once constructed: node 0's store is already serving. run() may be called once.
class Launcher {
 public:
  explicit Launcher(Options opts);
  ~Launcher();
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  // Runs the workers (restarting them up to max_restarts times) and returns the launcher's exit code:
  // 0 when every worker succeeded, the failing worker's code (128+signal if it was killed), or
  // 128+signal when the launcher itself was told to stop.
  int run();

 private:
  struct Outcome {
    int exit_code = 0;
    bool restartable = false;  // a worker failed (as opposed to success, or the launcher being stopped)
    std::string ended_by;      // elastic: why the round ended (the workers were stopped for it)
  };
  // One attempt: starts the workers and supervises them; `poll` (elastic rounds), called every tick,
  // stops them when it returns a reason.
  Outcome runOnce(int restart, const std::function<std::string()>& poll = {});
  // Elastic mode (elastic.cc): the rendezvous store, and the loop over rounds.
  void setUpElastic();
  int runElastic();

  Options opts_;
  // Declared before the store so that the store's thread starts with the launcher's signals blocked.
  std::unique_ptr<SignalWatcher> signals_;
  std::unique_ptr<comm::TcpStoreServer> store_;
  // This agent's store of its workers' in-memory snapshots: it outlives their restarts and rounds.
  std::unique_ptr<comm::TcpStoreServer> snapshot_store_;
  uint16_t master_port_ = 0;  // what workers are told: the store's real port when it picked one
  std::string run_log_dir_;   // this run's log directory, when anything is redirected or teed
  std::string flight_dir_;    // --hang-timeout: where the workers' dumps go (attempt_<restart>/ below)
  std::shared_ptr<comm::Store> rdzv_store_;  // elastic: the rendezvous store (a client)
};

}  // namespace dtrain::run
