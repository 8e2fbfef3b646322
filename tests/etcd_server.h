// An etcd for a test: /usr/bin/etcd (Debian's etcd-server, installed by scripts/setup.sh), one member or
// several forming one cluster, on free 127.0.0.1 ports, data in a temporary directory, killed with the
// test (and with this process: PR_SET_PDEATHSIG). Not installed, or not answering within the start
// limit, is an error with etcd's log, never a silent skip.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "harness.h"

namespace dtrain::test {

inline constexpr const char* kEtcdBinary = "/usr/bin/etcd";

class EtcdServer {
 public:
  // Throws std::runtime_error when etcd is missing, a member exits, or the cluster does not serve
  // within start_limit.
  explicit EtcdServer(int members = 1, std::chrono::seconds start_limit = std::chrono::seconds(30));
  ~EtcdServer();
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  std::string endpoint(int member = 0) const;  // http://127.0.0.1:<client port>
  std::string endpoints() const;               // every member's, comma-separated
  uint16_t port(int member = 0) const { return members_[member].client_port; }
  // Kills a member now (SIGKILL) and reaps it.
  void kill(int member = 0);

 private:
  struct Member {
    pid_t pid = -1;
    uint16_t client_port = 0;
    uint16_t peer_port = 0;
  };
  void spawn(int i, const std::string& initial_cluster);
  std::string logTail(int member) const;

  TempDir dir_;
  std::vector<Member> members_;
};

// A 127.0.0.1 port that nothing listens on (bound, then released).
uint16_t unusedPort();

}  // namespace dtrain::test
