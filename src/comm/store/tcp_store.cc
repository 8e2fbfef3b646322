// TcpStore: a key-value store served by one TcpStoreServer thread (like c10d's TCPStore).
//
// Wire protocol, little-endian. Every message either way is a 12-byte header and a payload:
//   u32 magic 'DTKV', u16 version, u16 command (request) or status (answer), u32 payload_len
// Payload fields: str = u32 length + bytes, i64 = 8 bytes, u8 = 1 byte.
//   request          payload                              answer payload (status kOk)
//   SET         1    str key, str value                   (empty)
//   GET         2    str key                              str value     parked until the key exists
//   ADD         3    str key, i64 delta                   i64 new value
//   COMPARE_SET 4    str key, str expected, str desired   str value after the operation
//   DELETE      5    str key                              u8 existed
//   CHECK       6    u32 n, n x str key                   n x u8 (1: the key exists)
//   WAIT        7    u32 n, n x str key                   (empty)       parked until all keys exist
//   NUM_KEYS    8    (empty)                              i64 count
// An answer with status kInvalidArgument (ADD on a non-integer) carries a str message instead.
//
// Memory on the server is bounded by what peers actually send, never by what they claim: a header
// is checked against its command's limit before any payload byte is read, the payload buffer grows
// as bytes arrive, and a client's next request is not read while its current one is parked or its
// answer is unsent. A bad frame closes that client's connection only.
//
// Timeouts are the client's business: the server parks a GET/WAIT until its keys exist. A client
// whose GET/WAIT passes its deadline drops the connection (the server's late answer goes nowhere and
// the parked request dies with the socket) and reconnects on its next request, so an answer can
// never be matched to the wrong request.
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "comm/net/socket.h"
#include "comm/store/quote.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm {
namespace {

constexpr uint32_t kMagic = 0x564B5444;  // "DTKV" on the wire
constexpr uint16_t kVersion = 1;
constexpr size_t kHeaderBytes = 12;

enum class Cmd : uint16_t {
  kSet = 1,
  kGet = 2,
  kAdd = 3,
  kCompareSet = 4,
  kDelete = 5,
  kCheck = 6,
  kWait = 7,
  kNumKeys = 8,
};
enum Status : uint16_t { kOk = 0, kInvalidArgument = 1 };

// A CHECK/WAIT key list: ~4000 maximal keys or a million short ones.
constexpr size_t kMaxKeyListBytes = 16u << 20;
constexpr size_t kKeyField = 4 + kMaxStoreKeyBytes;
constexpr size_t kValueField = 4 + kMaxStoreValueBytes;
// The largest answer: a value (GET, COMPARE_SET) or one byte per key of the largest key list (CHECK).
constexpr size_t kMaxAnswerPayload = std::max(kValueField, 4 + kMaxKeyListBytes / 4);

bool knownCommand(uint16_t c) { return c >= 1 && c <= 8; }

// The largest payload a request may carry; a header claiming more closes the connection.
size_t maxRequestPayload(Cmd cmd) {
  switch (cmd) {
    case Cmd::kSet: return kKeyField + kValueField;
    case Cmd::kGet:
    case Cmd::kDelete: return kKeyField;
    case Cmd::kAdd: return kKeyField + 8;
    case Cmd::kCompareSet: return kKeyField + 2 * kValueField;
    case Cmd::kCheck:
    case Cmd::kWait: return kMaxKeyListBytes;
    case Cmd::kNumKeys: return 0;
  }
  return 0;
}

struct Header {
  uint32_t magic = 0;
  uint16_t version = 0;
  uint16_t code = 0;  // command in a request, status in an answer
  uint32_t len = 0;
};

void putLE(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t getLE(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

Header decodeHeader(const uint8_t* p) {
  Header h;
  h.magic = static_cast<uint32_t>(getLE(p, 4));
  h.version = static_cast<uint16_t>(getLE(p + 4, 2));
  h.code = static_cast<uint16_t>(getLE(p + 6, 2));
  h.len = static_cast<uint32_t>(getLE(p + 8, 4));
  return h;
}

// Builds one frame: header placeholder, fields, then finish() fills in the header.
class Writer {
 public:
  Writer() : buf_(kHeaderBytes) {}
  Writer& u8(uint8_t v) {
    buf_.push_back(v);
    return *this;
  }
  Writer& u32(uint32_t v) { return fixed(v, 4); }
  Writer& i64(int64_t v) { return fixed(static_cast<uint64_t>(v), 8); }
  Writer& str(const void* p, size_t n) {
    u32(static_cast<uint32_t>(n));
    auto* c = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), c, c + n);
    return *this;
  }
  Writer& str(const std::string& s) { return str(s.data(), s.size()); }
  Writer& str(const Bytes& b) { return str(b.data(), b.size()); }
  Writer& keys(const std::vector<std::string>& ks) {
    u32(static_cast<uint32_t>(ks.size()));
    for (const auto& k : ks) str(k);
    return *this;
  }
  Bytes finish(uint16_t code) {
    putLE(buf_.data(), kMagic, 4);
    putLE(buf_.data() + 4, kVersion, 2);
    putLE(buf_.data() + 6, code, 2);
    putLE(buf_.data() + 8, buf_.size() - kHeaderBytes, 4);
    return std::move(buf_);
  }

 private:
  Writer& fixed(uint64_t v, int bytes) {
    size_t at = buf_.size();
    buf_.resize(at + bytes);
    putLE(buf_.data() + at, v, bytes);
    return *this;
  }
  Bytes buf_;
};

// Parses a payload; every length is checked against its limit and the bytes that remain.
class Reader {
 public:
  explicit Reader(const Bytes& b) : p_(b.data()), left_(b.size()) {}
  uint8_t u8() { return static_cast<uint8_t>(getLE(take(1), 1)); }
  uint32_t u32() { return static_cast<uint32_t>(getLE(take(4), 4)); }
  int64_t i64() { return static_cast<int64_t>(getLE(take(8), 8)); }
  std::string key() {
    size_t n = length(kMaxStoreKeyBytes, "key");
    const uint8_t* p = take(n);
    return std::string(p, p + n);
  }
  Bytes value() {
    size_t n = length(kMaxStoreValueBytes, "value");
    const uint8_t* p = take(n);
    return Bytes(p, p + n);
  }
  std::vector<std::string> keys() {
    uint32_t n = u32();
    // Each key takes at least its 4-byte length: bounds the reserve by the bytes actually present.
    if (n > left_ / 4) throw ProtocolError(fmt::format("key list claims {} keys in {} bytes", n, left_));
    std::vector<std::string> ks;
    ks.reserve(n);
    for (uint32_t i = 0; i < n; ++i) ks.push_back(key());
    return ks;
  }
  void end() const {
    if (left_ != 0) throw ProtocolError(fmt::format("{} unexpected trailing bytes", left_));
  }

 private:
  size_t length(size_t limit, const char* what) {
    uint32_t n = u32();
    if (n > limit) throw ProtocolError(fmt::format("{} of {} bytes exceeds the limit of {}", what, n, limit));
    return n;
  }
  const uint8_t* take(size_t n) {
    if (n > left_) throw ProtocolError(fmt::format("truncated payload: need {} bytes, {} left", n, left_));
    const uint8_t* p = p_;
    p_ += n;
    left_ -= n;
    return p;
  }
  const uint8_t* p_;
  size_t left_;
};


std::string msText(Duration d) { return fmt::format("{}ms", d.count()); }

// Store values hold integers as decimal text (what get() returns after add()).
bool parseInt(const Bytes& v, int64_t* out) {
  auto* b = reinterpret_cast<const char*>(v.data());
  auto* e = b + v.size();
  auto r = std::from_chars(b, e, *out);
  return !v.empty() && r.ec == std::errc() && r.ptr == e;
}

Bytes intBytes(int64_t v) { return toBytes(std::to_string(v)); }

}  // namespace

// ------------------------------------------------------------------------------------------------
// Server
// ------------------------------------------------------------------------------------------------

struct TcpStoreServer::Impl {
  Impl(const std::string& host, uint16_t port);
  ~Impl();

  // One client connection and where its current request stands.
  struct Conn {
    net::Socket sock;
    std::string peer;
    uint8_t hdr[kHeaderBytes] = {};
    size_t hdr_got = 0;
    Header h;               // valid once hdr_got == kHeaderBytes
    Bytes payload;          // grows as bytes arrive, up to the validated h.len
    Bytes out;              // the unsent part of the answer starts at out_off
    size_t out_off = 0;
    bool parked = false;    // a GET/WAIT waiting for parked_keys
    Cmd parked_cmd = Cmd::kGet;
    std::vector<std::string> parked_keys;
    bool dead = false;      // closed at the end of this poll round
    bool wantsInput() const { return !parked && out.empty() && !dead; }
  };

  void run();
  void acceptAll();
  void serve(Conn& c, short revents);
  void readFrames(Conn& c);
  bool recvResult(Conn& c, ssize_t r);
  void handleRequest(Conn& c);
  void answer(Conn& c, Status status, Writer&& w);
  void flush(Conn& c);
  void wakeParked();
  bool allExist(const std::vector<std::string>& keys) const;
  void drop(Conn& c, const std::string& why);

  net::Socket listener;
  net::Fd wake;  // an eventfd: the destructor writes it to stop the thread
  uint16_t port = 0;
  std::string addr;
  std::atomic<int> clients{0};
  // Owned by the server thread.
  std::unordered_map<std::string, Bytes> data;
  std::map<uint64_t, Conn> conns;
  uint64_t next_id = 0;
  net::Deadline accept_paused_until{};  // out of file descriptors: stop accepting for a moment
  std::thread thread;                   // last: starts once every other member exists
};

namespace {
// How many requests one client may have served per poll round before the others get their turn.
constexpr int kFramesPerRound = 16;
// Payload bytes read per recv(): the buffer never runs ahead of the bytes that arrived by more.
constexpr size_t kReadChunk = 64u << 10;
// Buffers larger than this are released after use rather than kept for the next request.
constexpr size_t kKeepCapacity = 1u << 20;

void releaseIfLarge(Bytes& b) {
  b.clear();
  if (b.capacity() > kKeepCapacity) Bytes().swap(b);
}
}  // namespace

TcpStoreServer::Impl::Impl(const std::string& host, uint16_t p)
    : listener(net::Socket::listen(host, p)), wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  if (!wake.valid()) throw IoError(fmt::format("TcpStoreServer: eventfd: {}", strerror(errno)));
  listener.setNonBlocking(true);
  port = listener.localPort();
  addr = listener.localAddr().str();
  thread = std::thread([this] { run(); });
}

TcpStoreServer::Impl::~Impl() {
  uint64_t one = 1;
  ssize_t w = ::write(wake.get(), &one, sizeof one);
  (void)w;  // cannot fail on a fresh eventfd; the thread sees it readable either way
  if (thread.joinable()) thread.join();
}

void TcpStoreServer::Impl::run() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  for (;;) {
    fds.clear();
    ids.clear();
    int timeout_ms = -1;
    short listen_events = POLLIN;
    if (net::Clock::now() < accept_paused_until) {
      listen_events = 0;
      timeout_ms = net::msUntil(accept_paused_until);
    }
    fds.push_back({wake.get(), POLLIN, 0});
    fds.push_back({listener.fd(), listen_events, 0});
    for (auto& [id, c] : conns) {
      // POLLRDHUP reports a peer that closed while we are not reading from it (parked request).
      short ev = POLLRDHUP;
      if (!c.out.empty()) ev |= POLLOUT;
      if (c.wantsInput()) ev |= POLLIN;
      fds.push_back({c.sock.fd(), ev, 0});
      ids.push_back(id);
    }
    int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      fmt::print(stderr, "dtrain TcpStoreServer {}: poll failed, server stopped: {}\n", addr, strerror(errno));
      return;
    }
    if (fds[0].revents) return;
    if (fds[1].revents) acceptAll();
    for (size_t i = 2; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      auto it = conns.find(ids[i - 2]);
      if (it != conns.end() && !it->second.dead) serve(it->second, fds[i].revents);
    }
    for (auto it = conns.begin(); it != conns.end();) {
      it = it->second.dead ? conns.erase(it) : std::next(it);
    }
    clients.store(static_cast<int>(conns.size()));
  }
}

void TcpStoreServer::Impl::acceptAll() {
  for (;;) {
    int fd = ::accept4(listener.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      // EMFILE and friends: the pending connection stays queued and the listener stays readable,
      // so back off instead of spinning on it.
      fmt::print(stderr, "dtrain TcpStoreServer {}: accept: {}; pausing accepts\n", addr, strerror(errno));
      accept_paused_until = net::deadlineAfter(std::chrono::milliseconds(100));
      return;
    }
    Conn c;
    c.sock = net::Socket(net::Fd(fd));
    c.sock.setNoDelay();
    c.peer = c.sock.peerAddr().str();
    conns.emplace(next_id++, std::move(c));
    clients.store(static_cast<int>(conns.size()));
  }
}

void TcpStoreServer::Impl::serve(Conn& c, short revents) {
  try {
    if (revents & (POLLERR | POLLNVAL)) {
      c.dead = true;
      return;
    }
    if (revents & POLLOUT) flush(c);
    if (c.dead) return;
    if ((revents & POLLIN) && c.wantsInput()) {
      readFrames(c);
    } else if (revents & (POLLHUP | POLLRDHUP)) {
      // Closed while parked or being answered: nobody is left to answer.
      c.dead = true;
    }
  } catch (const std::exception& e) {  // a ProtocolError, or bad_alloc for a large but legal request
    drop(c, e.what());
  }
}

void TcpStoreServer::Impl::drop(Conn& c, const std::string& why) {
  fmt::print(stderr, "dtrain TcpStoreServer {}: closing connection from {}: {}\n", addr, c.peer, why);
  c.dead = true;
}

// Interprets one recv() result: true when bytes arrived, false to stop reading for this round.
bool TcpStoreServer::Impl::recvResult(Conn& c, ssize_t r) {
  if (r > 0) return true;
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  c.dead = true;  // orderly close or reset: a normal way for a client to leave
  return false;
}

void TcpStoreServer::Impl::readFrames(Conn& c) {
  for (int frames = 0; frames < kFramesPerRound && c.wantsInput();) {
    if (c.hdr_got < kHeaderBytes) {
      ssize_t r = ::recv(c.sock.fd(), c.hdr + c.hdr_got, kHeaderBytes - c.hdr_got, MSG_DONTWAIT);
      if (!recvResult(c, r)) return;
      c.hdr_got += static_cast<size_t>(r);
      if (c.hdr_got < kHeaderBytes) continue;
      c.h = decodeHeader(c.hdr);
      if (c.h.magic != kMagic) throw ProtocolError(fmt::format("bad magic 0x{:08x}", c.h.magic));
      if (c.h.version != kVersion) {
        throw ProtocolError(fmt::format("unsupported protocol version {} (expected {})", c.h.version, kVersion));
      }
      if (!knownCommand(c.h.code)) throw ProtocolError(fmt::format("unknown command {}", c.h.code));
      size_t limit = maxRequestPayload(static_cast<Cmd>(c.h.code));
      if (c.h.len > limit) {
        throw ProtocolError(fmt::format("command {} claims a payload of {} bytes, over its limit of {}",
                                        c.h.code, c.h.len, limit));
      }
    }
    if (c.payload.size() < c.h.len) {
      size_t have = c.payload.size();
      size_t want = std::min<size_t>(c.h.len - have, kReadChunk);
      c.payload.resize(have + want);
      ssize_t r = ::recv(c.sock.fd(), c.payload.data() + have, want, MSG_DONTWAIT);
      c.payload.resize(have + static_cast<size_t>(std::max<ssize_t>(r, 0)));
      if (!recvResult(c, r)) return;
      if (c.payload.size() < c.h.len) continue;
    }
    handleRequest(c);
    c.hdr_got = 0;
    releaseIfLarge(c.payload);
    ++frames;
  }
}

void TcpStoreServer::Impl::handleRequest(Conn& c) {
  Reader in(c.payload);
  Writer w;
  switch (static_cast<Cmd>(c.h.code)) {
    case Cmd::kSet: {
      std::string key = in.key();
      Bytes value = in.value();
      in.end();
      data[key] = std::move(value);
      answer(c, kOk, std::move(w));
      wakeParked();
      return;
    }
    case Cmd::kGet: {
      std::string key = in.key();
      in.end();
      auto it = data.find(key);
      if (it != data.end()) return answer(c, kOk, std::move(w.str(it->second)));
      c.parked = true;
      c.parked_cmd = Cmd::kGet;
      c.parked_keys = {std::move(key)};
      return;
    }
    case Cmd::kAdd: {
      std::string key = in.key();
      int64_t delta = in.i64();
      in.end();
      int64_t cur = 0;
      auto it = data.find(key);
      if (it != data.end() && !parseInt(it->second, &cur)) {
        return answer(c, kInvalidArgument,
                      std::move(w.str(fmt::format("add({}, {}): the value of the key is not an integer: {}",
                                                  quoteKey(key), delta, quoteKey(toString(it->second))))));
      }
      int64_t next = 0;
      if (__builtin_add_overflow(cur, delta, &next)) {
        return answer(c, kInvalidArgument,
                      std::move(w.str(fmt::format("add({}, {}): {} + {} overflows int64", quoteKey(key), delta,
                                                  cur, delta))));
      }
      const bool created = it == data.end();
      data[key] = intBytes(next);  // may rehash: `it` is dead from here on
      answer(c, kOk, std::move(w.i64(next)));
      if (created) wakeParked();
      return;
    }
    case Cmd::kCompareSet: {
      std::string key = in.key();
      Bytes expected = in.value();
      Bytes desired = in.value();
      in.end();
      auto it = data.find(key);
      if (it == data.end()) {
        // A missing key matches an empty expected value; otherwise it stays missing (answer: empty).
        if (!expected.empty()) return answer(c, kOk, std::move(w.str(Bytes())));
        it = data.emplace(key, std::move(desired)).first;
        answer(c, kOk, std::move(w.str(it->second)));
        wakeParked();
        return;
      }
      if (it->second == expected) it->second = std::move(desired);
      return answer(c, kOk, std::move(w.str(it->second)));
    }
    case Cmd::kDelete: {
      std::string key = in.key();
      in.end();
      return answer(c, kOk, std::move(w.u8(data.erase(key) ? 1 : 0)));
    }
    case Cmd::kCheck: {
      std::vector<std::string> keys = in.keys();
      in.end();
      for (const auto& k : keys) w.u8(data.count(k) ? 1 : 0);
      return answer(c, kOk, std::move(w));
    }
    case Cmd::kWait: {
      std::vector<std::string> keys = in.keys();
      in.end();
      if (allExist(keys)) return answer(c, kOk, std::move(w));
      c.parked = true;
      c.parked_cmd = Cmd::kWait;
      c.parked_keys = std::move(keys);
      return;
    }
    case Cmd::kNumKeys:
      in.end();
      return answer(c, kOk, std::move(w.i64(static_cast<int64_t>(data.size()))));
  }
}

bool TcpStoreServer::Impl::allExist(const std::vector<std::string>& keys) const {
  return std::all_of(keys.begin(), keys.end(), [&](const std::string& k) { return data.count(k) > 0; });
}

// Answers every parked request whose keys now all exist. Called after a key is created; a linear
// scan over the connections is plenty for rendezvous-sized worlds.
void TcpStoreServer::Impl::wakeParked() {
  for (auto& [id, c] : conns) {
    if (!c.parked || c.dead || !allExist(c.parked_keys)) continue;
    Writer w;
    if (c.parked_cmd == Cmd::kGet) w.str(data.at(c.parked_keys.front()));
    c.parked = false;
    c.parked_keys.clear();
    answer(c, kOk, std::move(w));
  }
}

void TcpStoreServer::Impl::answer(Conn& c, Status status, Writer&& w) {
  c.out = w.finish(status);
  c.out_off = 0;
  flush(c);
}

void TcpStoreServer::Impl::flush(Conn& c) {
  while (c.out_off < c.out.size()) {
    ssize_t r = ::send(c.sock.fd(), c.out.data() + c.out_off, c.out.size() - c.out_off,
                       MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r > 0) {
      c.out_off += static_cast<size_t>(r);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;  // POLLOUT resumes it
    c.dead = true;
    return;
  }
  releaseIfLarge(c.out);
  c.out_off = 0;
}

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port)
    : impl_(std::make_unique<Impl>(host, port)) {}
TcpStoreServer::~TcpStoreServer() = default;
uint16_t TcpStoreServer::port() const { return impl_->port; }
int TcpStoreServer::numClients() const { return impl_->clients.load(); }

// ------------------------------------------------------------------------------------------------
// Client
// ------------------------------------------------------------------------------------------------

struct TcpStore::Impl {
  Impl(std::string h, uint16_t p) : host(std::move(h)), port(p), addr(fmt::format("{}:{}", host, port)) {}

  // Sends one request and returns the answer's payload. Any failure but a rejected argument drops
  // the connection, so the next request starts on a fresh one and cannot read a stale answer.
  // `awaited`: the keys a GET/WAIT blocks on, named in its timeout message.
  Bytes call(Bytes frame, Duration timeout, const std::string& what,
             const std::vector<std::string>* awaited = nullptr);
  void connect(net::Deadline deadline, Duration timeout, const std::string& what);
  Bytes exchange(const Bytes& frame, net::Deadline deadline);
  std::vector<std::string> missingKeys(const std::vector<std::string>& keys, Duration timeout);

  const std::string host;
  const uint16_t port;
  const std::string addr;
  std::mutex mu;      // serialises requests: one in flight per connection
  net::Socket sock;   // invalid while disconnected
};

void TcpStore::Impl::connect(net::Deadline deadline, Duration timeout, const std::string& what) {
  try {
    sock = net::Socket::connect(host, port, deadline);
  } catch (const Error& e) {
    throw RendezvousError(fmt::format("TcpStore {}: cannot reach the store server {} within {}: {}", what,
                                      addr, msText(timeout), e.what()));
  }
}

// One request/answer on the current connection; throws what the socket throws, or ProtocolError.
Bytes TcpStore::Impl::exchange(const Bytes& frame, net::Deadline deadline) {
  sock.sendAll(frame.data(), frame.size(), deadline, "store request");
  uint8_t hb[kHeaderBytes];
  sock.recvAll(hb, sizeof hb, deadline, "store answer");
  Header h = decodeHeader(hb);
  if (h.magic != kMagic || h.version != kVersion) {
    throw ProtocolError(fmt::format("answer with bad magic 0x{:08x} or version {}", h.magic, h.version));
  }
  if (h.len > kMaxAnswerPayload) {
    throw ProtocolError(fmt::format("answer claims {} bytes, over the limit of {}", h.len, kMaxAnswerPayload));
  }
  Bytes payload(h.len);
  sock.recvAll(payload.data(), payload.size(), deadline, "store answer");
  if (h.code == kInvalidArgument) {
    Reader r(payload);
    std::string msg = toString(r.value());
    throw InvalidArgument(msg);
  }
  if (h.code != kOk) throw ProtocolError(fmt::format("answer with unknown status {}", h.code));
  return payload;
}

Bytes TcpStore::Impl::call(Bytes frame, Duration timeout, const std::string& what,
                           const std::vector<std::string>* awaited) {
  std::lock_guard<std::mutex> lock(mu);
  const net::Deadline deadline = net::deadlineAfter(timeout);
  if (!sock.valid()) connect(deadline, timeout, what);
  try {
    return exchange(frame, deadline);
  } catch (const InvalidArgument& e) {
    // The server rejected the request and answered in full: the connection is still in step.
    throw InvalidArgument(fmt::format("TcpStore {} (store server {})", e.what(), addr));
  } catch (const TimeoutError& e) {
    sock = net::Socket();
    if (awaited) {
      std::vector<std::string> missing = missingKeys(*awaited, timeout);
      throw TimeoutError(fmt::format("TcpStore {} timed out after {} waiting for key{} {} (store server {})",
                                     what, msText(timeout), missing.size() == 1 ? "" : "s",
                                     quoteKeys(missing), addr));
    }
    throw TimeoutError(fmt::format("TcpStore {}: no answer from the store server {} within {}: {}", what, addr,
                                   msText(timeout), e.what()));
  } catch (const ProtocolError& e) {
    sock = net::Socket();
    throw ProtocolError(fmt::format("TcpStore {}: bad answer from the store server {}: {}", what, addr, e.what()));
  } catch (const std::exception& e) {
    sock = net::Socket();
    throw IoError(fmt::format("TcpStore {}: connection to the store server {} failed: {}", what, addr, e.what()));
  }
}

// After a timed-out WAIT: which of `keys` are still missing. Best effort on a fresh connection with
// a short deadline; when that fails too, every awaited key is reported.
std::vector<std::string> TcpStore::Impl::missingKeys(const std::vector<std::string>& keys, Duration timeout) {
  if (keys.size() <= 1) return keys;
  try {
    net::Deadline deadline = net::deadlineAfter(std::min<Duration>(timeout, std::chrono::seconds(1)));
    sock = net::Socket::connect(host, port, deadline);
    Bytes answer = exchange(Writer().keys(keys).finish(static_cast<uint16_t>(Cmd::kCheck)), deadline);
    if (answer.size() != keys.size()) throw ProtocolError("CHECK answer of the wrong size");
    std::vector<std::string> missing;
    for (size_t i = 0; i < keys.size(); ++i)
      if (!answer[i]) missing.push_back(keys[i]);
    return missing.empty() ? keys : missing;  // all arrived just now: still name what was awaited
  } catch (const std::exception&) {
    sock = net::Socket();
    return keys;
  }
}

namespace {
void checkKey(const std::string& key, const char* op) {
  if (key.size() > kMaxStoreKeyBytes) {
    throw InvalidArgument(fmt::format("store {}({}): key of {} bytes exceeds the limit of {}", op, quoteKey(key),
                                      key.size(), kMaxStoreKeyBytes));
  }
}
void checkValue(const std::string& key, const Bytes& value, const char* op) {
  if (value.size() > kMaxStoreValueBytes) {
    throw InvalidArgument(fmt::format("store {}({}): value of {} bytes exceeds the limit of {}", op, quoteKey(key),
                                      value.size(), kMaxStoreValueBytes));
  }
}
void checkKeyList(const std::vector<std::string>& keys, const char* op) {
  size_t bytes = 4;
  for (const auto& k : keys) {
    checkKey(k, op);
    bytes += 4 + k.size();
  }
  if (bytes > kMaxKeyListBytes) {
    throw InvalidArgument(fmt::format("store {}: {} keys take {} bytes, over the limit of {}", op, keys.size(),
                                      bytes, kMaxKeyListBytes));
  }
}
uint16_t code(Cmd c) { return static_cast<uint16_t>(c); }
}  // namespace

TcpStore::TcpStore(const std::string& host, uint16_t port, Duration timeout)
    : Store(timeout), impl_(std::make_unique<Impl>(host, port)) {
  impl_->connect(net::deadlineAfter(timeout), timeout, "connect");
}

TcpStore::~TcpStore() = default;

void TcpStore::set(const std::string& key, const Bytes& value) {
  checkKey(key, "set");
  checkValue(key, value, "set");
  impl_->call(Writer().str(key).str(value).finish(code(Cmd::kSet)), timeout(),
              fmt::format("set({})", quoteKey(key)));
}

Bytes TcpStore::get(const std::string& key) {
  checkKey(key, "get");
  std::vector<std::string> awaited{key};
  Bytes answer = impl_->call(Writer().str(key).finish(code(Cmd::kGet)), timeout(),
                             fmt::format("get({})", quoteKey(key)), &awaited);
  Reader r(answer);
  Bytes value = r.value();
  r.end();
  return value;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  checkKey(key, "add");
  Bytes answer = impl_->call(Writer().str(key).i64(delta).finish(code(Cmd::kAdd)), timeout(),
                             fmt::format("add({}, {})", quoteKey(key), delta));
  Reader r(answer);
  int64_t v = r.i64();
  r.end();
  return v;
}

Bytes TcpStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  checkKey(key, "compareSet");
  checkValue(key, expected, "compareSet");
  checkValue(key, desired, "compareSet");
  Bytes answer = impl_->call(Writer().str(key).str(expected).str(desired).finish(code(Cmd::kCompareSet)),
                             timeout(), fmt::format("compareSet({})", quoteKey(key)));
  Reader r(answer);
  Bytes value = r.value();
  r.end();
  return value;
}

bool TcpStore::deleteKey(const std::string& key) {
  checkKey(key, "deleteKey");
  Bytes answer = impl_->call(Writer().str(key).finish(code(Cmd::kDelete)), timeout(),
                             fmt::format("deleteKey({})", quoteKey(key)));
  Reader r(answer);
  bool existed = r.u8() != 0;
  r.end();
  return existed;
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  checkKeyList(keys, "check");
  Bytes answer = impl_->call(Writer().keys(keys).finish(code(Cmd::kCheck)), timeout(),
                             fmt::format("check([{}])", quoteKeys(keys)));
  if (answer.size() != keys.size()) {
    throw ProtocolError(fmt::format("TcpStore check: {} answers for {} keys from the store server {}",
                                    answer.size(), keys.size(), impl_->addr));
  }
  return std::all_of(answer.begin(), answer.end(), [](uint8_t b) { return b != 0; });
}

void TcpStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  checkKeyList(keys, "wait");
  impl_->call(Writer().keys(keys).finish(code(Cmd::kWait)), timeout, fmt::format("wait([{}])", quoteKeys(keys)),
              &keys);
}

int64_t TcpStore::numKeys() {
  Bytes answer = impl_->call(Writer().finish(code(Cmd::kNumKeys)), timeout(), "numKeys()");
  Reader r(answer);
  int64_t n = r.i64();
  r.end();
  return n;
}

}  // namespace dtrain::comm

namespace dtrain::comm {
std::shared_ptr<Store> TcpStore::clone() const { return std::make_shared<TcpStore>(impl_->host, impl_->port, timeout()); }
}  // namespace dtrain::comm
