// Tests of the key-value stores. One typed suite runs every Store behaviour against TcpStore, FileStore
// and EtcdStore (on a one-member etcd of its own: tests/etcd_server.h), in this process and across forked
// processes; then what is particular to each: the TCP server against hostile clients, the file's log
// format, and PrefixStore (etcd's leases and failover: etcd_test.cc).
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/net/socket.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/etcd.h"
#include "dtrain/comm/store.h"
#include "etcd_server.h"
#include "harness.h"

namespace dtrain::comm {
namespace {

using namespace std::chrono_literals;
using dtrain::test::rssKiB;
using Clock = std::chrono::steady_clock;

// Runs fn, which must throw Exc, and returns the exception's message for the caller to inspect.
template <class Exc, class Fn>
std::string messageOf(Fn&& fn) {
  try {
    fn();
  } catch (const Exc& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception, none was thrown";
  return {};
}

// Polls pred until it holds or `limit` passes; returns its last value.
template <class Pred>
bool eventually(Pred&& pred, std::chrono::milliseconds limit = 3s) {
  auto end = Clock::now() + limit;
  while (!pred()) {
    if (Clock::now() > end) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

double secondsSince(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// ---- Store kinds: each gives clients of one shared store, here or inside forked children. ----

struct TcpKind {
  static constexpr const char* kName = "Tcp";
  test::StoreServer server;
  std::shared_ptr<Store> make(Duration timeout) const { return server.client(timeout); }
  // What the store's error messages name it by.
  std::string address() const { return fmt::format("127.0.0.1:{}", server.port()); }
};

struct FileKind {
  static constexpr const char* kName = "File";
  test::TempDir dir;
  std::string path = dir.path() + "/store";
  std::shared_ptr<Store> make(Duration timeout) const { return std::make_shared<FileStore>(path, timeout); }
  std::string address() const { return path; }
};

struct EtcdKind {
  static constexpr const char* kName = "Etcd";
  test::EtcdServer server;
  std::shared_ptr<Store> make(Duration timeout) const {
    return makeEtcdStore(server.endpoint(), "/dtrain/test-job/", timeout);
  }
  std::string address() const { return server.endpoint(); }
};

template <class Kind>
class StoreTest : public ::testing::Test {
 protected:
  Kind kind;
  std::shared_ptr<Store> store = kind.make(5s);
};

struct KindNames {
  template <class T>
  static std::string GetName(int) {
    return T::kName;
  }
};
using Kinds = ::testing::Types<TcpKind, FileKind, EtcdKind>;
TYPED_TEST_SUITE(StoreTest, Kinds, KindNames);

TYPED_TEST(StoreTest, SetThenGetReturnsTheValue) {
  auto& s = *this->store;
  s.set("greeting", toBytes("hello"));
  EXPECT_EQ(toString(s.get("greeting")), "hello");
  s.set("greeting", toBytes("bye"));
  EXPECT_EQ(toString(s.get("greeting")), "bye");
  const Bytes binary{0, 1, 0xff, 0, '\n', 0x80};
  s.set("binary key/with spaces", binary);
  EXPECT_EQ(s.get("binary key/with spaces"), binary);
  s.set("empty", Bytes());
  EXPECT_TRUE(s.get("empty").empty());
  s.set("", toBytes("empty key"));
  EXPECT_EQ(toString(s.get("")), "empty key");
}

TYPED_TEST(StoreTest, LargeValuesRoundTrip) {
  Bytes big(8u << 20);
  std::mt19937 rng(7);
  for (auto& b : big) b = static_cast<uint8_t>(rng());
  this->store->set("big", big);
  auto other = this->kind.make(5s);
  EXPECT_EQ(other->get("big"), big);
}

TYPED_TEST(StoreTest, AddCreatesTheCounterAtZeroAndReturnsTheNewValue) {
  auto& s = *this->store;
  EXPECT_EQ(s.add("n", 5), 5);
  EXPECT_EQ(s.add("n", -7), -2);
  EXPECT_EQ(s.add("n", 0), -2);
  EXPECT_EQ(toString(s.get("n")), "-2");  // counters are decimal text
  s.set("m", toBytes("40"));
  EXPECT_EQ(s.add("m", 2), 42);
}

TYPED_TEST(StoreTest, AddOnAValueThatIsNotAnIntegerIsAnInvalidArgument) {
  auto& s = *this->store;
  s.set("word", toBytes("abc"));
  std::string msg = messageOf<InvalidArgument>([&] { s.add("word", 1); });
  EXPECT_NE(msg.find("'word'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not an integer"), std::string::npos) << msg;
  EXPECT_NE(msg.find(this->kind.address()), std::string::npos) << msg;
  s.set("max", toBytes(std::to_string(INT64_MAX)));
  EXPECT_THROW(s.add("max", 1), InvalidArgument);
  // The store is still in step afterwards.
  EXPECT_EQ(toString(s.get("word")), "abc");
  EXPECT_EQ(s.add("fine", 3), 3);
}

TYPED_TEST(StoreTest, CompareSetReplacesOnlyAMatchingValue) {
  auto& s = *this->store;
  // A missing key matches an empty expected value...
  EXPECT_EQ(toString(s.compareSet("k", Bytes(), toBytes("v1"))), "v1");
  EXPECT_EQ(toString(s.get("k")), "v1");
  // ...and nothing else: it stays missing.
  EXPECT_TRUE(s.compareSet("absent", toBytes("x"), toBytes("y")).empty());
  EXPECT_FALSE(s.check({"absent"}));
  // A mismatch leaves the value and returns it.
  EXPECT_EQ(toString(s.compareSet("k", toBytes("wrong"), toBytes("v2"))), "v1");
  EXPECT_EQ(toString(s.get("k")), "v1");
  EXPECT_EQ(toString(s.compareSet("k", toBytes("v1"), toBytes("v2"))), "v2");
  EXPECT_EQ(toString(s.get("k")), "v2");
}

TYPED_TEST(StoreTest, DeleteKeyReportsWhetherTheKeyExisted) {
  auto& s = *this->store;
  s.set("doomed", toBytes("x"));
  EXPECT_TRUE(s.deleteKey("doomed"));
  EXPECT_FALSE(s.deleteKey("doomed"));
  EXPECT_FALSE(s.check({"doomed"}));
  s.set("doomed", toBytes("again"));
  EXPECT_EQ(toString(s.get("doomed")), "again");
}

TYPED_TEST(StoreTest, CheckAndNumKeysSeeTheCurrentKeys) {
  auto& s = *this->store;
  EXPECT_EQ(s.numKeys(), 0);
  EXPECT_TRUE(s.check({}));
  EXPECT_FALSE(s.check({"a"}));
  s.set("a", toBytes("1"));
  s.add("b", 1);
  EXPECT_TRUE(s.check({"a"}));
  EXPECT_TRUE(s.check({"a", "b"}));
  EXPECT_FALSE(s.check({"a", "b", "c"}));
  EXPECT_EQ(s.numKeys(), 2);
  s.deleteKey("a");
  EXPECT_EQ(s.numKeys(), 1);
}

TYPED_TEST(StoreTest, OversizedKeysAndValuesAreInvalidArguments) {
  auto& s = *this->store;
  std::string long_key(kMaxStoreKeyBytes + 1, 'k');
  EXPECT_THROW(s.set(long_key, toBytes("v")), InvalidArgument);
  EXPECT_THROW(s.get(long_key), InvalidArgument);
  EXPECT_THROW(s.wait({"ok", long_key}, 1s), InvalidArgument);
  EXPECT_THROW(s.set("k", Bytes(kMaxStoreValueBytes + 1)), InvalidArgument);
  s.set(std::string(kMaxStoreKeyBytes, 'k'), toBytes("the longest key"));
  EXPECT_EQ(toString(s.get(std::string(kMaxStoreKeyBytes, 'k'))), "the longest key");
}

TYPED_TEST(StoreTest, GetTimesOutWithAMessageNamingTheKeyTheStoreAndTheTimeout) {
  auto impatient = this->kind.make(300ms);
  auto t0 = Clock::now();
  std::string msg = messageOf<TimeoutError>([&] { impatient->get("never/set"); });
  double waited = secondsSince(t0);
  EXPECT_GE(waited, 0.3);
  EXPECT_LT(waited, 3.0);
  EXPECT_NE(msg.find("'never/set'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("300ms"), std::string::npos) << msg;
  EXPECT_NE(msg.find(this->kind.address()), std::string::npos) << msg;
}

TYPED_TEST(StoreTest, WaitTimesOutNamingOnlyTheMissingKeys) {
  this->store->set("here", toBytes("1"));
  std::string msg = messageOf<TimeoutError>([&] { this->store->wait({"here", "absent"}, 300ms); });
  EXPECT_NE(msg.find("waiting for key 'absent'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("300ms"), std::string::npos) << msg;
  EXPECT_NE(msg.find(this->kind.address()), std::string::npos) << msg;
}

// After a timed-out get, the server still answers it once the key appears. That late answer must not
// be read as the answer to the client's next request.
TYPED_TEST(StoreTest, AnAnswerArrivingAfterATimeoutIsNotTakenForTheNextOne) {
  auto impatient = this->kind.make(200ms);
  EXPECT_THROW(impatient->get("late"), TimeoutError);
  this->store->set("late", toBytes("stale"));
  this->store->set("fresh", toBytes("fresh"));
  impatient->setTimeout(5s);
  EXPECT_EQ(toString(impatient->get("fresh")), "fresh");
  EXPECT_EQ(impatient->add("counter", 1), 1);
  EXPECT_EQ(toString(impatient->get("late")), "stale");
}

TYPED_TEST(StoreTest, WaitReturnsOnceAnotherClientSetsTheKeys) {
  auto setter = this->kind.make(5s);
  std::thread t([&] {
    std::this_thread::sleep_for(100ms);
    setter->set("w/a", toBytes("1"));
    std::this_thread::sleep_for(50ms);
    setter->set("w/b", toBytes("2"));
  });
  auto t0 = Clock::now();
  this->store->wait({"w/a", "w/b"});  // the store's default timeout (5s)
  EXPECT_LT(secondsSince(t0), 4.0);
  t.join();
  EXPECT_TRUE(this->store->check({"w/a", "w/b"}));
}

TYPED_TEST(StoreTest, OneClientIsSafeToShareBetweenThreads) {
  constexpr int kThreads = 4, kAdds = 200;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < kAdds; ++i) this->store->add("shared", 1);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(this->store->add("shared", 0), kThreads * kAdds);
}

// A clone is another connection to the same store: a thread blocked in get() on the original does not
// hold up the clone (on a shared TcpStore client the set below would queue behind the get), and a
// PrefixStore's clone keeps its prefix.
TYPED_TEST(StoreTest, ACloneIsAnIndependentClientOfTheSameStore) {
  PrefixStore prefixed("p", this->store);
  auto clone = prefixed.clone();
  EXPECT_EQ(clone->timeout(), prefixed.timeout());
  std::string got;
  std::thread waiter([&] {
    try {
      got = toString(prefixed.get("k"));
    } catch (const std::exception& e) {
      got = std::string("error: ") + e.what();
    }
  });
  std::this_thread::sleep_for(50ms);
  clone->set("k", toBytes("v"));  // through its own connection, while the waiter blocks
  waiter.join();
  EXPECT_EQ(got, "v");
  EXPECT_EQ(toString(this->store->get("p/k")), "v");
}

// Every add's result is claimed with compareSet under "seen/<value>": a value handed out twice would
// be claimed by two ranks, which a non-atomic add would show up as.
TYPED_TEST(StoreTest, ConcurrentAddsFromFiveProcessesGiveTheExactTotal) {
  constexpr int kRanks = 5, kAdds = 100;
  auto results = test::runRanks(
      kRanks,
      [&](int rank) {
        auto s = this->kind.make(20s);
        Bytes me = toBytes(std::to_string(rank));
        for (int i = 0; i < kAdds; ++i) {
          int64_t v = s->add("counter", 1);
          EXPECT_EQ(s->compareSet(fmt::format("seen/{}", v), Bytes(), me), me) << "value " << v << " handed out twice";
        }
      },
      60s);
  test::expectAllOk(results);
  EXPECT_EQ(this->store->add("counter", 0), kRanks * kAdds);
  EXPECT_EQ(this->store->numKeys(), 1 + kRanks * kAdds);
}

TYPED_TEST(StoreTest, AGetBlockedInOneProcessIsWokenBySetInAnother) {
  auto results = test::runRanks(
      2,
      [&](int rank) {
        auto s = this->kind.make(10s);
        if (rank == 0) {
          s->set("getter/ready", toBytes("1"));
          auto t0 = Clock::now();
          EXPECT_EQ(toString(s->get("wake/up")), "good morning");
          EXPECT_GE(secondsSince(t0), 0.15);  // it really was blocked
          EXPECT_LT(secondsSince(t0), 5.0);   // and was woken, not timed out
        } else {
          s->wait({"getter/ready"});
          std::this_thread::sleep_for(200ms);
          s->set("wake/up", toBytes("good morning"));
        }
      },
      30s);
  test::expectAllOk(results);
}

TYPED_TEST(StoreTest, PrefixStoresAreIsolated) {
  auto base = this->store;
  PrefixStore a("job/a", base), b("job/b", base);
  a.set("x", toBytes("1"));
  b.set("x", toBytes("2"));
  EXPECT_EQ(toString(a.get("x")), "1");
  EXPECT_EQ(toString(b.get("x")), "2");
  EXPECT_EQ(toString(base->get("job/a/x")), "1");  // the documented key layout
  EXPECT_EQ(a.add("n", 3), 3);
  EXPECT_FALSE(b.check({"n"}));
  EXPECT_EQ(b.add("n", 1), 1);
  EXPECT_EQ(toString(a.compareSet("x", toBytes("1"), toBytes("10"))), "10");
  EXPECT_EQ(toString(b.get("x")), "2");
  EXPECT_TRUE(a.deleteKey("x"));
  EXPECT_FALSE(a.check({"x"}));
  EXPECT_TRUE(b.check({"x", "n"}));
  EXPECT_EQ(a.numKeys(), base->numKeys());  // counts the whole underlying store

  // Nested prefixes compose.
  PrefixStore inner("sub", std::make_shared<PrefixStore>("job/a", base));
  inner.set("k", toBytes("deep"));
  EXPECT_EQ(toString(base->get("job/a/sub/k")), "deep");

  // The prefix store's own timeout applies, and errors name the full key.
  b.setTimeout(200ms);
  std::string msg = messageOf<TimeoutError>([&] { b.get("missing"); });
  EXPECT_NE(msg.find("job/b/missing"), std::string::npos) << msg;
  msg = messageOf<TimeoutError>([&] { a.wait({"never"}, 200ms); });
  EXPECT_NE(msg.find("job/a/never"), std::string::npos) << msg;

  EXPECT_THROW(PrefixStore("p", nullptr), InvalidArgument);
}

// ---- TcpStore and its server ----

// The wire format as the test spells it out, independently of the implementation, so an accidental
// protocol change fails here: {u32 magic, u16 version, u16 command, u32 payload_len}, little-endian.
constexpr uint32_t kWireMagic = 0x564B5444;
constexpr uint16_t kWireVersion = 1;
constexpr uint16_t kCmdSet = 1, kCmdGet = 2, kCmdCheck = 6, kCmdNumKeys = 8;

Bytes wireHeader(uint32_t magic, uint16_t version, uint16_t cmd, uint32_t len) {
  Bytes b;
  auto put = [&](uint64_t v, int n) {
    for (int i = 0; i < n; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
  };
  put(magic, 4);
  put(version, 2);
  put(cmd, 2);
  put(len, 4);
  return b;
}


net::Socket rawClient(uint16_t port) { return net::Socket::connect("127.0.0.1", port, net::deadlineAfter(2s)); }

// Sends what it can without blocking: the server may close on us halfway, which is the point.
void sendRaw(const net::Socket& s, const Bytes& b) {
  ssize_t w = ::send(s.fd(), b.data(), b.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)w;
}

// True when the server closes the connection (orderly or by reset) within `limit`.
bool closedByServer(const net::Socket& s, std::chrono::milliseconds limit = 2s) {
  auto end = Clock::now() + limit;
  uint8_t buf[4096];
  for (;;) {
    pollfd p{s.fd(), POLLIN, 0};
    if (::poll(&p, 1, net::msUntil(end)) <= 0) return false;
    ssize_t r = ::recv(s.fd(), buf, sizeof buf, MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) return true;
  }
}

TEST(TcpStoreServerTest, AnswersAWellFormedRawRequest) {
  TcpStoreServer server("127.0.0.1", 0);
  TcpStore(("127.0.0.1"), server.port(), 5s).set("one", toBytes("1"));
  net::Socket s = rawClient(server.port());
  // First the greeting: "DTAU", no secret required, a 32-byte challenge.
  uint8_t greeting[4 + 1 + 32];
  s.recvAll(greeting, sizeof greeting, net::deadlineAfter(2s));
  EXPECT_EQ(std::string(greeting, greeting + 4), "DTAU");
  EXPECT_EQ(greeting[4], 0);
  Bytes req = wireHeader(kWireMagic, kWireVersion, kCmdNumKeys, 0);
  s.sendAll(req.data(), req.size(), net::deadlineAfter(2s));
  uint8_t answer[12 + 8];
  s.recvAll(answer, sizeof answer, net::deadlineAfter(2s));
  EXPECT_EQ(Bytes(answer, answer + 12), wireHeader(kWireMagic, kWireVersion, /*status ok*/ 0, 8));
  EXPECT_EQ(answer[12], 1);  // one key, as an i64
}

TEST(TcpStoreServerTest, CountsConnectedClients) {
  TcpStoreServer server("127.0.0.1", 0);
  EXPECT_EQ(server.numClients(), 0);
  auto a = std::make_unique<TcpStore>("127.0.0.1", server.port(), 5s);
  auto b = std::make_unique<TcpStore>("127.0.0.1", server.port(), 5s);
  EXPECT_TRUE(eventually([&] { return server.numClients() == 2; })) << server.numClients();
  b.reset();
  EXPECT_TRUE(eventually([&] { return server.numClients() == 1; })) << server.numClients();
}

// The server must keep serving everyone else, and stay small, whatever one client sends.
TEST(TcpStoreServerTest, SurvivesHostileClients) {
  const long rss_before = rssKiB();
  TcpStoreServer server("127.0.0.1", 0);
  TcpStore good("127.0.0.1", server.port(), 5s);
  int round = 0;
  auto goodClientWorks = [&] {
    std::string key = fmt::format("round/{}", round++);
    good.set(key, toBytes("ok"));
    return toString(good.get(key)) == "ok" && good.add("rounds", 1) == round;
  };
  ASSERT_TRUE(goodClientWorks());

  // (d) half a header, then silence, for the rest of the test.
  net::Socket stalled = rawClient(server.port());
  Bytes header = wireHeader(kWireMagic, kWireVersion, kCmdGet, 8);
  sendRaw(stalled, Bytes(header.begin(), header.begin() + 6));
  // Legal headers announcing the largest SET there is, a little of the payload, then silence: the
  // server must not reserve what they announce.
  std::vector<net::Socket> trickles;
  for (int i = 0; i < 4; ++i) {
    trickles.push_back(rawClient(server.port()));
    const uint32_t max_set = 4 + kMaxStoreKeyBytes + 4 + kMaxStoreValueBytes;
    sendRaw(trickles.back(), wireHeader(kWireMagic, kWireVersion, kCmdSet, max_set));
    sendRaw(trickles.back(), Bytes(4096, 0));
  }
  EXPECT_TRUE(goodClientWorks());

  std::mt19937 rng(42);
  Bytes garbage(4096);
  for (auto& b : garbage) b = static_cast<uint8_t>(rng());
  Bytes lying_key = wireHeader(kWireMagic, kWireVersion, kCmdGet, 8);  // key length 0xFFFFFFF0 in 8 bytes
  lying_key.insert(lying_key.end(), {0xf0, 0xff, 0xff, 0xff, 'a', 'b', 'c', 'd'});
  Bytes lying_list = wireHeader(kWireMagic, kWireVersion, kCmdCheck, 4);  // a billion keys in 4 bytes
  lying_list.insert(lying_list.end(), {0x00, 0xca, 0x9a, 0x3b});
  const std::vector<std::pair<const char*, Bytes>> hostile = {
      {"(a) random garbage", garbage},
      {"(b) wrong magic", wireHeader(0xdeadbeef, kWireVersion, kCmdGet, 4)},
      {"(c) a payload of 4 GiB", wireHeader(kWireMagic, kWireVersion, kCmdSet, 0xFFFFFFFFu)},
      {"wrong version", wireHeader(kWireMagic, 99, kCmdGet, 4)},
      {"unknown command", wireHeader(kWireMagic, kWireVersion, 999, 0)},
      {"a payload over its command's limit", wireHeader(kWireMagic, kWireVersion, kCmdNumKeys, 1)},
      {"a key length past the payload", lying_key},
      {"a key count past the payload", lying_list},
  };
  for (const auto& [what, bytes] : hostile) {
    SCOPED_TRACE(what);
    net::Socket s = rawClient(server.port());
    sendRaw(s, bytes);
    EXPECT_TRUE(closedByServer(s));
    EXPECT_TRUE(goodClientWorks());
  }

  // The stalled and trickling clients are still connected, and still not in anyone's way.
  EXPECT_TRUE(eventually([&] { return server.numClients() == 1 + 1 + 4; })) << server.numClients();
  EXPECT_TRUE(goodClientWorks());
  TcpStore another("127.0.0.1", server.port(), 5s);
  EXPECT_EQ(toString(another.get("round/0")), "ok");

  const long grown_kib = rssKiB() - rss_before;
  EXPECT_LT(grown_kib, 32 * 1024) << "resident memory grew by " << grown_kib << " KiB";
}

TEST(TcpStoreTest, ConnectingRetriesUntilTheServerStarts) {
  uint16_t port = TcpStoreServer("127.0.0.1", 0).port();  // a free port, free again now
  std::unique_ptr<TcpStoreServer> server;
  std::string server_error;
  std::thread starter([&] {
    std::this_thread::sleep_for(300ms);
    try {
      server = std::make_unique<TcpStoreServer>("127.0.0.1", port);
    } catch (const std::exception& e) {
      server_error = e.what();
    }
  });
  auto t0 = Clock::now();
  std::unique_ptr<TcpStore> client;
  try {
    client = std::make_unique<TcpStore>("127.0.0.1", port, 5s);
  } catch (...) {
    starter.join();
    throw;
  }
  starter.join();
  ASSERT_TRUE(server_error.empty()) << server_error;
  EXPECT_GE(secondsSince(t0), 0.25);
  client->set("k", toBytes("v"));
  EXPECT_EQ(toString(client->get("k")), "v");
}

TEST(TcpStoreTest, AnUnreachableServerIsARendezvousErrorNamingItAndTheTimeout) {
  uint16_t port = TcpStoreServer("127.0.0.1", 0).port();
  auto t0 = Clock::now();
  std::string msg = messageOf<RendezvousError>([&] { TcpStore("127.0.0.1", port, 300ms); });
  EXPECT_LT(secondsSince(t0), 3.0);
  EXPECT_NE(msg.find(fmt::format("127.0.0.1:{}", port)), std::string::npos) << msg;
  EXPECT_NE(msg.find("300ms"), std::string::npos) << msg;
}

TEST(TcpStoreTest, AServerShutdownFailsABlockedGetPromptly) {
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0);
  TcpStore client("127.0.0.1", server->port(), 10s);
  std::string error;
  auto t0 = Clock::now();
  std::thread getter([&] {
    try {
      client.get("never");
    } catch (const IoError& e) {
      error = e.what();
    } catch (const std::exception& e) {
      error = std::string("wrong exception type: ") + e.what();
    }
  });
  std::this_thread::sleep_for(200ms);
  server.reset();
  getter.join();
  EXPECT_LT(secondsSince(t0), 3.0);
  EXPECT_NE(error.find("'never'"), std::string::npos) << error;
  EXPECT_EQ(error.find("wrong exception"), std::string::npos) << error;
}

// ---- FileStore ----

TEST(FileStoreTest, AMissingDirectoryIsARendezvousErrorNamingThePath) {
  test::TempDir dir;
  std::string path = dir.path() + "/no/such/dir/store";
  std::string msg = messageOf<RendezvousError>([&] { FileStore(path, 1s); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
}

TEST(FileStoreTest, AFileThatIsNotAStoreIsRejected) {
  test::TempDir dir;
  std::string path = dir.path() + "/notes.txt";
  std::ofstream(path) << "these are someone's notes, not a store\n";
  std::string msg = messageOf<ProtocolError>([&] { FileStore(path, 1s); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  std::ifstream f(path);
  std::string first;
  std::getline(f, first);
  EXPECT_EQ(first, "these are someone's notes, not a store");  // left untouched
}

// A writer killed halfway through an append leaves a torn record; the next operation cuts it off.
TEST(FileStoreTest, ATornLastRecordIsCutOff) {
  test::TempDir dir;
  std::string path = dir.path() + "/store";
  FileStore(path, 1s).set("a", toBytes("1"));
  const auto intact = std::filesystem::file_size(path);
  std::ofstream(path, std::ios::app | std::ios::binary) << std::string("S\x05\x00\x00\x00" "ab", 7);
  FileStore store(path, 1s);
  store.set("b", toBytes("2"));
  FileStore fresh(path, 1s);
  EXPECT_EQ(toString(fresh.get("a")), "1");
  EXPECT_EQ(toString(fresh.get("b")), "2");
  EXPECT_EQ(fresh.numKeys(), 2);
  EXPECT_GT(std::filesystem::file_size(path), intact);
}

// A store file deleted and created anew (a new job on the same path) is read from the start.
TEST(FileStoreTest, ARecreatedFileIsReadAfresh) {
  test::TempDir dir;
  std::string path = dir.path() + "/store";
  FileStore old_job(path, 1s);
  old_job.set("x", toBytes("old"));
  std::filesystem::remove(path);
  FileStore new_job(path, 1s);
  new_job.set("y", toBytes("new"));
  EXPECT_FALSE(old_job.check({"x"}));
  EXPECT_EQ(toString(old_job.get("y")), "new");
  EXPECT_EQ(old_job.numKeys(), 1);
}

}  // namespace
}  // namespace dtrain::comm
