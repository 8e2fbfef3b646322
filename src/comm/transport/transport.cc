// Transport registry and the frame checks shared by every backend.
#include "comm/transport/transport.h"

#include <unistd.h>

#include <fstream>
#include <map>
#include <mutex>

#include "comm/rendezvous/environment.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm::transport {

const char* opName(OpCode op) {
  switch (op) {
    case OpCode::none: return "none";
    case OpCode::allreduce: return "allreduce";
    case OpCode::broadcast: return "broadcast";
    case OpCode::reduce: return "reduce";
    case OpCode::allgather: return "allgather";
    case OpCode::reduce_scatter: return "reduce_scatter";
    case OpCode::alltoall: return "alltoall";
    case OpCode::gather: return "gather";
    case OpCode::scatter: return "scatter";
    case OpCode::barrier: return "barrier";
    case OpCode::send: return "send/recv";
    case OpCode::fingerprint: return "fingerprint";
    case OpCode::abort: return "abort";
  }
  return "unknown-op";
}

namespace {
std::mutex& registryMutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, TransportFactory>& registry() {
  static std::map<std::string, TransportFactory> r;
  return r;
}
}  // namespace

void registerTransport(const std::string& name, TransportFactory f) {
  std::lock_guard<std::mutex> g(registryMutex());
  registry()[name] = std::move(f);
}

std::vector<std::string> transportNames() {
  std::lock_guard<std::mutex> g(registryMutex());
  std::vector<std::string> out;
  for (auto& [k, v] : registry()) out.push_back(k);
  return out;
}

// Backends register from static initialisers in their own translation units; a static library drops
// unreferenced objects, so the registry pulls them in by name here.
void registerTcpTransport();
void registerShmTransport();
#ifdef DTRAIN_WITH_MPI
void registerMpiTransport();
#endif

std::unique_ptr<Transport> createTransport(const std::string& name, Store& store, int rank, int size,
                                           const TransportOptions& opts) {
  static std::once_flag once;
  std::call_once(once, [] {
    registerTcpTransport();
    registerShmTransport();
#ifdef DTRAIN_WITH_MPI
    registerMpiTransport();
#endif
  });
  TransportFactory f;
  {
    std::lock_guard<std::mutex> g(registryMutex());
    auto it = registry().find(name);
    if (it == registry().end()) {
      std::string known;
      for (auto& [k, v] : registry()) known += (known.empty() ? "" : ", ") + k;
      throw InvalidArgument(fmt::format("unknown transport '{}' (known: {}{})", name, known,
                                        name == "mpi" ? "; this dtrain was built without MPI: configure with "
                                                        "-DDTRAIN_WITH_MPI=ON and libopenmpi-dev installed"
                                                      : ""));
    }
    f = it->second;
  }
  return f(store, rank, size, opts);
}

std::string hostId() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char ns[128] = {0};
  ssize_t n = readlink("/proc/self/ns/net", ns, sizeof ns - 1);
  if (n < 0) ns[0] = 0;
  // Test hook: DTRAIN_HOST_ID makes ranks of one machine look like ranks of different hosts (still
  // suffixed with the real id, so ranks of different machines never look alike).
  const auto env = rendezvous::Environment::read();  // get() points into it
  const char* fake = env.get("DTRAIN_HOST_ID");
  return fmt::format("{}{}{}|{}|{}", fake ? fake : "", fake ? "@" : "", host, boot, ns);
}

ErrorKind errorKindOf(const std::exception& e) {
  if (dynamic_cast<const TimeoutError*>(&e)) return ErrorKind::timeout;
  if (dynamic_cast<const ProtocolError*>(&e)) return ErrorKind::protocol;
  if (dynamic_cast<const IoError*>(&e)) return ErrorKind::io;
  return ErrorKind::other;
}

void throwOfKind(ErrorKind k, const std::string& msg) {
  switch (k) {
    case ErrorKind::timeout: throw TimeoutError(msg);
    case ErrorKind::protocol: throw ProtocolError(msg);
    case ErrorKind::io: throw IoError(msg);
    default: throw Error(msg);
  }
}

Header frameHeader(const Label& label, uint32_t tag, uint64_t length) {
  Header h;
  h.opcode = static_cast<uint16_t>(label.op);
  h.seq = label.seq;
  h.tag = tag;
  h.length = length;
  h.fp = label.fp;
  return h;
}

Header abortHeader(const std::exception& why, std::string& msg) {
  msg = why.what();
  if (msg.size() > kMaxAbortMessage) msg.resize(kMaxAbortMessage);
  Header h;
  h.opcode = static_cast<uint16_t>(OpCode::abort);
  h.tag = static_cast<uint32_t>(errorKindOf(why));
  h.length = msg.size();
  return h;
}

void throwPeerFailed(int self, const Label& label, int peer, ErrorKind kind, const std::string& msg,
                     const std::string& waiting) {
  throwOfKind(kind, fmt::format("[rank {}] {}: peer rank {} failed: {}{}", self, label.what, peer, msg,
                                waiting.empty() ? "" : " (this rank was waiting for " + waiting + ")"));
}

uint64_t hashCounts(const std::vector<size_t>& counts) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the counts' 8-byte little-endian values
  for (size_t c : counts) {
    for (int b = 0; b < 8; ++b) {
      h ^= (static_cast<uint64_t>(c) >> (8 * b)) & 0xFF;
      h *= 1099511628211ull;
    }
  }
  return h ? h : 1;
}

std::string Fingerprint::describe(uint32_t seq) const {
  auto o = static_cast<OpCode>(op);
  if (!collective() || o == OpCode::barrier) return fmt::format("{}() seq={}", opName(o), seq);
  std::string s = fmt::format("{}({} x {}", opName(o), dtypeName(static_cast<DType>(dtype)), count);
  if (counts_hash) s += fmt::format(", counts #{:08x}", static_cast<uint32_t>(counts_hash ^ (counts_hash >> 32)));
  if (rop != 0xFF) s += fmt::format(", {}", reduceOpName(static_cast<ReduceOp>(rop)));
  if (root >= 0) s += fmt::format(", root {}", root);
  if (algo > 0 && algo <= static_cast<uint8_t>(AllreduceAlgorithm::direct))
    s += fmt::format(", algorithm {}", allreduceAlgorithmName(static_cast<AllreduceAlgorithm>(algo)));
  return s + fmt::format(") seq={}", seq);
}

void throwMismatch(int self, const Label& label, const std::string& peer, uint32_t peer_seq,
                   const Fingerprint& peer_fp, const char* outputs) {
  throw ProtocolError(fmt::format(
      "[rank {}] {}: collective mismatch: this rank called {} but {} called {}: every rank of a group must "
      "call the same collectives in the same order with the same dtype, count, reduce op and root ({})",
      self, label.what, label.fp.describe(label.seq), peer, peer_fp.describe(peer_seq), outputs));
}

void checkHeader(const Header& h, uint32_t tag, uint64_t length, int self, const std::string& peer,
                 const Label& label, const char* outputs) {
  if (h.magic != kFrameMagic || h.version != kFrameVersion) {
    throw ProtocolError(fmt::format(
        "[rank {}] {}: bad frame from {}: magic {:#x} version {} (expected {:#x} version {}); "
        "the peer is not a dtrain rank of this group or the stream is corrupt",
        self, label.what, peer, h.magic, h.version, kFrameMagic, kFrameVersion));
  }
  const auto op = label.op;
  const bool p2p = op == OpCode::send;
  // A collective frame, or a collective's frame where this rank expected one: compare the calls.
  if ((label.fp.collective() || h.fp.collective()) && (h.fp != label.fp || h.seq != label.seq)) {
    throwMismatch(self, label, peer, h.seq, h.fp, outputs);
  }
  if (h.opcode != static_cast<uint16_t>(op) || (!p2p && h.seq != label.seq) || h.tag != tag) {
    throw ProtocolError(fmt::format(
        "[rank {}] {}: {} sent {} seq={} tag={} but this rank expected {} seq={} tag={}: "
        "the ranks are not calling the same collectives in the same order",
        self, label.what, peer, opName(static_cast<OpCode>(h.opcode)), h.seq, h.tag, opName(op), label.seq,
        tag));
  }
  if (h.length != length) {
    throw ProtocolError(fmt::format(
        "[rank {}] {}: {} sent {} bytes (tag {}) but this rank expected {} bytes: "
        "counts or dtypes differ between ranks",
        self, label.what, peer, h.length, tag, length));
  }
}

}  // namespace dtrain::comm::transport
