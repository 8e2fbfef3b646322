// Shared by the libFuzzer harnesses (tests/fuzz/*_fuzz.cc): loopback sockets with deadlines, so that a
// harness never blocks past a bound whatever the code under test does with the bytes it gets.
#pragma once
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace dtrain::fuzz {

// Crashes the harness (libFuzzer reports it with the input) with a message: a broken invariant.
[[noreturn]] inline void die(const std::string& why) {
  std::fprintf(stderr, "fuzz harness: %s\n", why.c_str());
  std::abort();
}

// Closing `fd` resets the connection instead of leaving it in TIME_WAIT: a harness makes hundreds of
// connections a second, and loopback's ephemeral ports ran out in a 5-minute run (connect failed).
inline void resetOnClose(int fd) {
  linger l{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
}

// A TCP connection to 127.0.0.1:port (reset on close), or -1 after 5 s of failed tries.
inline int connectLoopback(uint16_t port) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (;;) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    resetOnClose(fd);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
    ::close(fd);
    if (std::chrono::steady_clock::now() >= until) return -1;
    ::usleep(10000);
  }
}

// A listening socket on 127.0.0.1 (an ephemeral port, returned in `port`), or -1.
inline int listenLoopback(uint16_t& port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 16) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return -1;
  }
  port = ntohs(a.sin_port);
  return fd;
}

// Writes what it can of data[n] before `patience` passes (the peer may close or stop reading early).
inline void sendSome(int fd, const uint8_t* data, size_t n, std::chrono::milliseconds patience) {
  const auto until = std::chrono::steady_clock::now() + patience;
  while (n > 0 && std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, 10) <= 0) continue;
    ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w <= 0) return;
    data += w;
    n -= static_cast<size_t>(w);
  }
}

// Reads and discards until the peer closes or `patience` passes; returns whether it closed.
inline bool drainUntilClosed(int fd, std::chrono::milliseconds patience) {
  const auto until = std::chrono::steady_clock::now() + patience;
  char buf[4096];
  while (std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 10) <= 0) continue;
    ssize_t r = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
  return false;
}

}  // namespace dtrain::fuzz
