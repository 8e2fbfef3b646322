// An etcd for a test (see etcd_server.h).
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

std::string url(uint16_t port) { return "http://127.0.0.1:" + std::to_string(port); }

}  // namespace

uint16_t unusedPort() {
  uint16_t port = 0;
  ::close(boundSocket(&port));
  return port;
}

EtcdServer::EtcdServer(int members, std::chrono::seconds start_limit) : members_(members) {
  if (::access(kEtcdBinary, X_OK) != 0) {
    throw std::runtime_error(std::string(kEtcdBinary) +
                             " not found: the etcd tests need Debian's etcd-server (scripts/setup.sh installs it)");
  }
  // Every port held at once so they differ; released just before etcd binds them.
  std::vector<int> held;
  std::string initial_cluster;
  for (int i = 0; i < members; ++i) {
    held.push_back(boundSocket(&members_[i].client_port));
    held.push_back(boundSocket(&members_[i].peer_port));
    initial_cluster += (i ? "," : "") + ("m" + std::to_string(i)) + "=" + url(members_[i].peer_port);
  }
  for (int fd : held) ::close(fd);
  for (int i = 0; i < members; ++i) spawn(i, initial_cluster);
  // Up once every member serves a request through the gateway (after electing a leader).
  auto end = std::chrono::steady_clock::now() + start_limit;
  for (int i = 0; i < members; ++i) {
    comm::EtcdStore probe(endpoint(i), "/dtrain-test-probe/", std::chrono::milliseconds(500));
    for (std::string last;;) {
      int status = 0;
      if (::waitpid(members_[i].pid, &status, WNOHANG) == members_[i].pid) {
        members_[i].pid = -1;
        throw std::runtime_error("etcd exited at start (status " + std::to_string(status) + "); its log:\n" +
                                 logTail(i));
      }
      try {
        probe.numKeys();
        break;
      } catch (const std::exception& e) {
        last = e.what();
      }
      if (std::chrono::steady_clock::now() > end) {
        std::string log = logTail(i);
        for (int j = 0; j < members; ++j) kill(j);
        throw std::runtime_error("etcd did not serve " + endpoint(i) + " within " +
                                 std::to_string(start_limit.count()) + "s (" + last + "); its log:\n" + log);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
}

void EtcdServer::spawn(int i, const std::string& initial_cluster) {
  const std::string name = "m" + std::to_string(i);
  const std::string client = url(members_[i].client_port), peer = url(members_[i].peer_port);
  std::vector<std::string> args = {kEtcdBinary, "--name", name, "--data-dir", dir_.path() + "/" + name,
                                   "--listen-client-urls", client, "--advertise-client-urls", client,
                                   "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                                   "--initial-cluster", initial_cluster, "--initial-cluster-token", dir_.path(),
                                   "--logger", "zap", "--log-level", "warn",
                                   // The store conformance suite round-trips 8 MiB values (etcd: 1.5 MiB).
                                   "--max-request-bytes", std::to_string(32 << 20)};
  std::string log = dir_.path() + "/" + name + ".log";
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
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
  members_[i].pid = pid;
}

EtcdServer::~EtcdServer() {
  for (size_t i = 0; i < members_.size(); ++i) kill(static_cast<int>(i));
}

std::string EtcdServer::endpoint(int member) const { return url(members_[member].client_port); }

std::string EtcdServer::endpoints() const {
  std::string out;
  for (size_t i = 0; i < members_.size(); ++i) out += (i ? "," : "") + endpoint(static_cast<int>(i));
  return out;
}

void EtcdServer::kill(int member) {
  pid_t& pid = members_[member].pid;
  if (pid <= 0) return;
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  pid = -1;
}

std::string EtcdServer::logTail(int member) const {
  std::ifstream f(dir_.path() + "/m" + std::to_string(member) + ".log");
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  return s.size() > 4000 ? s.substr(s.size() - 4000) : s;
}

}  // namespace dtrain::test
