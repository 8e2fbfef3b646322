// Runs the built dtrain-run with small bash programs as workers and checks what they saw, what the
// launcher printed, how it exited and that no worker outlived it. Every run is bounded in time.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

const char* const kLauncher = DTRAIN_BIN_DIR "/dtrain-run";
const char* const kLineWorker = DTRAIN_BIN_DIR "/line_worker";  // tests/tools/line_worker.cc

struct RunResult {
  int exit_code = -1;  // the launcher's exit code, 128+signal if it was killed
  bool timed_out = false;
  std::string out, err;
  double seconds = 0;
  std::string describe() const {
    return "exit " + std::to_string(exit_code) + (timed_out ? " (timed out)" : "") + "\n--- stdout:\n" + out +
           "--- stderr:\n" + err;
  }
};

// dtrain-run started with `args`, its stdout and stderr captured. `env` changes the launcher's
// environment (nullopt unsets a variable).
class Launch {
 public:
  explicit Launch(const std::vector<std::string>& args,
                  const std::map<std::string, std::optional<std::string>>& env = {}) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) std::abort();
    start_ = Clock::now();
    pid_ = ::fork();
    if (pid_ == 0) {
      // The test process is single-threaded, so the child may allocate.
      for (const auto& [k, v] : env) {
        if (v) {
          ::setenv(k.c_str(), v->c_str(), 1);
        } else {
          ::unsetenv(k.c_str());
        }
      }
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      // As from an interactive shell: a test started in the background (nohup, `&` in a script)
      // inherits SIGINT ignored, and an ignored signal never reaches the launcher to be forwarded.
      for (int s : {SIGINT, SIGTERM, SIGHUP}) ::signal(s, SIG_DFL);
      std::vector<char*> argv{const_cast<char*>(kLauncher)};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(kLauncher, argv.data());
      std::perror("execv dtrain-run");
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    out_ = out[0];
    err_ = err[0];
  }
  ~Launch() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) ::close(out_);
    if (err_ >= 0) ::close(err_);
  }

  pid_t pid() const { return pid_; }

  // Collects the output until the launcher exits; SIGKILLs it at the deadline.
  RunResult wait(std::chrono::seconds deadline = 60s) {
    RunResult r;
    auto end = start_ + deadline;
    int status = 0;
    bool reaped = false;
    while (!reaped || out_ >= 0 || err_ >= 0) {
      if (!reaped && ::waitpid(pid_, &status, WNOHANG) == pid_) reaped = true;
      if (Clock::now() >= end) {
        r.timed_out = true;
        if (!reaped) {
          ::kill(pid_, SIGKILL);
          ::waitpid(pid_, &status, 0);
          reaped = true;
        }
        break;
      }
      std::vector<pollfd> pfds;
      for (int fd : {out_, err_}) {
        if (fd >= 0) pfds.push_back(pollfd{fd, POLLIN, 0});
      }
      if (pfds.empty()) {
        std::this_thread::sleep_for(10ms);
        continue;
      }
      ::poll(pfds.data(), pfds.size(), 50);
      readSome(out_, r.out);
      readSome(err_, r.err);
    }
    pid_ = -1;
    r.seconds = std::chrono::duration<double>(Clock::now() - start_).count();
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return r;
  }

 private:
  static void readSome(int& fd, std::string& into) {
    if (fd < 0) return;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) return;
    char buf[4096];
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      into.append(buf, static_cast<size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      ::close(fd);
      fd = -1;
    }
  }

  pid_t pid_ = -1;
  int out_ = -1, err_ = -1;
  Clock::time_point start_;
};

RunResult run(const std::vector<std::string>& args,
              const std::map<std::string, std::optional<std::string>>& env = {}) {
  return Launch(args, env).wait();
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream is(s);
  for (std::string l; std::getline(is, l);) v.push_back(l);
  return v;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// A zombie (a reparented grandchild nobody reaped yet) counts as gone.
bool alive(pid_t pid) {
  if (::kill(pid, 0) != 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  auto paren = s.rfind(')');
  return paren == std::string::npos || paren + 2 >= s.size() || s[paren + 2] != 'Z';
}

pid_t readPid(const std::string& path) {
  std::ifstream f(path);
  pid_t p = -1;
  f >> p;
  return p;
}

bool waitForFiles(const std::vector<std::string>& paths, std::chrono::seconds timeout = 20s) {
  auto end = Clock::now() + timeout;
  while (Clock::now() < end) {
    bool all = true;
    for (const auto& p : paths) all = all && std::filesystem::exists(p);
    if (all) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

// The fields each rank printed, keyed by rank, checking each line's "[rank r]: " prefix.
std::map<int, std::vector<std::string>> fieldsByRank(const std::string& out) {
  std::map<int, std::vector<std::string>> by_rank;
  for (const auto& line : lines(out)) {
    std::istringstream is(line);
    std::string tag, rank_colon;
    is >> tag >> rank_colon;
    EXPECT_EQ(tag, "[rank") << line;
    std::vector<std::string> fields;
    for (std::string f; is >> f;) fields.push_back(f);
    EXPECT_FALSE(fields.empty()) << line;
    if (fields.empty()) continue;
    int rank = std::stoi(fields[0]);
    EXPECT_EQ(rank_colon, std::to_string(rank) + "]:") << line;
    by_rank[rank] = fields;
  }
  return by_rank;
}

const std::string kPrintEnv =
    "echo $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT "
    "$DTRAIN_RESTART_COUNT $OMP_NUM_THREADS $TORCHELASTIC_RESTART_COUNT $DTRAIN_USE_AGENT_STORE $DTRAIN_ROLE";

TEST(Launcher, ExportsTheEnvironmentToEveryRank) {
  auto r = run({"--nproc-per-node", "3", "--standalone", "bash", "-c", kPrintEnv}, {{"OMP_NUM_THREADS", {}}});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto by_rank = fieldsByRank(r.out);
  ASSERT_EQ(by_rank.size(), 3u) << r.describe();
  const std::string port = by_rank[0].at(6);
  EXPECT_NE(port, "0");
  EXPECT_NE(port, "29500") << "--standalone picks a free port";
  for (int rank = 0; rank < 3; ++rank) {
    std::vector<std::string> expected{std::to_string(rank),
                                      std::to_string(rank),
                                      "3",
                                      "3",
                                      "0",
                                      "127.0.0.1",
                                      port,
                                      "0",
                                      "1",
                                      "0",
                                      "1",
                                      "worker"};
    EXPECT_EQ(by_rank[rank], expected) << r.describe();
  }
}

TEST(Launcher, KeepsTheUsersOmpNumThreads) {
  auto r =
      run({"--nproc-per-node", "2", "--standalone", "bash", "-c", kPrintEnv}, {{"OMP_NUM_THREADS", "3"}});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto by_rank = fieldsByRank(r.out);
  ASSERT_EQ(by_rank.size(), 2u) << r.describe();
  for (auto& [rank, fields] : by_rank) EXPECT_EQ(fields.at(8), "3") << r.describe();
}

// --gpu-per-worker: each worker sees the LOCAL_RANK-th of the launcher's GPUs (cycling), or its LOCAL_RANK.
TEST(Launcher, GpuPerWorkerGivesEachWorkerOneGpu) {
  const char* print = "echo \"gpu $LOCAL_RANK=${CUDA_VISIBLE_DEVICES-unset}\"";
  auto r = run({"--nproc-per-node", "3", "--standalone", "--gpu-per-worker", "bash", "-c", print},
               {{"CUDA_VISIBLE_DEVICES", "3,5"}});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  for (const char* want : {"gpu 0=3", "gpu 1=5", "gpu 2=3"}) EXPECT_NE(r.out.find(want), std::string::npos) << r.describe();
  r = run({"--nproc-per-node", "2", "--standalone", "--gpu-per-worker", "bash", "-c", print}, {{"CUDA_VISIBLE_DEVICES", ""}});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  for (const char* want : {"gpu 0=0", "gpu 1=1"}) EXPECT_NE(r.out.find(want), std::string::npos) << r.describe();
  r = run({"--nproc-per-node", "1", "--standalone", "bash", "-c", print}, {{"CUDA_VISIBLE_DEVICES", "7"}});
  EXPECT_NE(r.out.find("gpu 0=7"), std::string::npos) << r.describe();  // without the flag: inherited as it is
}

// On a node other than the first, the GPU follows LOCAL_RANK, not RANK: ranks 3, 4 and 5 of node 1 see the
// node's GPUs 0, 1 and 2 of theirs (with CUDA_VISIBLE_DEVICES: its 1st, 2nd and 1st again). Node 1 hosts no
// store, so nothing needs to listen on the port.
TEST(Launcher, GpuPerWorkerFollowsTheLocalRankOnEveryNode) {
  const char* print = "echo \"gpu $RANK/$LOCAL_RANK=${CUDA_VISIBLE_DEVICES-unset}\"";
  const std::vector<std::string> node1{"--nproc-per-node", "3", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                                       "127.0.0.1", "--master-port", "29999", "--gpu-per-worker", "bash", "-c", print};
  auto r = run(node1, {{"CUDA_VISIBLE_DEVICES", "3,5"}});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  for (const char* want : {"gpu 3/0=3\n", "gpu 4/1=5\n", "gpu 5/2=3\n"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << r.describe();
  r = run(node1, {{"CUDA_VISIBLE_DEVICES", std::nullopt}});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  for (const char* want : {"gpu 3/0=0\n", "gpu 4/1=1\n", "gpu 5/2=2\n"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << r.describe();
}

TEST(Launcher, NodeRankOffsetsRanks) {
  // Node 1 hosts no store, so nothing needs to listen on this port.
  auto r = run({"--nproc-per-node", "3", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                "--master-port", "29999", "bash", "-c", kPrintEnv},
               {{"OMP_NUM_THREADS", {}}});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  auto by_rank = fieldsByRank(r.out);
  ASSERT_EQ(by_rank.size(), 3u) << r.describe();
  for (int local = 0; local < 3; ++local) {
    int rank = 3 + local;
    std::vector<std::string> expected{std::to_string(rank),
                                      std::to_string(local),
                                      "6",
                                      "3",
                                      "1",
                                      "127.0.0.1",
                                      "29999",
                                      "0",
                                      "1",
                                      "0",
                                      "1",
                                      "worker"};
    EXPECT_EQ(by_rank[rank], expected) << r.describe();
  }
}

TEST(Launcher, StandaloneStoreIsReachable) {
  auto r = run({"--nproc-per-node", "2", "--standalone", "bash", "-c",
                "exec 3<>/dev/tcp/$MASTER_ADDR/$MASTER_PORT && echo $RANK connected"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 0]: 0 connected\n")) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 1]: 1 connected\n")) << r.describe();
}

TEST(Launcher, MasterPortZeroHostsTheStoreOnAFreePort) {
  auto r = run({"--nproc-per-node", "1", "--master-port", "0", "bash", "-c",
                "[ \"$MASTER_PORT\" != 0 ] && exec 3<>/dev/tcp/$MASTER_ADDR/$MASTER_PORT && echo connected"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 0]: connected\n")) << r.describe();
}

TEST(Launcher, ArgumentsPassThroughUntouched) {
  auto r = run({"--nproc-per-node", "1", "--standalone", "--", "bash", "-c", "printf '<%s>' \"$@\"; echo",
                "bash", "--nproc-per-node", "x y", "--", "-v"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(r.out, "[rank 0]: <--nproc-per-node><x y><--><-v>\n") << r.describe();
}

TEST(Launcher, PrefixesOutputLinesIncludingAnUnterminatedLastOne) {
  auto r = run({"--nproc-per-node", "2", "--standalone", "bash", "-c",
                "printf 'one\\ntwo\\n'; printf 'oops\\n' >&2; printf 'tail'; printf 'etail' >&2"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  for (int rank = 0; rank < 2; ++rank) {
    std::string p = "[rank " + std::to_string(rank) + "]: ";
    // Each rank's stdout lines stay in order; ranks may interleave with each other.
    std::vector<std::string> mine;
    for (const auto& l : lines(r.out)) {
      if (l.rfind(p, 0) == 0) mine.push_back(l);
    }
    EXPECT_EQ(mine, (std::vector<std::string>{p + "one", p + "two", p + "tail"})) << r.describe();
    EXPECT_TRUE(contains(r.err, p + "oops\n")) << r.describe();
    EXPECT_TRUE(contains(r.err, p + "etail\n")) << r.describe();
  }
  EXPECT_EQ(lines(r.out).size(), 6u) << r.describe();
  EXPECT_EQ(r.out.back(), '\n');
}

TEST(Launcher, NoPrefixPassesOutputThrough) {
  auto r = run({"--nproc-per-node", "1", "--standalone", "--no-prefix", "bash", "-c", "printf 'a\\nb'"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(r.out, "a\nb");
}

TEST(Launcher, FailureStopsTheOtherWorkersAndPropagatesTheCode) {
  dtrain::test::TempDir dir;
  const std::string d = dir.path();
  // Rank 1 fails once the others are surely asleep (their pid files are written).
  const std::string program = "d=" + d +
                              "\n"
                              "if [ $RANK = 1 ]; then\n"
                              "  while [ ! -f $d/pid.0 ] || [ ! -f $d/pid.2 ]; do sleep 0.02; done\n"
                              "  echo failing; exit 3\n"
                              "fi\n"
                              "echo $$ > $d/tmp.$RANK && mv $d/tmp.$RANK $d/pid.$RANK\n"
                              "sleep 30\n";
  auto r = run({"--nproc-per-node", "3", "--standalone", "bash", "-c", program});
  EXPECT_EQ(r.exit_code, 3) << r.describe();
  EXPECT_LT(r.seconds, 15.0) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 1]: failing\n")) << r.describe();
  EXPECT_TRUE(contains(r.err, "dtrain-run: rank 1 (pid ")) << r.describe();
  EXPECT_TRUE(contains(r.err, ") exited with code 3; stopping the other workers")) << r.describe();
  for (int rank : {0, 2}) {
    pid_t pid = readPid(d + "/pid." + std::to_string(rank));
    ASSERT_GT(pid, 0);
    EXPECT_FALSE(alive(pid)) << "rank " << rank << " (pid " << pid << ") outlived the launcher";
  }
}

TEST(Launcher, WorkerKilledBySignalGives128PlusSignal) {
  auto r = run({"--nproc-per-node", "1", "--standalone", "bash", "-c", "kill -KILL $$"});
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.describe();
  EXPECT_TRUE(contains(r.err, "was killed by signal 9 (SIGKILL)")) << r.describe();
}

TEST(Launcher, WorkerIgnoringSigtermIsKilledAfterTheGracePeriod) {
  dtrain::test::TempDir dir;
  const std::string d = dir.path();
  // Rank 0 and its background sleep ignore SIGTERM; only SIGKILL of its process group ends them.
  const std::string program = "d=" + d +
                              "\n"
                              "if [ $RANK = 1 ]; then\n"
                              "  while [ ! -f $d/pid.0 ]; do sleep 0.02; done\n"
                              "  exit 5\n"
                              "fi\n"
                              "trap '' TERM\n"
                              "sleep 30 & echo $! > $d/sleep.0\n"
                              "echo $$ > $d/tmp.0 && mv $d/tmp.0 $d/pid.0\n"
                              "wait\n";
  auto r = run({"--nproc-per-node", "2", "--standalone", "--grace-period", "1", "bash", "-c", program});
  EXPECT_EQ(r.exit_code, 5) << r.describe();
  EXPECT_GE(r.seconds, 1.0) << r.describe();
  EXPECT_LT(r.seconds, 15.0) << r.describe();
  EXPECT_TRUE(contains(r.err, "still running 1s after SIGTERM; sending SIGKILL")) << r.describe();
  for (const char* f : {"/pid.0", "/sleep.0"}) {
    pid_t pid = readPid(d + f);
    ASSERT_GT(pid, 0) << f;
    EXPECT_FALSE(alive(pid)) << f << " (pid " << pid << ") outlived the launcher";
  }
}

const std::string kFailUntilSecondRestart =
    "echo attempt $DTRAIN_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT; [ \"$DTRAIN_RESTART_COUNT\" = 2 ] || "
    "exit 4";

TEST(Launcher, RestartsTheGroupUntilItSucceeds) {
  auto r = run({"--nproc-per-node", "2", "--standalone", "--max-restarts", "2", "bash", "-c",
                kFailUntilSecondRestart});
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_TRUE(contains(r.err, "dtrain-run: restarting workers (restart 1 of 2)\n")) << r.describe();
  EXPECT_TRUE(contains(r.err, "dtrain-run: restarting workers (restart 2 of 2)\n")) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 0]: attempt 2 2\n")) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 1]: attempt 2 2\n")) << r.describe();
}

TEST(Launcher, GivesUpWhenRestartsRunOut) {
  auto r = run({"--nproc-per-node", "2", "--standalone", "--max-restarts", "1", "bash", "-c",
                kFailUntilSecondRestart});
  EXPECT_EQ(r.exit_code, 4) << r.describe();
  EXPECT_TRUE(contains(r.err, "(restart 1 of 1)")) << r.describe();
  EXPECT_FALSE(contains(r.out, "attempt 2")) << r.describe();
}

// Starts 2 workers that record the signal they get, sends `sig` to the launcher once they are asleep.
RunResult signalTheLauncher(int sig, const std::string& d) {
  const std::string program = "d=" + d +
                              "\n"
                              "trap 'echo got > $d/sig.$RANK; exit 0' TERM INT\n"
                              "echo $$ > $d/tmp.$RANK && mv $d/tmp.$RANK $d/pid.$RANK\n"
                              "sleep 30 & wait\n";
  Launch launch({"--nproc-per-node", "2", "--standalone", "bash", "-c", program});
  EXPECT_TRUE(waitForFiles({d + "/pid.0", d + "/pid.1"}));
  ::kill(launch.pid(), sig);
  return launch.wait();
}

TEST(Launcher, ForwardsSigtermAndExits143) {
  dtrain::test::TempDir dir;
  auto r = signalTheLauncher(SIGTERM, dir.path());
  EXPECT_EQ(r.exit_code, 143) << r.describe();
  EXPECT_LT(r.seconds, 15.0) << r.describe();
  EXPECT_TRUE(contains(r.err, "received SIGTERM; forwarding it to the workers")) << r.describe();
  for (int rank : {0, 1}) {
    std::string base = dir.path() + "/";
    EXPECT_TRUE(std::filesystem::exists(base + "sig." + std::to_string(rank))) << "rank " << rank;
    EXPECT_FALSE(alive(readPid(base + "pid." + std::to_string(rank))));
  }
}

TEST(Launcher, ForwardsSigintAndExits130) {
  dtrain::test::TempDir dir;
  auto r = signalTheLauncher(SIGINT, dir.path());
  EXPECT_EQ(r.exit_code, 130) << r.describe();
  for (int rank : {0, 1}) {
    EXPECT_TRUE(std::filesystem::exists(dir.path() + "/sig." + std::to_string(rank))) << "rank " << rank;
  }
}

TEST(Launcher, StartsParameterServersOnNodeZero) {
  const std::string program =
      "echo $DTRAIN_ROLE ${DTRAIN_SERVER_INDEX:-x} $DTRAIN_NUM_SERVERS $DTRAIN_NUM_WORKERS ${RANK:-none}";
  auto r = run({"--nproc-per-node", "2", "--standalone", "--servers", "2", "bash", "-c", program},
               {{"RANK", "7"}});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 0]: worker x 2 2 0\n")) << r.describe();
  EXPECT_TRUE(contains(r.out, "[rank 1]: worker x 2 2 1\n")) << r.describe();
  EXPECT_TRUE(contains(r.out, "[server 0]: server 0 2 2 none\n")) << r.describe();
  EXPECT_TRUE(contains(r.out, "[server 1]: server 1 2 2 none\n")) << r.describe();
}

TEST(Launcher, StopsLingeringServersOnceTheWorkersSucceed) {
  auto r = run({"--nproc-per-node", "1", "--standalone", "--servers", "1", "--grace-period", "1", "bash",
                "-c", "[ $DTRAIN_ROLE = worker ] || sleep 30"});
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_LT(r.seconds, 15.0) << r.describe();
  EXPECT_TRUE(contains(r.err, "stopping the servers")) << r.describe();
}

// The lines line_worker printed (as the console shows them) that are missing from `out`.
std::vector<std::string> missingWorkerLines(const std::string& out, int rank) {
  const std::string p = "[rank " + std::to_string(rank) + "]: line ";
  std::vector<std::string> missing;
  for (std::string l : {"1 of rank R (printf)", "2 of rank R (cout)", "3 of rank R (printf)"}) {
    l = p + l.replace(l.find('R'), 1, std::to_string(rank)) + "\n";
    if (!contains(out, l)) missing.push_back(l);
  }
  return missing;
}

// line_worker on 2 ranks, "hold" mode; the launcher gets SIGTERM once both have printed.
RunResult stopPrintingWorkers(const std::string& d, const std::map<std::string, std::optional<std::string>>& env) {
  Launch launch({"--nproc-per-node", "2", "--standalone", kLineWorker, d, "hold"}, env);
  EXPECT_TRUE(waitForFiles({d + "/ready.0", d + "/ready.1"}));
  ::kill(launch.pid(), SIGTERM);
  return launch.wait();
}

TEST(Launcher, LinesOfWorkersStoppedBySigtermAreNotLost) {
  dtrain::test::TempDir dir;
  auto r = stopPrintingWorkers(dir.path(), {{"DTRAIN_LINE_BUFFERED", {}}});
  EXPECT_EQ(r.exit_code, 143) << r.describe();
  for (int rank : {0, 1}) EXPECT_EQ(missingWorkerLines(r.out, rank), std::vector<std::string>{}) << r.describe();
}

// The control: with the line buffering turned off, stdout (a pipe) is block-buffered and a worker
// killed by SIGTERM loses what it printed. This is what DTRAIN_LINE_BUFFERED=1 prevents.
TEST(Launcher, LinesAreLostWhenTheUserTurnsLineBufferingOff) {
  dtrain::test::TempDir dir;
  auto r = stopPrintingWorkers(dir.path(), {{"DTRAIN_LINE_BUFFERED", "0"}});
  EXPECT_EQ(r.exit_code, 143) << r.describe();
  for (int rank : {0, 1}) EXPECT_EQ(missingWorkerLines(r.out, rank).size(), 3u) << r.describe();
}

TEST(Launcher, LinesOfWorkersStoppedAfterAFailureAreNotLost) {
  dtrain::test::TempDir dir;
  auto r = run({"--nproc-per-node", "2", "--standalone", kLineWorker, dir.path(), "fail"},
               {{"DTRAIN_LINE_BUFFERED", {}}});
  EXPECT_EQ(r.exit_code, 3) << r.describe();
  EXPECT_TRUE(contains(r.err, "rank 1 (pid ")) << r.describe();
  for (int rank : {0, 1}) EXPECT_EQ(missingWorkerLines(r.out, rank), std::vector<std::string>{}) << r.describe();
}

std::string readFile(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path << " does not exist";
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// The run's log directory, from the launcher's "log directory set to DIR" line.
std::string logDirOf(const RunResult& r) {
  std::smatch m;
  EXPECT_TRUE(std::regex_search(r.err, m, std::regex("dtrain-run: log directory set to (\\S+)\n"))) << r.describe();
  return m.empty() ? "/nonexistent" : m[1].str();
}

const std::string kOutAndErr = "echo out $RANK; echo err $RANK >&2";

TEST(Launcher, RedirectsWriteTorchrunsLayoutAndNothingToTheConsole) {
  dtrain::test::TempDir dir;
  const std::string base = dir.path() + "/logs/job";  // created, parents too
  auto r = run({"--nproc-per-node", "2", "--standalone", "--log-dir", base, "--redirects", "3", "bash", "-c",
                kOutAndErr});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(r.out, "") << r.describe();
  EXPECT_FALSE(contains(r.err, "[rank")) << r.describe();
  const std::string run_dir = logDirOf(r);
  EXPECT_TRUE(std::regex_match(run_dir, std::regex(base + "/node0_[A-Za-z0-9]{6}"))) << run_dir;
  for (int rank : {0, 1}) {
    const std::string d = run_dir + "/attempt_0/" + std::to_string(rank) + "/";
    EXPECT_EQ(readFile(d + "stdout.log"), "out " + std::to_string(rank) + "\n");
    EXPECT_EQ(readFile(d + "stderr.log"), "err " + std::to_string(rank) + "\n");
  }
  // A second run into the same base directory gets a directory of its own.
  auto again = run({"--nproc-per-node", "1", "--standalone", "--log_dir", base, "-r", "1", "true"});
  ASSERT_EQ(again.exit_code, 0) << again.describe();
  EXPECT_NE(logDirOf(again), run_dir);
}

TEST(Launcher, PerRankRedirectsAndTee) {
  dtrain::test::TempDir dir;
  // Local rank 0: stdout to the file only. Local rank 1: stderr to the file and the console.
  auto r = run({"--nproc-per-node", "2", "--standalone", "--log-dir", dir.path(), "-r", "0:1", "-t", "1:2", "bash",
                "-c", kOutAndErr});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(r.out, "[rank 1]: out 1\n") << r.describe();
  EXPECT_TRUE(contains(r.err, "[rank 0]: err 0\n")) << r.describe();
  EXPECT_TRUE(contains(r.err, "[rank 1]: err 1\n")) << r.describe();
  const std::string a = logDirOf(r) + "/attempt_0/";
  EXPECT_EQ(readFile(a + "0/stdout.log"), "out 0\n");
  EXPECT_EQ(readFile(a + "1/stderr.log"), "err 1\n");  // unprefixed in the file
  EXPECT_FALSE(std::filesystem::exists(a + "0/stderr.log"));
  EXPECT_FALSE(std::filesystem::exists(a + "1/stdout.log"));
}

TEST(Launcher, EachRestartLogsIntoItsOwnAttemptDirectory) {
  dtrain::test::TempDir dir;
  auto r = run({"--nproc-per-node", "1", "--standalone", "--max-restarts", "2", "--tee", "1", "bash", "-c",
                kFailUntilSecondRestart},
               {{"TMPDIR", dir.path()}});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  const std::string run_dir = logDirOf(r);
  // Without --log-dir, a new directory under $TMPDIR, as torchrun does.
  EXPECT_TRUE(std::regex_match(run_dir, std::regex(dir.path() + "/dtrain-run_\\w{6}/node0_\\w{6}"))) << run_dir;
  for (int attempt : {0, 1, 2}) {
    std::string a = std::to_string(attempt);
    EXPECT_EQ(readFile(run_dir + "/attempt_" + a + "/0/stdout.log"), "attempt " + a + " " + a + "\n");
    EXPECT_TRUE(contains(r.out, "[rank 0]: attempt " + a + " " + a + "\n")) << r.describe();
  }
}

TEST(Launcher, ServersFollowASingleRedirectValue) {
  dtrain::test::TempDir dir;
  auto r = run({"--nproc-per-node", "1", "--standalone", "--servers", "1", "--log-dir", dir.path(), "-r", "1",
                "bash", "-c", "echo $DTRAIN_ROLE"});
  ASSERT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_EQ(r.out, "") << r.describe();
  const std::string a = logDirOf(r) + "/attempt_0/";
  EXPECT_EQ(readFile(a + "0/stdout.log"), "worker\n");
  EXPECT_EQ(readFile(a + "server0/stdout.log"), "server\n");
}

TEST(Launcher, LogDirectoryProblemsAreReported) {
  dtrain::test::TempDir dir;
  const std::string file = dir.path() + "/a_file";
  std::ofstream(file) << "x";
  auto r = run({"--nproc-per-node", "1", "--standalone", "--log-dir", file, "-r", "3", "true"});
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_TRUE(contains(r.err, "dtrain-run: error: cannot create the log directory " + file +
                                  ": a file of that name exists")) << r.describe();
  auto unused = run({"--nproc-per-node", "1", "--standalone", "--log-dir", dir.path(), "true"});
  EXPECT_EQ(unused.exit_code, 0) << unused.describe();
  EXPECT_TRUE(contains(unused.err, "--log-dir " + dir.path() + " is unused: nothing is redirected")) << unused.describe();
}

TEST(Launcher, MissingProgramIsAnError) {
  auto r = run({"--nproc-per-node", "2", "--standalone", "/nonexistent/program"});
  EXPECT_EQ(r.exit_code, 1) << r.describe();
  EXPECT_TRUE(contains(r.err, "dtrain-run: error: cannot execute '/nonexistent/program'")) << r.describe();
}

TEST(Launcher, BadUsageExits2WithAMessage) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--nproc-per-node", "2", "--standalone"}, "PROGRAM"},
      {{"--nproc-per-node", "0", "--standalone", "true"}, "--nproc-per-node"},
      {{"--standalone", "true"}, "--nproc-per-node"},
      {{"--nproc-per-node", "1", "--bogus", "true"}, "--bogus"},
      {{"--nproc-per-node", "1", "--standalone", "--nnodes", "2", "true"}, "--standalone"},
      {{"--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2", "true"}, "--node-rank"},
      {{"--nproc-per-node", "1", "--master-port", "70000", "true"}, "--master-port"},
      {{"--nproc-per-node", "1", "--grace-period", "-1", "--standalone", "true"}, "--grace-period"},
      {{"--nproc-per-node", "1", "--standalone", "--redirects", "4", "true"}, "--redirects '4': not a value in 0..3"},
      {{"--nproc-per-node", "2", "--standalone", "--tee", "0:1,x", "true"}, "--tee '0:1,x': 'x' is not LOCAL_RANK:VALUE"},
      {{"--nproc-per-node", "2", "--standalone", "-r", "0:1,0:2", "true"}, "local rank 0 is named twice"},
      {{"--nproc-per-node", "2", "--standalone", "-r", "2:1", "true"},
       "--redirects '2:1' names local rank 2, but --nproc-per-node is 2"},
  };
  for (const auto& c : cases) {
    auto r = run(c.args);
    std::string cmd;
    for (const auto& a : c.args) cmd += " " + a;
    EXPECT_EQ(r.exit_code, 2) << "dtrain-run" << cmd << "\n" << r.describe();
    EXPECT_TRUE(contains(r.err, c.message)) << "dtrain-run" << cmd << "\n" << r.describe();
  }
}

TEST(Launcher, HelpExits0) {
  auto r = run({"--help"});
  EXPECT_EQ(r.exit_code, 0) << r.describe();
  EXPECT_TRUE(contains(r.out, "--nproc-per-node")) << r.describe();
}

}  // namespace
