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
//
// The failure path never leaves MPI a buffer the caller may free. MPI cannot cancel a send, and a
// receive that matched already is delivered, not cancelled; a peer that has not yet seen the failure may
// still post the receive that matches a send of ours, and then MPI reads our buffer. So a failed run
// returns only when nothing can touch its buffers (settle()): it withdraws its receives and waits for the
// ones that had matched; then it tells every peer "closed" (on the abort tag: this rank posts no receive
// on this group again); then it waits until each of its sends has completed or its peer said "closed".
// A peer that sees an abort and has no receive from that rank pending says "closed" at once. The wait is
// bounded by the op's timeout (at most kMaxSettle); a peer that never answers (stopped) leaves the
// requests to MPI and their headers alive for the life of the process, with a warning.
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

#include "comm/transport/mpi/setup.h"
#include "comm/transport/transport.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm::transport {
namespace {

constexpr size_t kDefaultChunk = 1u << 20;
constexpr size_t kMaxChunk = 256u << 20;  // an MPI count is an int
constexpr size_t kWindow = 4;             // chunk receives in flight per peer
// The control message "closed" on the abort tag (settle()): an abort frame's header with this opcode.
constexpr uint16_t kClosedOpcode = 0xACu;
constexpr Clock::duration kMaxSettle = std::chrono::seconds(30);
constexpr Clock::duration kCloseWait = std::chrono::seconds(2);  // for the peers' "closed" at destruction

// How long a rank that timed out waits for the peers it receives from to name the stuck rank: the op's
// own timeout, between 0.5 and 10 s (see throwTimeout).
Clock::duration timeoutPatience(Clock::duration timeout) {
  return std::clamp<Clock::duration>(timeout, std::chrono::milliseconds(500), std::chrono::seconds(10));
}

class MpiTransport : public Transport {
 public:
  MpiTransport(Store& store, int rank, int size, const TransportOptions& opts)
      : Transport(rank, size), peers_(size), failures_(size), closed_by_(size, 0), closed_to_(size, 0), world_(size),
        names_(size), hold_until_(size) {
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
    findMembers(store, rank, size, ws, world_, names_);
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

  // Frees the communicator only once every peer said "closed" (its last message on it): OpenMPI puts a
  // message that arrives for a freed communicator into the next one given the same id, where it breaks
  // the matching order. A peer that is not done within kCloseWait leaves the communicator kept.
  ~MpiTransport() override {
    std::unique_lock<std::mutex> g(mpiMutex());
    int done = 0;
    MPI_Finalized(&done);
    if (done) return;
    if (!settle(g, kCloseWait, /*all_closed=*/true)) {
      kept().buffers.push_back(std::move(abort_in_));  // its receive stays posted on the kept communicator
      return;
    }
    MPI_Cancel(&abort_in_req_);
    MPI_Wait(&abort_in_req_, MPI_STATUS_IGNORE);  // nothing can match it now: it completes as cancelled
    MPI_Comm_free(&comm_);
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
    patience_ = std::min<Clock::duration>(label.timeout, kMaxSettle);
    try {
      {
        std::lock_guard<std::mutex> g(mpiMutex());
        in_run_ = true;
        pollControl();
        if (deferred_) raiseDeferred(label);  // a peer failed: nothing of this run is posted
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
      std::lock_guard<std::mutex> g(mpiMutex());
      in_run_ = false;
      closeHeld(Clock::time_point::max());
    } catch (const std::exception& e) {
      abort(e);  // tells the peers, and returns once no transfer of this run can touch the caller's buffers
      throw;
    }
  }

  void abort(const std::exception& why) noexcept override {
    try {
      std::unique_lock<std::mutex> g(mpiMutex());
      if (comm_ == MPI_COMM_NULL) return;
      in_run_ = false;
      sendAbort(why);
      broken_ = true;
      settle(g, patience_);
    } catch (...) {
    }
  }

 private:
  // The headers live on the heap: MPI reads a send's and writes a receive's header until its request
  // completes, which may be after the state moved (see settle).
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
  // What MPI may still use after its owner went: kept past MPI_Finalize (which may touch it), so never
  // destroyed, unlike a function-local static (destroyed before the atexit handler that finalizes MPI).
  struct Kept {
    std::deque<SendState> sends;
    std::deque<RecvState> recvs;
    std::deque<std::vector<char>> buffers;
  };
  static Kept& kept() {
    static Kept* k = new Kept;  // NOLINT(cppcoreguidelines-owning-memory): deliberately never freed
    return *k;
  }
  struct Peer {
    std::deque<SendState> sends;
    std::deque<RecvState> recvs;
    std::vector<char> staging;  // kWindow chunks, for reducing receives
    size_t next_slot = 0;
  };

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

  // Takes the control messages that arrived on the abort tag: a peer's abort (its failure, kept per peer;
  // with no receive from that peer pending this rank says "closed" to it: it never posts one again, since
  // every later run raises the failure first) and a peer's "closed" (see settle()).
  // "Closed" is the last message to that peer, so it is held back after a peer's timeout that comes in
  // while this rank is inside a run: ranks waiting on each other time out together, and if this run
  // times out too, its abort must still reach that peer, which waits for it (throwTimeout) to name the
  // rank this one was stuck on. Held until the run ends, or for the wait throwTimeout gives it.
  void pollControl() {
    while (abort_in_req_ != MPI_REQUEST_NULL) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Test(&abort_in_req_, &flag, &st) != MPI_SUCCESS || !flag) return;
      int n = 0;
      MPI_Get_count(&st, MPI_BYTE, &n);
      Header h;
      std::string msg = "(message lost)";
      ErrorKind kind = ErrorKind::other;
      bool closed = false;
      if (n >= static_cast<int>(sizeof h)) {
        std::memcpy(&h, abort_in_.data(), sizeof h);
        if (h.magic == kFrameMagic && h.length == static_cast<uint64_t>(n) - sizeof h) {
          closed = h.opcode == kClosedOpcode;
          if (h.opcode == static_cast<uint16_t>(OpCode::abort)) {
            msg.assign(abort_in_.data() + sizeof h, h.length);
            kind = static_cast<ErrorKind>(h.tag);
          }
        }
      }
      const int peer = st.MPI_SOURCE;
      postAbortRecv();  // the next one: a peer this run needs may fail after this one
      if (peer < 0 || peer >= size_ || peer == rank_) continue;
      const auto i = static_cast<size_t>(peer);
      if (closed) {
        closed_by_[i] = 1;
        continue;
      }
      if (failures_[i]) continue;
      failures_[i] = PeerFailure{peer, kind, std::move(msg)};
      if (!deferred_) deferred_ = failures_[i];
      if (!peers_[i].recvs.empty()) continue;
      if (in_run_ && kind == ErrorKind::timeout) hold_until_[i] = Clock::now() + timeoutPatience(patience_);
      else closeToward(peer);
    }
    closeHeld(Clock::now());
  }

  // Says "closed" to each failed peer whose "closed" was held back until `now` or earlier (see pollControl).
  void closeHeld(Clock::time_point now) {
    for (size_t i = 0; i < hold_until_.size(); ++i) {
      if (hold_until_[i] == Clock::time_point{} || hold_until_[i] > now) continue;
      hold_until_[i] = Clock::time_point{};
      closeToward(static_cast<int>(i));
    }
  }

  // A failed peer's abort: raised now when this run needs that peer (receives from it, with
  // `receiving_only`), otherwise kept and raised at the next run (the peer may have finished its part of
  // this one).
  void checkAbort(const Label& label, bool receiving_only = false) {
    pollControl();
    for (size_t i = 0; i < failures_.size(); ++i) {
      const auto& p = peers_[i];
      if (!failures_[i] || ((receiving_only || p.sends.empty()) && p.recvs.empty())) continue;
      const PeerFailure d = *failures_[i];
      throwPeerFailed(rank_, label, d.peer, d.kind, d.msg, waitingFor(*this, peers_));
    }
  }

  [[noreturn]] void throwTimeout(const Label& label) {
    std::string msg = fmt::format("[rank {}] {} timed out after {}s waiting for {}", rank_, label.what,
                                  label.timeout.count() / 1000.0, waitingFor(*this, peers_));
    // Ranks waiting on each other time out together. Tell the others at once, then wait for the peers
    // this rank receives from: the one that waited for the stuck rank names it. Their deadlines started
    // when they entered the op, which a loaded machine can delay by a second or more: the wait is the
    // op's own timeout, between 0.5 and 10 s (a stuck upstream peer never answers).
    {
      std::lock_guard<std::mutex> g(mpiMutex());
      sendAbort(TimeoutError(msg));
    }
    const auto until = Clock::now() + timeoutPatience(label.timeout);
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

  // Sends `why` to every peer still open once (the first failure is the one they name). mpiMutex() held.
  void sendAbort(const std::exception& why) {
    if (comm_ == MPI_COMM_NULL || told_) return;  // told them already
    told_ = true;
    std::string msg;
    const Header h = abortHeader(why, msg);
    abort_out_.resize(sizeof h + msg.size());
    std::memcpy(abort_out_.data(), &h, sizeof h);
    std::memcpy(abort_out_.data() + sizeof h, msg.data(), msg.size());
    for (int i = 0; i < size_; ++i) {
      if (i == rank_ || closed_to_[static_cast<size_t>(i)]) continue;  // "closed" is the last message
      abort_out_reqs_.push_back(MPI_REQUEST_NULL);
      MPI_Isend(abort_out_.data(), static_cast<int>(abort_out_.size()), MPI_BYTE, i, abort_tag_, comm_,
                &abort_out_reqs_.back());
    }
  }

  // Tells `peer` that this rank posts no receive on this group again: its last message to that peer here
  // (every later run raises a failure before it posts). mpiMutex() held.
  void closeToward(int peer) {
    auto& flag = closed_to_[static_cast<size_t>(peer)];
    if (peer == rank_ || flag) return;
    flag = 1;
    auto& s = control_.emplace_back();
    s.h->opcode = kClosedOpcode;
    s.reqs.push_back(MPI_REQUEST_NULL);
    MPI_Isend(s.h.get(), sizeof(Header), MPI_BYTE, peer, abort_tag_, comm_, &s.reqs.back());
  }

  // After a failure, and when the group closes: withdraws every receive and waits for the ones that had
  // matched (MPI delivers those into the caller's buffers), says "closed" to every peer, then waits until
  // every send completed or its peer said "closed" (no receive will match it then, so MPI never reads its
  // buffer again), and for the abort and "closed" messages to leave; with `all_closed`, also for every
  // peer's "closed". Bounded by `patience`: what is pending then stays with MPI (requests freed, headers
  // kept for the life of the process; a warning names the peers). Returns whether all of it happened.
  // Called with mpiMutex() held through `g`, which is released while idle.
  bool settle(std::unique_lock<std::mutex>& g, Clock::duration patience, bool all_closed = false) {
    std::vector<MPI_Request*> recvs, sends;
    for (auto& p : peers_)
      for (auto& r : p.recvs) {
        recvs.push_back(&r.hreq);
        for (auto& c : r.inflight) recvs.push_back(&c.req);
      }
    for (MPI_Request* q : recvs)
      if (*q != MPI_REQUEST_NULL) MPI_Cancel(q);
    const auto until = Clock::now() + patience;
    bool closed = false, transfers = false, peers_closed = false;
    for (;;) {
      pollControl();
      if (!closed && completeWithin(recvs, Clock::duration::zero())) {
        for (int i = 0; i < size_; ++i) closeToward(i);
        closed = true;
      }
      sends.clear();
      for (auto& r : abort_out_reqs_) sends.push_back(&r);
      for (auto& s : control_)
        for (auto& r : s.reqs) sends.push_back(&r);
      peers_closed = true;
      for (size_t i = 0; i < peers_.size(); ++i) {
        peers_closed = peers_closed && (closed_by_[i] || static_cast<int>(i) == rank_);
        if (closed_by_[i]) continue;
        for (auto& s : peers_[i].sends)
          for (auto& r : s.reqs) sends.push_back(&r);
      }
      transfers = closed && completeWithin(sends, Clock::duration::zero());
      if ((transfers && (peers_closed || !all_closed)) || Clock::now() >= until) break;
      g.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      g.lock();
    }
    if (!transfers) {
      std::fprintf(stderr, "[rank %d] mpi transport: transfers with %s still pending %.1f s after the group %s; "
                   "MPI may yet touch their buffers\n", rank_, waitingFor(*this, peers_).c_str(),
                   std::chrono::duration<double>(patience).count(), broken_ ? "failed" : "closed");
    }
    for (auto& p : peers_) {
      for (auto& r : p.recvs) {
        if (r.hreq != MPI_REQUEST_NULL) MPI_Request_free(&r.hreq);
        for (auto& c : r.inflight)
          if (c.req != MPI_REQUEST_NULL) MPI_Request_free(&c.req);
        if (!transfers) kept().recvs.push_back(std::move(r));
      }
      p.recvs.clear();
      for (auto& s : p.sends) control_.push_back(std::move(s));
      p.sends.clear();
    }
    // Sends to a peer that said "closed" never match: their requests are freed, their headers kept.
    for (auto& s : control_) {
      for (auto& r : s.reqs)
        if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
      kept().sends.push_back(std::move(s));
    }
    control_.clear();
    bool aborts_pending = false;
    for (auto& r : abort_out_reqs_)
      if (r != MPI_REQUEST_NULL) aborts_pending = MPI_Request_free(&r) == MPI_SUCCESS;
    if (aborts_pending) kept().buffers.push_back(std::move(abort_out_));
    return transfers && peers_closed;
  }

  std::optional<PeerFailure> deferred_;  // the first peer failure not raised yet
  std::vector<Peer> peers_;
  std::vector<std::optional<PeerFailure>> failures_;  // each peer's abort, once it came
  std::vector<char> closed_by_, closed_to_;           // "closed" received from / sent to each peer
  std::vector<int> world_;                            // each group rank's MPI_COMM_WORLD rank
  std::vector<std::string> names_;                    // and its processor name
  MPI_Comm comm_ = MPI_COMM_NULL;
  int frame_tag_ = 0, abort_tag_ = 1;  // this group's (see the constructor); frames use one tag, aborts the next
  size_t chunk_ = kDefaultChunk;
  bool broken_ = false;
  Clock::duration patience_ = kMaxSettle;  // settle()'s bound after a failure: the last op's timeout
  std::deque<SendState> control_;          // "closed" messages sent
  std::vector<char> abort_in_;
  MPI_Request abort_in_req_ = MPI_REQUEST_NULL;
  std::vector<char> abort_out_;
  bool told_ = false;  // abort sent
  bool in_run_ = false;  // inside run() (see pollControl)
  std::vector<Clock::time_point> hold_until_;  // per failed peer: "closed" held back until then (or zero)
  std::vector<MPI_Request> abort_out_reqs_;
};

}  // namespace

void registerMpiTransport() {
  registerTransport("mpi", [](Store& store, int rank, int size, const TransportOptions& opts) {
    return std::make_unique<MpiTransport>(store, rank, size, opts);
  });
}

}  // namespace dtrain::comm::transport
