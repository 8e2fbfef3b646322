// scripts/cluster.sh, the emulated cluster: a short run on 2 hosts x 2 processes at 1 Gbit/s, the
// hierarchical collectives' equality checks on 3 hosts x 2 processes, the PyTorch peer under torchrun, a killed
// host making the other host's ranks fail promptly, cut/restore/add-host, and no namespace left behind,
// also when the one shot is stopped by SIGTERM. Needs root (ip netns, tc), as CI has; without it the
// tests fail with the script's reason rather than skipping.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>

namespace {

const std::string kScript = DTRAIN_SOURCE_DIR "/scripts/cluster.sh";
const std::string kBin = DTRAIN_BIN_DIR;

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct Result {
  int code = -1;
  std::string out;
};

// Runs `bash cluster.sh ARGS` with a hard limit (timeout sends TERM, which the script's trap handles).
Result cluster(const std::string& args, int limit_s = 60) {
  std::string log = ::testing::TempDir() + "/cluster-" + std::to_string(getpid()) + ".out";
  std::string cmd = "timeout -k 5 " + std::to_string(limit_s) + " bash " + kScript + " " + args + " >" + log + " 2>&1";
  int st = std::system(cmd.c_str());
  Result r;
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.out = slurp(log);
  return r;
}

std::string capture(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  pclose(p);
  return out;
}

// Nothing of rig NAME is left: no namespace (the bridge and every veth live in them) and no state.
void expectGone(const std::string& name) {
  std::string ns = capture("ip netns list 2>&1");
  EXPECT_EQ(ns.find("dtc-" + name + "-"), std::string::npos) << "namespaces left behind:\n" << ns;
  std::string links = capture("ip -o link 2>&1");
  EXPECT_EQ(links.find("dtc-" + name), std::string::npos) << links;
  EXPECT_NE(access(("/tmp/dtrain-cluster/" + name).c_str(), F_OK), 0) << "state directory left behind";
}

std::string rigName(const std::string& out) {
  std::smatch m;
  return std::regex_search(out, m, std::regex("rig '([A-Za-z0-9_]+)' up")) ? m[1].str() : std::string();
}

TEST(Cluster, TwoHostsTwoProcessesRunTheBenchmarkAndCleanUp) {
  // (--shaped-rate-check: the start-up stream must get through and be capped by the link; 90% of the link's
  // rate, the default, is a timed bound that a busy machine missed: 0.87 Gbit/s of 1 seen)
  auto r = cluster("--hosts 2 --nproc-per-host 2 --gbit 1 --shaped-rate-check --bin-dir " + kBin + " --timeout 45 -- " + kBin +
                   "/dtrain-bench allreduce --min-bytes 64K --max-bytes 1M --iters 5 --progress off");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("rate check: one TCP stream host 1 -> host 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[host 0] [rank 0]: # dtrain-bench allreduce: world=4 transport=tcp"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("host 0 exited with 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("host 1 exited with 0"), std::string::npos) << r.out;
  std::string name = rigName(r.out);
  ASSERT_FALSE(name.empty()) << r.out;
  expectGone(name);
}

// The hierarchical collectives on real (emulated) hosts: 3 hosts x 2 processes, whose sub-groups give
// the layouts 3x2, 2x2, 2x1, 3x1 and 2+1 (hierarchical_rig_worker.cc). Every rank must pass all 30
// checks (6 checks x 5 layouts, a rank outside a layout passing it trivially).
TEST(Cluster, HierarchicalEqualsFlatOnEveryLayout) {
  auto r = cluster("--hosts 3 --nproc-per-host 2 --gbit 1 --no-rate-check --bin-dir " + kBin +
                       " --env DTRAIN_TIMEOUT=60 --timeout 150 -- " + kBin + "/hierarchical_rig_worker",
                   200);
  EXPECT_EQ(r.code, 0) << r.out;
  size_t passed = 0;
  for (size_t at = 0; (at = r.out.find("[  PASSED  ] 30 tests.", at)) != std::string::npos; ++at) ++passed;
  EXPECT_EQ(passed, 6u) << r.out;
  for (int h = 0; h < 3; ++h)
    EXPECT_NE(r.out.find("host " + std::to_string(h) + " exited with 0"), std::string::npos) << r.out;
  expectGone(rigName(r.out));
}

// The PyTorch peer runs on the rig the same way (one torchrun per host), for side-by-side comparisons.
TEST(Cluster, TorchrunRunsThePyTorchPeer) {
  auto r = cluster("--hosts 2 --gbit 1 --no-rate-check --launcher torchrun --timeout 150 -- " +
                       std::string(DTRAIN_SOURCE_DIR) + "/benches/peers/torch_ddp.py env 2 8 --hook fp16 --warmup 1",
                   200);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("torch-ddp world=2 params=7912458 batch_per_rank=8"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("hook=fp16 bytes_per_step=15824916"), std::string::npos) << r.out;
  expectGone(rigName(r.out));
}

TEST(Cluster, AFailingHostGivesTheWorstExitCode) {
  // One process per host: host 1 runs RANK 1, whose program exits 3; host 0 exits 0: the rig exits 3.
  auto r = cluster("--hosts 2 --gbit 1 --no-rate-check --bin-dir " + kBin +
                   " --timeout 30 -- /bin/sh -c 'echo rank $RANK; [ $RANK -eq 0 ] || exit 3'");
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("host 1 exited with 3"), std::string::npos) << r.out;
  expectGone(rigName(r.out));
}

TEST(Cluster, KillHostMakesTheOtherHostFailPromptlyNamingThePeer) {
  std::string name = "k" + std::to_string(getpid());
  auto up = cluster("up --name " + name + " --owner " + std::to_string(getpid()) +
                    " --hosts 2 --nproc-per-host 2 --gbit 1 --no-rate-check --bin-dir " + kBin);
  ASSERT_EQ(up.code, 0) << up.out;
  std::string bench = " --bg --env DTRAIN_TIMEOUT=10 -- " + kBin +
                      "/dtrain-bench allreduce --min-bytes 1M --max-bytes 1M --iters 1000000 --progress off";
  ASSERT_EQ(cluster("run-host " + name + " 0" + bench).code, 0);
  ASSERT_EQ(cluster("run-host " + name + " 1" + bench).code, 0);
  std::string log0 = "/tmp/dtrain-cluster/" + name + "/host-0.log";
  auto joinBy = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (slurp(log0).find("# dtrain-bench allreduce: world=4") == std::string::npos &&
         std::chrono::steady_clock::now() < joinBy)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (slurp(log0).find("world=4") == std::string::npos) {
    std::string logs = slurp(log0) + slurp("/tmp/dtrain-cluster/" + name + "/host-1.log");
    cluster("down " + name);
    FAIL() << "the four ranks never formed a group:\n" << logs;
  }
  ASSERT_EQ(cluster("kill-host " + name + " 1").code, 0);
  auto t0 = std::chrono::steady_clock::now();
  auto w = cluster("wait-host " + name + " 0 --timeout 40", 50);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(w.code, 0) << w.out;
  EXPECT_LT(secs, 2 * 10 + 5) << w.out;  // within twice DTRAIN_TIMEOUT plus the launcher's grace period
  bool named = w.out.find("rank 2 (10.212.0.2") != std::string::npos || w.out.find("rank 3 (10.212.0.2") != std::string::npos;
  EXPECT_TRUE(named) << w.out;
  EXPECT_EQ(cluster("down " + name).code, 0);
  expectGone(name);
}

TEST(Cluster, CutRestoreAndAddHost) {
  std::string name = "c" + std::to_string(getpid());
  auto up = cluster("up --name " + name + " --owner " + std::to_string(getpid()) +
                    " --hosts 2 --gbit 1 --no-rate-check --bin-dir " + kBin);
  ASSERT_EQ(up.code, 0) << up.out;
  auto cut = cluster("cut " + name + " 1");
  EXPECT_EQ(cut.code, 0) << cut.out;
  auto during = cluster("check-rate " + name + " 0 1", 30);  // no stream gets through a cut link
  EXPECT_NE(during.code, 0) << during.out;
  EXPECT_NE(during.out.find("rate check: the TCP stream from host 0 to host 1 failed"), std::string::npos) << during.out;
  EXPECT_EQ(cluster("restore " + name + " 1").code, 0);
  // After the cut: the stream gets through, capped by the link (not a timed bound: a loaded machine may
  // carry less than the link's rate, which made this check fail under ctest -j2 when it asked for 90%).
  auto after = cluster("check-rate " + name + " 0 1 --shaped", 30);
  EXPECT_EQ(after.code, 0) << after.out;
  auto add = cluster("add-host " + name);
  EXPECT_EQ(add.code, 0) << add.out;
  EXPECT_EQ(add.out, "2\n");
  auto added = cluster("check-rate " + name + " 2 0 --shaped", 30);  // the new host's link is shaped like the others
  EXPECT_EQ(added.code, 0) << added.out;
  EXPECT_EQ(cluster("addr " + name + " 2").out, "10.212.0.3\n");
  EXPECT_EQ(cluster("down " + name).code, 0);
  expectGone(name);
}

TEST(Cluster, TheOneShotCleansUpWhenTerminated) {
  std::string log = ::testing::TempDir() + "/cluster-term-" + std::to_string(getpid()) + ".out";
  pid_t pid = fork();
  if (pid == 0) {
    std::string out = "--hosts 2 --gbit 1 --no-rate-check --bin-dir " + kBin + " -- /bin/sleep 1000";
    execl("/bin/bash", "bash", "-c", ("exec bash " + kScript + " " + out + " >" + log + " 2>&1").c_str(), nullptr);
    _exit(127);
  }
  auto by = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (rigName(slurp(log)).empty() && std::chrono::steady_clock::now() < by)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the sleeps have started
  std::string name = rigName(slurp(log));
  kill(pid, SIGTERM);
  int st = 0;
  auto end = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  while (waitpid(pid, &st, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() > end) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      ADD_FAILURE() << "cluster.sh did not stop within 15 s of SIGTERM:\n" << slurp(log);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_FALSE(name.empty()) << slurp(log);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 143) << slurp(log);
  expectGone(name);
}

}  // namespace
