// The transport interface: point-to-point framed messages between the ranks of one group.
//
// A collective algorithm hands the transport a batch of sends and receives (Op) and the transport
// progresses all of them concurrently until every one is complete, the deadline passes (TimeoutError)
// or a peer fails (IoError / ProtocolError). Ops to the same peer in the same direction complete in
// list order; everything else overlaps. A receive may reduce into its destination instead of copying,
// so reduction is pipelined with arrival (no staging copy of the whole message).
//
// Every message is a frame: a Header (magic, version, opcode, seq, tag, length) and the payload. The
// receiver knows what it expects (opcode, seq, tag and exact length) and checks every field, so a
// desynchronised or hostile peer is a ProtocolError naming it, and nothing is ever allocated from a
// length a peer claims.
//
// Backends live in one folder each (tcp/, shm/) and are found through a registry by name.
#pragma once
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "dtrain/comm/store.h"
#include "dtrain/comm/types.h"

namespace dtrain::comm::transport {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// Operation codes carried in frames: the collectives, point-to-point sends, the fingerprint exchange,
// and abort, which carries a failing rank's error message to its peers so that everyone reports the
// root cause.
enum class OpCode : uint16_t {
  none = 0,
  allreduce,
  broadcast,
  reduce,
  allgather,
  reduce_scatter,
  alltoall,
  gather,
  scatter,
  barrier,
  send,
  fingerprint,
  abort = 0xABu,
};
const char* opName(OpCode op);

inline constexpr uint32_t kFrameMagic = 0x4E525444;  // "DTRN" little-endian
inline constexpr uint16_t kFrameVersion = 2;
// An abort frame's message is at most this long; a longer claim is a protocol error.
inline constexpr uint64_t kMaxAbortMessage = 4096;

// What a collective call is, compared across ranks on every collective (always on): the op, its dtype,
// count, reduce op, root, requested algorithm and, for the v-ops, a hash of the per-rank counts.
// Together with the sequence number it identifies the call; two ranks whose fingerprints differ
// called different collectives (or the same one with different arguments) at the same point.
struct Fingerprint {
  uint16_t op = 0;        // OpCode of the collective; 0 for point-to-point
  uint8_t dtype = 0;
  uint8_t rop = 0xFF;     // ReduceOp, or 0xFF when the op does not reduce
  uint8_t algo = 0;       // the allreduce algorithm asked for (0: automatic)
  uint8_t pad[3] = {0, 0, 0};
  int32_t root = -1;
  uint64_t count = 0;     // elements (the total for the v-ops)
  uint64_t counts_hash = 0;  // v-ops: FNV-1a of the per-rank counts; 0 otherwise
  bool operator==(const Fingerprint& o) const {
    return op == o.op && dtype == o.dtype && rop == o.rop && algo == o.algo && root == o.root &&
           count == o.count && counts_hash == o.counts_hash;
  }
  bool operator!=(const Fingerprint& o) const { return !(*this == o); }
  bool collective() const { return op != 0 && op < static_cast<uint16_t>(OpCode::send); }
  // "allreduce(f32 x 1000, sum) seq=3"
  std::string describe(uint32_t seq) const;
};
static_assert(sizeof(Fingerprint) == 32, "fingerprint layout");
uint64_t hashCounts(const std::vector<size_t>& counts);

struct Header {
  uint32_t magic = kFrameMagic;
  uint16_t version = kFrameVersion;
  uint16_t opcode = 0;
  uint32_t seq = 0;  // the group's collective sequence number (low 32 bits), or the p2p message count
  uint32_t tag = 0;  // step within a collective, or the user's tag for send/recv
  uint64_t length = 0;
  Fingerprint fp;    // the sender's call: every frame of a collective carries it, receivers compare
};
static_assert(sizeof(Header) == 56, "frame header layout");

// out[i] = a[i] (op) b[i] for `count` elements (out may alias a). The collectives pass their kernel
// with each reduce receive, so transports move bytes and never include the kernels themselves.
using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t count, DType dtype, ReduceOp op);

struct Op {
  enum Kind : uint8_t { kSend, kRecv } kind;
  int peer;
  uint32_t tag;
  void* data;  // const for sends
  size_t bytes;
  // Receives only: when set, the payload is reduced into `data` instead of copied:
  // data[i] = operand[i] (op) payload[i], where operand defaults to data itself (in place). A separate
  // operand lets an out-of-place collective skip copying its input into the output first. The
  // collectives build such receives (algo::recvReduceOp).
  ReduceFn reduce = nullptr;
  DType dtype = DType::u8;
  ReduceOp rop = ReduceOp::sum;
  const void* operand = nullptr;
  // Receives only: `data` is the algorithm's scratch, not a user buffer, so the payload may be delivered
  // before the ranks' calls were compared (the algorithm calls compareCalls before it writes output).
  bool to_scratch = false;
  // The first operand of a reduce receive at byte offset `off` of the payload.
  const char* operandAt(size_t off) const {
    return static_cast<const char*>(operand ? operand : data) + off;
  }
};

inline Op sendOp(int peer, uint32_t tag, const void* data, size_t bytes) {
  return Op{Op::kSend, peer, tag, const_cast<void*>(data), bytes};
}
inline Op recvOp(int peer, uint32_t tag, void* data, size_t bytes) {
  return Op{Op::kRecv, peer, tag, data, bytes};
}

// What the ops belong to, for frame checks and error messages.
struct Label {
  OpCode op = OpCode::none;  // the frames' opcode (the collective's, or fingerprint for the exchange)
  uint32_t seq = 0;
  Fingerprint fp;            // this rank's call (fp.op == 0 for point-to-point)
  std::string what;  // e.g. "allreduce seq=41 f32 x 6291456"
  std::chrono::milliseconds timeout{0};
};

struct TransportOptions {
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  std::string listen_host;      // tcp: address to listen on and advertise
  size_t segment_bytes = 0;     // shm: ring capacity per peer pair; tcp: reduce staging. 0 = default
  std::string secret;           // tcp: the job secret connections must prove (net/auth.h); "": none
  int spin_us = -1;             // shm, tcp: busy-wait budget before sleeping (spin.h); -1: the default
  int ranks_on_host = 0;        // tcp: the group's ranks on this host, when the group exchanged host ids
                                // (0: unknown, the transport exchanges them through the store itself)
};

class Staging;

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  int rank() const { return rank_; }
  int size() const { return size_; }

  // Progresses every op until all complete. Throws TimeoutError / IoError / ProtocolError whose
  // message starts "[rank r] <label.what>" and names the peer(s).
  virtual void run(std::vector<Op>& ops, Deadline deadline, const Label& label) = 0;
  // After a failure: best effort, tell every peer why (they raise an error of the same kind carrying
  // this message) so a dead rank is named by everyone, not only by its neighbours.
  virtual void abort(const std::exception& why) noexcept = 0;
  // "rank 3 (10.0.0.2:41233)" or "rank 3 (pid 1234)".
  virtual std::string peerName(int peer) const = 0;
  // Called once at the start of every collective, before any of its ops run. A transport that can
  // compare every rank's fingerprint before any output is written (shared memory: fingerprints are
  // published beside the staged data) does so and returns true; a mismatch is then an error on every
  // rank with no output modified. Otherwise (tcp) it returns false: each frame's header carries the
  // sender's fingerprint and every receiver compares it, and the group exchanges fingerprints first for
  // the ops in which some rank would not receive from every other (see ProcessGroup).
  virtual bool beginCollective(const Label& label, Deadline deadline) { return false; }
  // Returns once every rank's call is known to be this one, or throws the mismatch. A transport that
  // compares calls before delivering payloads (shm) may still have that pending; algorithms that
  // receive into scratch call it before they write the output, and the group calls it when the
  // algorithm returns. Where calls are compared in frame headers (tcp) it returns at once.
  virtual void compareCalls(const Label& label, Deadline deadline) {}
  // Memory every rank can address directly (shared memory), for algorithms that read each other's
  // data in place instead of sending it; nullptr when the transport has none (tcp).
  virtual Staging* staging() { return nullptr; }
  // Whether the ranks outnumber the cores any of them may use (the same answer on every rank): waits
  // are then context switches, and algorithm choices (collectives/select.cc) favour fewer of them.
  virtual bool oversubscribed() const { return false; }

 protected:
  Transport(int rank, int size) : rank_(rank), size_(size) {}
  int rank_;
  int size_;
};

// A transport's staging area (see Transport::staging): `slots()` slots of (size + 1) chunks of
// chunkBytes() each: one chunk per rank, where it stages its data for the others to read, and one
// result chunk. Each rank also has progress counters, one per Counter, that only grow: an algorithm
// publishes "I reached chunk g" and waits until every other rank has. Waits share the transport's
// deadline, abort and liveness checks, and name the ranks that are behind.
class Staging {
 public:
  enum Counter { kInReady = 0, kOutReady = 1, kDone = 2 };
  virtual ~Staging() = default;
  virtual size_t chunkBytes() const = 0;
  virtual uint64_t slots() const = 0;
  // Rank q's chunk of slot s (q == size: the result chunk).
  virtual char* chunk(uint64_t s, int q) = 0;
  // Numbers the chunks staged on this group: 1, 2, ... across calls, the same on every rank.
  virtual uint64_t nextChunk() = 0;
  virtual void publish(Counter k, uint64_t g) = 0;
  // Until every other rank's counter k reaches g. With `calls`, also until every rank's call of the
  // current collective is known and compared (a mismatch throws, naming both calls): the first wait
  // after which an algorithm writes outputs passes it, so a mismatch modifies no output.
  virtual void waitFor(Counter k, uint64_t g, Deadline deadline, const Label& label, const char* doing,
                       bool calls = false) = 0;
};

// Backends register a factory under a name ("tcp", "shm"); connect() builds the mesh through the store.
using TransportFactory = std::function<std::unique_ptr<Transport>(
    Store& store, int rank, int size, const TransportOptions& opts)>;
void registerTransport(const std::string& name, TransportFactory f);
std::unique_ptr<Transport> createTransport(const std::string& name, Store& store, int rank, int size,
                                           const TransportOptions& opts);
std::vector<std::string> transportNames();

// Identifies this host (hostname, boot id and network namespace): ranks with equal ids can share memory.
std::string hostId();

// Helpers shared by backends.
// Error kinds carried in abort frames (tag field), so the receiver rethrows the same exception type.
enum class ErrorKind : uint32_t { io = 1, timeout = 2, protocol = 3, other = 4 };
ErrorKind errorKindOf(const std::exception& e);
[[noreturn]] void throwOfKind(ErrorKind k, const std::string& msg);
// The header of a frame this rank sends in the run `label` describes (op, sequence, its call).
Header frameHeader(const Label& label, uint32_t tag, uint64_t length);
// The header of an abort frame carrying `why`; `msg` gets its message, cut to kMaxAbortMessage.
Header abortHeader(const std::exception& why, std::string& msg);
// A peer's failure as its abort frame told it, kept until this rank needs that peer (throwPeerFailed).
struct PeerFailure {
  int peer;
  ErrorKind kind;
  std::string msg;
};

// "rank 3 (10.0.0.2:41233) (recv), ...": the peers with ops still pending in the current run, for a
// backend that keeps per-peer `sends` and `recvs` queues.
template <class Peers>
std::string waitingFor(const Transport& t, const Peers& peers) {
  std::string waiting;
  for (int i = 0; i < t.size(); ++i) {
    const auto& p = peers[static_cast<size_t>(i)];
    if (p.sends.empty() && p.recvs.empty()) continue;
    waiting += fmt::format("{}{} ({})", waiting.empty() ? "" : ", ", t.peerName(i),
                           !p.recvs.empty() ? (!p.sends.empty() ? "send+recv" : "recv") : "send");
  }
  return waiting;
}
// The error for a peer's abort frame: "[rank r] <what>: peer rank p failed: <its message> (this rank was
// waiting for ...)", of the kind the peer's error was.
[[noreturn]] void throwPeerFailed(int self, const Label& label, int peer, ErrorKind kind, const std::string& msg,
                                  const std::string& waiting);

// Checks a received header against what this rank expected; throws ProtocolError naming the peer.
// A collective whose fingerprint or sequence number differs is a mismatch naming both calls.
// Abort frames are not handled here (callers check opcode == abort first).
// `outputs` says what became of this call's outputs (see throwMismatch).
void checkHeader(const Header& h, uint32_t tag, uint64_t length, int self, const std::string& peer,
                 const Label& label, const char* outputs = "the outputs of this call are unspecified");
// The error for two ranks that called different collectives: names both calls. `outputs` says what
// became of this call's output ("no output buffer was modified" on shm, "outputs are unspecified").
[[noreturn]] void throwMismatch(int self, const Label& label, const std::string& peer, uint32_t peer_seq,
                                const Fingerprint& peer_fp, const char* outputs);

}  // namespace dtrain::comm::transport
