// MPI transport: dtrain's frames carried by MPI's non-blocking point-to-point calls (OpenMPI), so that a
// network only MPI drives (InfiniBand, UCX) carries dtrain's collectives. Built when CMake finds MPI
// (DTRAIN_WITH_MPI); chosen with DTRAIN_TRANSPORT=mpi, every rank a process of one mpirun job.
//
// Set-up: MPI is initialised on first use (MPI_THREAD_MULTIPLE asked; every call below is made under one
// process-wide mutex anyway, so SERIALIZED is enough) and finalised at exit when dtrain initialised it.
// Each rank publishes its MPI_COMM_WORLD rank in the group's store; the group's ranks then make a
// communicator of their own (MPI_Comm_create_group: only the members take part), so sub-groups and
// concurrent groups never see each other's messages.
//
// run(): a send is a header message then the payload in chunks of `segment_bytes` (1 MiB by default),
// all posted at once. A receive posts the header first and checks it (checkHeader: the same frame checks
// as tcp) before any payload lands, then keeps a window of chunk receives posted; a reducing receive
// lands chunks in a staging window and reduces each as it completes, so reduction overlaps arrival. All
// frames to one peer use one MPI tag, so MPI's non-overtaking rule keeps them in list order. The calls
// are polled (MPI_Test) against the deadline: a stuck peer is a TimeoutError naming it, like tcp. A rank
// that fails sends its error on a second tag to every peer (abort()); a persistent receive on that tag
// raises it on the others, so everyone names the root cause. A process that dies makes OpenMPI abort
// the whole job: the fault-tolerance guarantees of tcp and shm do not hold here (docs/CLUSTER.md).
// The C API only: OpenMPI's mpi.h would otherwise pull in the deprecated C++ bindings (libmpi_cxx).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "comm/transport/transport.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm::transport {
namespace {

constexpr size_t kDefaultChunk = 1u << 20;
constexpr size_t kMaxChunk = 256u << 20;  // an MPI count is an int
constexpr size_t kWindow = 4;             // chunk receives in flight per peer

std::mutex& mpiMutex() {
  static std::mutex m;
  return m;
}

std::string mpiError(int rc) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(msg, static_cast<size_t>(len));
}

// Initialises MPI once per process unless the program did, and finalises it at exit if dtrain did.
void ensureMpi() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::lock_guard<std::mutex> g(mpiMutex());
    int inited = 0;
    MPI_Initialized(&inited);
    int provided = 0;
    if (!inited) {
      int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      if (rc != MPI_SUCCESS) throw IoError("mpi transport: MPI_Init_thread failed: " + mpiError(rc));
      std::atexit([] {
        std::lock_guard<std::mutex> g2(mpiMutex());
        int done = 0;
        MPI_Finalized(&done);
        if (!done) MPI_Finalize();
      });
    } else {
      MPI_Query_thread(&provided);
    }
    // Collectives run on each group's own thread: calls from several threads, one at a time.
    if (provided < MPI_THREAD_SERIALIZED) {
      throw InvalidArgument(fmt::format(
          "mpi transport: MPI provides thread level {} but dtrain calls MPI from its groups' threads: "
          "initialise MPI with MPI_Init_thread(..., MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE, ...)",
          provided));
    }
  });
}

class MpiTransport : public Transport {
 public:
  MpiTransport(Store& store, int rank, int size, const TransportOptions& opts)
      : Transport(rank, size), peers_(size), world_(size), names_(size) {
    ensureMpi();
    chunk_ = opts.segment_bytes ? std::clamp<size_t>(opts.segment_bytes / 8 * 8, 64, kMaxChunk) : kDefaultChunk;
    int wr = 0, ws = 0;
    char host[MPI_MAX_PROCESSOR_NAME + 1] = {0};
    {
      std::lock_guard<std::mutex> g(mpiMutex());
      MPI_Comm_rank(MPI_COMM_WORLD, &wr);
      MPI_Comm_size(MPI_COMM_WORLD, &ws);
      int len = 0;
      MPI_Get_processor_name(host, &len);
    }
    if (rank == 0) {
      // MPI_Comm_create_group's tag (concurrent creations should differ), and the tags of this group's
      // frames: a group that failed may leave messages in flight, and a later communicator can reuse the
      // freed one's context id; with other tags those messages never match the new group's receives.
      void* ub = nullptr;
      int flag = 0;
      {
        std::lock_guard<std::mutex> g(mpiMutex());
        MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
      }
      const uint32_t tag_ub = flag && ub ? static_cast<uint32_t>(*static_cast<int*>(ub)) : 32767u;
      std::random_device rd;
      store.set("mpi/tags", toBytes(fmt::format("{} {}", rd() % 30000 + 100, rd() % (tag_ub / 2 - 1) * 2)));
    }
    store.set(fmt::format("mpi/world/{}", rank), toBytes(fmt::format("{} {} {}", wr, ws, host)));
    findMembers(store, ws);
    int tag = 0;
    if (std::sscanf(toString(store.get("mpi/tags")).c_str(), "%d %d", &tag, &frame_tag_) != 2) {
      throw ProtocolError(fmt::format("[rank {}] mpi transport: bad tags from rank 0", rank));
    }
    abort_tag_ = frame_tag_ + 1;
    std::lock_guard<std::mutex> g(mpiMutex());
    MPI_Group world_group = MPI_GROUP_NULL, members = MPI_GROUP_NULL;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Group_incl(world_group, size, world_.data(), &members);
    int rc = MPI_Comm_create_group(MPI_COMM_WORLD, members, tag, &comm_);
    MPI_Group_free(&members);
    MPI_Group_free(&world_group);
    if (rc != MPI_SUCCESS || comm_ == MPI_COMM_NULL) {
      throw RendezvousError(fmt::format("[rank {}] mpi transport: MPI_Comm_create_group failed: {}", rank,
                                        mpiError(rc)));
    }
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    postAbortRecv();
  }

  ~MpiTransport() override {
    std::lock_guard<std::mutex> g(mpiMutex());
    int done = 0;
    MPI_Finalized(&done);
    if (done) return;
    cancelAll();
    // The abort receive may have matched a frame already (the peers of a failed group all send theirs):
    // then it is delivered, not cancelled, and MPI writes abort_in_ until it completes.
    if (abort_in_req_ != MPI_REQUEST_NULL) MPI_Cancel(&abort_in_req_);
    // Abort frames and the sends of a failed run still leaving: give them a moment, then keep their
    // buffers for the life of the process (MPI may still read them after the requests are freed).
    std::vector<MPI_Request*> pending = {&abort_in_req_};
    for (auto& r : abort_out_reqs_) pending.push_back(&r);
    for (auto& u : unsent_)
      for (auto& r : u.reqs) pending.push_back(&r);
    if (!completeWithin(pending, std::chrono::seconds(2))) {
      for (MPI_Request* r : pending)
        if (*r != MPI_REQUEST_NULL) MPI_Request_free(r);
      static std::vector<std::vector<char>> kept_aborts;
      static std::deque<SendState> kept_sends;
      kept_aborts.push_back(std::move(abort_out_));
      kept_aborts.push_back(std::move(abort_in_));
      for (auto& u : unsent_) kept_sends.push_back(std::move(u));
    }
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }

  const char* name() const override { return "mpi"; }

  std::string peerName(int peer) const override {
    if (peer < 0 || peer >= size_) return fmt::format("rank {}", peer);
    return fmt::format("rank {} (MPI rank {} on {})", peer, world_[peer], names_[peer]);
  }

  void run(std::vector<Op>& ops, Deadline deadline, const Label& label) override {
    if (broken_) {
      throw IoError(fmt::format("[rank {}] {}: the mpi transport failed earlier and cannot be used again", rank_,
                                label.what));
    }
    if (deferred_) raiseDeferred(label);
    try {
      {
        std::lock_guard<std::mutex> g(mpiMutex());
        for (auto& op : ops) {
          if (op.peer < 0 || op.peer >= size_ || op.peer == rank_) {
            throw InvalidArgument(fmt::format("[rank {}] {}: op to peer {} in a group of {}", rank_, label.what,
                                              op.peer, size_));
          }
          if (op.kind == Op::kSend) postSend(op, label);
          else peers_[op.peer].recvs.emplace_back().op = &op;
        }
      }
      progress(deadline, label);
    } catch (...) {
      std::lock_guard<std::mutex> g(mpiMutex());
      cancelAll();
      broken_ = true;
      throw;
    }
  }

  void abort(const std::exception& why) noexcept override {
    try {
      std::string msg;
      const Header h = abortHeader(why, msg);
      std::lock_guard<std::mutex> g(mpiMutex());
      if (comm_ == MPI_COMM_NULL || !abort_out_.empty()) return;  // told them already
      abort_out_.resize(sizeof h + msg.size());
      std::memcpy(abort_out_.data(), &h, sizeof h);
      std::memcpy(abort_out_.data() + sizeof h, msg.data(), msg.size());
      abort_out_reqs_.assign(static_cast<size_t>(size_), MPI_REQUEST_NULL);
      for (int i = 0; i < size_; ++i) {
        if (i == rank_) continue;
        MPI_Isend(abort_out_.data(), static_cast<int>(abort_out_.size()), MPI_BYTE, i, abort_tag_, comm_,
                  &abort_out_reqs_[static_cast<size_t>(i)]);
      }
      // Small messages go eagerly; give them a moment to leave before the caller moves on.
      std::vector<MPI_Request*> reqs;
      for (auto& r : abort_out_reqs_) reqs.push_back(&r);
      completeWithin(reqs, std::chrono::milliseconds(500));
    } catch (...) {
    }
  }

 private:
  // The headers live on the heap: MPI reads a send's and writes a receive's header until its request
  // completes, which may be after the state moved (a failed run's sends are kept; see cancelAll).
  struct SendState {
    std::unique_ptr<Header> h = std::make_unique<Header>();
    std::vector<MPI_Request> reqs;
  };
  struct Chunk {
    MPI_Request req = MPI_REQUEST_NULL;
    size_t off = 0;
    size_t len = 0;
    char* dst = nullptr;
  };
  struct RecvState {
    Op* op = nullptr;
    std::unique_ptr<Header> h = std::make_unique<Header>();
    MPI_Request hreq = MPI_REQUEST_NULL;
    bool header_posted = false;
    bool header_done = false;
    size_t posted = 0;  // payload bytes with a receive posted
    size_t done = 0;    // payload bytes delivered (and reduced)
    std::deque<Chunk> inflight;
  };
  struct Peer {
    std::deque<SendState> sends;
    std::deque<RecvState> recvs;
    std::vector<char> staging;  // kWindow chunks, for reducing receives
    size_t next_slot = 0;
  };

  // Reads every member's "world-rank world-size host" and checks they are distinct processes of one job.
  void findMembers(Store& store, int ws) {
    for (int p = 0; p < size_; ++p) {
      std::string v = toString(store.get(fmt::format("mpi/world/{}", p)));
      int wr = -1, their_ws = -1;
      char host[MPI_MAX_PROCESSOR_NAME + 1] = {0};
      if (std::sscanf(v.c_str(), "%d %d %256s", &wr, &their_ws, host) < 2) {
        throw ProtocolError(fmt::format("[rank {}] mpi transport: rank {} published '{}'", rank_, p, v));
      }
      world_[p] = wr;
      names_[p] = host;
      for (int q = 0; q < p; ++q) {
        if (world_[q] == wr || their_ws != ws) {
          throw InvalidArgument(fmt::format(
              "[rank {}] mpi transport: ranks {} and {} are not distinct processes of one MPI job (MPI_COMM_WORLD "
              "rank {} of {} and rank {} of {}): DTRAIN_TRANSPORT=mpi needs every rank started by one mpirun "
              "(or srun --mpi=pmix), not by dtrain-run or by hand",
              rank_, q, p, world_[q], ws, wr, their_ws));
        }
      }
    }
  }

  // Tests the requests until all completed (true) or `patience` passed (false). mpiMutex() held.
  static bool completeWithin(const std::vector<MPI_Request*>& reqs, Clock::duration patience) {
    const auto until = Clock::now() + patience;
    for (;;) {
      bool all = true;
      for (MPI_Request* r : reqs) {
        int done = 1;
        if (*r != MPI_REQUEST_NULL) MPI_Test(r, &done, MPI_STATUS_IGNORE);
        all = all && done;
      }
      if (all) return true;
      if (Clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  void check(int rc, int peer, const Label& label, const char* call) {
    if (rc == MPI_SUCCESS) return;
    throw IoError(fmt::format("[rank {}] {}: {} with {} failed: {}", rank_, label.what, call, peerName(peer),
                              mpiError(rc)));
  }

  void postAbortRecv() {
    if (abort_in_.empty()) abort_in_.assign(sizeof(Header) + kMaxAbortMessage, 0);
    MPI_Irecv(abort_in_.data(), static_cast<int>(abort_in_.size()), MPI_BYTE, MPI_ANY_SOURCE, abort_tag_, comm_,
              &abort_in_req_);
  }

  void postSend(Op& op, const Label& label) {
    auto& s = peers_[op.peer].sends.emplace_back();
    *s.h = frameHeader(label, op.tag, op.bytes);
    s.reqs.reserve(1 + (op.bytes + chunk_ - 1) / chunk_);
    s.reqs.push_back(MPI_REQUEST_NULL);
    check(MPI_Isend(s.h.get(), sizeof(Header), MPI_BYTE, op.peer, frame_tag_, comm_, &s.reqs.back()), op.peer, label,
          "MPI_Isend");
    for (size_t off = 0; off < op.bytes; off += chunk_) {
      s.reqs.push_back(MPI_REQUEST_NULL);
      int n = static_cast<int>(std::min(chunk_, op.bytes - off));
      check(MPI_Isend(static_cast<char*>(op.data) + off, n, MPI_BYTE, op.peer, frame_tag_, comm_, &s.reqs.back()),
            op.peer, label, "MPI_Isend");
    }
  }

  // Polls every peer's sends and front receive, and the abort receive, until all ops complete.
  void progress(Deadline deadline, const Label& label) {
    int idle = 0;
    for (;;) {
      bool moved = false, left = false;
      {
        std::lock_guard<std::mutex> g(mpiMutex());
        for (int i = 0; i < size_; ++i) {
          auto& p = peers_[i];
          while (!p.sends.empty()) {
            int all = 0;
            auto& reqs = p.sends.front().reqs;
            check(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &all, MPI_STATUSES_IGNORE), i, label,
                  "sending to");
            if (!all) break;
            p.sends.pop_front();
            moved = true;
          }
          while (!p.recvs.empty()) {
            moved |= pumpRecv(i, label);
            if (p.recvs.front().done < p.recvs.front().op->bytes || !p.recvs.front().header_done) break;
            p.recvs.pop_front();
          }
          left |= !p.sends.empty() || !p.recvs.empty();
        }
        checkAbort(label);
      }
      if (!left) return;
      if (moved) {
        idle = 0;
        continue;
      }
      if (Clock::now() >= deadline) throwTimeout(label);
      // Polling: spin briefly, then yield, then sleep a little (ranks may outnumber the cores).
      if (++idle < 64) continue;
      if (idle < 256) sched_yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(idle < 4096 ? 20 : 200));
    }
  }

  bool test(MPI_Request& req, MPI_Status& st, int peer, const Label& label) {
    int flag = 0;
    check(MPI_Test(&req, &flag, &st), peer, label, "receiving from");
    return flag != 0;
  }

  bool pumpRecv(int i, const Label& label) {
    auto& p = peers_[i];
    auto& r = p.recvs.front();
    Op& op = *r.op;
    MPI_Status st;
    bool moved = false;
    if (!r.header_posted) {
      check(MPI_Irecv(r.h.get(), sizeof(Header), MPI_BYTE, i, frame_tag_, comm_, &r.hreq), i, label, "MPI_Irecv");
      r.header_posted = true;
    }
    if (!r.header_done) {
      if (!test(r.hreq, st, i, label)) return false;
      int n = 0;
      MPI_Get_count(&st, MPI_BYTE, &n);
      if (n != static_cast<int>(sizeof(Header))) {
        throw ProtocolError(fmt::format("[rank {}] {}: {} sent a {}-byte message where a frame header was due",
                                        rank_, label.what, peerName(i), n));
      }
      checkHeader(*r.h, op.tag, op.bytes, rank_, peerName(i), label);
      r.header_done = moved = true;
      if (op.reduce && p.staging.size() < kWindow * chunk_) p.staging.resize(kWindow * chunk_);
    }
    for (;;) {
      while (r.inflight.size() < kWindow && r.posted < op.bytes) {
        Chunk c;
        c.off = r.posted;
        c.len = std::min(chunk_, op.bytes - r.posted);
        c.dst = op.reduce ? p.staging.data() + (p.next_slot++ % kWindow) * chunk_ : static_cast<char*>(op.data) + c.off;
        check(MPI_Irecv(c.dst, static_cast<int>(c.len), MPI_BYTE, i, frame_tag_, comm_, &c.req), i, label,
              "MPI_Irecv");
        r.posted += c.len;
        r.inflight.push_back(c);
      }
      if (r.inflight.empty() || !test(r.inflight.front().req, st, i, label)) return moved;
      Chunk c = r.inflight.front();
      r.inflight.pop_front();
      int n = 0;
      MPI_Get_count(&st, MPI_BYTE, &n);
      if (n != static_cast<int>(c.len)) {
        throw ProtocolError(fmt::format(
            "[rank {}] {}: {} sent a {}-byte chunk where {} bytes were due: the ranks' segment sizes differ "
            "(DTRAIN_SEGMENT_BYTES must be the same on every rank)",
            rank_, label.what, peerName(i), n, c.len));
      }
      if (op.reduce) {
        size_t elem = dtypeSize(op.dtype);
        op.reduce(static_cast<char*>(op.data) + c.off, op.operandAt(c.off), c.dst, c.len / elem, op.dtype, op.rop);
      }
      r.done += c.len;
      moved = true;
    }
  }

  // An abort frame from any peer: raised now when this run needs that peer (receives from it, with
  // `receiving_only`), otherwise kept and raised when the run times out or at the next run (the peer
  // may have finished its part of this one).
  void checkAbort(const Label& label, bool receiving_only = false) {
    if (abort_in_req_ == MPI_REQUEST_NULL) return;
    int flag = 0;
    MPI_Status st;
    if (MPI_Test(&abort_in_req_, &flag, &st) != MPI_SUCCESS || !flag) return;
    int n = 0;
    MPI_Get_count(&st, MPI_BYTE, &n);
    Header h;
    std::string msg = "(message lost)";
    ErrorKind kind = ErrorKind::other;
    if (n >= static_cast<int>(sizeof h)) {
      std::memcpy(&h, abort_in_.data(), sizeof h);
      if (h.magic == kFrameMagic && h.opcode == static_cast<uint16_t>(OpCode::abort) &&
          h.length == static_cast<uint64_t>(n) - sizeof h) {
        msg.assign(abort_in_.data() + sizeof h, h.length);
        kind = static_cast<ErrorKind>(h.tag);
      }
    }
    const int peer = st.MPI_SOURCE;
    PeerFailure d{peer, kind, std::move(msg)};
    postAbortRecv();  // the next one: a peer this run needs may fail after this one
    const auto& p = peers_[static_cast<size_t>(peer)];
    if ((!receiving_only && !p.sends.empty()) || !p.recvs.empty()) {
      deferred_ = std::move(d);
      raiseDeferred(label);
    }
    if (!deferred_) deferred_ = std::move(d);
  }

  [[noreturn]] void throwTimeout(const Label& label) {
    std::string msg = fmt::format("[rank {}] {} timed out after {}s waiting for {}", rank_, label.what,
                                  label.timeout.count() / 1000.0, waitingFor(*this, peers_));
    // Ranks waiting on each other time out together. Tell the others at once, then wait a moment for
    // the peers this rank receives from: the one that waited for the stuck rank names it.
    abort(TimeoutError(msg));
    const auto until = Clock::now() + std::chrono::milliseconds(500);
    while (Clock::now() < until) {
      {
        std::lock_guard<std::mutex> g(mpiMutex());
        checkAbort(label, /*receiving_only=*/true);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    throw TimeoutError(msg);
  }

  [[noreturn]] void raiseDeferred(const Label& label) {
    PeerFailure d = *deferred_;
    deferred_.reset();
    throwPeerFailed(rank_, label, d.peer, d.kind, d.msg, waitingFor(*this, peers_));
  }

  // After a failure: withdraws every pending receive and forgets every send (MPI cannot cancel a send;
  // the group is broken from here on, as with every transport). Called with mpiMutex() held.
  // A cancelled receive whose message had matched already is delivered, not cancelled: MPI writes its
  // buffer (a header here, or the caller's memory) until it completes. So the receives are given a
  // moment to complete; any still pending then keeps its header alive for the life of the process.
  // Sends stay posted (their headers with them) and the destructor gives them a moment to leave, as it
  // does the abort frames.
  void cancelAll() {
    std::vector<MPI_Request*> pending;
    for (auto& p : peers_)
      for (auto& r : p.recvs) {
        pending.push_back(&r.hreq);
        for (auto& c : r.inflight) pending.push_back(&c.req);
      }
    for (MPI_Request* q : pending)
      if (*q != MPI_REQUEST_NULL) MPI_Cancel(q);
    const bool delivering = !completeWithin(pending, std::chrono::seconds(1));
    for (auto& p : peers_) {
      if (delivering) {
        static std::deque<RecvState> kept;
        for (auto& r : p.recvs) {
          if (r.hreq != MPI_REQUEST_NULL) MPI_Request_free(&r.hreq);
          for (auto& c : r.inflight)
            if (c.req != MPI_REQUEST_NULL) MPI_Request_free(&c.req);
          kept.push_back(std::move(r));
        }
      }
      p.recvs.clear();
      for (auto& s : p.sends) unsent_.push_back(std::move(s));
      p.sends.clear();
    }
    if (delivering) {
      std::fprintf(stderr, "[rank %d] mpi transport: receives of a failed collective still pending 1 s after "
                   "being cancelled; MPI may yet write into their buffers\n", rank_);
    }
  }

  std::optional<PeerFailure> deferred_;
  std::vector<Peer> peers_;
  std::vector<int> world_;          // each group rank's MPI_COMM_WORLD rank
  std::vector<std::string> names_;  // and its processor name
  MPI_Comm comm_ = MPI_COMM_NULL;
  int frame_tag_ = 0, abort_tag_ = 1;  // this group's (see the constructor); frames use one tag, aborts the next
  size_t chunk_ = kDefaultChunk;
  bool broken_ = false;
  std::deque<SendState> unsent_;  // sends of a failed run (see cancelAll)
  std::vector<char> abort_in_;
  MPI_Request abort_in_req_ = MPI_REQUEST_NULL;
  std::vector<char> abort_out_;
  std::vector<MPI_Request> abort_out_reqs_;
};

}  // namespace

void registerMpiTransport() {
  registerTransport("mpi", [](Store& store, int rank, int size, const TransportOptions& opts) {
    return std::make_unique<MpiTransport>(store, rank, size, opts);
  });
}

}  // namespace dtrain::comm::transport
