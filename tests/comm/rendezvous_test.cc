// Rendezvous: where rank and world size come from (explicit, torchrun, OpenMPI, Slurm, nothing), the
// world of one that opens no socket, and initWorld() in real processes through each kind of store.
#include <dirent.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <map>

#include "comm/net/socket.h"
#include "comm_test_util.h"
#include "rendezvous_env.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/rendezvous.h"

namespace dtrain::test {
namespace {

using comm::InitOptions;
using comm::detectWorld;

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
  auto pg = comm::initWorld();
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
  setenv("SLURM_NODEID", "1", 1);
  setenv("SLURM_TASKS_PER_NODE", "2,6", 1);
  auto w = detectWorld();
  EXPECT_EQ(w.source, "slurm");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.size, 8);
  EXPECT_EQ(w.local_rank, 1);
  EXPECT_EQ(w.local_size, 6);
  EXPECT_EQ(w.node, 1);
  EXPECT_EQ(w.num_nodes, 2);
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

// initWorld() in real processes, with each way of finding the store: torchrun variables with rank 0
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
         setenv("SLURM_LOCALID", std::to_string(r).c_str(), 1);
         setenv("SLURM_TASKS_PER_NODE", std::to_string(w).c_str(), 1);
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
      o.group = comm::GroupOptions::fromEnv();
      o.group->timeout = std::chrono::seconds(20);
      auto pg = comm::initWorld(o);
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
  o.group = comm::GroupOptions::fromEnv();
  o.group->timeout = std::chrono::milliseconds(500);
  try {
    comm::initWorld(o);
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

// ---- Configuration errors: at once, InvalidArgument naming the variable and its value ----

TEST_F(Env, BadPortsAndAddressesAreRejectedAtOnce) {
  for (const char* port : {"99999", "0", "65536", "-1", "abc", "29500x", " 29500", "1e4"}) {
    setenv("MASTER_PORT", port, 1);
    std::string m = messageOf<InvalidArgument>([] { comm::GroupOptions::fromEnv(); });
    EXPECT_NE(m.find(fmt::format("MASTER_PORT='{}' is not a port number (1-65535)", port)), std::string::npos) << m;
    // The same check comes first in initWorld(), so it and dtrain::init() fail before anything else.
    EXPECT_THROW(comm::initWorld(), InvalidArgument) << port;
  }
  setenv("MASTER_PORT", "65535", 1);
  EXPECT_EQ(comm::storeAddress().port, 65535);
  unsetenv("MASTER_PORT");
  for (const char* addr : {"no-such-host.invalid", "127.0.0.1:29500", "10.0.0.300", "bad host"}) {
    setenv("MASTER_ADDR", addr, 1);
    std::string m = messageOf<InvalidArgument>([] { comm::GroupOptions::fromEnv(); });
    EXPECT_NE(m.find(fmt::format("MASTER_ADDR='{}' is not a usable address", addr)), std::string::npos) << m;
  }
  unsetenv("MASTER_ADDR");
  InitOptions o;
  o.master_port = 70000;
  std::string m = messageOf<InvalidArgument>([&] { comm::storeAddress(o); });
  EXPECT_NE(m.find("InitOptions::master_port='70000' is not a port number"), std::string::npos) << m;
  // With a rank known, the message says whose it is; the tcp:// init method is checked in initWorld()
  // before any socket is opened.
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_PORT", "99999", 1);
  m = messageOf<InvalidArgument>([] { comm::GroupOptions::fromEnv(); });
  EXPECT_EQ(m.rfind("[rank 1] MASTER_PORT='99999' is not a port number (1-65535)", 0), 0u) << m;
  unsetenv("MASTER_PORT");
  setenv("RANK", "0", 1);
  o = InitOptions{};
  o.init_method = "tcp://127.0.0.1:99999";
  m = messageOf<InvalidArgument>([&] { comm::initWorld(o); });
  EXPECT_NE(m.find("the port of init_method 'tcp://127.0.0.1:99999'='99999' is not a port number"), std::string::npos)
      << m;
  o.init_method = "tcp://no-such-host.invalid:29500";
  m = messageOf<InvalidArgument>([&] { comm::initWorld(o); });
  EXPECT_NE(m.find("the host of init_method 'tcp://no-such-host.invalid:29500'='no-such-host.invalid' is not a "
                   "usable address"),
            std::string::npos)
      << m;
}

// Ranks pointed at different MASTER_PORTs: rank 0 names the rank that has not joined its store, after
// how long, and what to check; rank 1 names the store it cannot reach.
TEST_F(Env, RanksOnDifferentPortsAreNamedWithWhatToCheck) {
  uint16_t p0 = freePort(), p1 = freePort();
  while (p1 == p0) p1 = freePort();
  auto results = runRanks(2, [&](int rank) {
    setenv("RANK", std::to_string(rank).c_str(), 1);
    setenv("WORLD_SIZE", "2", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(rank == 0 ? p0 : p1).c_str(), 1);
    InitOptions o;
    o.group = comm::GroupOptions::fromEnv();
    o.group->timeout = std::chrono::seconds(2);
    std::string m = messageOf<RendezvousError>([&] { comm::initWorld(o); });
    if (rank == 0) {
      EXPECT_NE(m.find(fmt::format("[rank 0] rendezvous: rank 1 of 2 has not joined the store at 127.0.0.1:{} "
                                   "(MASTER_ADDR:MASTER_PORT) after 2s. Check that every rank has the same store "
                                   "address (MASTER_ADDR and MASTER_PORT",
                                   p0)),
                std::string::npos)
          << m;
      EXPECT_NE(m.find("that 2 processes were started (the world size comes from torchrun variables)"),
                std::string::npos)
          << m;
      EXPECT_NE(m.find("firewall"), std::string::npos) << m;
    } else {
      EXPECT_NE(m.find(fmt::format("[rank 1] cannot reach the store at 127.0.0.1:{} (MASTER_ADDR:MASTER_PORT)", p1)),
                std::string::npos)
          << m;
      EXPECT_NE(m.find("Check that rank 0 is running with the same store address"), std::string::npos) << m;
    }
  });
  expectAllOk(results);
}

// ---- Ranks that disagree about the world fail at start-up, every one of them, naming it ----

struct Disagreement {
  const char* name;
  int processes;
  std::function<void(int process)> env;  // sets the variables of process i
  const char* message;                   // what every process must say
};

void PrintTo(const Disagreement& d, std::ostream* os) { *os << d.name; }

class Disagree : public Env, public ::testing::WithParamInterface<Disagreement> {};

TEST_P(Disagree, EveryRankFailsAtStartUpNamingIt) {
  const Disagreement& d = GetParam();
  uint16_t port = freePort();
  auto start = std::chrono::steady_clock::now();
  auto results = runRanks(d.processes, [&](int p) {
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    d.env(p);
    InitOptions o;
    o.group = comm::GroupOptions::fromEnv();
    o.group->timeout = std::chrono::seconds(60);  // a disagreement must not wait for the deadline
    std::string m = messageOf<RendezvousError>([&] { comm::initWorld(o); });
    EXPECT_NE(m.find(d.message), std::string::npos) << m;
    EXPECT_EQ(m.rfind("[rank ", 0), 0u) << m;
  });
  expectAllOk(results);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

void torchrun(int rank, int world, int local_rank, int local_size) {
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(local_rank).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(local_size).c_str(), 1);
}

// An srun task of job `job`, step 0, on node `node` of `nodelist` with `counts` tasks per node.
void srunTask(int rank, int ntasks, int local, int node, const char* counts, const char* nodelist, int job = 7) {
  setenv("SLURM_JOB_ID", std::to_string(job).c_str(), 1);
  setenv("SLURM_STEP_ID", "0", 1);
  setenv("SLURM_PROCID", std::to_string(rank).c_str(), 1);
  setenv("SLURM_NTASKS", std::to_string(ntasks).c_str(), 1);
  setenv("SLURM_STEP_NUM_TASKS", std::to_string(ntasks).c_str(), 1);
  setenv("SLURM_LOCALID", std::to_string(local).c_str(), 1);
  setenv("SLURM_NODEID", std::to_string(node).c_str(), 1);
  setenv("SLURM_STEP_TASKS_PER_NODE", counts, 1);
  setenv("SLURM_STEP_NODELIST", nodelist, 1);
}

INSTANTIATE_TEST_SUITE_P(
    Rendezvous, Disagree,
    ::testing::Values(
        Disagreement{"WorldSizeLarger", 2, [](int p) { torchrun(p, p == 0 ? 2 : 3, p, 2); },
                     "ranks disagree about the world size: rank 0 has 2 (torchrun variables), rank 1 has 3"},
        // Rank 0 expects a third rank that never comes: rank 1's view is enough to fail both.
        Disagreement{"WorldSizeSmaller", 2, [](int p) { torchrun(p, p == 0 ? 3 : 2, p, 2); },
                     "ranks disagree about the world size: rank 0 has 3 (torchrun variables), rank 1 has 2"},
        // The Slurm hang of issue 9: one rank believes its node has 2 ranks, the other 1.
        Disagreement{"LocalSize", 2, [](int p) { torchrun(p, 2, 0, p == 0 ? 2 : 1); },
                     "ranks disagree about who is on node 0"},
        Disagreement{"DuplicateLocalRank", 2,
                     [](int p) {
                       torchrun(p, 2, 0, 2);
                       setenv("GROUP_RANK", "0", 1);
                     },
                     "ranks 0 and 1 both have local rank 0 on node 0"},
        Disagreement{"SlurmNodeCount", 2,
                     [](int p) {
                       if (p == 0) srunTask(0, 2, 0, 0, "2", "localhost");
                       else srunTask(1, 2, 0, 1, "1(x2)", "localhost,other");
                     },
                     "ranks disagree about the number of nodes: rank 0 counts 1, rank 1 counts 2"},
        Disagreement{"TwoJobsOneStore", 2, [](int p) { srunTask(p, 2, p, 0, "2", "localhost", 100 + p); },
                     "ranks belong to different jobs: rank 0 to slurm job 100 step 0, rank 1 to slurm job 101 step 0"},
        Disagreement{"TwoProcessesOneRank", 3, [](int p) { torchrun(p == 2 ? 1 : p, 3, p == 2 ? 1 : p, 3); },
                     "another process already joined as rank 1"}),
    [](const ::testing::TestParamInfo<Disagreement>& i) { return std::string(i.param.name); });

// The store's address and the nodes from Slurm's variables alone: 4 tasks on 2 "nodes" of this host
// laid out cyclically (ranks 0, 2, 3 on node 0; rank 1 on node 1), as --distribution=cyclic would.
TEST_F(Env, SlurmNodesAndStoreAddressWithoutMasterVariables) {
  // A job id whose derived port is free here.
  int job = 4000 + static_cast<int>(getpid() % 1000);
  while (true) {
    try {
      comm::net::Socket::listen("0.0.0.0", static_cast<uint16_t>(comm::slurmStorePort(job, 3)));
      break;
    } catch (const Error&) {
      ++job;
    }
  }
  const int node_of[] = {0, 1, 0, 0}, local_of[] = {0, 0, 1, 2};
  auto results = runRanks(4, [&](int rank) {
    srunTask(rank, 4, local_of[rank], node_of[rank], "3,1", "localhost,localhost", job);
    setenv("SLURM_STEP_ID", "3", 1);
    auto addr = comm::storeAddress();
    EXPECT_EQ(addr.host, "localhost");
    EXPECT_EQ(addr.port, comm::slurmStorePort(job, 3));
    EXPECT_TRUE(addr.derived);
    EXPECT_NE(addr.origin.find("the first node of SLURM_STEP_NODELIST"), std::string::npos) << addr.origin;
    InitOptions o;
    o.group = comm::GroupOptions::fromEnv();
    o.group->timeout = std::chrono::seconds(30);
    comm::WorldInfo info;
    auto world = comm::initWorld(o, &info);
    ASSERT_EQ(info.nodes, (std::vector<std::vector<int>>{{0, 2, 3}, {1}}));
    auto local = comm::newNodeGroup(world, info);
    ASSERT_EQ(local->size(), info.local_size);
    EXPECT_EQ(local->rank(), info.local_rank);
    int64_t v = rank;
    local->allreduce(&v, 1, DType::i64)->wait();
    EXPECT_EQ(v, node_of[rank] == 0 ? 0 + 2 + 3 : 1);
    world->barrier()->wait();
  });
  expectAllOk(results);
}

}  // namespace
}  // namespace dtrain::test
