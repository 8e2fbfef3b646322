/// @file
/// ProcessGroup: the ranks of a job (or a subset) and the collectives they run together.
///
/// \code
///   auto pg = dtrain::comm::initWorld();               // from RANK/WORLD_SIZE/... or a world of one
///   std::vector<float> grad(1 << 20, 1.0f);
///   pg->allreduce(grad.data(), grad.size(), DType::f32, ReduceOp::avg)->wait();
///   auto w = pg->broadcast(params.data(), params.size(), DType::f32, /*root=*/0);  // async
///   ...                                                 // overlap other work
///   w->wait();                                          // rethrows the op's error, if any
/// \endcode
///
/// Every call returns at once with a Work; ops on one group run in the order they were issued, on the
/// group's own thread. Buffers must stay valid until the Work completes. in == out means in place.
/// Every op has a deadline (GroupOptions::timeout; initWorld() takes it from DTRAIN_TIMEOUT): a dead
/// or stuck peer makes every rank fail with an error naming the op, its sequence number and the peer,
/// never hang. Ranks that call different collectives (or the same with another dtype, count, reduce op
/// or root) all fail with a ProtocolError naming both calls. After a failure the group is broken: later
/// ops fail at once with the original error.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/comm/store.h"
#include "dtrain/comm/types.h"
#include "dtrain/comm/work.h"

namespace dtrain::comm {

/// The options of a group: plain data with plain defaults. initWorld() fills them from the environment
/// (GroupOptions::fromEnv()) unless InitOptions::group is given.
struct GroupOptions {
  /// Deadline of every op, counted from when it is issued. DTRAIN_TIMEOUT (seconds), default 300.
  Duration timeout = std::chrono::seconds(300);
  /// "auto" (shared memory when every rank is on this host, else TCP), "tcp" or "shm"; "mpi" when built
  /// with MPI (every rank a process of one mpirun job; docs/CLUSTER.md). DTRAIN_TRANSPORT.
  std::string transport = "auto";
  /// TCP: the address to listen on and advertise; empty: 127.0.0.1. initWorld() fills an empty one with
  /// DTRAIN_IFNAME's address, else the address that routes to MASTER_ADDR (under srun without
  /// MASTER_ADDR: to another node of the step).
  std::string listen_host;
  /// Ring capacity of the shm transport per peer pair, staging size of tcp, chunk size of mpi (the same on
  /// every rank); 0 picks a default.
  /// Tests set it small to reach multi-segment paths. DTRAIN_SEGMENT_BYTES.
  size_t segment_bytes = 0;
  /// The job secret every tcp connection between ranks must prove it knows (challenge-response; see
  /// jobSecretFrom in store.h and docs/SECURITY.md); empty: connections are not authenticated.
  /// DTRAIN_SECRET or DTRAIN_SECRET_FILE; initWorld() fills an empty one from them.
  std::string secret;
  /// Every collective's fingerprint (op, dtype, count, reduce op, root, seq, v-op counts) is always
  /// compared across ranks, and a mismatch fails every rank naming both calls (on shm before any output
  /// is written; on tcp the mismatched call's outputs are unspecified). This option additionally
  /// exchanges every rank's call first, so the error lists all of them. DTRAIN_DEBUG=detail.
  bool check_fingerprints = false;
  /// The group's name in timelines and flight-recorder dumps, the same on every member. initWorld()'s
  /// group is "world", newGroup's "<parent>/sub<k>"; empty: "group<k>" (k counts this process's groups).
  std::string name;
  /// The allreduce algorithm of calls that leave it automatic (types.h); automatic here: DTRAIN_ALGO
  /// (auto, ring, recursive_doubling or rd, direct, hierarchical), read when the group is created.
  AllreduceAlgorithm allreduce_algorithm = AllreduceAlgorithm::automatic;
  /// How the torch layer moves CUDA tensors through this group (dtrain/device.h): "auto" (NCCL when
  /// dtrain was built with it and every rank of the group has a GPU of its own, else staged through pinned
  /// host buffers over this group's transport), "nccl" (fails when a rank shares its GPU) or "staged".
  /// The same on every rank. DTRAIN_CUDA_COMM.
  std::string cuda_path = "auto";
  /// How long a rank that waits for its peers busy-polls before it sleeps, in microseconds (shm and tcp):
  /// -1 picks the default (100 us; none when this host's ranks outnumber its cores), 0 never spins; set
  /// with more ranks than cores, each try yields the core. Longer spins catch more answers without a
  /// wake-up (small messages' latency and tails) and cost a core while they last. DTRAIN_SPIN_US.
  int spin_us = -1;

  /// What initWorld() uses when InitOptions::group is not given: the defaults overridden by the DTRAIN_*
  /// variables above, listen_host resolved as described there. Reads the environment on every call.
  /// InvalidArgument naming the variable and its value for a malformed one, a MASTER_PORT outside
  /// 1-65535 or a MASTER_ADDR that does not resolve.
  static GroupOptions fromEnv();
};

/// One send or receive of a batch that runs concurrently (like torch.distributed.batch_isend_irecv).
struct P2POp {
  /// Send or receive.
  enum Kind {
    kSend,  ///< send buf to peer
    kRecv   ///< receive into buf from peer
  } kind;   ///< send or receive
  void* buf;         ///< what is sent, or where it is received
  size_t count;      ///< elements
  DType dtype;       ///< their type
  int peer;          ///< the other rank (not this one)
  uint32_t tag = 0;  ///< must match the other side's
};

/// Payload bytes this process has sent so far in the collectives and point-to-point ops of all its
/// process groups (every send the algorithms hand to a transport; for shm's direct allreduce, which
/// shares a staging area instead of sending, what its peers read of this rank's: 2(n-1)/n of the
/// buffer, as a ring sends; n-1 times a buffer of at most 16 KiB, which every rank reads whole). Monotonic; take differences (dtrain::BytesSentMeter).
uint64_t bytesSent();

/// A group of ranks and its collective and point-to-point ops over plain buffers. Every op is issued at
/// once and runs asynchronously: it returns a Work to wait on. Every rank issues the same collectives in
/// the same order.
class ProcessGroup {
 public:
  /// Collective: all `size` ranks call it with the same store (keys under the store are used for the
  /// rendezvous). size == 1 opens no socket and no shared memory. The options are used as given (the
  /// environment is not read here: pass GroupOptions::fromEnv() for what initWorld() would use).
  static std::shared_ptr<ProcessGroup> create(std::shared_ptr<Store> store, int rank, int size,
                                              GroupOptions opts = {});
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  /// This process's rank in the group, 0 .. size()-1.
  int rank() const;
  /// The number of ranks.
  int size() const;
  /// "tcp", "shm" or "local" (a world of one).
  std::string transportName() const;
  /// The options the group runs with.
  const GroupOptions& options() const;

  /// out (count elements) = op over every rank's in; in == out works in place. `algo` automatic: the group's
  /// GroupOptions::allreduce_algorithm.
  WorkPtr allreduce(const void* in, void* out, size_t count, DType t, ReduceOp op = ReduceOp::sum,
                    AllreduceAlgorithm algo = AllreduceAlgorithm::automatic);
  /// In place: buf = op over every rank's buf.
  WorkPtr allreduce(void* buf, size_t count, DType t, ReduceOp op = ReduceOp::sum) {
    return allreduce(buf, buf, count, t, op);
  }
  /// root's buf (count elements) into every rank's buf.
  WorkPtr broadcast(void* buf, size_t count, DType t, int root);
  /// out is written on root only (may be null elsewhere).
  WorkPtr reduce(const void* in, void* out, size_t count, DType t, ReduceOp op, int root);
  /// out holds size() * count elements, rank r's block at r * count.
  WorkPtr allgather(const void* in, void* out, size_t count, DType t);
  /// Uneven blocks: counts[r] elements from rank r, in rank order; every rank passes the same counts.
  WorkPtr allgatherv(const void* in, void* out, std::vector<size_t> counts, DType t);
  /// in holds size() * count elements; out receives this rank's reduced block of count elements. out is
  /// a buffer of its own or this rank's block of in (in place); it must not overlap in's other blocks.
  WorkPtr reduceScatter(const void* in, void* out, size_t count, DType t, ReduceOp op = ReduceOp::sum);
  /// Uneven blocks: in holds sum(counts) elements, rank r's block counts[r] of them; out receives this
  /// rank's reduced block. Every rank passes the same counts.
  WorkPtr reduceScatterv(const void* in, void* out, std::vector<size_t> counts, DType t,
                         ReduceOp op = ReduceOp::sum);
  /// Block b (count elements) of in goes to rank b; block b of out comes from rank b.
  WorkPtr alltoall(const void* in, void* out, size_t count, DType t);
  /// out (size() * count elements) is written on root only.
  WorkPtr gather(const void* in, void* out, size_t count, DType t, int root);
  /// in (size() * count elements) is read on root only.
  WorkPtr scatter(const void* in, void* out, size_t count, DType t, int root);
  /// Completes once every rank has called it.
  WorkPtr barrier();
  /// Sends count elements of buf to rank dst. Point to point: messages between two ranks are received
  /// in the order they were sent, and the tag and size must match (a mismatch is a ProtocolError). Use
  /// sendRecv for simultaneous exchanges.
  WorkPtr send(const void* buf, size_t count, DType t, int dst, uint32_t tag = 0);
  /// Receives count elements from rank src (see send()).
  WorkPtr recv(void* buf, size_t count, DType t, int src, uint32_t tag = 0);
  /// A batch of sends and receives to and from other ranks, run concurrently (see P2POp).
  WorkPtr sendRecv(std::vector<P2POp> ops);

  /// Fails this group on purpose, after the ops already issued: peers waiting for this rank get an
  /// error carrying `reason` promptly, instead of timing out; later ops here fail with it too. For a
  /// rank that knows it cannot go on (e.g. DDP found a parameter without a gradient).
  WorkPtr abort(const std::string& reason);

  /// A step of this rank alone, run in the group's issue order: after the ops issued before it, before
  /// those issued after. It runs on the group's thread (or a thread waiting for it) and must end before
  /// the group's deadline; if it throws, the group fails as with abort(). The torch layer uses it to wait
  /// for a device-to-host copy right before the collective that reads the copied bytes.
  WorkPtr localStep(std::string what, std::function<void()> fn);

  /// State that lives as long as this group (a device backend's communicator, say): the object attached
  /// under `key`, made by make() on the first call. Thread-safe; make() runs at most once per key.
  std::shared_ptr<void> attachment(const std::string& key, const std::function<std::shared_ptr<void>()>& make);

  /// Collective over this group: every rank calls it with the same ranks (distinct, in range). Members
  /// get the new group (ranks renumbered in the given order); the others get nullptr.
  std::shared_ptr<ProcessGroup> newGroup(const std::vector<int>& ranks);

  struct Impl;

 private:
  explicit ProcessGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace dtrain::comm
