// The environment parsed from plain values (no setenv): group options, the world, the restart
// generation, the store's address and the one store set-up that initWorld() and the parameter server
// share (file:// and tcp, keys under gen<restart>/<scope>).
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "comm/rendezvous/internal.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"
#include "harness.h"

namespace dtrain::test {
namespace {

using comm::InitOptions;
using comm::rendezvous::Environment;
using namespace std::chrono_literals;

TEST(Environment, OnlyVariablesDtrainReadsCanBeNamed) {
  // A misspelt name would otherwise read as unset, silently.
  std::string m = errorOf([] { Environment::of({{"DTRAIN_TIMEOUTS", "5"}}); });
  EXPECT_NE(m.find("DTRAIN_TIMEOUTS is not one dtrain reads"), std::string::npos) << m;
  m = errorOf([] { Environment().get("MASTER_ADRR"); });
  EXPECT_NE(m.find("MASTER_ADRR is not one dtrain reads"), std::string::npos) << m;
  auto env = Environment::of({{"RANK", "3"}, {"MASTER_ADDR", ""}});
  EXPECT_STREQ(env.get("RANK"), "3");
  EXPECT_EQ(env.get("MASTER_ADDR"), nullptr);  // empty reads as unset
  EXPECT_EQ(env.get("WORLD_SIZE"), nullptr);
  EXPECT_EQ(env.rankPrefix(), "[rank 3] ");
  EXPECT_EQ(env.integer("WORLD_SIZE", 7, 1), 7);
  m = errorOf([] { Environment::of({{"WORLD_SIZE", "0"}}).integer("WORLD_SIZE", 1, 1); });
  EXPECT_NE(m.find("WORLD_SIZE='0' is not an integer >= 1"), std::string::npos) << m;
}

TEST(Environment, GroupOptions) {
  comm::GroupOptions d = comm::rendezvous::groupOptions(Environment());
  EXPECT_EQ(d.timeout, comm::GroupOptions{}.timeout);
  EXPECT_EQ(d.transport, "auto");
  EXPECT_EQ(d.segment_bytes, 0u);
  EXPECT_FALSE(d.check_fingerprints);
  EXPECT_EQ(d.listen_host, "");
  auto o = comm::rendezvous::groupOptions(Environment::of({{"DTRAIN_TIMEOUT", "0.25"},
                                                       {"DTRAIN_TRANSPORT", "shm"},
                                                       {"DTRAIN_SEGMENT_BYTES", "4096"},
                                                       {"DTRAIN_DEBUG", "detail"}}));
  EXPECT_EQ(o.timeout, 250ms);
  EXPECT_EQ(o.transport, "shm");
  EXPECT_EQ(o.segment_bytes, 4096u);
  EXPECT_TRUE(o.check_fingerprints);
  EXPECT_FALSE(comm::rendezvous::groupOptions(Environment::of({{"DTRAIN_DEBUG", "1"}})).check_fingerprints);
  for (auto [name, value] : {std::pair{"DTRAIN_TIMEOUT", "0"}, {"DTRAIN_TIMEOUT", "5s"}, {"DTRAIN_TRANSPORT", "ib"},
                             {"DTRAIN_SEGMENT_BYTES", "-1"}, {"DTRAIN_SEGMENT_BYTES", "1k"}}) {
    std::string m = errorOf([&] { comm::rendezvous::groupOptions(Environment::of({{name, value}})); });
    EXPECT_NE(m.find(fmt::format("{}='{}'", name, value)), std::string::npos) << m;
  }
}

TEST(Environment, StoreVariablesAndListenHost) {
  auto bad_port = Environment::of({{"RANK", "2"}, {"MASTER_PORT", "0"}});
  std::string m = errorOf([&] { comm::rendezvous::checkStoreVariables(bad_port); });
  EXPECT_EQ(m.rfind("[rank 2] MASTER_PORT='0' is not a port number (1-65535)", 0), 0u) << m;
  m = errorOf([] { comm::rendezvous::checkStoreVariables(Environment::of({{"MASTER_ADDR", "no-such-host.invalid"}})); });
  EXPECT_NE(m.find("MASTER_ADDR='no-such-host.invalid' is not a usable address"), std::string::npos) << m;
  comm::rendezvous::checkStoreVariables(Environment::of({{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}}));
  EXPECT_EQ(comm::rendezvous::listenHost(Environment()), "");
  EXPECT_EQ(comm::rendezvous::listenHost(Environment::of({{"MASTER_ADDR", "127.0.0.1"}})), "127.0.0.1");
  EXPECT_EQ(comm::rendezvous::listenHost(Environment::of({{"DTRAIN_IFNAME", "lo"}, {"MASTER_ADDR", "127.0.0.1"}})),
            "127.0.0.1");
}

TEST(Environment, WorldFromEachSource) {
  using comm::rendezvous::detectWorld;
  EXPECT_EQ(detectWorld(Environment(), {}).source, "none");
  auto w = detectWorld(Environment::of({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                                    {"LOCAL_WORLD_SIZE", "2"}, {"TORCHELASTIC_RUN_ID", "r7"}}),
                       {});
  EXPECT_EQ(w.source, "torchrun");
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.size, 4);
  EXPECT_EQ(w.node, 1);
  EXPECT_EQ(w.job, "torchrun run r7");
  w = detectWorld(Environment::of({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "3"}}), {});
  EXPECT_EQ(w.source, "openmpi");
  EXPECT_EQ(w.rank, 1);
  EXPECT_EQ(w.node, -1);
  w = detectWorld(Environment::of({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "3"}, {"SLURM_STEP_ID", "0"},
                               {"SLURM_LOCALID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", "2,1"},
                               {"SLURM_STEP_NODELIST", "n[1-2]"}, {"SLURMD_NODENAME", "n2"}, {"SLURM_JOB_ID", "9"}}),
                  {});
  EXPECT_EQ(w.source, "slurm");
  EXPECT_EQ(w.node, 1);
  EXPECT_EQ(w.local_size, 1);
  EXPECT_EQ(w.job, "slurm job 9 step 0");
  // Explicit options win over the variables.
  InitOptions o;
  o.rank = 0;
  o.world_size = 2;
  EXPECT_EQ(detectWorld(Environment::of({{"RANK", "3"}, {"WORLD_SIZE", "4"}}), o).source, "explicit");
  std::string m = errorOf([] { detectWorld(Environment::of({{"RANK", "1"}}), {}); });
  EXPECT_NE(m.find("RANK and WORLD_SIZE must be set together"), std::string::npos) << m;
}

TEST(Environment, RestartCountFallsBackToTorchrunsAndStoreAddress) {
  using comm::rendezvous::restartCount;
  EXPECT_EQ(restartCount(Environment()), 0);
  EXPECT_EQ(restartCount(Environment::of({{"TORCHELASTIC_RESTART_COUNT", "4"}})), 4);
  EXPECT_EQ(restartCount(Environment::of({{"TORCHELASTIC_RESTART_COUNT", "4"}, {"DTRAIN_RESTART_COUNT", "2"}})), 2);
  std::string m = errorOf([] { restartCount(Environment::of({{"DTRAIN_RESTART_COUNT", "-1"}})); });
  EXPECT_NE(m.find("DTRAIN_RESTART_COUNT='-1'"), std::string::npos) << m;

  using comm::rendezvous::storeAddress;
  auto a = storeAddress(Environment(), {});
  EXPECT_EQ(a.host, "127.0.0.1");
  EXPECT_EQ(a.port, 29500);
  a = storeAddress(Environment::of({{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1234"}}), {});
  EXPECT_EQ(a.port, 1234);
  EXPECT_EQ(a.origin, "MASTER_ADDR:MASTER_PORT");
  InitOptions o;
  o.master_port = 4321;
  a = storeAddress(Environment::of({{"MASTER_PORT", "1234"}}), o);
  EXPECT_EQ(a.port, 4321);
  EXPECT_EQ(a.origin, "the default host and InitOptions::master_port");
}

// The parameter server's request: never hosts, keys under gen<restart>/ps.
comm::rendezvous::JobStoreRequest psRequest() {
  comm::rendezvous::JobStoreRequest r;
  r.scope = "ps";
  r.user = "ps: ";
  r.timeout = 5s;
  return r;
}

TEST(Environment, StoreSetUpThroughAFile) {
  TempDir dir;
  const std::string path = dir.path() + "/store";
  auto env = Environment::of({{"DTRAIN_INIT_METHOD", "file://" + path}, {"TORCHELASTIC_RESTART_COUNT", "3"}});
  auto js = comm::rendezvous::openJobStore(env, {}, psRequest());
  EXPECT_EQ(js.where, "file://" + path);
  EXPECT_FALSE(js.hosted);
  EXPECT_FALSE(js.address.has_value());
  js.store->set("k", comm::toBytes("v"));
  comm::FileStore raw(path, 5s);
  EXPECT_EQ(comm::toString(raw.get("gen3/ps/k")), "v");
  // InitOptions::init_method wins over DTRAIN_INIT_METHOD; the world's keys are beside the PS's.
  InitOptions o;
  o.init_method = "file://" + path;
  comm::rendezvous::JobStoreRequest world;
  world.scope = "world";
  world.timeout = 5s;
  auto w = comm::rendezvous::openJobStore(Environment::of({{"DTRAIN_INIT_METHOD", "file:///nonexistent/dir/x"}}), o, world);
  w.store->set("k", comm::toBytes("w"));
  EXPECT_EQ(comm::toString(raw.get("gen0/world/k")), "w");
}

TEST(Environment, StoreSetUpOverTcp) {
  StoreServer server;
  const std::string port = std::to_string(server.port());
  auto env = Environment::of({{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}, {"DTRAIN_RESTART_COUNT", "2"}});
  auto js = comm::rendezvous::openJobStore(env, {}, psRequest());
  EXPECT_FALSE(js.hosted);
  ASSERT_TRUE(js.address.has_value());
  EXPECT_EQ(js.where, "127.0.0.1:" + port + " (MASTER_ADDR:MASTER_PORT)");
  js.store->set("k", comm::toBytes("v"));
  EXPECT_EQ(comm::toString(server.client()->get("gen2/ps/k")), "v");
  // A tcp:// init method names its own address.
  auto t = comm::rendezvous::openJobStore(Environment::of({{"DTRAIN_INIT_METHOD", "tcp://127.0.0.1:" + port}}), {},
                                          psRequest());
  EXPECT_EQ(t.where, "127.0.0.1:" + port + " (DTRAIN_INIT_METHOD)");
  t.store->set("t", comm::toBytes("u"));
  EXPECT_EQ(comm::toString(server.client()->get("gen0/ps/t")), "u");
}

TEST(Environment, StoreSetUpErrorsNameTheCause) {
  std::string m = errorOf([] {
    comm::rendezvous::openJobStore(Environment::of({{"DTRAIN_INIT_METHOD", "nfs://share"}}), {}, psRequest());
  });
  EXPECT_NE(m.find("init_method 'nfs://share': expected env://, tcp://host:port or file:///path"), std::string::npos)
      << m;
  m = errorOf([] {
    comm::rendezvous::openJobStore(Environment::of({{"DTRAIN_INIT_METHOD", "tcp://127.0.0.1"}}), {}, psRequest());
  });
  EXPECT_NE(m.find("expected tcp://host:port"), std::string::npos) << m;
  // Nobody serves the store: the PS (which never hosts it) names the address and who should.
  auto listener = std::make_unique<comm::TcpStoreServer>("127.0.0.1", 0);
  const std::string port = std::to_string(listener->port());
  listener.reset();
  auto r = psRequest();
  r.timeout = 500ms;
  m = errorOf([&] {
    comm::rendezvous::openJobStore(
        Environment::of({{"RANK", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}}), {}, r);
  });
  EXPECT_EQ(m.rfind("[rank 1] ps: cannot reach the store at 127.0.0.1:" + port + " (MASTER_ADDR:MASTER_PORT)", 0), 0u)
      << m;
  EXPECT_NE(m.find("the process that hosts it (dtrain-run)"), std::string::npos) << m;
}

}  // namespace
}  // namespace dtrain::test
