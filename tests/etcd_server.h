// A one-member etcd for a test: /usr/bin/etcd (Debian's etcd-server, installed by scripts/setup.sh) on
// free 127.0.0.1 ports, its data in a temporary directory, killed with the test (and with this process:
// PR_SET_PDEATHSIG). Not installed, or not answering within the start limit, is an error with etcd's
// log, never a silent skip.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "harness.h"

namespace dtrain::test {

inline constexpr const char* kEtcdBinary = "/usr/bin/etcd";

class EtcdServer {
 public:
  // Throws std::runtime_error when etcd is missing, exits, or does not serve within start_limit.
  explicit EtcdServer(std::chrono::seconds start_limit = std::chrono::seconds(30));
  ~EtcdServer();
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  std::string endpoint() const;  // http://127.0.0.1:<client port>
  uint16_t port() const { return client_port_; }
  // Kills etcd now (SIGKILL) and reaps it.
  void kill();

 private:
  std::string logTail() const;

  TempDir dir_;
  pid_t pid_ = -1;
  uint16_t client_port_ = 0;
  uint16_t peer_port_ = 0;
};

// A 127.0.0.1 port that nothing listens on (bound, then released).
uint16_t unusedPort();

}  // namespace dtrain::test
