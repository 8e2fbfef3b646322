// What is particular to EtcdStore, on a one-member etcd of each test's own (tests/etcd_server.h): leases
// (a key attached to one disappears after its TTL unless renewed; EtcdLease renews and revokes), listing
// by prefix with revisions, putIfAbsent, failover between endpoints, and its errors. The Store behaviours
// it shares with TcpStore and FileStore are checked by the typed suite of store_test.cc.
#include <gtest/gtest.h>

#include <thread>

#include "dtrain/comm/error.h"
#include "dtrain/comm/etcd.h"
#include "etcd_server.h"
#include "harness.h"

namespace dtrain::comm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

template <class Pred>
bool eventually(Pred&& pred, std::chrono::milliseconds limit) {
  auto end = Clock::now() + limit;
  while (!pred()) {
    if (Clock::now() > end) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

class EtcdTest : public ::testing::Test {
 protected:
  test::EtcdServer etcd;
  std::shared_ptr<EtcdStore> store = makeEtcdStore(etcd.endpoint(), "/dtrain/job1/", 5s);
};

TEST_F(EtcdTest, AKeyOnALeaseThatIsNotRenewedDisappearsAfterItsTTL) {
  EtcdLeaseGrant lease = store->grantLease(2s);
  EXPECT_NE(lease.id, 0);
  EXPECT_GE(lease.ttl, 2s);
  auto t0 = Clock::now();
  store->setWithLease("nodes/a", toBytes("alive"), lease.id);
  store->set("nodes/b", toBytes("no lease"));
  auto listed = store->list("nodes/");
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].lease, lease.id);
  EXPECT_EQ(listed[1].lease, 0);
  EXPECT_TRUE(eventually([&] { return !store->check({"nodes/a"}); }, lease.ttl + 6s));
  EXPECT_GE(secondsSince(t0), static_cast<double>(lease.ttl.count()) - 0.5);
  EXPECT_TRUE(store->check({"nodes/b"}));
  // The lease is gone: renewing it or putting on it says so.
  std::string msg = test::errorOf([&] { store->keepAlive(lease.id); });
  EXPECT_TRUE(contains(msg, "expired")) << msg;
  msg = test::errorOf([&] { store->setWithLease("nodes/a", toBytes("late"), lease.id); });
  EXPECT_TRUE(contains(msg, "expired or was revoked")) << msg;
  EXPECT_TRUE(contains(msg, "'nodes/a'")) << msg;
  EXPECT_THROW(store->setWithLease("nodes/a", toBytes("late"), lease.id), RendezvousError);
}

TEST_F(EtcdTest, AKeyOnALeaseKeptAliveStays) {
  EtcdLeaseGrant lease = store->grantLease(2s);
  store->setWithLease("hb", toBytes("x"), lease.id);
  auto t0 = Clock::now();
  while (secondsSince(t0) < 5.0) {  // 2.5 TTLs
    EXPECT_GE(store->keepAlive(lease.id), 1s);
    std::this_thread::sleep_for(500ms);
  }
  EXPECT_TRUE(store->check({"hb"}));
  store->revokeLease(lease.id);
  EXPECT_FALSE(store->check({"hb"}));  // revoking deletes the lease's keys at once
  store->revokeLease(lease.id);        // a lease already gone is not an error
}

TEST_F(EtcdTest, AnEtcdLeaseRenewsFromItsOwnThreadAndRevokesOnDestruction) {
  {
    EtcdLease lease(store, 2s);
    store->setWithLease("hb", toBytes("x"), lease.id());
    // A get blocked on the store meanwhile does not hold up the renewals (they use a clone).
    store->setTimeout(5s);
    EXPECT_THROW(store->get("never"), TimeoutError);
    EXPECT_TRUE(lease.alive());
    EXPECT_NO_THROW(lease.check());
    EXPECT_TRUE(store->check({"hb"}));
  }
  EXPECT_FALSE(store->check({"hb"}));
}

TEST_F(EtcdTest, AnEtcdLeaseThatCannotBeRenewedIsReportedLost) {
  EtcdLease lease(store, 2s);
  etcd.kill();
  auto t0 = Clock::now();
  EXPECT_TRUE(eventually([&] { return !lease.alive(); }, 10s));
  EXPECT_LT(secondsSince(t0), 2.0 * static_cast<double>(lease.ttl().count()) + 1.0);
  std::string msg = test::errorOf([&] { lease.check(); });
  EXPECT_TRUE(contains(msg, "was lost")) << msg;
  EXPECT_TRUE(contains(msg, etcd.endpoint())) << msg;
  EXPECT_THROW(lease.check(), RendezvousError);
}

TEST_F(EtcdTest, ListGivesTheKeysUnderAPrefixWithTheirRevisions) {
  store->set("nodes/b", toBytes("2"));
  store->set("nodes/a", toBytes("1"));
  store->set("nodesX", toBytes("not under nodes/"));
  makeEtcdStore(etcd.endpoint(), "/dtrain/job2/", 5s)->set("nodes/c", toBytes("another job"));
  auto listed = store->list("nodes/");
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].key, "nodes/a");  // in key order, relative to the store's prefix
  EXPECT_EQ(toString(listed[0].value), "1");
  EXPECT_EQ(listed[1].key, "nodes/b");
  EXPECT_GT(listed[0].mod_revision, listed[1].mod_revision);
  const EtcdKeyValue before = listed[1];
  store->set("nodes/b", toBytes("2'"));
  const EtcdKeyValue after = store->list("nodes/b")[0];
  EXPECT_EQ(after.create_revision, before.create_revision);
  EXPECT_GT(after.mod_revision, before.mod_revision);
  EXPECT_EQ(store->list("").size(), 3u);
  EXPECT_EQ(store->numKeys(), 3);  // this store's prefix only
  EXPECT_TRUE(store->list("none/").empty());
}

TEST_F(EtcdTest, PutIfAbsentCreatesTheKeyOnce) {
  EXPECT_TRUE(store->putIfAbsent("leader", toBytes("node0")));
  EXPECT_FALSE(store->putIfAbsent("leader", toBytes("node1")));
  EXPECT_EQ(toString(store->get("leader")), "node0");
  EtcdLeaseGrant lease = store->grantLease(5s);
  EXPECT_TRUE(store->putIfAbsent("round/1", toBytes("x"), lease.id));
  store->revokeLease(lease.id);
  EXPECT_FALSE(store->check({"round/1"}));
  EXPECT_TRUE(store->putIfAbsent("round/1", toBytes("y")));
}

TEST_F(EtcdTest, AddsFromThreadsWithClientsOfTheirOwnGiveTheExactTotal) {
  constexpr int kThreads = 6, kAdds = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      auto mine = store->cloneEtcd();
      for (int i = 0; i < kAdds; ++i) {
        int64_t v = mine->add("n", 1);
        EXPECT_TRUE(mine->putIfAbsent("seen/" + std::to_string(v), toBytes("1"))) << v << " handed out twice";
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(store->add("n", 0), kThreads * kAdds);
}

TEST_F(EtcdTest, AnEndpointThatCannotBeReachedIsSkippedForTheNext) {
  const std::string down = "http://127.0.0.1:" + std::to_string(test::unusedPort());
  auto s = makeEtcdStore(down + "," + etcd.endpoint(), "/dtrain/job1/", 5s);
  auto t0 = Clock::now();
  s->set("k", toBytes("v"));
  EXPECT_EQ(toString(s->get("k")), "v");
  EXPECT_EQ(s->add("n", 2), 2);
  EXPECT_LT(secondsSince(t0), 3.0);
  // Scheme-less endpoints mean http://, in any order.
  auto t = makeEtcdStore(fmt::format("127.0.0.1:{}, {}", etcd.port(), down), "/dtrain/job1/", 5s);
  EXPECT_EQ(toString(t->get("k")), "v");
}

// The point of several endpoints: a 3-member cluster loses the member its clients talk to (maybe the
// leader), and the store, a blocked get and a heartbeat carry on through the others.
TEST(EtcdClusterTest, AStoreAndItsLeasesSurviveTheLossOfTheMemberInUse) {
  test::EtcdServer cluster(3);
  auto store = makeEtcdStore(cluster.endpoints(), "/dtrain/job1/", 20s);
  store->set("before", toBytes("1"));
  EXPECT_EQ(store->add("n", 1), 1);
  EtcdLease lease(store, 5s);
  store->setWithLease("nodes/me", toBytes("x"), lease.id());
  std::string got;
  std::thread waiter([&] {
    auto mine = store->cloneEtcd();
    try {
      got = toString(mine->get("after"));
    } catch (const std::exception& e) {
      got = std::string("error: ") + e.what();
    }
  });
  std::this_thread::sleep_for(300ms);
  cluster.kill(0);
  auto t0 = Clock::now();
  store->set("after", toBytes("2"));
  EXPECT_EQ(store->add("n", 1), 2);
  EXPECT_EQ(toString(store->get("before")), "1");
  // A put in flight on a member when the leader dies waits out etcd's request timeout (7 s) before it
  // is answered "request timed out" and sent again.
  EXPECT_LT(secondsSince(t0), 15.0);
  waiter.join();
  EXPECT_EQ(got, "2");
  std::this_thread::sleep_for(lease.ttl() + 2s);  // past a TTL: renewed through the survivors
  EXPECT_TRUE(lease.alive());
  EXPECT_TRUE(store->check({"nodes/me"}));
  EXPECT_EQ(store->list("nodes/").size(), 1u);
}

TEST_F(EtcdTest, NoEndpointAnsweringIsARendezvousErrorNamingEachOfThemAndTheTimeout) {
  const std::string a = "http://127.0.0.1:" + std::to_string(test::unusedPort());
  const std::string b = "http://127.0.0.1:" + std::to_string(test::unusedPort());
  auto s = makeEtcdStore(a + "," + b, "/dtrain/job1/", 500ms);
  auto t0 = Clock::now();
  std::string msg = test::errorOf([&] { s->set("some/key", toBytes("v")); });
  EXPECT_LT(secondsSince(t0), 3.0);
  EXPECT_GE(secondsSince(t0), 0.5);
  EXPECT_TRUE(contains(msg, "no etcd endpoint answered within")) << msg;
  EXPECT_TRUE(contains(msg, a)) << msg;
  EXPECT_TRUE(contains(msg, b)) << msg;
  EXPECT_TRUE(contains(msg, "set('some/key')")) << msg;
  EXPECT_THROW(s->get("some/key"), RendezvousError);
  // The etcd of the test going away mid-job is the same error, within the store's timeout.
  store->setTimeout(500ms);
  etcd.kill();
  EXPECT_THROW(store->add("n", 1), RendezvousError);
}

TEST_F(EtcdTest, BadArgumentsAreInvalidArguments) {
  EXPECT_THROW(EtcdStore(etcd.endpoint(), "", 5s), InvalidArgument);
  EXPECT_THROW(EtcdStore(" , ", "/p/", 5s), InvalidArgument);
  EXPECT_THROW(store->grantLease(0s), InvalidArgument);
  std::string msg = test::errorOf([&] { EtcdStore("http://127.0.0.1:1,ftp://127.0.0.1:1", "/p/", 1s); });
  EXPECT_TRUE(contains(msg, "'ftp://127.0.0.1:1'")) << msg;
  EXPECT_THROW(EtcdStore("ftp://127.0.0.1:1", "/p/", 1s), InvalidArgument);
  // A value etcd refuses (the test's etcd takes requests up to 32 MiB) names the key and etcd's reason.
  Bytes big(40u << 20, 'x');
  msg = test::errorOf([&] { store->set("too/big", big); });
  EXPECT_TRUE(contains(msg, "'too/big'")) << msg;
  EXPECT_TRUE(contains(msg, "too large")) << msg;
  EXPECT_THROW(store->set("too/big", big), InvalidArgument);
  EXPECT_EQ(store->add("still/fine", 1), 1);
}

}  // namespace
}  // namespace dtrain::comm
