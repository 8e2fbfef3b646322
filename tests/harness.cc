// Multi-process test harness (see harness.h).
#include "harness.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <memory>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <thread>

#include "dtrain/comm/error.h"

namespace dtrain::test {

std::string ChildResult::describe() const {
  std::ostringstream os;
  os << "rank " << rank << " (pid " << pid << ")";
  if (timed_out) os << " timed out and was killed";
  else if (signal) os << " killed by signal " << signal;
  else os << " exited with " << exit_code;
  os << "; output:\n" << output;
  return os.str();
}

namespace {
// Counts gtest failures inside a forked child so it can exit with status 2.
class FailureCounter : public ::testing::EmptyTestEventListener {
 public:
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) ++failures;
  }
  int failures = 0;
};
}  // namespace

bool mpiRunner() {
  static const bool on = std::getenv("DTRAIN_TEST_MPI_DIR") && std::getenv("OMPI_COMM_WORLD_RANK");
  return on;
}

int mpiRank() { return mpiRunner() ? std::atoi(std::getenv("OMPI_COMM_WORLD_RANK")) : -1; }

namespace {
// Under mpirun: this process is one rank; processes past `world` sit the test out.
std::vector<ChildResult> runInThisProcess(int world, const std::function<void(int)>& fn) {
  const int me = mpiRank(), n = std::atoi(std::getenv("OMPI_COMM_WORLD_SIZE"));
  if (world > n) {
    ADD_FAILURE() << "this test needs " << world << " ranks but mpirun started " << n << " processes";
    return {};
  }
  if (me >= world) return {};
  ChildResult c;
  c.rank = me;
  c.pid = getpid();
  c.exit_code = 0;
  try {
    fn(me);
  } catch (const std::exception& e) {
    c.exit_code = 1;
    c.output = std::string("rank ") + std::to_string(me) + " threw: " + e.what();
  }
  return {c};
}
}  // namespace

double timeScale() {
  static const double scale = [] {
    const char* env = std::getenv("DTRAIN_TEST_TIME_SCALE");
    if (!env || !*env) return 1.0;
    char* end = nullptr;
    long v = std::strtol(env, &end, 10);
    if (*end != '\0' || v < 1 || v > 100) {
      fprintf(stderr, "DTRAIN_TEST_TIME_SCALE='%s': expected a whole number from 1 to 100\n", env);
      std::exit(2);
    }
    return static_cast<double>(v);
  }();
  return scale;
}

std::vector<ChildResult> runRanks(int world, const std::function<void(int)>& fn,
                                  std::chrono::seconds deadline) {
  if (mpiRunner()) return runInThisProcess(world, fn);
  deadline = scaled(deadline);
  TempDir dir;
  std::vector<ChildResult> res(world);
  std::cout.flush();
  std::cerr.flush();
  for (int r = 0; r < world; ++r) {
    std::string out = dir.path() + "/rank" + std::to_string(r) + ".log";
    pid_t pid = fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork failed";
      break;
    }
    if (pid == 0) {
      int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
      auto* counter = new FailureCounter;  // owned by gtest's listener list
      ::testing::UnitTest::GetInstance()->listeners().Append(counter);
      int code = 0;
      try {
        fn(r);
        if (counter->failures) code = 2;
      } catch (const std::exception& e) {
        fprintf(stderr, "rank %d threw: %s\n", r, e.what());
        code = 1;
      }
      fflush(stdout);
      fflush(stderr);
      _exit(code);
    }
    res[r].rank = r;
    res[r].pid = pid;
  }
  auto end = std::chrono::steady_clock::now() + deadline;
  int remaining = world;
  while (remaining > 0) {
    bool any = false;
    for (auto& c : res) {
      if (c.pid <= 0 || c.exit_code != -1 || c.signal || c.timed_out) continue;
      int st = 0;
      pid_t p = waitpid(c.pid, &st, WNOHANG);
      if (p == c.pid) {
        any = true;
        --remaining;
        if (WIFEXITED(st)) c.exit_code = WEXITSTATUS(st);
        else if (WIFSIGNALED(st)) c.signal = WTERMSIG(st);
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() > end) {
      for (auto& c : res) {
        if (c.pid <= 0 || c.exit_code != -1 || c.signal) continue;
        kill(c.pid, SIGKILL);
        waitpid(c.pid, nullptr, 0);
        c.timed_out = true;
      }
      break;
    }
    if (!any) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto& c : res) {
    std::ifstream f(dir.path() + "/rank" + std::to_string(c.rank) + ".log");
    std::stringstream ss;
    ss << f.rdbuf();
    c.output = ss.str();
    // DTRAIN_TEST_VERBOSE=1 shows what every child printed, passing or not.
    if (const char* v = std::getenv("DTRAIN_TEST_VERBOSE"); v && *v == '1') std::cout << c.describe() << "\n";
  }
  return res;
}

void expectAllOk(const std::vector<ChildResult>& results) {
  for (const auto& c : results) EXPECT_TRUE(c.ok()) << c.describe();
}

namespace {
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

// Starts a TcpStoreServer in a child process (killed with its parent); returns its pid and port.
std::pair<int, uint16_t> serverProcess() {
  int fds[2];
  if (pipe(fds) != 0) throw std::runtime_error("harness: pipe failed");
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(fds[0]);
    comm::TcpStoreServer server("127.0.0.1", 0);
    const uint16_t port = server.port();
    if (write(fds[1], &port, sizeof port) != sizeof port) _exit(1);
    for (;;) pause();
  }
  close(fds[1]);
  uint16_t port = 0;
  const bool ok = pid > 0 && read(fds[0], &port, sizeof port) == sizeof port;
  close(fds[0]);
  if (!ok) throw std::runtime_error("harness: the store server process did not start");
  return {pid, port};
}
}  // namespace

StoreServer::StoreServer() {
  if (!mpiRunner() && kSanitized) {
    std::tie(server_pid_, port_) = serverProcess();
    return;
  }
  if (!mpiRunner()) {
    server_ = std::make_unique<comm::TcpStoreServer>("127.0.0.1", 0);
    return;
  }
  // Every process of the mpirun job makes the same StoreServers in the same order: the n-th is one file.
  static int made = 0;
  file_ = std::string(std::getenv("DTRAIN_TEST_MPI_DIR")) + "/store-" + std::to_string(made++);
}
StoreServer::~StoreServer() {
  if (server_pid_ > 0) {
    kill(server_pid_, SIGKILL);
    waitpid(server_pid_, nullptr, 0);
  }
}
uint16_t StoreServer::port() const { return server_ ? server_->port() : port_; }
std::shared_ptr<comm::Store> StoreServer::client(std::chrono::milliseconds timeout) const {
  timeout = scaled(timeout);
  if (server_pid_ > 0) return std::make_shared<comm::TcpStore>("127.0.0.1", port_, timeout);
  if (!server_) return std::make_shared<comm::FileStore>(file_, timeout);
  return std::make_shared<comm::TcpStore>("127.0.0.1", server_->port(), timeout);
}

const char* const kPythonDtrainLoad =
    "import torch\n"
    "def dtrain_load(path):\n"
    "    return torch.load(path)  # the default: weights-only from PyTorch 2.6\n";

std::string pythonPath() {
  const char* env = std::getenv("DTRAIN_TEST_PYTHON");
  return env && *env ? env : DTRAIN_TEST_PYTHON;
}

std::string runPython(const std::string& code) {
  TempDir dir;
  const std::string script = dir.path() + "/check.py";
  std::ofstream(script) << code;
  std::string cmd = pythonPath() + " " + script + " 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.c_str(), "r"), pclose);
  if (!pipe) {
    ADD_FAILURE() << "popen failed";
    return "";
  }
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe.get())) > 0) out.append(buf.data(), n);
  int status = pclose(pipe.release());
  if (status != 0) {
    ADD_FAILURE() << pythonPath() << " failed (status " << status << "): " << out;
    return "";
  }
  return out;
}

std::pair<int, std::string> runCommand(const std::string& cmd, int timeout_seconds) {
  std::string out;
  const long seconds = std::lround(timeout_seconds * timeScale());
  std::string full = "timeout " + std::to_string(seconds) + " " + cmd + " 2>&1";
  FILE* p = popen(full.c_str(), "r");
  if (!p) return {-1, "popen failed"};
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

long rssKiB() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "dtrain-test-XXXXXX").string();
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}
TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string errorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "no dtrain::Error";
}

}  // namespace dtrain::test
