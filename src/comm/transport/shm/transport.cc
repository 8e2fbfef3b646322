// Shared-memory transport between the ranks of one host.
//
// Rank 0 creates one POSIX shared-memory segment (found by the others through the store) and unlinks
// it once everyone has mapped it, so nothing is left in /dev/shm if a rank crashes later. The segment
// holds, per rank, a doorbell word (a futex) and an abort record; and, per ordered pair (src -> dst),
// a single-producer single-consumer byte ring with a write position and a read position.
//
// A message is the same frame the TCP transport sends (Header, payload) padded to 8 bytes, streamed
// through the ring in pieces of at most kPiece bytes, so the receiver starts copying (or reducing)
// while the sender is still writing. Every position moves in multiples of 8, so a reduce receive
// always sees whole elements, even across the ring's wrap-around.
//
// Waiting: a rank that can make no progress reads its doorbell, checks once more, spins (spin.h), then
// sleeps on the doorbell futex in short slices. Whoever moves data a peer may wait for rings the peer's
// doorbell and wakes it only if it is asleep. Each slice checks the abort records (a failed rank writes
// its error there) and that the peers waited for are alive: a dead peer is named within a fraction of a
// second. A peer that did its part of a wait and then failed is raised by the next op needing it.
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <random>
#include <thread>

#include "comm/transport/shm/segment.h"
#include "comm/transport/transport.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm::transport {
namespace {

using namespace shm;  // the segment layout and wait primitives (segment.h)

class ShmTransport : public Transport, public Staging {
 public:
  ShmTransport(Store& store, int rank, int size, const TransportOptions& opts) : Transport(rank, size) {
    size_t ring = opts.segment_bytes;
    if (ring == 0) {
      // About 32 MiB of rings in all, between 64 KiB and 1 MiB per ordered pair. Small rings stay in
      // cache while producer and consumer stream through them: 1 MiB beat 4 MiB by 30% at 16 MiB.
      size_t pairs = static_cast<size_t>(size) * static_cast<size_t>(std::max(size - 1, 1));
      ring = std::clamp<size_t>((32u << 20) / pairs, 64u << 10, 1u << 20);
    }
    ring_ = pow2Floor(std::max(ring, kMinRing));
    slots_off_ = roundUp(sizeof(SegHeader), 64);
    ctl_off_ = slots_off_ + roundUp(sizeof(RankSlot), 64) * size;
    data_off_ = roundUp(ctl_off_ + sizeof(RingCtl) * size * size, 4096);
    // Staging chunks (for the direct allreduce, collectives/allreduce_direct.cc). With a core per rank, smaller chunks keep a chunk's staging, reduction
    // and gather in cache (2 ranks idle, 16 MiB: 4.6 GB/s busbw with 64 KiB chunks, 4.5 with 256 KiB,
    // 3.6 with 1 MiB); but each chunk costs three waits, and when another job takes a core every wait
    // is a context switch, so 256 KiB is the compromise. With more ranks than cores waits are always
    // context switches and chunks must be large (4 ranks on 2 cores, 4 MiB: 2.8 GB/s with 1 MiB
    // chunks, 1.5 with 64 KiB). A configured segment size (tests) overrides both.
    if (opts.segment_bytes) {
      chunk_ = std::max<size_t>(ring_ / 2, kMinRing);
    } else {
      chunk_ = size > usableCores() ? kChunkLarge : kChunkSmall;
    }
    coll_ctl_off_ = data_off_ + ring_ * size * size;
    coll_data_off_ = roundUp(coll_ctl_off_ + sizeof(ProgressWord) * 3 * size, 4096);
    total_ = coll_data_off_ + kSlots * (size + 1) * chunk_;
    auto deadline = Clock::now() + opts.timeout;
    std::string name;
    if (rank == 0) {
      std::random_device rd;
      name = fmt::format("/dtrain-{}-{:x}{:x}", getpid(), rd(), rd());
      int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0) throw IoError(fmt::format("[rank 0] shm transport: shm_open({}): {}", name, strerror(errno)));
      if (ftruncate(fd, static_cast<off_t>(total_)) != 0) {
        int e = errno;
        close(fd);
        shm_unlink(name.c_str());
        throw IoError(fmt::format("[rank 0] shm transport: cannot size {} to {} bytes: {}", name, total_, strerror(e)));
      }
      map(fd, name);
      auto* h = header();
      h->size = static_cast<uint64_t>(size);
      h->ring_bytes = ring_;
      h->total_bytes = total_;
      std::atomic_thread_fence(std::memory_order_release);
      h->magic = kSegMagic;
      store.set("shm/name", toBytes(name));
    } else {
      name = toString(store.get("shm/name"));
      int fd = shm_open(name.c_str(), O_RDWR, 0600);
      if (fd < 0) {
        throw RendezvousError(fmt::format(
            "[rank {}] shm transport: cannot open rank 0's segment {}: {} (are all ranks on one host? "
            "set DTRAIN_TRANSPORT=tcp otherwise)", rank, name, strerror(errno)));
      }
      map(fd, name);
      auto* h = header();
      if (h->magic != kSegMagic || h->size != static_cast<uint64_t>(size) || h->ring_bytes != ring_ ||
          h->total_bytes != total_) {
        throw RendezvousError(fmt::format(
            "[rank {}] shm transport: segment {} does not match this rank's view (size {} ring {} vs {} {}): "
            "ranks disagree on DTRAIN_SEGMENT_BYTES or the world size", rank, name, h->size, h->ring_bytes, size, ring_));
      }
    }
    slot(rank)->pid.store(getpid());
    slot(rank)->cores.store(usableCores());
    store.set(fmt::format("shm/mapped/{}", rank), toBytes("1"));
    std::vector<std::string> keys;
    for (int r = 0; r < size; ++r) keys.push_back(fmt::format("shm/mapped/{}", r));
    store.wait(keys, std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::max(deadline - Clock::now(), Clock::duration(0))));
    if (rank == 0) shm_unlink(name.c_str());
    int cores = INT_MAX;
    for (int r = 0; r < size; ++r) {
      pids_.push_back(slot(r)->pid.load());
      cores = std::min(cores, slot(r)->cores.load());
    }
    ring_mask_.assign(size, 0);
    // The fewest cores any rank has: every rank must pick the same algorithm for the same call.
    oversubscribed_ = size > cores;
    spin_ = spinBudget(opts.spin_us, oversubscribed_);
  }

  // A peer that still waits for this rank (its process lives on: a thread, a caller that goes on) learns
  // now that nothing will come, instead of at its deadline: checkPeersAlive reads `closed`.
  ~ShmTransport() override {
    if (!base_) return;
    slot(rank_)->closed.store(1, std::memory_order_seq_cst);
    wakeEveryPeer();
    munmap(base_, total_);
  }

  const char* name() const override { return "shm"; }

  std::string peerName(int p) const override {
    return fmt::format("rank {} (pid {})", p, p >= 0 && p < size_ ? pids_[p] : -1);
  }

  void run(std::vector<Op>& ops, Deadline deadline, const Label& label) override {
    std::vector<Stream> sends(size_), recvs(size_);
    // Per peer and direction, ops run in list order: index queues (members, for error reports).
    auto& sq = sq_;
    auto& rq = rq_;
    auto& sqi = sqi_;
    auto& rqi = rqi_;
    sq.assign(size_, {});
    rq.assign(size_, {});
    for (auto& op : ops) {
      DTRAIN_CHECK(op.peer >= 0 && op.peer < size_ && op.peer != rank_, InvalidArgument,
                   "[rank {}] {}: invalid peer {} (group size {})", rank_, label.what, op.peer, size_);
      (op.kind == Op::kSend ? sq : rq)[op.peer].push_back(&op);
    }
    sqi.assign(size_, 0);
    rqi.assign(size_, 0);
    size_t remaining = ops.size();
    auto* me = slot(rank_);
    while (remaining > 0) {
      uint32_t bell = me->doorbell.load(std::memory_order_seq_cst);
      bool progress = false;
      gated_ = false;
      ring_mask_.assign(size_, 0);
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        while (sqi[p] < sq[p].size()) {
          Stream& s = sends[p];
          if (!s.op) s.start(sq[p][sqi[p]], label, true);
          progress |= pumpSend(p, s);
          if (!s.finished()) break;
          s = Stream{};
          ++sqi[p];
          --remaining;
        }
        while (rqi[p] < rq[p].size()) {
          Stream& r = recvs[p];
          if (!r.op) r.start(rq[p][rqi[p]], label, false);
          progress |= pumpRecv(p, r, label);
          if (!r.finished()) break;
          r = Stream{};
          ++rqi[p];
          --remaining;
        }
      }
      ringPeers();
      if (remaining == 0 || progress) continue;
      if (gated_) {  // a payload waits for the others' calls: be woken when one is published
        awaitingCalls(true);
        if (fingerprintsAgree(label)) continue;  // a call published since the pass: deliver now
      }
      waitForBell(bell, deadline, label);
    }
  }

  Staging* staging() override { return this; }
  bool oversubscribed() const override { return oversubscribed_; }

  // Staging: the segment's collective area (kSlots slots of size + 1 chunks) and progress counters.
  size_t chunkBytes() const override { return chunk_; }
  uint64_t slots() const override { return kSlots; }
  char* chunk(uint64_t s, int q) override { return base_ + coll_data_off_ + (s * (size_ + 1) + q) * chunk_; }
  uint64_t nextChunk() override { return ++chunks_done_; }
  void publish(Counter k, uint64_t g) override {
    counter(k, rank_)->v.store(g, std::memory_order_release);
    for (int p = 0; p < size_; ++p) ring_mask_[p] = p != rank_;
    ringPeers();
  }
  void waitFor(Counter k, uint64_t g, Deadline deadline, const Label& label, const char* doing, bool calls) override {
    if (calls && check_pending_) {
      // A rank publishes its call before it stages, so one wait covers both; a rank in another
      // collective never stages, but its call is seen (and named) while waiting.
      waitAll([&](int p) { return sameCall(p, label) && counter(k, p)->v.load(std::memory_order_acquire) >= g; },
              deadline, label, doing);
      check_pending_ = false;
    } else {
      waitAll([&](int p) { return counter(k, p)->v.load(std::memory_order_acquire) >= g; }, deadline, label, doing);
    }
  }

  // Publishes this rank's call and compares every rank's before anything is written to an output.
  // Most algorithms copy local blocks into the output before they communicate, so for them the ranks
  // compare at once. Allreduce writes its output only from received data (or after its first exchange),
  // so there the comparison joins a wait the algorithm has anyway: the direct allreduce's first wait
// (Staging::waitFor with calls),
  // or, over the pair queues, the first delivery of a received payload (pumpRecv holds it back until
  // every rank's call is known to be the same). Sends go ahead meanwhile.
  bool beginCollective(const Label& label, Deadline deadline) override {
    FpEntry& e = slot(rank_)->fps[++begun_ & 1];
    e.seq = label.seq;
    e.fp = label.fp;
    e.stamp.store(begun_, std::memory_order_seq_cst);
    check_pending_ = true;
    // Wake only the ranks that wait for calls (awaitingCalls): ringing everyone on every collective
    // costs a context switch per peer when ranks outnumber cores.
    for (int p = 0; p < size_; ++p)
      ring_mask_[p] = p != rank_ && slot(p)->awaiting_calls.load(std::memory_order_seq_cst);
    ringPeers();
    if (label.fp.op != static_cast<uint16_t>(OpCode::allreduce)) awaitFingerprints(deadline, label);
    return true;
  }

  void compareCalls(const Label& label, Deadline deadline) override {
    if (check_pending_) awaitFingerprints(deadline, label);
  }

  void abort(const std::exception& why) noexcept override {
    auto* me = slot(rank_);
    if (me->aborted.load()) return;
    std::string msg = why.what();
    if (msg.size() > kMaxAbortMessage) msg.resize(kMaxAbortMessage);
    std::memcpy(me->abort_msg, msg.data(), msg.size());
    me->abort_msg[msg.size()] = 0;
    me->abort_kind = static_cast<uint32_t>(errorKindOf(why));
    me->aborted.store(1, std::memory_order_seq_cst);
    wakeEveryPeer();
  }

 private:
  // Rings every other rank's doorbell and wakes its sleepers, so that each looks at this rank's slot now
  // (its abort record, its closed flag).
  void wakeEveryPeer() {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      slot(p)->doorbell.fetch_add(1);
      futexWakeAll(&slot(p)->doorbell);
    }
  }

  // One frame travelling through a ring: header, payload, padding to 8 bytes.
  struct Stream {
    Op* op = nullptr;
    Header h;
    uint64_t done = 0;   // stream bytes moved
    uint64_t total = 0;  // sizeof(Header) + roundUp(bytes, 8); receivers learn it from the header
    bool header_ok = false;
    void start(Op* o, const Label& label, bool send) {
      op = o;
      if (send) h = frameHeader(label, o->tag, o->bytes);
      total = sizeof(Header) + roundUp(o->bytes, 8);
    }
    bool finished() const { return op && done == total; }
  };

  void map(int fd, const std::string& name) {
    void* p = mmap(nullptr, total_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED) {
      throw IoError(fmt::format("[rank {}] shm transport: mmap of {} ({} bytes): {}", rank_, name, total_, strerror(e)));
    }
    base_ = static_cast<char*>(p);
  }
  SegHeader* header() { return reinterpret_cast<SegHeader*>(base_); }
  RankSlot* slot(int r) { return reinterpret_cast<RankSlot*>(base_ + slots_off_ + roundUp(sizeof(RankSlot), 64) * r); }
  const RankSlot* slot(int r) const {
    return reinterpret_cast<const RankSlot*>(base_ + slots_off_ + roundUp(sizeof(RankSlot), 64) * r);
  }
  RingCtl* ctl(int src, int dst) { return reinterpret_cast<RingCtl*>(base_ + ctl_off_) + (src * size_ + dst); }
  char* ringData(int src, int dst) { return base_ + data_off_ + ring_ * (src * size_ + dst); }

  // Copies stream bytes [from, from+n) of a send into the ring at position pos.
  void produce(Stream& s, char* ring, uint64_t pos, uint64_t from, uint64_t n) {
    while (n > 0) {
      uint64_t off = pos & (ring_ - 1);
      uint64_t chunk = std::min<uint64_t>(n, ring_ - off);
      uint64_t c = 0;
      // header part
      if (from < sizeof(Header)) {
        uint64_t k = std::min<uint64_t>(chunk, sizeof(Header) - from);
        std::memcpy(ring + off, reinterpret_cast<char*>(&s.h) + from, k);
        c = k;
      }
      if (c < chunk) {
        uint64_t poff = from + c - sizeof(Header);
        uint64_t k = chunk - c;
        if (poff < s.op->bytes) {
          uint64_t real = std::min<uint64_t>(k, s.op->bytes - poff);
          std::memcpy(ring + off + c, static_cast<char*>(s.op->data) + poff, real);
        }
      }
      pos += chunk;
      from += chunk;
      n -= chunk;
    }
  }

  bool pumpSend(int p, Stream& s) {
    RingCtl* c = ctl(rank_, p);
    uint64_t head = c->head.load(std::memory_order_relaxed);
    uint64_t tail = c->tail.load(std::memory_order_acquire);
    uint64_t space = ring_ - (head - tail);
    uint64_t n = std::min<uint64_t>({space, s.total - s.done, kPiece});
    if (n == 0) return false;
    produce(s, ringData(rank_, p), head, s.done, n);
    c->head.store(head + n, std::memory_order_release);
    s.done += n;
    ring_mask_[p] = 1;
    return true;
  }

  bool pumpRecv(int p, Stream& r, const Label& label) {
    RingCtl* c = ctl(p, rank_);
    uint64_t tail = c->tail.load(std::memory_order_relaxed);
    uint64_t head = c->head.load(std::memory_order_acquire);
    uint64_t avail = head - tail;
    if (avail == 0) return false;
    char* ring = ringData(p, rank_);
    uint64_t used = 0;
    if (r.done < sizeof(Header)) {
      // Writers publish in multiples of 8 bytes, so the header may arrive in parts.
      uint64_t k = std::min<uint64_t>(avail, sizeof(Header) - r.done);
      copyOut(reinterpret_cast<char*>(&r.h) + r.done, ring, tail, k);
      r.done += k;
      used += k;
      if (r.done == sizeof(Header)) {
        // Payloads are delivered only after every rank's call was compared (see beginCollective).
        checkHeader(r.h, r.op->tag, r.op->bytes, rank_, peerName(p), label, "no output buffer was modified");
      }
    }
    // A payload reaches its destination only once every rank's call is known to be this one.
    const bool deliver =
        r.done >= sizeof(Header) && (!check_pending_ || r.op->to_scratch || fingerprintsAgree(label));
    gated_ |= r.done >= sizeof(Header) && !deliver;
    if (deliver) {
      uint64_t n = std::min<uint64_t>({avail - used, r.total - r.done, kPiece});
      uint64_t poff = r.done - sizeof(Header);
      uint64_t real = poff < r.op->bytes ? std::min<uint64_t>(n, r.op->bytes - poff) : 0;
      char* dst = static_cast<char*>(r.op->data) + poff;
      uint64_t pos = tail + used;
      while (real > 0) {
        uint64_t off = pos & (ring_ - 1);
        uint64_t chunk = std::min<uint64_t>(real, ring_ - off);
        if (r.op->reduce) {
          r.op->reduce(dst, r.op->operandAt(static_cast<size_t>(dst - static_cast<char*>(r.op->data))), ring + off,
                       chunk / dtypeSize(r.op->dtype), r.op->dtype, r.op->rop);
        } else {
          std::memcpy(dst, ring + off, chunk);
        }
        dst += chunk;
        pos += chunk;
        real -= chunk;
      }
      r.done += n;
      used += n;
    }
    c->tail.store(tail + used, std::memory_order_release);
    ring_mask_[p] = 1;
    return used > 0;
  }

  ProgressWord* counter(Counter k, int r) {
    return reinterpret_cast<ProgressWord*>(base_ + coll_ctl_off_) + (static_cast<int>(k) * size_ + r);
  }

  // Waits until every rank has begun this collective and compares their calls: a difference is a
  // mismatch error on this rank (and, since every rank compares every other, on all of them), raised
  // before anything was written to an output.
  void awaitFingerprints(Deadline deadline, const Label& label) {
    if (fingerprintsAgree(label)) return;
    awaitingCalls(true);
    waitAll([&](int p) { return sameCall(p, label); }, deadline, label, "to begin this collective");
    check_pending_ = false;
    awaitingCalls(false);
  }

  // Whether rank p published its call for the collective this rank began last.
  bool began(int p) const { return slot(p)->fps[begun_ & 1].stamp.load(std::memory_order_seq_cst) == begun_; }

  // Whether rank p began this collective; a different call is a mismatch error.
  bool sameCall(int p, const Label& label) {
    if (!began(p)) return false;
    const FpEntry& e = slot(p)->fps[begun_ & 1];
    if (e.seq != label.seq || e.fp != label.fp)
      throwMismatch(rank_, label, peerName(p), e.seq, e.fp, "no output buffer was modified");
    return true;
  }

  // Without waiting: true (and no longer pending) once every rank began this same collective.
  bool fingerprintsAgree(const Label& label) {
    for (int p = 0; p < size_; ++p)
      if (p != rank_ && !sameCall(p, label)) return false;
    check_pending_ = false;
    awaitingCalls(false);
    return true;
  }

  // Before sleeping for others' calls, a rank says so and then looks again; a rank that publishes its
  // call after that sees the flag and rings (both sides seq_cst: one of them sees the other).
  void awaitingCalls(bool on) {
    auto& f = slot(rank_)->awaiting_calls;
    if (f.load(std::memory_order_relaxed) != static_cast<uint32_t>(on)) f.store(on, std::memory_order_seq_cst);
  }

  // Waits until ready(p) holds for every other rank p (ready may throw), spinning briefly, then sleeping
  // in slices that check aborts, the deadline and whether the ranks still needed are alive.
  template <typename Ready>
  void waitAll(Ready&& ready, Deadline deadline, const Label& label, const char* doing) {
    auto* me = slot(rank_);
    auto allReady = [&] {
      for (int p = 0; p < size_; ++p)
        if (p != rank_ && !ready(p)) return false;
      return true;
    };
    // Built only for an error message: the ranks still behind.
    auto describe = [&] {
      std::string w;
      for (int p = 0; p < size_; ++p)
        if (p != rank_ && !ready(p)) w += (w.empty() ? "" : ", ") + peerName(p);
      return fmt::format("{} {}", w, doing);
    };
    for (SpinWait spin(spin_);;) {
      uint32_t bell = me->doorbell.load(std::memory_order_seq_cst);
      if (allReady()) return;
      if (spin.spin()) continue;
      for (int p = 0; p < size_; ++p) {
        if (p != rank_ && kill(pids_[p], 0) != 0 && errno == ESRCH && !ready(p)) {
          checkAborts(label, describe);  // a rank that failed and exited left its reason: report that
          throw IoError(fmt::format("[rank {}] {}: {} exited or was killed while this rank waited for it {}",
                                    rank_, label.what, peerName(p), doing));
        }
      }
      try {
        sleepSlice(bell, deadline, label, describe);
      } catch (const Error&) {  // a peer did its part of this wait, then failed: the next op raises it
        if (allReady()) return;
        throw;
      }
    }
  }

  void copyOut(char* dst, const char* ring, uint64_t pos, uint64_t n) {
    while (n > 0) {
      uint64_t off = pos & (ring_ - 1);
      uint64_t chunk = std::min<uint64_t>(n, ring_ - off);
      std::memcpy(dst, ring + off, chunk);
      dst += chunk;
      pos += chunk;
      n -= chunk;
    }
  }

  void ringPeers() {
    for (int p = 0; p < size_; ++p) {
      if (!ring_mask_[p]) continue;
      RankSlot* s = slot(p);
      s->doorbell.fetch_add(1, std::memory_order_seq_cst);
      if (s->sleepers.load(std::memory_order_seq_cst) > 0) futexWakeAll(&s->doorbell);
    }
  }

  void waitForBell(uint32_t bell, Deadline deadline, const Label& label) {
    auto* me = slot(rank_);
    for (SpinWait spin(spin_); spin.spin();) {
      if (me->doorbell.load(std::memory_order_acquire) != bell) return;
    }
    for (;;) {
      sleepSlice(bell, deadline, label, [this] { return waitingFor(); });
      if (me->doorbell.load(std::memory_order_acquire) != bell) return;
      checkPeersAlive(label);
    }
  }

  // One slice of waiting for this rank's doorbell to move from `bell`, shared by every wait: first the
  // checks that end a wait early (a peer's abort record, a peer in a different collective, the
  // deadline), then sleep on the futex for at most kSleepSlice. `waiting` names what we wait for.
  template <typename Waiting>
  void sleepSlice(uint32_t bell, Deadline deadline, const Label& label, Waiting&& waiting) {
    checkAborts(label, waiting);
    auto now = Clock::now();
    if (now >= deadline) {
      throw TimeoutError(fmt::format("[rank {}] {} timed out after {}s waiting for {}", rank_, label.what,
                                     label.timeout.count() / 1000.0, waiting()));
    }
    auto* me = slot(rank_);
    me->sleepers.fetch_add(1, std::memory_order_seq_cst);
    if (me->doorbell.load(std::memory_order_seq_cst) == bell) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now) + std::chrono::milliseconds(1);
      futexWait(&me->doorbell, bell, std::min<std::chrono::milliseconds>(left, kSleepSlice));
    }
    me->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }

  // `waiting()` names what this rank waits for; called only when a peer did fail.
  template <typename Waiting>
  void checkAborts(const Label& label, Waiting&& waiting) {
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      RankSlot* s = slot(p);
      if (s->aborted.load(std::memory_order_acquire)) {
        std::string msg(s->abort_msg, strnlen(s->abort_msg, kMaxAbortMessage));
        throwOfKind(static_cast<ErrorKind>(s->abort_kind),
                    fmt::format("[rank {}] {}: peer rank {} failed: {} (this rank was waiting for {})", rank_,
                                label.what, p, msg, waiting()));
      }
    }
  }

  // A peer we still need that no longer exists will never ring: say so now rather than at the timeout.
  // (A peer that finished and exited is fine as long as we need nothing more from it.)
  void checkPeersAlive(const Label& label) {
    const auto &sq = sq_, &rq = rq_;
    const auto &sqi = sqi_, &rqi = rqi_;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      bool pending = sqi[p] < sq[p].size() || rqi[p] < rq[p].size() || (check_pending_ && !sameCall(p, label));
      if (!pending) continue;
      const bool closed = slot(p)->closed.load(std::memory_order_acquire) != 0;
      if (closed || (kill(pids_[p], 0) != 0 && errno == ESRCH)) {
        // Data it wrote before dying may still be in the ring: let the caller pump once more.
        RingCtl* c = ctl(p, rank_);
        if (rqi[p] < rq[p].size() && c->head.load() != c->tail.load()) return;
        checkAborts(label, [this] { return waitingFor(); });  // a rank that failed and exited left its reason: report that
        throw IoError(fmt::format("[rank {}] {}: {} {} while this rank waited for it", rank_, label.what, peerName(p),
                                  closed ? "closed its process group (destroyed it)" : "exited or was killed"));
      }
    }
  }

  // "rank 3 (pid 1234) (recv), rank 1 (pid 1200) (send)": the peers the current run still needs.
  std::string waitingFor() const {
    std::string waiting;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      bool s = sqi_[p] < sq_[p].size(), r = rqi_[p] < rq_[p].size();
      if (check_pending_ && !began(p)) {
        waiting += fmt::format("{}{} (to begin this collective)", waiting.empty() ? "" : ", ", peerName(p));
        continue;
      }
      if (!s && !r) continue;
      waiting += fmt::format("{}{} ({})", waiting.empty() ? "" : ", ", peerName(p), r ? (s ? "send+recv" : "recv") : "send");
    }
    return waiting;
  }

  char* base_ = nullptr;
  size_t ring_ = 0, slots_off_ = 0, ctl_off_ = 0, data_off_ = 0, total_ = 0;
  size_t chunk_ = 0, coll_ctl_off_ = 0, coll_data_off_ = 0;
  uint64_t chunks_done_ = 0;  // chunks staged so far (the same on every rank)
  uint64_t begun_ = 0;        // collectives begun (the stamp of this rank's published fingerprint)
  bool gated_ = false;          // this pass held back a payload until the others' calls are known
  bool check_pending_ = false;  // begun, but the fingerprints not compared yet
  std::vector<int32_t> pids_;
  std::vector<uint8_t> ring_mask_;
  std::vector<std::vector<Op*>> sq_, rq_;  // the current run's sends and receives per peer
  std::vector<size_t> sqi_, rqi_;           // how many of each are complete
  SpinPolicy spin_{};  // how a wait spins before it sleeps (spin.h)
  bool oversubscribed_ = false;  // more ranks than cores: never spin, prefer fewer waits
};

}  // namespace

void registerShmTransport() {
  registerTransport("shm", [](Store& store, int rank, int size, const TransportOptions& opts) {
    return std::make_unique<ShmTransport>(store, rank, size, opts);
  });
}

}  // namespace dtrain::comm::transport
