// RAII sockets with deadlines (see socket.h).
#include "comm/net/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>

#include "dtrain/comm/error.h"

namespace dtrain::comm::net {

int msUntil(Deadline d) {
  auto left = std::chrono::ceil<std::chrono::milliseconds>(d - Clock::now()).count();
  if (left <= 0) return 0;
  return left > INT_MAX ? INT_MAX : static_cast<int>(left);
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string SockAddr::str() const {
  char host[NI_MAXHOST] = "?";
  char serv[NI_MAXSERV] = "?";
  getnameinfo(reinterpret_cast<const sockaddr*>(&ss), len, host, sizeof host, serv, sizeof serv,
              NI_NUMERICHOST | NI_NUMERICSERV);
  if (ss.ss_family == AF_INET6) return fmt::format("[{}]:{}", host, serv);
  return fmt::format("{}:{}", host, serv);
}

uint16_t SockAddr::port() const {
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
  return 0;
}

SockAddr resolve(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  std::string h = host;
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  int rc = getaddrinfo(h.empty() ? nullptr : h.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    throw RendezvousError(fmt::format("cannot resolve host '{}': {}", host, gai_strerror(rc)));
  }
  SockAddr a;
  // Prefer IPv4 when both exist: loopback peers usually listen there.
  const addrinfo* pick = res;
  for (const addrinfo* p = res; p; p = p->ai_next)
    if (p->ai_family == AF_INET) {
      pick = p;
      break;
    }
  std::memcpy(&a.ss, pick->ai_addr, pick->ai_addrlen);
  a.len = pick->ai_addrlen;
  freeaddrinfo(res);
  return a;
}

Socket Socket::listen(const std::string& host, uint16_t port, int backlog) {
  SockAddr a = resolve(host.empty() ? "0.0.0.0" : host, port);
  Fd fd(::socket(a.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) throw IoError(fmt::format("socket(): {}", strerror(errno)));
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a.ss), a.len) != 0) {
    throw IoError(fmt::format("cannot listen on {}: bind: {}", a.str(), strerror(errno)));
  }
  if (::listen(fd.get(), backlog) != 0) {
    throw IoError(fmt::format("cannot listen on {}: {}", a.str(), strerror(errno)));
  }
  return Socket(std::move(fd));
}

namespace {
// TCP simultaneous open: retrying a loopback port nobody listens on can connect a socket to itself
// when the kernel picks that same port as its ephemeral port. Such a "connection" must count as refused.
bool isSelfConnected(int fd) {
  SockAddr local, peer;
  local.len = peer.len = sizeof(sockaddr_storage);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&local.ss), &local.len) != 0) return false;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer.ss), &peer.len) != 0) return false;
  return local.port() == peer.port() && local.str() == peer.str();
}
}  // namespace

Socket Socket::connect(const std::string& host, uint16_t port, Deadline deadline) {
  SockAddr a = resolve(host, port);
  int last_errno = 0;
  auto backoff = std::chrono::milliseconds(10);
  for (;;) {
    Fd fd(::socket(a.ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd.valid()) throw IoError(fmt::format("socket(): {}", strerror(errno)));
    int rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a.ss), a.len);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd.get(), POLLOUT, 0};
      int pr = ::poll(&p, 1, msUntil(deadline));
      if (pr > 0) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      } else {
        rc = -1;
        errno = ETIMEDOUT;
      }
    }
    if (rc == 0 && isSelfConnected(fd.get())) {
      rc = -1;
      errno = ECONNREFUSED;
    }
    if (rc == 0) {
      Socket s(std::move(fd));
      s.setNonBlocking(false);
      s.setNoDelay();
      return s;
    }
    last_errno = errno;
    if (Clock::now() >= deadline) break;
    // The last attempt happens at the deadline, not one backoff step before it.
    std::this_thread::sleep_until(std::min(Clock::now() + backoff, deadline));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
  throw TimeoutError(
      fmt::format("cannot connect to {} before the deadline: {}", a.str(), strerror(last_errno)));
}

Socket Socket::accept(Deadline deadline) const {
  for (;;) {
    pollfd p{fd(), POLLIN, 0};
    int pr = ::poll(&p, 1, msUntil(deadline));
    if (pr < 0 && errno == EINTR) continue;
    if (pr == 0) {
      throw TimeoutError(fmt::format("no connection arrived on {} before the deadline", localAddr().str()));
    }
    if (pr < 0) throw IoError(fmt::format("poll on listener: {}", strerror(errno)));
    int c = ::accept4(fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
      throw IoError(fmt::format("accept on {}: {}", localAddr().str(), strerror(errno)));
    }
    Socket s{Fd(c)};
    s.setNoDelay();
    return s;
  }
}

void Socket::setNonBlocking(bool on) const {
  int flags = fcntl(fd(), F_GETFL, 0);
  fcntl(fd(), F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void Socket::setNoDelay() const {
  int one = 1;
  setsockopt(fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void Socket::setBufferSizes(int bytes) const {
  setsockopt(fd(), SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
  setsockopt(fd(), SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
}

uint16_t Socket::localPort() const { return localAddr().port(); }

SockAddr Socket::localAddr() const {
  SockAddr a;
  a.len = sizeof a.ss;
  getsockname(fd(), reinterpret_cast<sockaddr*>(&a.ss), &a.len);
  return a;
}

SockAddr Socket::peerAddr() const {
  SockAddr a;
  a.len = sizeof a.ss;
  getpeername(fd(), reinterpret_cast<sockaddr*>(&a.ss), &a.len);
  return a;
}

void Socket::sendAll(const void* p, size_t n, Deadline deadline, const char* what) const {
  auto* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::send(fd(), c, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      c += w;
      n -= static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pf{fd(), POLLOUT, 0};
      int pr = ::poll(&pf, 1, msUntil(deadline));
      if (pr == 0) throw TimeoutError(fmt::format("{} to {} timed out", what, peerAddr().str()));
      continue;
    }
    throw IoError(fmt::format("{} to {} failed: {}", what, peerAddr().str(), strerror(errno)));
  }
}

void Socket::recvAll(void* p, size_t n, Deadline deadline, const char* what) const {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = ::recv(fd(), c, n, MSG_DONTWAIT);
    if (r > 0) {
      c += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) throw IoError(fmt::format("{} from {}: connection closed by peer", what, peerAddr().str()));
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd pf{fd(), POLLIN, 0};
      int pr = ::poll(&pf, 1, msUntil(deadline));
      if (pr == 0) throw TimeoutError(fmt::format("{} from {} timed out", what, peerAddr().str()));
      continue;
    }
    throw IoError(fmt::format("{} from {} failed: {}", what, peerAddr().str(), strerror(errno)));
  }
}

std::string localAddressFor(const std::string& remote) {
  SockAddr a = resolve(remote, 9);
  Fd fd(::socket(a.ss.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd.valid() || ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a.ss), a.len) != 0) {
    throw RendezvousError(fmt::format("no route to {}: {}", remote, strerror(errno)));
  }
  SockAddr local;
  local.len = sizeof local.ss;
  getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local.ss), &local.len);
  char host[NI_MAXHOST];
  getnameinfo(reinterpret_cast<const sockaddr*>(&local.ss), local.len, host, sizeof host, nullptr, 0,
              NI_NUMERICHOST);
  return host;
}

std::string interfaceAddress(const std::string& ifname) {
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) throw RendezvousError(fmt::format("getifaddrs: {}", strerror(errno)));
  std::string v4, v6;
  for (ifaddrs* i = ifs; i; i = i->ifa_next) {
    if (!i->ifa_addr || ifname != i->ifa_name) continue;
    char host[NI_MAXHOST];
    int fam = i->ifa_addr->sa_family;
    if (fam != AF_INET && fam != AF_INET6) continue;
    socklen_t len = fam == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (getnameinfo(i->ifa_addr, len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) continue;
    if (fam == AF_INET && v4.empty()) v4 = host;
    if (fam == AF_INET6 && v6.empty()) v6 = host;
  }
  freeifaddrs(ifs);
  if (!v4.empty()) return v4;
  if (!v6.empty()) return v6;
  throw RendezvousError(fmt::format("network interface '{}' (DTRAIN_IFNAME) has no IP address", ifname));
}

std::string hostName() {
  char host[HOST_NAME_MAX + 1] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "";
  return host;
}

}  // namespace dtrain::comm::net
