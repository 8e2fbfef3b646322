// A one-member etcd for a test (see etcd_server.h).
#include "etcd_server.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "dtrain/comm/etcd.h"

namespace dtrain::test {

namespace {

// Binds a 127.0.0.1 socket to an ephemeral port and returns it with its port (close it to release).
int boundSocket(uint16_t* port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    throw std::runtime_error("cannot bind a 127.0.0.1 socket");
  }
  *port = ntohs(a.sin_port);
  return fd;
}

}  // namespace

uint16_t unusedPort() {
  uint16_t port = 0;
  ::close(boundSocket(&port));
  return port;
}

EtcdServer::EtcdServer(std::chrono::seconds start_limit) {
  if (::access(kEtcdBinary, X_OK) != 0) {
    throw std::runtime_error(std::string(kEtcdBinary) +
                             " not found: the etcd tests need Debian's etcd-server (scripts/setup.sh installs it)");
  }
  // Both ports held at once so they differ; released just before etcd binds them.
  int c = boundSocket(&client_port_), p = boundSocket(&peer_port_);
  ::close(c);
  ::close(p);
  std::string client = "http://127.0.0.1:" + std::to_string(client_port_);
  std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
  std::vector<std::string> args = {kEtcdBinary, "--name", "t", "--data-dir", dir_.path() + "/data",
                                   "--listen-client-urls", client, "--advertise-client-urls", client,
                                   "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                   "--initial-cluster", "t=" + peer, "--logger", "zap", "--log-level", "warn",
                                   // The store conformance suite round-trips 8 MiB values (etcd: 1.5 MiB).
                                   "--max-request-bytes", std::to_string(32 << 20)};
  std::string log = dir_.path() + "/etcd.log";
  pid_t parent = ::getpid();
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) _exit(127);
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(kEtcdBinary, argv.data());
    _exit(127);
  }
  // Up once it serves a request through the gateway (a member elects itself leader first).
  comm::EtcdStore probe(endpoint(), "/dtrain-test-probe/", std::chrono::milliseconds(500));
  auto end = std::chrono::steady_clock::now() + start_limit;
  std::string last;
  for (;;) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      throw std::runtime_error("etcd exited at start (status " + std::to_string(status) + "); its log:\n" +
                               logTail());
    }
    try {
      probe.numKeys();
      return;
    } catch (const std::exception& e) {
      last = e.what();
    }
    if (std::chrono::steady_clock::now() > end) {
      kill();
      throw std::runtime_error("etcd did not serve " + endpoint() + " within " +
                               std::to_string(start_limit.count()) + "s (" + last + "); its log:\n" + logTail());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

EtcdServer::~EtcdServer() { kill(); }

std::string EtcdServer::endpoint() const { return "http://127.0.0.1:" + std::to_string(client_port_); }

void EtcdServer::kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

std::string EtcdServer::logTail() const {
  std::ifstream f(dir_.path() + "/etcd.log");
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  return s.size() > 4000 ? s.substr(s.size() - 4000) : s;
}

}  // namespace dtrain::test
