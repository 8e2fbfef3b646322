// TCP transport: a full mesh of sockets, one per peer, driven by poll().
//
// Connection setup: every rank listens on an ephemeral port of the address it advertises, publishes
// "host:port" in the store, connects to every lower rank and accepts every higher one. A connector
// opens with a Hello (magic, group nonce, its rank); the acceptor drops any connection whose Hello
// is wrong, so a stray or hostile client cannot take a peer's place. The listener closes once the
// mesh is complete.
//
// run(): each op is a small state machine (header, then payload). All sockets are non-blocking; one
// pass tries every active op, and when nothing moves the thread sleeps in poll() until a socket is
// ready or the deadline passes. Receives that reduce go through a bounded staging buffer per peer, so
// reduction overlaps arrival. Idle peers are watched for abort frames, so that when any rank fails,
// the others learn the root cause instead of only "connection closed"; an idle peer's abort is raised
// when the run times out or loses a connection, or at the next run (checkIdlePeer).
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <deque>
#include <optional>
#include <cstring>
#include <random>

#include "comm/net/auth.h"
#include "comm/net/socket.h"
#include "comm/transport/spin.h"
#include "comm/transport/tcp/hello.h"
#include "comm/transport/transport.h"
#include "dtrain/comm/error.h"

namespace dtrain::comm::transport {
namespace {

constexpr size_t kDefaultStaging = 1u << 20;
constexpr int kSocketBuffer = 4 << 20;

class TcpTransport : public Transport {
 public:
  TcpTransport(Store& store, int rank, int size, const TransportOptions& opts)
      : Transport(rank, size), peers_(size) {
    staging_bytes_ = opts.segment_bytes ? std::max<size_t>(opts.segment_bytes, 64) : kDefaultStaging;
    auto deadline = net::deadlineAfter(opts.timeout);
    std::string host = opts.listen_host.empty() ? "127.0.0.1" : opts.listen_host;
    net::Socket listener = net::Socket::listen(host, 0, std::max(size, 16));
    std::string me = fmt::format("{}:{}", host.find(':') != std::string::npos ? "[" + host + "]" : host,
                                 listener.localPort());
    if (opts.ranks_on_host == 0) store.set(fmt::format("tcp/host/{}", rank), toBytes(hostId()));
    store.set(fmt::format("tcp/addr/{}", rank), toBytes(me));
    if (rank == 0) {
      std::random_device rd;
      uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
      store.set("tcp/nonce", toBytes(std::to_string(nonce)));
    }
    nonce_ = std::stoull(toString(store.get("tcp/nonce")));

    for (int p = 0; p < rank; ++p) {
      std::string addr = toString(store.get(fmt::format("tcp/addr/{}", p)));
      auto colon = addr.rfind(':');
      std::string h = addr.substr(0, colon);
      if (h.size() > 2 && h.front() == '[') h = h.substr(1, h.size() - 2);
      uint16_t port = static_cast<uint16_t>(std::stoi(addr.substr(colon + 1)));
      net::Socket s;
      try {
        s = net::Socket::connect(h, port, deadline);
      } catch (const Error& e) {
        throw RendezvousError(fmt::format("[rank {}] tcp transport: cannot connect to rank {} at {}: {}",
                                          rank, p, addr, e.what()));
      }
      TcpHello hello;
      hello.nonce = nonce_;
      hello.rank = rank;
      hello.size = size;
      try {  // the greeting, the hello (and with a secret its MAC and the verdict)
        net::authenticate(s, opts.secret, "transport", &hello, sizeof hello, deadline,
                          fmt::format("rank {} at {}", p, addr));
      } catch (const RendezvousError& e) {
        throw RendezvousError(fmt::format("[rank {}] tcp transport: {}", rank, e.what()));
      }
      peers_[p].addr = addr;
      peers_[p].sock = std::move(s);
    }
    acceptHigherRanks(listener, deadline, opts.timeout, opts.secret);
    const int here = opts.ranks_on_host > 0 ? opts.ranks_on_host : ranksOnHost(store);
    spin_ = spinBudget(opts.spin_us, here > usableCores());
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      peers_[p].sock.setNonBlocking(true);
      // Large kernel buffers let a whole ring step be in flight: fewer sleeps in poll() per MiB
      // (2 ranks on loopback, 16 MiB allreduce: ~20% faster than the autotuned default).
      peers_[p].sock.setBufferSizes(kSocketBuffer);
      peers_[p].staging.resize(0);
    }
  }

  // Accepts one connection from every higher rank. Connections wait for their Hello concurrently, so a
  // stranger that connects and stalls delays nobody; anything that is not a Hello of this group (wrong
  // magic, nonce, rank, or a duplicate) is closed. Each connection is greeted first (net/auth.h); with
  // a secret the Hello must come with the MAC of the greeting's challenge, and a wrong one is refused
  // and logged with the peer's address.
  void acceptHigherRanks(const net::Socket& listener, Deadline deadline, std::chrono::milliseconds timeout,
                         const std::string& secret) {
    struct Pending {
      net::Socket sock;
      net::Challenge challenge{};
      uint8_t buf[sizeof(TcpHello) + net::kMacBytes] = {};
      size_t got = 0;
    };
    const size_t want = sizeof(TcpHello) + (secret.empty() ? 0 : net::kMacBytes);
    auto verdict = [&](const net::Socket& s, uint8_t v) {
      if (!secret.empty()) (void)::send(s.fd(), &v, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
    };
    std::vector<Pending> pending;
    listener.setNonBlocking(true);
    int expected = size_ - 1 - rank_;
    while (expected > 0) {
      std::vector<pollfd> pfds{{listener.fd(), POLLIN, 0}};
      for (auto& p : pending) pfds.push_back({p.sock.fd(), POLLIN, 0});
      int rc = ::poll(pfds.data(), pfds.size(), net::msUntil(deadline));
      if (rc == 0) {
        std::string missing;
        for (int p = rank_ + 1; p < size_; ++p)
          if (!peers_[p].sock.valid()) missing += (missing.empty() ? "" : ", ") + std::to_string(p);
        throw TimeoutError(fmt::format("[rank {}] tcp transport: ranks {} did not connect within {}ms", rank_,
                                       missing, timeout.count()));
      }
      if (rc < 0) continue;  // EINTR
      // Read Hellos first (pfds[k + 1] belongs to pending[k]); erase from the back to keep indices valid.
      for (size_t k = pending.size(); k-- > 0;) {
        if (!pfds[k + 1].revents) continue;
        Pending& p = pending[k];
        ssize_t n = ::recv(p.sock.fd(), p.buf + p.got, want - p.got, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        bool drop = n <= 0;
        if (drop && !secret.empty())
          fmt::print(stderr, "[rank {}] tcp transport: refused a connection from {}: closed before authenticating\n",
                     rank_, p.sock.peerAddr().str());
        if (n > 0) {
          p.got += static_cast<size_t>(n);
          if (p.got < want) continue;
          TcpHello h;
          std::memcpy(&h, p.buf, sizeof h);
          if (!secret.empty() && !net::macMatches(secret, "transport", p.challenge, p.buf, sizeof h, p.buf + sizeof h)) {
            fmt::print(stderr, "[rank {}] tcp transport: refused a connection from {}: authentication failed (wrong "
                       "job secret)\n", rank_, p.sock.peerAddr().str());
            verdict(p.sock, net::kRefused);
            pending.erase(pending.begin() + static_cast<long>(k));
            continue;
          }
          drop = h.magic != kFrameMagic || h.version != kFrameVersion || h.kind != TcpHello::kKind ||
                 h.nonce != nonce_ || h.size != size_ || h.rank <= rank_ || h.rank >= size_ ||
                 peers_[h.rank].sock.valid();
          verdict(p.sock, drop ? net::kRefused : net::kAccepted);
          if (!drop) {
            p.sock.setNonBlocking(false);
            peers_[h.rank].addr = p.sock.peerAddr().str();
            peers_[h.rank].sock = std::move(p.sock);
            --expected;
          }
        }
        pending.erase(pending.begin() + static_cast<long>(k));
      }
      if (pfds[0].revents & POLLIN) {
        int c = ::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c >= 0) {
          Pending p;
          p.sock = net::Socket(net::Fd(c));
          p.sock.setNoDelay();
          if (!secret.empty()) p.challenge = net::freshChallenge();
          const net::Greeting g = net::greeting(!secret.empty(), p.challenge);
          // (a fresh socket's buffer takes 37 bytes at once; if not, the stranger is not worth waiting for)
          if (::send(c, g.data(), g.size(), MSG_DONTWAIT | MSG_NOSIGNAL) == static_cast<ssize_t>(g.size()))
            pending.push_back(std::move(p));
        }
      }
    }
  }

  // This group's ranks on this host, when the group did not say (DTRAIN_TRANSPORT=tcp): every rank
  // publishes its host id before its address, so once the mesh is complete every peer's is in the store;
  // one that is not (a peer that is not a dtrain rank) counts as elsewhere. Only this rank's waits (how
  // they spin) depend on the answer.
  int ranksOnHost(Store& store) const {
    const std::string host = hostId();
    int here = 1;
    for (int p = 0; p < size_; ++p) {
      const std::string key = fmt::format("tcp/host/{}", p);
      if (p != rank_ && store.check({key})) here += toString(store.get(key)) == host;
    }
    return here;
  }

  const char* name() const override { return "tcp"; }

  std::string peerName(int p) const override {
    return fmt::format("rank {} ({})", p, p >= 0 && p < size_ ? peers_[p].addr : "?");
  }

  void run(std::vector<Op>& ops, Deadline deadline, const Label& label) override {
    if (deferred_) raiseDeferred(label);
    for (auto& p : peers_) {
      p.sends.clear();
      p.recvs.clear();
      p.watch_idle = true;
    }
    for (auto& op : ops) {
      DTRAIN_CHECK(op.peer >= 0 && op.peer < size_ && op.peer != rank_, InvalidArgument,
                   "[rank {}] {}: invalid peer {} (group size {})", rank_, label.what, op.peer, size_);
      auto& p = peers_[op.peer];
      if (op.kind == Op::kSend) {
        SendState s;
        s.op = &op;
        s.h = frameHeader(label, op.tag, op.bytes);
        p.sends.push_back(s);
      } else {
        RecvState r;
        r.op = &op;
        p.recvs.push_back(r);
        if (op.reduce && p.staging.size() < staging_bytes_) p.staging.resize(staging_bytes_);
      }
      p.watch_idle = false;
    }
    size_t remaining = ops.size();
    std::vector<pollfd> pfds;
    std::vector<int> pfd_peer;
    SpinWait spin(spin_);  // busy-poll the sockets for a while before sleeping in poll()
    while (remaining > 0) {
      bool progress = false;
      for (int i = 0; i < size_; ++i) {
        if (i == rank_) continue;
        auto& p = peers_[i];
        while (!p.sends.empty()) {
          bool moved = pumpSend(i, label);
          progress |= moved;
          if (p.sends.front().done()) {
            p.sends.pop_front();
            --remaining;
            p.send_partial = false;
          } else {
            break;
          }
        }
        while (!p.recvs.empty()) {
          bool moved = pumpRecv(i, deadline, label);
          progress |= moved;
          if (p.recvs.front().complete) {
            p.recvs.pop_front();
            --remaining;
          } else {
            break;
          }
        }
      }
      if (remaining == 0) continue;
      if (progress) {
        spin.reset();
        continue;
      }
      if (spin.spin()) continue;

      pfds.clear();
      pfd_peer.clear();
      for (int i = 0; i < size_; ++i) {
        if (i == rank_) continue;
        auto& p = peers_[i];
        short ev = 0;
        if (!p.sends.empty()) ev |= POLLOUT;
        if (!p.recvs.empty() || p.watch_idle) ev |= POLLIN;
        if (!ev) continue;
        pfds.push_back({p.sock.fd(), ev, 0});
        pfd_peer.push_back(i);
      }
      int ms = std::min(net::msUntil(deadline), 1000);
      int rc = ::poll(pfds.data(), pfds.size(), ms);
      if (rc < 0 && errno != EINTR) {
        throw IoError(fmt::format("[rank {}] {}: poll failed: {}", rank_, label.what, strerror(errno)));
      }
      if (rc == 0 && Clock::now() >= deadline) throwTimeout(label);
      for (size_t k = 0; k < pfds.size(); ++k) {
        int i = pfd_peer[k];
        auto& p = peers_[i];
        if (p.watch_idle && p.sends.empty() && p.recvs.empty() && (pfds[k].revents & (POLLIN | POLLHUP | POLLERR))) {
          checkIdlePeer(i, deadline, label);
        }
      }
    }
  }

  void abort(const std::exception& why) noexcept override {
    std::string msg;
    Header h = abortHeader(why, msg);
    for (int i = 0; i < size_; ++i) {
      if (i == rank_ || !peers_[i].sock.valid() || peers_[i].send_partial) continue;
      iovec iov[2] = {{&h, sizeof h}, {msg.data(), msg.size()}};
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = 2;
      (void)::sendmsg(peers_[i].sock.fd(), &m, MSG_DONTWAIT | MSG_NOSIGNAL);
      peers_[i].send_partial = true;  // never send more on this connection
    }
  }

 private:
  struct SendState {
    Op* op = nullptr;
    Header h;
    size_t sent = 0;  // bytes of header + payload
    bool done() const { return sent == sizeof(Header) + op->bytes; }
  };
  struct RecvState {
    Op* op = nullptr;
    Header h;
    size_t hdr_got = 0;
    size_t got = 0;        // payload bytes delivered to op->data
    size_t fill = 0;       // bytes in the staging buffer (reduce receives)
    bool complete = false;
  };
  struct Peer {
    net::Socket sock;
    std::string addr;
    std::deque<SendState> sends;
    std::deque<RecvState> recvs;
    std::vector<uint8_t> staging;
    bool send_partial = false;
    bool watch_idle = true;
  };

  // A lost connection is usually a consequence: the peer failed (or learnt that another rank did) and
  // closed its sockets, and it could not send its abort frame to us on a connection it was in the
  // middle of a frame on. The rank that failed first did send one on every idle connection: look for
  // it on every peer at a frame boundary, for a short while, and raise that root cause instead.
  [[noreturn]] void throwLost(int i, const Label& label, const std::string& why) {
    if (deferred_) raiseDeferred(label);
    raiseAnyAbort(i, label, std::chrono::milliseconds(300));
    throw IoError(fmt::format("[rank {}] {}: connection to {} lost: {}", rank_, label.what, peerName(i), why));
  }

  [[noreturn]] void throwTimeout(const Label& label) {
    if (deferred_) raiseDeferred(label);  // the root cause, rather than its consequence
    throw TimeoutError(fmt::format("[rank {}] {} timed out after {}s waiting for {}", rank_, label.what,
                                   label.timeout.count() / 1000.0, waitingFor(*this, peers_)));
  }

  bool pumpSend(int i, const Label& label) {
    auto& p = peers_[i];
    auto& s = p.sends.front();
    bool moved = false;
    while (!s.done()) {
      iovec iov[2];
      int n = 0;
      if (s.sent < sizeof(Header)) {
        iov[n++] = {reinterpret_cast<char*>(&s.h) + s.sent, sizeof(Header) - s.sent};
        if (s.op->bytes) iov[n++] = {s.op->data, s.op->bytes};
      } else {
        size_t off = s.sent - sizeof(Header);
        iov[n++] = {static_cast<char*>(s.op->data) + off, s.op->bytes - off};
      }
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = n;
      ssize_t w = ::sendmsg(p.sock.fd(), &m, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (w > 0) {
        s.sent += static_cast<size_t>(w);
        p.send_partial = true;
        moved = true;
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      throwLost(i, label, strerror(errno));
    }
    return moved;
  }

  // Peeks at peer j's connection: an abort frame waiting there (at a frame boundary) is read and raised.
  // Returns what the peek returned (the header's size when a whole non-abort header is waiting, 0 at EOF).
  ssize_t raiseAbortWaiting(int j, Deadline deadline, const Label& label) {
    Header h;
    ssize_t n = ::recv(peers_[j].sock.fd(), &h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
    if (n == static_cast<ssize_t>(sizeof h) && h.magic == kFrameMagic &&
        h.opcode == static_cast<uint16_t>(OpCode::abort)) {
      peers_[j].sock.recvAll(&h, sizeof h, deadline);
      raiseAbort(j, h, deadline, label);
    }
    return n;
  }

  // Raises an abort frame waiting at a frame boundary on any peer's connection (peer `first`'s before
  // the others'), polling up to `patience` for one to arrive.
  void raiseAnyAbort(int first, const Label& label, std::chrono::milliseconds patience) {
    const Deadline until = Clock::now() + patience;
    const Deadline read_by = net::deadlineAfter(std::chrono::seconds(2));
    auto atBoundary = [&](int j) {  // not in the middle of a frame: what follows would be data
      return peers_[j].sock.valid() && (peers_[j].recvs.empty() || peers_[j].recvs.front().hdr_got == 0);
    };
    if (atBoundary(first)) raiseAbortWaiting(first, read_by, label);
    std::vector<int> watch;
    for (int j = 0; j < size_; ++j)
      if (j != rank_ && atBoundary(j)) watch.push_back(j);
    while (!watch.empty()) {
      std::vector<pollfd> pfds;
      for (int j : watch) pfds.push_back({peers_[j].sock.fd(), POLLIN, 0});
      int ms = net::msUntil(until);
      if (::poll(pfds.data(), pfds.size(), ms) <= 0 && ms <= 0) return;
      for (size_t k = pfds.size(); k-- > 0;) {
        if (!pfds[k].revents) continue;
        ssize_t n = raiseAbortWaiting(watch[k], read_by, label);
        if (n == 0 || n == static_cast<ssize_t>(sizeof(Header)) || (n < 0 && errno != EAGAIN && errno != EINTR)) {
          watch.erase(watch.begin() + static_cast<long>(k));  // closed, data, or an error: nothing to wait for
        }
      }
      if (Clock::now() >= until) return;
    }
  }

  // Reads into buf; returns bytes read, 0 if it would block. EOF and errors throw.
  size_t readSome(int i, void* buf, size_t n, const Label& label) {
    for (;;) {
      ssize_t r = ::recv(peers_[i].sock.fd(), buf, n, MSG_DONTWAIT);
      if (r > 0) return static_cast<size_t>(r);
      if (r == 0) throwLost(i, label, "the peer closed the connection (its process exited or crashed)");
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      throwLost(i, label, strerror(errno));
    }
  }

  // Reads the message of the abort frame whose header `h` came from peer i.
  std::string readAbort(int i, const Header& h, Deadline deadline, const Label& label) {
    if (h.length > kMaxAbortMessage) {
      throw ProtocolError(fmt::format("[rank {}] {}: {} sent an abort frame claiming {} bytes (max {})",
                                      rank_, label.what, peerName(i), h.length, kMaxAbortMessage));
    }
    std::string msg(h.length, '\0');
    try {
      peers_[i].sock.recvAll(msg.data(), msg.size(), std::min(deadline, net::deadlineAfter(std::chrono::seconds(2))));
    } catch (const Error&) {
      msg = "(message lost)";
    }
    return msg;
  }

  [[noreturn]] void raiseFrom(int i, ErrorKind kind, const std::string& msg, const Label& label) {
    throwPeerFailed(rank_, label, i, kind, msg, waitingFor(*this, peers_));
  }

  [[noreturn]] void raiseAbort(int i, const Header& h, Deadline deadline, const Label& label) {
    raiseFrom(i, static_cast<ErrorKind>(h.tag), readAbort(i, h, deadline, label), label);
  }

  [[noreturn]] void raiseDeferred(const Label& label) {
    PeerFailure d = *deferred_;
    deferred_.reset();
    raiseFrom(d.peer, d.kind, d.msg, label);
  }

  bool pumpRecv(int i, Deadline deadline, const Label& label) {
    auto& p = peers_[i];
    auto& r = p.recvs.front();
    Op& op = *r.op;
    bool moved = false;
    while (r.hdr_got < sizeof(Header)) {
      size_t n = readSome(i, reinterpret_cast<char*>(&r.h) + r.hdr_got, sizeof(Header) - r.hdr_got, label);
      if (n == 0) return moved;
      moved = true;
      r.hdr_got += n;
      if (r.hdr_got == sizeof(Header)) {
        if (r.h.magic == kFrameMagic && r.h.opcode == static_cast<uint16_t>(OpCode::abort)) {
          raiseAbort(i, r.h, deadline, label);
        }
        checkHeader(r.h, op.tag, op.bytes, rank_, peerName(i), label);
      }
    }
    if (!op.reduce) {
      while (r.got < op.bytes) {
        size_t n = readSome(i, static_cast<char*>(op.data) + r.got, op.bytes - r.got, label);
        if (n == 0) return moved;
        moved = true;
        r.got += n;
      }
    } else {
      size_t elem = dtypeSize(op.dtype);
      while (r.got < op.bytes) {
        size_t want = std::min(p.staging.size() - r.fill, op.bytes - r.got - r.fill);
        size_t n = readSome(i, p.staging.data() + r.fill, want, label);
        if (n == 0) return moved;
        moved = true;
        r.fill += n;
        size_t whole = r.fill / elem * elem;
        if (whole) {
          op.reduce(static_cast<char*>(op.data) + r.got, op.operandAt(r.got), p.staging.data(), whole / elem,
                   op.dtype, op.rop);
          r.got += whole;
          r.fill -= whole;
          if (r.fill) std::memmove(p.staging.data(), p.staging.data() + whole, r.fill);
        }
      }
    }
    r.complete = true;
    return moved;
  }

  // An idle peer became readable: an abort frame, early data for a later op, or EOF from a rank that
  // finished and exited. Only the abort is an error, and not yet: the peers this run needs may still
  // deliver (a rank that failed in a later op finished this one; its own partners will finish too), so
  // it is kept and raised when this run times out or loses a connection, or when the next run starts.
  // A run waiting on a peer that will never deliver learns the failure from that peer (every rank that
  // fails sends its abort to all). EOF and data are dealt with when an op actually needs that peer.
  void checkIdlePeer(int i, Deadline deadline, const Label& label) {
    peers_[i].watch_idle = false;
    Header h;
    ssize_t n = ::recv(peers_[i].sock.fd(), &h, sizeof h, MSG_PEEK | MSG_DONTWAIT);
    if (n != static_cast<ssize_t>(sizeof h) || h.magic != kFrameMagic || h.opcode != static_cast<uint16_t>(OpCode::abort))
      return;
    peers_[i].sock.recvAll(&h, sizeof h, deadline);
    std::string msg = readAbort(i, h, deadline, label);
    if (!deferred_) deferred_ = PeerFailure{i, static_cast<ErrorKind>(h.tag), std::move(msg)};
    peers_[i].send_partial = true;  // it sends nothing more; neither do we
  }

  std::optional<PeerFailure> deferred_;
  std::vector<Peer> peers_;
  size_t staging_bytes_;
  uint64_t nonce_ = 0;
  SpinPolicy spin_{};  // how a wait spins before it sleeps (spin.h)
};

}  // namespace

void registerTcpTransport() {
  registerTransport("tcp", [](Store& store, int rank, int size, const TransportOptions& opts) {
    return std::make_unique<TcpTransport>(store, rank, size, opts);
  });
}

}  // namespace dtrain::comm::transport
