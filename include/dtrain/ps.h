/// @file
/// Parameter server: workers push gradients of named float32 tensors to server processes, which
/// aggregate them and (optionally) run the optimizer; workers pull the new values.
///
/// \code
///   // every process (under `dtrain-run --servers S`):
///   if (dtrain::ps::runServerIfRole()) return 0;           // a server process serves until done
///   auto store = dtrain::ps::storeFromEnv();
///   dtrain::ps::Worker ps(store, rank, world, num_servers, opts);
///   for (auto& p : params) ps.declare(name(p), p);          // same order on every worker; worker 0's values win
///   for (step...) {
///     ps.pull(name, p);                                     // BSP: waits for the previous step's update
///     ...forward/backward...
///     ps.push(name, p.grad());
///     ps.clock();                                           // ends this worker's step
///   }
///   ps.finish();
/// \endcode
///
/// Or, with the roles and sizes read from the environment (and a world of one when run alone):
/// \code
///   auto job = dtrain::ps::init(opts);                      // a server process serves here, then:
///   if (job.isServer()) return 0;
///   dtrain::ps::Worker ps(job, opts);                       // job.rank() of job.numWorkers()
///   ...as above; job.workers() is the workers' own group (barriers, per-rank checkpoints)...
/// \endcode
///
/// Processes: workers 0..W-1 and servers 0..S-1. Each (worker, server) pair has its own 2-rank
/// ProcessGroup (store prefix "ps/w<w>s<s>", worker = rank 0, server = rank 1). A tensor is cut into
/// partitions of at most partition_bytes; each partition goes to the server with the fewest bytes so
/// far (ties: lowest index). Sparse tables (declareRows) put row r on server r % S.
///
/// Wire protocol: every request and reply is a fixed-size Header (kHeaderBytes) followed by a payload
/// whose size the receiver derives from its own view of the layout: a header that claims more than the
/// declared partition (or more rows than one message may carry) is a ProtocolError; nothing is ever
/// allocated from a peer's claim beyond partition_bytes.
///
/// Consistency (dense tensors):
///  - bsp: push of clock c for a partition is summed with the other workers' pushes of clock c; when all
///    W have arrived the server applies ONE update with the mean gradient (sum / W), so BSP equals
///    single-process training on the global batch when each worker's loss is a mean over an equal local
///    batch. A pull at clock c waits until step c-1 has been applied (version >= c). A server that waits
///    longer than `timeout` fails with an error naming the workers whose pushes are missing.
///  - asp: each push is applied at once as its own optimizer step (lr * grad, no 1/W scaling); pulls
///    return the current values.
///  - ssp(s): pushes applied at once as in asp; a pull at clock c waits while c - min_clock > s, where
///    min_clock is the slowest unfinished worker's clock (clock() messages reach every server).
/// Update modes: sgd (momentum, like torch::optim::SGD), adam (like torch::optim::Adam), sum_only (a
/// summation service: in bsp a pull at clock c returns the SUM of the W pushes of step c-1 — divide by W
/// for the mean and run your optimizer locally; in asp/ssp the value accumulates every push: value += push,
/// so workers push their own deltas).
/// Sparse tables: rows are created as zeros on first touch; each pushRows is applied to its rows at once
/// (the update mode per row, no 1/W scaling); pullRows obeys the clock gate (bsp: all workers have reached
/// the puller's clock; ssp: staleness). Only the touched rows travel.
///
/// Asynchronous calls: every operation has an ...Async form returning a comm::WorkPtr (the collectives'
/// Work); the operations of one Worker run in the order they were issued, on the Worker's own
/// communication thread, so a caller can push a bucket while backward computes the next one. The
/// synchronous forms are the Async form plus wait(). Tensors handed to an Async call must not be modified (grads) or read (outputs) until its
/// Work completed. After an operation failed, every later one fails with that error.
/// \code
///   auto push = ps.pushAsync("fc.weight", fc->weight.grad());  // sent while backward goes on
///   ...
///   push->wait();                                               // rethrows the push's error, if any
/// \endcode
///
/// Local aggregation (Worker(store, LocalAggregation, ...)): the workers of one host form one PS client.
/// They sum their gradients over shared memory (the local group) and only the host's local rank 0 talks
/// to the servers; pulled values are broadcast back over shared memory. The servers then count hosts,
/// not processes, as their workers (runServerIfRole with opts.local_aggregation reads DTRAIN_NUM_NODES).
/// The host pushes the MEAN of its workers' gradients (sum_only: the SUM, so a pull still returns the sum
/// over every process); sparse rows of all local workers are pushed (and pulled) together.
///
/// Checkpoints: saveState() returns the servers' state (values, optimizer state, versions, sparse rows)
/// as named tensors — put them in CheckpointState::parameter_server — and loadState() puts it back (every
/// worker calls it after declaring; worker 0 sends the data; every worker's clock becomes the saved one).
///
/// Failures: every error a worker raises names the server ("[worker w] server s: ..."); a dead server is
/// found by the transport (connection closed / process gone) at once. Every deadline derives from
/// PSOptions::timeout in one place (src/torch/ps/deadlines.h): a worker's I/O waits timeout +
/// max(1s, timeout/4), so a server's own (more informative) timeout error arrives first. A server waits
/// for a worker's next request without a practical deadline (a worker may compute for long); a dead
/// worker is found by the transport at once. A server fails on its first error (a worker gone, a
/// protocol error, a BSP/SSP wait past the timeout): it tells every worker, and run() throws.
#pragma once
#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "dtrain/comm/process_group.h"
#include "dtrain/comm/store.h"
#include "dtrain/comm/work.h"

/// The parameter server: workers push gradients of named float32 tensors to server processes, which
/// aggregate them and may run the optimizer; workers pull the new values.
namespace dtrain::ps {

/// How the servers order pushes and pulls of dense tensors (see the file's description).
enum class Consistency {
  bsp,  ///< bulk synchronous: one update per step, with the mean of the workers' gradients
  asp,  ///< asynchronous: each push is applied at once
  ssp   ///< stale synchronous: as asp, and a pull waits while its worker is > staleness steps ahead
};

/// Options of a parameter-server job: the same on every worker and server.
struct PSOptions {
  Consistency consistency = Consistency::bsp;  ///< how pushes and pulls are ordered
  /// Server side: the workers are hosts whose local workers aggregate first (see LocalAggregation).
  bool local_aggregation = false;
  int staleness = 0;  ///< ssp only
  size_t partition_bytes = 4u << 20;  ///< a tensor is cut into partitions of at most this many bytes
  /// What the servers do with the gradients.
  enum class Update {
    sum_only,  ///< sum them: a summation service (the workers run the optimizer)
    sgd,       ///< SGD with momentum, like torch::optim::SGD
    adam       ///< Adam, like torch::optim::Adam
  } update = Update::sgd;  ///< the servers' update
  ///@{
  /// The servers' optimizer: lr (sgd, adam), momentum (sgd), beta1, beta2 and eps (adam).
  double lr = 0.1, momentum = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  ///@}
  /// The one timeout every deadline of the PS derives from (src/torch/ps/deadlines.h names them): a
  /// server's BSP/SSP wait; a worker's I/O (timeout + max(1 s, timeout / 4)); a Work's wait (4 x timeout).
  std::chrono::milliseconds timeout{60000};
};

/// Bytes of one request or reply header on the wire (counted by bytesSent/bytesReceived).
inline constexpr int64_t kHeaderBytes = 40;

// The asynchronous operations return comm::Work, as the collectives do: wait() blocks until the operation
// completed and rethrows its error; it gives up with a TimeoutError naming the operation 4 x
// PSOptions::timeout after the operation was issued (an operation's own waits are bounded by the timeout,
// so that deadline only fires when several long operations are queued ahead of it).

/// The workers of one host acting as one PS client (see the file comment).
struct LocalAggregation {
  std::shared_ptr<comm::ProcessGroup> local;  ///< this host's workers (Distributed::local()); not used by the
                                              ///< Worker itself: it makes its own group from it, collectively
  int node = 0;                               ///< this host's index: the PS worker index
  int num_nodes = 1;                          ///< hosts: the number of PS workers the servers count
};

/// One thread calls a Worker's methods; the Worker's own thread does the communication.
class Job;

/// A worker's client of the parameter servers: declares tensors, pushes gradients, pulls values (see the
/// file's description).
class Worker {
 public:
  /// Connects to every server (collective with them: each server constructs its Server).
  Worker(std::shared_ptr<comm::Store> store, int rank, int num_workers, int num_servers, PSOptions opts);
  /// The worker of init()'s job (InvalidArgument for a server's job; local aggregation: use
  /// Worker(job.store(), job.localAggregation(), job.numServers(), opts)).
  Worker(const Job& job, PSOptions opts);
  /// Local aggregation: collective over agg.local; only its rank 0 connects to the servers.
  Worker(std::shared_ptr<comm::Store> store, LocalAggregation agg, int num_servers, PSOptions opts);
  /// Calls finish() if it was not called (ignoring its errors).
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Every worker declares the same tensors in the same order. Worker 0's values are stored.
  void declare(const std::string& name, const at::Tensor& init);
  /// A sparse table of num_rows x dim float32 rows, created as zeros on first touch.
  void declareRows(const std::string& name, int64_t num_rows, int64_t dim);

  /// grad / out: float32, CPU, same numel as declared (out must be contiguous).
  void push(const std::string& name, const at::Tensor& grad);
  /// Copies the current values of `name` into out (bsp: after the previous step's update).
  void pull(const std::string& name, at::Tensor& out);
  /// push then pull in one round trip per partition; in bsp the values returned include this step's
  /// update (the pull waits for version clock+1).
  void pushPull(const std::string& name, const at::Tensor& grad, at::Tensor& out);
  /// Ends this worker's step: clock() += 1 on every server.
  void clock();
  /// This worker's clock: the steps it has ended.
  int clockValue() const;

  /// rows: int64 [n] (distinct not required; duplicates are applied in turn), grads: float32 [n, dim].
  void pushRows(const std::string& name, const at::Tensor& rows, const at::Tensor& grads);
  /// The rows of a sparse table: float32 [rows.numel(), dim].
  at::Tensor pullRows(const std::string& name, const at::Tensor& rows);

  /// push() as an asynchronous operation (see the file's description).
  comm::WorkPtr pushAsync(const std::string& name, const at::Tensor& grad);
  /// A push whose `used` (uint8 or bool, one per element) marks the elements it carries a gradient for.
  /// An element that no worker's push of a step marks is not updated, nor its optimizer state (Adam counts
  /// each element's own updates): what one process's optimizer does with a parameter whose gradient is
  /// undefined. Under bsp the step's gradient is the mean over all workers, zeros from those that did not
  /// mark the element. Under local aggregation every worker of a host passes `used` or none does.
  comm::WorkPtr pushAsync(const std::string& name, const at::Tensor& grad, const at::Tensor& used);
  /// pull() as an asynchronous operation: out holds the values once the Work completed.
  comm::WorkPtr pullAsync(const std::string& name, at::Tensor out);
  /// pushPull() as an asynchronous operation.
  comm::WorkPtr pushPullAsync(const std::string& name, const at::Tensor& grad, at::Tensor out);
  /// clock() as an asynchronous operation.
  comm::WorkPtr clockAsync();
  /// pushRows() as an asynchronous operation.
  comm::WorkPtr pushRowsAsync(const std::string& name, const at::Tensor& rows, const at::Tensor& grads);
  /// out: contiguous float32 [rows.numel(), dim].
  comm::WorkPtr pullRowsAsync(const std::string& name, const at::Tensor& rows, at::Tensor out);

  /// The servers' state, gated like a pull at this worker's clock (bsp: every update of the steps before
  /// it applied). Keys: "<name>" [slots, numel] (value, then momentum or Adam's m and v), "<name>#step"
  /// and "<name>#version" (per partition), "<name>#rows" / "<name>#data" / "<name>#steps" for sparse
  /// tables, "#clock". Collective with nothing: any worker may call it (worker 0 usually does).
  std::map<std::string, at::Tensor> saveState();
  /// Every worker calls it with the same state, after declaring the same tensors: worker 0 sends the
  /// values and optimizer state, every worker's clock becomes state["#clock"]. In bsp the next pulls wait
  /// for worker 0's restore; in asp/ssp, synchronise the workers (a barrier) before training on.
  void loadState(const std::map<std::string, at::Tensor>& state);

  /// Every byte this worker sent to servers (headers included).
  int64_t bytesSent() const;
  /// Every byte this worker received from servers (headers included).
  int64_t bytesReceived() const;

  /// Says goodbye to every server (waits for their acknowledgement). Idempotent; the destructor calls it
  /// (ignoring errors) if the user did not.
  void finish();

  /// The PS worker index (with local aggregation: the host's index) and count.
  int rank() const;
  /// The number of PS workers (with local aggregation: hosts).
  int numWorkers() const;
  /// Training processes behind the PS workers (with local aggregation: hosts x this host's workers,
  /// assuming equal hosts).
  int numProcesses() const;
  /// The number of servers.
  int numServers() const;
  /// Whether this process talks to the servers (false for local ranks > 0 under local aggregation).
  bool connected() const;
  /// The options given.
  const PSOptions& options() const;

 private:
  struct Impl;  // src/torch/ps/worker_impl.h
  std::unique_ptr<Impl> impl_;
};

/// A server's part of the job: holds its partitions and applies the workers' pushes until they finish.
class Server {
 public:
  /// Server `index` of num_servers, for num_workers workers (collective with them: each worker constructs its
  /// Worker).
  Server(std::shared_ptr<comm::Store> store, int index, int num_servers, int num_workers, PSOptions opts);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  /// Serves until every worker said goodbye; throws the first error (naming the server and the worker).
  void run();
  /// Fails the server on purpose (from another thread): every worker gets `reason`, run() throws it.
  void abort(const std::string& reason);

 private:
  struct State;  // src/torch/ps/server_state.h
  std::unique_ptr<State> state_;
};

/// A server as a thread of this process ("colocated" mode for one-machine runs: e.g. worker i < S hosts
/// server i). Construct it before this process's Worker; join() after the Worker's finish().
class ColocatedServer {
 public:
  /// Starts server `index` on a thread of this process (the arguments as Server's).
  ColocatedServer(std::shared_ptr<comm::Store> store, int index, int num_servers, int num_workers, PSOptions opts);
  /// Waits up to the timeout for the server to end (the other workers may still train), then aborts it;
  /// ignores its error (call join() to see it).
  ~ColocatedServer();
  ColocatedServer(const ColocatedServer&) = delete;
  ColocatedServer& operator=(const ColocatedServer&) = delete;
  /// Waits until the server ended (every worker said goodbye, or it failed) and rethrows its error.
  void join();

 private:
  struct Impl;  // src/torch/ps/server.cc
  std::unique_ptr<Impl> impl_;
};

/// This process's part in a parameter-server job, as init() found it in the environment.
class Job {
 public:
  /// No job: init() makes the real one.
  Job() = default;
  /// Movable (init() returns it).
  Job(Job&&) = default;
  /// Movable.
  Job& operator=(Job&&) = default;
  /// Destroy the Worker first (declare the Job before it): a colocated server waits for its goodbye.
  ~Job();

  /// A server process that has served until the workers finished: return from main.
  bool isServer() const { return server_; }
  int rank() const { return rank_; }              ///< the worker index (the process's RANK)
  int numWorkers() const { return num_workers_; }  ///< worker processes (WORLD_SIZE)
  int numServers() const { return num_servers_; }  ///< server processes
  const std::shared_ptr<comm::Store>& store() const { return store_; }  ///< the job's store
  /// The workers' own group (dtrain::init()): all workers, rank = worker index.
  const std::shared_ptr<comm::ProcessGroup>& workers() const { return workers_; }
  const std::shared_ptr<comm::ProcessGroup>& local() const { return local_; }  ///< this host's workers
  /// For Worker(store, LocalAggregation, ...): this host's workers as one PS worker (DTRAIN_NUM_NODES hosts).
  LocalAggregation localAggregation() const;
  /// Whether the server runs as a thread of this process (a world of one).
  bool colocated() const { return colocated_ != nullptr; }
  /// After the Worker's finish(): waits for a colocated server to end and rethrows its error.
  void join();

 private:
  friend Job init(PSOptions opts);
  bool server_ = false;
  int rank_ = 0, num_workers_ = 1, num_servers_ = 0, local_rank_ = 0, local_size_ = 1, num_nodes_ = 1;
  std::shared_ptr<comm::TcpStoreServer> store_server_;  // a world of one: the job's own store
  std::shared_ptr<comm::Store> store_;
  std::shared_ptr<comm::ProcessGroup> workers_, local_;
  std::unique_ptr<ColocatedServer> colocated_;
};

/// The PS counterpart of dtrain::init(), reading what dtrain-run --servers S sets:
///  - DTRAIN_ROLE=server: runs this process's server until every worker said goodbye (as
///    runServerIfRole) and returns a Job whose isServer() is true;
///  - a worker (DTRAIN_NUM_SERVERS set): its rank and the workers' groups from dtrain::init(), the store
///    from storeFromEnv(); DTRAIN_NUM_WORKERS must equal WORLD_SIZE;
///  - none of the launchers' variables: a world of one, with one server colocated as a thread of this
///    process behind a store of its own on 127.0.0.1 (the same program runs alone unchanged).
/// RendezvousError naming the variable when they are inconsistent (e.g. WORLD_SIZE=2 without servers).
Job init(PSOptions opts = {});

/// The store a job's processes share, found as comm::initWorld() finds the world's (rendezvous.h): the
/// init method's FileStore ("file:///path" in DTRAIN_INIT_METHOD) or TcpStore, else the TcpStore at
/// MASTER_ADDR:MASTER_PORT (dtrain-run hosts it: DTRAIN_USE_AGENT_STORE=1); never hosted here. Keys
/// under "gen<DTRAIN_RESTART_COUNT, else TORCHELASTIC_RESTART_COUNT>/ps".
std::shared_ptr<comm::Store> storeFromEnv(std::chrono::milliseconds timeout = std::chrono::seconds(60));

/// With DTRAIN_ROLE=server: builds a Server from DTRAIN_SERVER_INDEX, DTRAIN_NUM_SERVERS,
/// DTRAIN_NUM_WORKERS and storeFromEnv(), runs it and returns true. Otherwise returns false at once.
bool runServerIfRole(PSOptions opts = {});

}  // namespace dtrain::ps
