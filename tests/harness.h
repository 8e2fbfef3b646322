// Multi-process test harness: forks real ranks, collects each child's exit status and output, and
// bounds the whole run in time (children still running at the deadline are SIGKILLed and reported).
#pragma once
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/comm/store.h"

namespace dtrain::test {

struct ChildResult {
  int rank = -1;
  pid_t pid = -1;
  int exit_code = -1;   // exit status, or -1 if killed by a signal
  int signal = 0;       // terminating signal, or 0
  bool timed_out = false;
  std::string output;   // everything the child wrote to stdout and stderr
  bool ok() const { return exit_code == 0 && signal == 0 && !timed_out; }
  std::string describe() const;
};

// DTRAIN_TEST_TIME_SCALE (default 1): how much longer than on an idle developer machine the tests may
// take, for a slower or loaded machine. It multiplies every deadline the harness sets (runRanks,
// runCommand, StoreServer::client) and those a test passes through scaled(); CMake multiplies the CTest
// TIMEOUTs by the value it was configured with (-DDTRAIN_TEST_TIME_SCALE, scripts/test.sh passes the
// environment's). A deadline that a test asserts as the library's behaviour (an op timing out after its
// configured timeout) is the library's option, not scaled; only how long the test waits for it is.
double timeScale();
template <class Rep, class Period>
std::chrono::duration<Rep, Period> scaled(std::chrono::duration<Rep, Period> d) {
  return std::chrono::duration_cast<std::chrono::duration<Rep, Period>>(d * timeScale());
}

// The test runs under mpirun (DTRAIN_TEST_MPI_DIR set, a shared scratch directory): runRanks then runs
// fn in this process as rank OMPI_COMM_WORLD_RANK, without forking (processes past `world` sit the
// test out), and StoreServer is a FileStore in that directory. mpiRank(): this process's rank, or -1.
bool mpiRunner();
int mpiRank();

// Runs fn(rank) in `world` forked children. A child exits 0 when fn returns, 1 when it throws (the
// exception's what() goes to its output) and 2 when a gtest assertion failed inside it.
std::vector<ChildResult> runRanks(int world, const std::function<void(int rank)>& fn,
                                  std::chrono::seconds deadline = std::chrono::seconds(120));

// Fails the current test (with every failing child's output) unless all children succeeded.
void expectAllOk(const std::vector<ChildResult>& results);

// A TcpStore server on 127.0.0.1 with an ephemeral port, started in the parent before forking (under
// mpirun: a FileStore, see mpiRunner).
class StoreServer {
 public:
  StoreServer();
  ~StoreServer();
  uint16_t port() const;
  // A client for use inside a child.
  std::shared_ptr<comm::Store> client(std::chrono::milliseconds timeout = std::chrono::seconds(30)) const;

 private:
  std::unique_ptr<comm::TcpStoreServer> server_;
  std::string file_;
  // Sanitizer builds: the server runs in a process of its own (its pid here), so that the test process has
  // no thread of its own when it forks ranks (clang 14's ASan and TSan runtimes do not make fork safe
  // from a process whose other threads may hold their locks: a child could hang in its first malloc).
  int server_pid_ = -1;
  uint16_t port_ = 0;
};

// The Python whose torch the parity tests compare with: $DTRAIN_TEST_PYTHON, else the one CMake chose
// (DTRAIN_TEST_PYTHON: the virtual environment of the torch wheel dtrain was built against, or Debian's
// /usr/bin/python3 with python3-torch 1.13). Both come from scripts/setup.sh, with numpy.
std::string pythonPath();

// Python source that defines dtrain_load(path): torch.load(path) with no arguments, as a user loads a
// file dtrain wrote: weights-only by default on PyTorch 2.6 and later (src/torch/pickle_save.h). Put it
// first in a script.
extern const char* const kPythonDtrainLoad;

// Runs pythonPath() on `code` (written to a file: no shell quoting) and returns its output; empty,
// with a test failure, if it did not exit 0.
std::string runPython(const std::string& code);

// Runs a shell command under `timeout <seconds>` and returns its exit status (-1 if it did not exit)
// and everything it printed on stdout and stderr.
std::pair<int, std::string> runCommand(const std::string& cmd, int timeout_seconds = 120);

// Resident memory of this process, in KiB (from /proc/self/status).
long rssKiB();

// The message of the dtrain::Error that fn throws, or "no dtrain::Error" when it throws none.
std::string errorOf(const std::function<void()>& fn);

// A fresh temporary directory removed (recursively) on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace dtrain::test
