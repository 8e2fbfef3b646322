// RAII sockets with deadlines: the one place dtrain::comm touches the BSD socket API.
// Every blocking call takes a Deadline and throws TimeoutError past it, IoError on a failed peer.
#pragma once
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "dtrain/comm/fd.h"

namespace dtrain::comm::net {

struct SockAddr {
  sockaddr_storage ss{};
  socklen_t len = 0;
  std::string str() const;  // "host:port"
  uint16_t port() const;
};

// Resolves host (name or numeric, IPv4 or IPv6) and port; throws RendezvousError naming the host.
SockAddr resolve(const std::string& host, uint16_t port);

class Socket {
 public:
  Socket() = default;
  explicit Socket(Fd fd) : fd_(std::move(fd)) {}

  // Binds and listens on host:port (port 0: the kernel picks one). SO_REUSEADDR is set.
  static Socket listen(const std::string& host, uint16_t port, int backlog = 128);
  // Connects, retrying refused or unreachable attempts until the deadline (the listener may not exist yet).
  static Socket connect(const std::string& host, uint16_t port, Deadline deadline);
  // Accepts one connection or throws TimeoutError at the deadline.
  Socket accept(Deadline deadline) const;

  void setNonBlocking(bool on) const;
  void setNoDelay() const;
  void setBufferSizes(int bytes) const;
  int fd() const { return fd_.get(); }
  bool valid() const { return fd_.valid(); }
  uint16_t localPort() const;
  SockAddr localAddr() const;
  SockAddr peerAddr() const;

  // Blocking transfers of exactly n bytes, bounded by the deadline. `what` names the transfer in errors.
  void sendAll(const void* p, size_t n, Deadline deadline, const char* what = "send") const;
  void recvAll(void* p, size_t n, Deadline deadline, const char* what = "recv") const;

 private:
  Fd fd_;
};

// The local IP address the kernel would use to reach `remote` (no packet is sent), e.g. to advertise
// a listening address to peers. Loopback when remote is loopback.
std::string localAddressFor(const std::string& remote);
// The first IPv4 (else IPv6) address of interface `ifname`; RendezvousError if none.
std::string interfaceAddress(const std::string& ifname);
// This machine's host name ("" if the kernel will not say).
std::string hostName();

}  // namespace dtrain::comm::net
