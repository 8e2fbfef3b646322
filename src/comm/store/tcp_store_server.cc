// TcpStoreServer: the key-value store's server thread (like c10d's TCPStore server), one poll loop
// over every client connection. The wire format is in tcp_store_codec.h.
//
// Memory on the server is bounded by what peers actually send, never by what they claim: a header
// is checked against its command's limit before any payload byte is read, the payload buffer grows
// as bytes arrive, and a client's next request is not read while its current one is parked or its
// answer is unsent. A bad frame closes that client's connection only.
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
#include <thread>
#include <unordered_map>

#include "comm/net/auth.h"
#include "comm/net/socket.h"
#include "comm/store/quote.h"
#include "comm/store/tcp_store_codec.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm {
using namespace tcp_store_wire;  // NOLINT(google-build-using-namespace): the wire format's own names

namespace {
// Store values hold integers as decimal text (what get() returns after add()).
bool parseInt(const Bytes& v, int64_t* out) {
  auto* b = reinterpret_cast<const char*>(v.data());
  auto* e = b + v.size();
  auto r = std::from_chars(b, e, *out);
  return !v.empty() && r.ec == std::errc() && r.ptr == e;
}

Bytes intBytes(int64_t v) { return toBytes(std::to_string(v)); }
}  // namespace

struct TcpStoreServer::Impl {
  Impl(const std::string& host, uint16_t port, std::string secret);
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
    // With a job secret: the greeting's challenge, and the MAC arriving (before any request).
    bool authenticating = false;
    net::Challenge challenge{};
    uint8_t mac[net::kMacBytes] = {};
    size_t mac_got = 0;
    bool close_after_flush = false;  // refused: the verdict goes out, then the connection closes
    bool wantsInput() const { return !parked && out.empty() && !dead && !close_after_flush; }
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
  void readMac(Conn& c);

  net::Socket listener;
  net::Fd wake;  // an eventfd: the destructor writes it to stop the thread
  uint16_t port = 0;
  std::string addr;
  const std::string secret;  // "": connections are not authenticated
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

TcpStoreServer::Impl::Impl(const std::string& host, uint16_t p, std::string s)
    : listener(net::Socket::listen(host, p)), wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)), secret(std::move(s)) {
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
    c.authenticating = !secret.empty();
    if (c.authenticating) c.challenge = net::freshChallenge();
    const net::Greeting g = net::greeting(c.authenticating, c.challenge);
    c.out.assign(g.begin(), g.end());
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
    if (c.dead && c.authenticating)
      fmt::print(stderr, "dtrain TcpStoreServer {}: refused a connection from {}: closed before authenticating "
                 "(no job secret?)\n", addr, c.peer);
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

void TcpStoreServer::Impl::readMac(Conn& c) {
  ssize_t r = ::recv(c.sock.fd(), c.mac + c.mac_got, net::kMacBytes - c.mac_got, MSG_DONTWAIT);
  if (!recvResult(c, r)) return;
  c.mac_got += static_cast<size_t>(r);
  if (c.mac_got < net::kMacBytes) return;
  c.authenticating = false;
  const bool ok = net::macMatches(secret, "store", c.challenge, nullptr, 0, c.mac);
  c.out.push_back(ok ? net::kAccepted : net::kRefused);
  if (!ok) {
    fmt::print(stderr, "dtrain TcpStoreServer {}: refused a connection from {}: authentication failed (wrong job "
               "secret)\n", addr, c.peer);
    c.close_after_flush = true;
  }
}

void TcpStoreServer::Impl::readFrames(Conn& c) {
  if (c.authenticating) return readMac(c);
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
  if (c.close_after_flush) c.dead = true;
}

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port, std::string secret)
    : impl_(std::make_unique<Impl>(host, port, std::move(secret))) {}
TcpStoreServer::~TcpStoreServer() = default;
uint16_t TcpStoreServer::port() const { return impl_->port; }
int TcpStoreServer::numClients() const { return impl_->clients.load(); }

}  // namespace dtrain::comm
