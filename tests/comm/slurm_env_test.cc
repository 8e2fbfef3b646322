// Slurm's variables: the compressed node lists and task counts (every form srun and sbatch write, and
// malformed ones), the world of an srun task (local size and node from the step's lists, not from
// SLURM_NTASKS_PER_NODE), the store's address and port, and the comparison of the ranks' views.
#include <gtest/gtest.h>

#include <set>

#include "comm/rendezvous/internal.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/rendezvous.h"
#include "rendezvous_env.h"

namespace dtrain::test {
namespace {

using comm::detectWorld;
using comm::expandSlurmNodeList;
using comm::expandSlurmTasksPerNode;
using Hosts = std::vector<std::string>;

TEST(SlurmNodeList, ExpandsEveryForm) {
  struct Case {
    const char* list;
    Hosts hosts;
  };
  const Case cases[] = {
      {"vm", {"vm"}},
      {"node[01-04,07]", {"node01", "node02", "node03", "node04", "node07"}},
      {"a,b[1-2],c-3", {"a", "b1", "b2", "c-3"}},
      {"node[8-10]", {"node8", "node9", "node10"}},             // no padding: widths grow
      {"node[008-010]", {"node008", "node009", "node010"}},     // padding kept across the carry
      {"gpu[5]", {"gpu5"}},
      {"rack[1-2]-n[1-2]", {"rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"}},
      {"n[1-2]-ib,login", {"n1-ib", "n2-ib", "login"}},
      {"x[0-1,3],y[09-11]", {"x0", "x1", "x3", "y09", "y10", "y11"}},
      {"host-1.example.com,10.0.0.5", {"host-1.example.com", "10.0.0.5"}},
      {"[1-2]x", {"1x", "2x"}},
      {"c[7,3]", {"c7", "c3"}},  // Slurm keeps the order it was given
  };
  for (const auto& c : cases) EXPECT_EQ(expandSlurmNodeList(c.list), c.hosts) << c.list;
  EXPECT_EQ(expandSlurmNodeList("n[0000-1023]").size(), 1024u);
  EXPECT_EQ(expandSlurmNodeList("n[0000-1023]").back(), "n1023");
}

TEST(SlurmNodeList, MalformedListsAreInvalidArgumentsQuotingTheText) {
  struct Case {
    const char* list;
    const char* why;
  };
  const Case cases[] = {
      {"", "empty node list"},
      {"node[1-3", "'[' without ']'"},
      {"node1-3]", "']' without '['"},
      {"node[]", "empty brackets '[]'"},
      {"node[1-]", "range bound '' is not a number"},
      {"node[-3]", "range bound '' is not a number"},
      {"node[3-1]", "descending range '3-1'"},
      {"node[a-c]", "range bound 'a' is not a number"},
      {"node[1-2-3]", "range bound '2-3' is not a number"},
      {"node[1,]", "empty range in '[1,]'"},
      {"a,,b", "empty host name"},
      {"a,", "empty host name"},
      {",a", "empty host name"},
      {"node[1-2[3]]", "nested '['"},
      {"node [1-2]", "unexpected character at offset 4"},
      {"node[1-99999999]", "more than 1048576 hosts"},
      {"node[1234567890]", "range bound '1234567890' is too large"},
  };
  for (const auto& c : cases) {
    std::string m = messageOf<InvalidArgument>([&] { expandSlurmNodeList(c.list, "SLURM_STEP_NODELIST"); });
    EXPECT_NE(m.find(fmt::format("SLURM_STEP_NODELIST='{}': ", c.list)), std::string::npos) << m;
    EXPECT_NE(m.find(c.why), std::string::npos) << c.list << ": " << m;
  }
}

TEST(SlurmTasksPerNode, ExpandsEveryForm) {
  struct Case {
    const char* counts;
    std::vector<int> tasks;
  };
  const Case cases[] = {
      {"2", {2}},
      {"2(x3),1", {2, 2, 2, 1}},
      {"1,2,3", {1, 2, 3}},
      {"4(x1)", {4}},
      {"16(x2),8(x2)", {16, 16, 8, 8}},
      {"1(x5)", {1, 1, 1, 1, 1}},
      {"3,3(x2)", {3, 3, 3}},
      {"10", {10}},
      {"1,1", {1, 1}},
      {"7(x1),2", {7, 2}},
      {"128", {128}},
  };
  for (const auto& c : cases) EXPECT_EQ(expandSlurmTasksPerNode(c.counts), c.tasks) << c.counts;
  EXPECT_EQ(expandSlurmTasksPerNode("1(x4096)").size(), 4096u);
}

TEST(SlurmTasksPerNode, MalformedCountsAreInvalidArgumentsQuotingTheText) {
  struct Case {
    const char* counts;
    const char* why;
  };
  const Case cases[] = {
      {"", "empty task counts"},
      {"2(x)", "'2(x)' is not COUNT or COUNT(xREPEATS)"},
      {"(x2)", "task count '' is not a number"},
      {"2(x3", "'2(x3' is not COUNT or COUNT(xREPEATS)"},
      {"2x3", "task count '2x3' is not a number"},
      {"0", "a node with 0 tasks"},
      {"-1", "task count '-1' is not a number"},
      {"2,,1", "empty item"},
      {"2,", "empty item"},
      {"a", "task count 'a' is not a number"},
      {"2(x0)", "'2(x0)' repeats 0 times"},
      {"2(y3)", "'2(y3)' is not COUNT or COUNT(xREPEATS)"},
      {" 2", "task count ' 2' is not a number"},
      {"2(x3)1", "'2(x3)1' is not COUNT or COUNT(xREPEATS)"},
      {"1(x99999999)", "more than 1048576 nodes or tasks"},
  };
  for (const auto& c : cases) {
    std::string m = messageOf<InvalidArgument>([&] { expandSlurmTasksPerNode(c.counts, "SLURM_TASKS_PER_NODE"); });
    EXPECT_NE(m.find(fmt::format("SLURM_TASKS_PER_NODE='{}': ", c.counts)), std::string::npos) << m;
    EXPECT_NE(m.find(c.why), std::string::npos) << c.counts << ": " << m;
  }
}

TEST(SlurmStorePort, DeterministicHighAndDistinctAcrossJobsAndSteps) {
  std::set<int> ports;
  for (uint64_t job = 1000; job < 1000 + 768; ++job) {
    for (uint64_t step = 0; step < 16; ++step) {
      int p = comm::slurmStorePort(job, step);
      EXPECT_GE(p, 20000);
      EXPECT_LT(p, 32768);  // below the kernel's ephemeral ports
      EXPECT_EQ(p, comm::slurmStorePort(job, step));
      ports.insert(p);
    }
  }
  EXPECT_EQ(ports.size(), 768u * 16u);
}

// The rendezvous variables cleared for each test (rendezvous_env.h).
class SlurmEnv : public Env {};

// An srun task: the step's variables as srun 22.05 sets them.
void srunTask(int rank, int ntasks, int local, const char* counts, const char* nodelist, const char* nodename) {
  setenv("SLURM_JOB_ID", "42", 1);
  setenv("SLURM_STEP_ID", "1", 1);
  setenv("SLURM_PROCID", std::to_string(rank).c_str(), 1);
  setenv("SLURM_NTASKS", std::to_string(ntasks).c_str(), 1);
  setenv("SLURM_STEP_NUM_TASKS", std::to_string(ntasks).c_str(), 1);
  setenv("SLURM_LOCALID", std::to_string(local).c_str(), 1);
  setenv("SLURM_STEP_TASKS_PER_NODE", counts, 1);
  setenv("SLURM_STEP_NODELIST", nodelist, 1);
  setenv("SLURMD_NODENAME", nodename, 1);
}

TEST_F(SlurmEnv, SrunTaskWithoutNtasksPerNodeKnowsItsNode) {
  // `srun -n 2` on one node (the case that hung): no SLURM_NTASKS_PER_NODE, both ranks see a node of 2.
  for (int r = 0; r < 2; ++r) {
    srunTask(r, 2, r, "2", "vm", "vm");
    setenv("SLURM_NODEID", "0", 1);
    auto w = detectWorld();
    EXPECT_EQ(w.source, "slurm");
    EXPECT_EQ(w.rank, r);
    EXPECT_EQ(w.size, 2);
    EXPECT_EQ(w.local_rank, r);
    EXPECT_EQ(w.local_size, 2);
    EXPECT_EQ(w.node, 0);
    EXPECT_EQ(w.num_nodes, 1);
    EXPECT_EQ(w.job, "slurm job 42 step 1");
  }
  // 7 tasks as 2(x3),1 over node[01-04]: the last task is alone on node04.
  srunTask(6, 7, 0, "2(x3),1", "node[01-04]", "node04");
  auto w = detectWorld();
  EXPECT_EQ(w.local_size, 1);
  EXPECT_EQ(w.node, 3);
  EXPECT_EQ(w.num_nodes, 4);
  // The node's place in the step's list wins over a job-relative SLURM_NODEID (a step on part of a job).
  srunTask(2, 4, 0, "2(x2)", "a[3-4]", "a4");
  setenv("SLURM_NODEID", "3", 1);
  setenv("SLURM_NTASKS_PER_NODE", "1", 1);  // the job's, ignored
  w = detectWorld();
  EXPECT_EQ(w.node, 1);
  EXPECT_EQ(w.local_size, 2);
}

TEST_F(SlurmEnv, InconsistentSlurmVariablesAreNamed) {
  srunTask(0, 4, 0, "2(x3)", "n[1-3]", "n1");
  std::string m = messageOf<RendezvousError>([] { detectWorld(); });
  EXPECT_NE(m.find("SLURM_STEP_TASKS_PER_NODE='2(x3)' adds up to 6 tasks but SLURM_STEP_NUM_TASKS=4"),
            std::string::npos)
      << m;
  srunTask(0, 4, 0, "2(x2)", "n[1-3]", "n1");
  m = messageOf<RendezvousError>([] { detectWorld(); });
  EXPECT_NE(m.find("SLURM_STEP_NODELIST='n[1-3]' names 3 nodes but SLURM_STEP_TASKS_PER_NODE='2(x2)' gives counts "
                   "for 2"),
            std::string::npos)
      << m;
  srunTask(0, 4, 0, "2(x2", "n[1-2]", "n1");
  m = messageOf<InvalidArgument>([] { detectWorld(); });
  EXPECT_NE(m.find("SLURM_STEP_TASKS_PER_NODE='2(x2'"), std::string::npos) << m;
  srunTask(0, 4, 0, "2(x2)", "n[1-2", "n1");
  m = messageOf<InvalidArgument>([] { detectWorld(); });
  EXPECT_NE(m.find("SLURM_STEP_NODELIST='n[1-2'"), std::string::npos) << m;
  srunTask(3, 4, 2, "2(x2)", "n[1-2]", "n2");
  m = messageOf<RendezvousError>([] { detectWorld(); });
  EXPECT_NE(m.find("local rank 2 is not within a local world of 2"), std::string::npos) << m;
}

TEST_F(SlurmEnv, ABatchScriptIsNotRankZero) {
  // sbatch -n 3 runs the script once with SLURM_PROCID=0 and SLURM_NTASKS=3 but no step: a program
  // started there directly would wait for two ranks that never come.
  setenv("SLURM_JOB_ID", "9", 1);
  setenv("SLURM_PROCID", "0", 1);
  setenv("SLURM_NTASKS", "3", 1);
  setenv("SLURM_TASKS_PER_NODE", "3", 1);
  setenv("SLURM_JOB_NODELIST", "vm", 1);
  std::string m = messageOf<RendezvousError>([] { detectWorld(); });
  EXPECT_NE(m.find("belong to the batch script of Slurm job 9, not to a task that srun started: start the program "
                   "with srun"),
            std::string::npos)
      << m;
  setenv("SLURM_NTASKS", "1", 1);  // sbatch -n 1: a world of one, as before
  EXPECT_EQ(detectWorld().size, 1);
}

TEST_F(SlurmEnv, StoreAddressFromSlurmOrMasterVariables) {
  srunTask(1, 2, 1, "2", "localhost,n[2-3]", "localhost");
  auto a = comm::storeAddress();
  EXPECT_EQ(a.host, "localhost");
  EXPECT_EQ(a.port, comm::slurmStorePort(42, 1));
  EXPECT_TRUE(a.derived);
  EXPECT_EQ(a.origin, "the first node of SLURM_STEP_NODELIST and a port from SLURM_JOB_ID=42 and SLURM_STEP_ID=1");
  // Without node lists: the launch node's address.
  unsetenv("SLURM_STEP_NODELIST");
  setenv("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1", 1);
  EXPECT_EQ(comm::storeAddress().host, "127.0.0.1");
  // MASTER_PORT alone keeps Slurm's host; MASTER_ADDR and MASTER_PORT together win.
  setenv("SLURM_STEP_NODELIST", "localhost", 1);
  setenv("MASTER_PORT", "31000", 1);
  a = comm::storeAddress();
  EXPECT_EQ(a.host, "localhost");
  EXPECT_EQ(a.port, 31000);
  EXPECT_EQ(a.origin, "the first node of SLURM_STEP_NODELIST and MASTER_PORT");
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  a = comm::storeAddress();
  EXPECT_EQ(a.host, "127.0.0.1");
  EXPECT_FALSE(a.derived);
  EXPECT_EQ(a.origin, "MASTER_ADDR:MASTER_PORT");
  unsetenv("MASTER_ADDR");
  unsetenv("MASTER_PORT");
  // A first node that does not resolve, and a step id that is not a number.
  setenv("SLURM_STEP_NODELIST", "no-such-node-h1.invalid,localhost", 1);
  std::string m = messageOf<InvalidArgument>([] { comm::storeAddress(); });
  EXPECT_NE(m.find("the first node of SLURM_STEP_NODELIST='no-such-node-h1.invalid' is not a usable address"),
            std::string::npos)
      << m;
  setenv("SLURM_STEP_NODELIST", "localhost", 1);
  setenv("SLURM_STEP_ID", "batch", 1);
  m = messageOf<InvalidArgument>([] { comm::storeAddress(); });
  EXPECT_NE(m.find("SLURM_STEP_ID='batch' is not a Slurm id"), std::string::npos) << m;
  // Nothing set: the default, named as such.
  for (const char* v : {"SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LAUNCH_NODE_IPADDR"}) unsetenv(v);
  a = comm::storeAddress();
  EXPECT_EQ(a.host, "127.0.0.1");
  EXPECT_EQ(a.port, 29500);
}

TEST_F(SlurmEnv, PeerNodeForTheTransportAddress) {
  srunTask(5, 6, 1, "2(x3)", "n[1-3]", "n3");
  EXPECT_EQ(comm::rendezvous::slurmPeerNode(comm::rendezvous::Environment::read()), "n1");  // the next node, wrapping around
  setenv("SLURMD_NODENAME", "n1", 1);
  EXPECT_EQ(comm::rendezvous::slurmPeerNode(comm::rendezvous::Environment::read()), "n2");
  srunTask(1, 2, 1, "2", "n1", "n1");
  EXPECT_EQ(comm::rendezvous::slurmPeerNode(comm::rendezvous::Environment::read()), std::nullopt);  // one node: no peer
}

// The comparison of the views, without processes: each kind of disagreement, and agreement.
comm::rendezvous::View view(int rank, int size, int local, int local_size, int node, const char* host) {
  comm::rendezvous::View v;
  v.world.rank = rank;
  v.world.size = size;
  v.world.local_rank = local;
  v.world.local_size = local_size;
  v.world.node = node;
  v.world.num_nodes = 2;
  v.world.source = "slurm";
  v.world.job = "slurm job 1 step 0";
  v.host_id = v.hostname = host;
  return v;
}

TEST(WorldViews, EveryDisagreementIsNamed) {
  using comm::rendezvous::findDisagreement;
  using comm::rendezvous::View;
  std::vector<View> ok = {view(0, 4, 0, 2, 0, "a"), view(1, 4, 0, 2, 1, "b"), view(2, 4, 1, 2, 0, "a"),
                          view(3, 4, 1, 2, 1, "b")};
  EXPECT_EQ(findDisagreement(ok), "");
  EXPECT_EQ(comm::rendezvous::nodesOf(ok), (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));
  for (const auto& v : ok) EXPECT_EQ(View::decode(v.encode(), v.world.rank).encode(), v.encode());

  auto bad = ok;
  bad[3].host_id = bad[3].hostname = "c";
  EXPECT_EQ(findDisagreement(bad), "node 1 (b) has ranks on different hosts: rank 1 on b and rank 3 on c");
  bad = ok;
  bad[2].world.local_size = 3;
  EXPECT_EQ(findDisagreement(bad),
            "ranks disagree about who is on node 0 (a): it has 2 ranks (ranks 0, 2) but rank 2 says its node has 3 "
            "(local size)");
  bad = ok;
  bad[2].world.local_rank = 0;
  EXPECT_EQ(findDisagreement(bad), "ranks 0 and 2 both have local rank 0 on node 0 (a)");
  bad = ok;
  bad[1].world.local_rank = 1;
  bad[3].world.local_rank = 2;
  bad[1].world.local_size = bad[3].world.local_size = 2;
  EXPECT_EQ(findDisagreement(bad), "no rank has local rank 0 on node 1 (b) (ranks 1, 3 with local ranks up to 2)");
  bad = ok;
  bad[0].world.num_nodes = bad[1].world.num_nodes = bad[2].world.num_nodes = bad[3].world.num_nodes = 3;
  EXPECT_EQ(findDisagreement(bad), "ranks disagree about the nodes: every rank counts 3 nodes but the ranks name 2");
  bad = ok;
  bad[3].world.job = "slurm job 2 step 0";
  EXPECT_NE(findDisagreement(bad).find("ranks belong to different jobs: rank 0 to slurm job 1 step 0, rank 3 to slurm "
                                       "job 2 step 0"),
            std::string::npos);
  bad = ok;
  bad[1].world.source = "torchrun";
  EXPECT_EQ(findDisagreement(bad),
            "ranks found their rank in different places: rank 0 in slurm variables, rank 1 in torchrun");
  // Unknown node indices (mpirun): ranks are grouped by host.
  std::vector<View> mpi = {view(0, 3, 0, 2, -1, "x"), view(1, 3, 0, 1, -1, "y"), view(2, 3, 1, 2, -1, "x")};
  for (auto& v : mpi) v.world.num_nodes = -1;
  EXPECT_EQ(findDisagreement(mpi), "");
  EXPECT_EQ(comm::rendezvous::nodesOf(mpi), (std::vector<std::vector<int>>{{0, 2}, {1}}));
}

}  // namespace
}  // namespace dtrain::test
