// Rendezvous: where rank and world size come from (explicit, torchrun, OpenMPI, Slurm, nothing), the
// world of one that opens no socket, and init() in real processes through each kind of store.
#include <dirent.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>

#include "comm/net/socket.h"
#include "comm_test_util.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/rendezvous.h"

namespace dtrain::test {
namespace {

using comm::InitOptions;
using comm::detectWorld;

const char* kVars[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                       "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                       "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                       "SLURM_NTASKS_PER_NODE", "DTRAIN_INIT_METHOD", "DTRAIN_USE_AGENT_STORE",
                       "DTRAIN_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "DTRAIN_TRANSPORT", "DTRAIN_TIMEOUT",
                       "DTRAIN_SEGMENT_BYTES", "DTRAIN_DEBUG", "DTRAIN_IFNAME"};

// Clears the rendezvous variables for the test and restores them afterwards.
class Env : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kVars) {
      if (const char* x = getenv(v)) saved_[v] = x;
      unsetenv(v);
    }
  }
  void TearDown() override {
    for (const char* v : kVars) unsetenv(v);
    for (auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }
  std::map<std::string, std::string> saved_;
};

int openFds() {
  int n = 0;
  DIR* d = opendir("/proc/self/fd");
  while (readdir(d)) ++n;
  closedir(d);
  return n;
}

uint16_t freePort() {
  auto s = comm::net::Socket::listen("127.0.0.1", 0);
  return s.localPort();
}

TEST_F(Env, NothingSetIsAWorldOfOneThatOpensNoSocket) {
  auto w = detectWorld();
  EXPECT_EQ(w.source, "none");
  EXPECT_EQ(w.size, 1);
  int before = openFds();
  auto pg = comm::init();
  EXPECT_EQ(openFds(), before) << "a world of one opened a file descriptor";
  EXPECT_EQ(pg->size(), 1);
  EXPECT_EQ(pg->rank(), 0);
  EXPECT_EQ(pg->transportName(), "local");
  // Every collective works (and copies where it must) in a world of one.
  float in[3] = {1, 2, 3}, out[3] = {0, 0, 0};
  pg->allreduce(in, out, 3, DType::f32, ReduceOp::avg)->wait();
  EXPECT_EQ(out[2], 3.0f);
  pg->allgather(in, out, 3, DType::f32)->wait();
  EXPECT_EQ(out[1], 2.0f);
  pg->barrier()->wait();
  EXPECT_THROW(pg->send(in, 1, DType::f32, 0), InvalidArgument);
}

TEST_F(Env, SourcesInOrder) {
  setenv("SLURM_PROCID", "3", 1);
  setenv("SLURM_NTASKS", "8", 1);
  setenv("SLURM_LOCALID", "1", 1);
  setenv("SLURM_NTASKS_PER_NODE", "4", 1);
  auto w = detectWorld();
  EXPECT_EQ(w.source, "slurm");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.size, 8);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_size, 4);
  setenv("OMPI_COMM_WORLD_RANK", "2", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "6", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "3", 1);
  w = detectWorld();
  EXPECT_EQ(w.source, "openmpi");
  EXPECT_EQ(w.rank, 2);
  EXPECT_EQ(w.size, 6);
  EXPECT_EQ(w.local_size, 3);
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("LOCAL_WORLD_SIZE", "2", 1);
  w = detectWorld();
  EXPECT_EQ(w.source, "torchrun");
  EXPECT_EQ(w.rank, 1);
  EXPECT_EQ(w.size, 2);
  InitOptions o;
  o.rank = 0;
  o.world_size = 5;
  w = detectWorld(o);
  EXPECT_EQ(w.source, "explicit");
  EXPECT_EQ(w.size, 5);
}

TEST_F(Env, MalformedVariablesAreNamed) {
  auto expectError = [](const char* needle) {
    try {
      detectWorld();
      ADD_FAILURE() << "no error for " << needle;
    } catch (const RendezvousError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  setenv("RANK", "abc", 1);
  setenv("WORLD_SIZE", "2", 1);
  expectError("RANK='abc'");
  setenv("RANK", "2", 1);
  expectError("rank 2 is not within a world of 2");
  unsetenv("WORLD_SIZE");
  expectError("RANK and WORLD_SIZE must be set together");
  unsetenv("RANK");
  setenv("OMPI_COMM_WORLD_RANK", "0", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "-4", 1);
  expectError("OMPI_COMM_WORLD_SIZE='-4'");
}

// init() in real processes, with each way of finding the store: torchrun variables with rank 0
// hosting a TcpStore, OpenMPI variables with a FileStore, Slurm variables with a tcp:// init method
// and the store hosted outside (as dtrain-run does).
TEST_F(Env, InitInRealProcesses) {
  struct Case {
    const char* name;
    std::function<void(int rank, int world)> env;
  };
  TempDir dir;
  uint16_t port = freePort();
  StoreServer agent;  // stands in for dtrain-run's store
  std::vector<Case> cases = {
      {"torchrun",
       [&](int r, int w) {
         setenv("RANK", std::to_string(r).c_str(), 1);
         setenv("WORLD_SIZE", std::to_string(w).c_str(), 1);
         setenv("MASTER_ADDR", "127.0.0.1", 1);
         setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
       }},
      {"openmpi+file",
       [&](int r, int w) {
         setenv("OMPI_COMM_WORLD_RANK", std::to_string(r).c_str(), 1);
         setenv("OMPI_COMM_WORLD_SIZE", std::to_string(w).c_str(), 1);
         setenv("DTRAIN_INIT_METHOD", ("file://" + dir.path() + "/store").c_str(), 1);
       }},
      {"slurm+agent",
       [&](int r, int w) {
         setenv("SLURM_PROCID", std::to_string(r).c_str(), 1);
         setenv("SLURM_NTASKS", std::to_string(w).c_str(), 1);
         setenv("DTRAIN_USE_AGENT_STORE", "1", 1);
         setenv("DTRAIN_INIT_METHOD", ("tcp://127.0.0.1:" + std::to_string(agent.port())).c_str(), 1);
         setenv("DTRAIN_RESTART_COUNT", "2", 1);
       }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const int world = 3;
    auto results = runRanks(world, [&](int rank) {
      c.env(rank, world);
      InitOptions o;
      o.group.timeout = std::chrono::seconds(20);
      auto pg = comm::init(o);
      ASSERT_EQ(pg->size(), world);
      ASSERT_EQ(pg->rank(), rank);
      int64_t v = rank + 1;
      pg->allreduce(&v, 1, DType::i64)->wait();
      EXPECT_EQ(v, 6);
    });
    expectAllOk(results);
  }
}

TEST_F(Env, UnreachableStoreIsARendezvousErrorNamingIt) {
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(freePort()).c_str(), 1);
  InitOptions o;
  o.group.timeout = std::chrono::milliseconds(500);
  try {
    comm::init(o);
    ADD_FAILURE() << "init succeeded without a store";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR:MASTER_PORT"), std::string::npos) << e.what();
  }
}

TEST_F(Env, GroupOptionsFromEnvironment) {
  setenv("DTRAIN_TIMEOUT", "2.5", 1);
  setenv("DTRAIN_TRANSPORT", "tcp", 1);
  setenv("DTRAIN_SEGMENT_BYTES", "8192", 1);
  setenv("DTRAIN_DEBUG", "detail", 1);
  auto o = comm::GroupOptions::fromEnv();
  EXPECT_EQ(o.timeout.count(), 2500);
  EXPECT_EQ(o.transport, "tcp");
  EXPECT_EQ(o.segment_bytes, 8192u);
  EXPECT_TRUE(o.check_fingerprints);
  setenv("DTRAIN_TRANSPORT", "carrier-pigeon", 1);
  EXPECT_THROW(comm::GroupOptions::fromEnv(), InvalidArgument);
  setenv("DTRAIN_TRANSPORT", "auto", 1);
  setenv("DTRAIN_TIMEOUT", "soon", 1);
  EXPECT_THROW(comm::GroupOptions::fromEnv(), InvalidArgument);
}

}  // namespace
}  // namespace dtrain::test
