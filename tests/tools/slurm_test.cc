// Under a real one-host Slurm (scripts/slurm.sh: Debian's munged, slurmctld and slurmd, as root),
// srun and sbatch start dtrain programs that find their rank, their node's ranks and the store from
// Slurm's variables alone: no --ntasks-per-node, no MASTER_ADDR/MASTER_PORT, two jobs at once.
//
// These tests need root and the packages munge, slurmctld, slurmd and slurm-client (scripts/setup.sh
// installs them; CI runs as root): without them they fail, saying so, rather than skip.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <string>

#include "harness.h"

namespace {

using dtrain::test::runCommand;

double lastAccuracy(const std::string& out) {
  std::regex re("accuracy ([0-9.]+)");
  double acc = -1;
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) acc = std::stod((*it)[1]);
  return acc;
}

std::string readFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Each test starts its own Slurm (own config, ports and job ids) in a temporary directory and stops it
// afterwards, whatever happened.
class Slurm : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(geteuid(), 0u) << "the Slurm tests need root (slurmd starts the tasks): run them as root, as CI does "
                                "after scripts/setup.sh";
    auto [rc, out] = runCommand("bash " DTRAIN_SOURCE_DIR "/scripts/slurm.sh start " + slurmDir(), 120);
    ASSERT_EQ(rc, 0) << "could not start a one-host Slurm with scripts/slurm.sh (packages munge slurmctld slurmd "
                        "slurm-client from scripts/setup.sh, and root, are needed):\n"
                     << out;
    started_ = true;
  }
  void TearDown() override {
    if (!started_) return;
    auto [rc, out] = runCommand("bash " DTRAIN_SOURCE_DIR "/scripts/slurm.sh stop " + slurmDir(), 60);
    EXPECT_EQ(rc, 0) << out;
  }
  std::string slurmDir() const { return dir_.path() + "/slurm"; }
  // Runs a shell command in the test's directory against this Slurm, with every command bounded.
  std::pair<int, std::string> run(const std::string& cmd, int timeout_seconds = 120) {
    return runCommand(
        shellQuoted("cd " + dir_.path() + " || exit 97\nexport SLURM_CONF=" + slurmDir() + "/slurm.conf\n" + cmd),
        timeout_seconds);
  }
  // bash -c 'cmd', for runCommand's `timeout N command`.
  static std::string shellQuoted(const std::string& cmd) {
    std::string q = "bash -c '";
    for (char c : cmd) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  }

  dtrain::test::TempDir dir_;
  bool started_ = false;
};

TEST_F(Slurm, SrunAllreduceOnThreeTasks) {
  auto [rc, out] = run("srun -n 3 " DTRAIN_BIN_DIR "/example-allreduce");
  ASSERT_EQ(rc, 0) << out;
  for (int r = 0; r < 3; ++r)
    EXPECT_NE(out.find("rank " + std::to_string(r) + " of 3 (shm): sum = 3 (expected 3)"), std::string::npos) << out;
}

// The case that hung: DDP's node-local group needs every rank to agree on the node's size, which
// SLURM_NTASKS_PER_NODE (unset here) used to decide.
TEST_F(Slurm, SrunDdpOnTwoTasksWithoutNtasksPerNode) {
  auto [rc, out] = run("env | grep -q SLURM_NTASKS_PER_NODE && exit 3; srun -n 2 " DTRAIN_BIN_DIR "/example-ddp");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("epoch 4"), std::string::npos) << out;
  EXPECT_NE(out.find("(2 ranks)"), std::string::npos) << out;
  EXPECT_GT(lastAccuracy(out), 0.9) << out;
}

// Two jobs on one node at once: each derives its own store port from its job id. Their tasks wait
// (bounded) until both jobs run before starting, so their rendezvous overlap.
TEST_F(Slurm, TwoDdpJobsAtOnce) {
  const std::string job =
      "srun -n 2 bash -c 'touch started.$SLURM_JOB_ID; for i in $(seq 300); do "
      "[ $(ls started.* | wc -l) -ge 2 ] && break; sleep 0.1; done; exec " DTRAIN_BIN_DIR "/example-ddp'";
  auto [rc, out] = run("(" + job + " > job1.log 2>&1; echo $? > job1.rc) & (" + job +
                       " > job2.log 2>&1; echo $? > job2.rc) & wait");
  ASSERT_EQ(rc, 0) << out;
  for (const char* j : {"job1", "job2"}) {
    std::string log = readFile(dir_.path() + "/" + j + ".log");
    EXPECT_EQ(readFile(dir_.path() + "/" + j + ".rc"), "0\n") << j << ":\n" << log;
    EXPECT_NE(log.find("(2 ranks)"), std::string::npos) << j << ":\n" << log;
    EXPECT_GT(lastAccuracy(log), 0.9) << j << ":\n" << log;
  }
  auto [lrc, started] = run("ls started.* | wc -l");
  EXPECT_EQ(started, "2\n");
}

// examples/slurm/milnce_train.sbatch, submitted as a user would, on tiny generated data.
TEST_F(Slurm, SbatchMilnceTrain) {
  auto [grc, gen] = run(DTRAIN_BIN_DIR "/milnce gen-data --out data --videos 200 --eval-videos 20 --seed 5");
  ASSERT_EQ(grc, 0) << gen;
  auto [rc, out] = run("DTRAIN_BIN=" DTRAIN_BIN_DIR " DATA_DIR=data RUN_DIR=run sbatch --wait -n 2 -o job.log " DTRAIN_SOURCE_DIR
                       "/examples/slurm/milnce_train.sbatch --epochs 2 --batch 16 --no-progress",
                       240);
  std::string log = readFile(dir_.path() + "/job.log");
  ASSERT_EQ(rc, 0) << out << "\njob.log:\n" << log;
  EXPECT_NE(log.find("before training"), std::string::npos) << log;
  EXPECT_NE(log.find("after training (2 epochs)"), std::string::npos) << log;
  // Rank 0's metrics (docs/OBSERVABILITY.md): 200 videos over 2 ranks in batches of 16 are 6 steps an
  // epoch; evaluations before training and after each of the 2 epochs.
  std::ifstream metrics(dir_.path() + "/run/metrics.jsonl");
  int steps = 0, evals = 0;
  for (std::string l; std::getline(metrics, l);) {
    steps += l.find("{\"kind\":\"step\"") == 0;
    evals += l.find("{\"kind\":\"eval\"") == 0;
  }
  EXPECT_EQ(steps, 12) << log;
  EXPECT_EQ(evals, 3) << log;
}

// A task whose variables are forged to describe another world (two nodes instead of one): both ranks
// fail at once, naming the disagreement, instead of hanging.
TEST_F(Slurm, TasksThatDisagreeFailAtStartUpNamingIt) {
  auto [rc, out] = run(
      "DTRAIN_TIMEOUT=100 timeout 60 srun -n 2 bash -c 'if [ $SLURM_PROCID = 1 ]; then "
      "export SLURM_STEP_TASKS_PER_NODE=\"1(x2)\" SLURM_STEP_NODELIST=\"$SLURM_STEP_NODELIST,ghost\" "
      "SLURMD_NODENAME=ghost SLURM_LOCALID=0; fi; exec " DTRAIN_BIN_DIR "/example-allreduce'");
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(rc, 124) << "timed out instead of failing at start-up:\n" << out;
  // Whichever rank finds it first, each says it (the other as "rank r found: ...").
  const std::string what = "ranks disagree about the number of nodes: rank 0 counts 1, rank 1 counts 2";
  for (int r = 0; r < 2; ++r) {
    std::regex line("(^|\n)\\[rank " + std::to_string(r) + "\\] (rank [01] found: )?" + what);
    EXPECT_TRUE(std::regex_search(out, line)) << "rank " << r << ":\n" << out;
  }
}

}  // namespace
