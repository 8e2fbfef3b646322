// Authenticated connections (src/comm/net/auth.h, docs/SECURITY.md): the store server and the tcp
// transport's listener refuse a client with a wrong secret, with none, and one replaying a captured
// handshake, log each refusal with the peer's address, and go on serving the job; the secret appears
// in no message. jobSecretFrom's checks of DTRAIN_SECRET_FILE.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <thread>

#include "comm/net/auth.h"
#include "comm/net/socket.h"
#include "comm/transport/tcp/hello.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/store.h"
#include "harness.h"

namespace dtrain::test {
namespace {

using namespace std::chrono_literals;
using comm::GroupOptions;
using comm::toBytes;
using comm::toString;
using comm::ProcessGroup;
using comm::TcpStore;
using comm::TcpStoreServer;
namespace net = comm::net;

const std::string kSecret = "correct horse battery staple";

// A connection that has read its greeting.
struct Greeted {
  net::Socket s;
  bool requires_secret = false;
  net::Challenge challenge{};
};

Greeted greet(const std::string& host, uint16_t port) {
  Greeted g;
  g.s = net::Socket::connect(host, port, net::deadlineAfter(5s));
  net::Greeting raw{};
  g.s.recvAll(raw.data(), raw.size(), net::deadlineAfter(5s), "greeting");
  EXPECT_EQ(std::string(raw.begin(), raw.begin() + 4), "DTAU");
  g.requires_secret = raw[4] != 0;
  std::copy(raw.begin() + 5, raw.end(), g.challenge.begin());
  return g;
}

// Sends extra[n] and the MAC; the verdict byte, or -1 when the connection closed without one.
int answer(Greeted& g, const void* extra, size_t n, const net::Mac& mac) {
  std::string out(static_cast<const char*>(extra), n);
  out.append(reinterpret_cast<const char*>(mac.data()), mac.size());
  g.s.sendAll(out.data(), out.size(), net::deadlineAfter(5s));
  uint8_t v = 0;
  try {
    g.s.recvAll(&v, 1, net::deadlineAfter(5s), "verdict");
  } catch (const IoError&) {
    return -1;
  }
  return v;
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = 0; (at = text.find(what, at)) != std::string::npos; at += what.size()) ++n;
  return n;
}

TEST(Auth, StoreRefusesWrongMissingAndReplayedSecrets) {
  std::string wrong, none;
  ::testing::internal::CaptureStderr();
  {
    TcpStoreServer server("127.0.0.1", 0, kSecret);
    TcpStore good("127.0.0.1", server.port(), 5s, kSecret);
    good.set("k", toBytes("v"));
    wrong = errorOf([&] { TcpStore("127.0.0.1", server.port(), 2s, "not the secret").get("k"); });
    none = errorOf([&] { TcpStore("127.0.0.1", server.port(), 2s).get("k"); });
    // A handshake recorded on one connection does not open another: each greeting has a new challenge.
    Greeted first = greet("127.0.0.1", server.port());
    EXPECT_TRUE(first.requires_secret);
    const net::Mac recorded = net::computeMac(kSecret, "store", first.challenge, nullptr, 0);
    EXPECT_EQ(answer(first, nullptr, 0, recorded), net::kAccepted);
    Greeted second = greet("127.0.0.1", server.port());
    EXPECT_NE(second.challenge, first.challenge);
    EXPECT_EQ(answer(second, nullptr, 0, recorded), net::kRefused);
    // The job goes on.
    EXPECT_EQ(toString(good.get("k")), "v");
    good.set("k2", toBytes("w"));
    EXPECT_EQ(good.add("n", 2), 2);
    // (the refused connections are closed: only the good client and `first` remain)
    EXPECT_TRUE([&] {
      for (int i = 0; i < 200 && server.numClients() != 2; ++i) std::this_thread::sleep_for(10ms);
      return server.numClients() == 2;
    }()) << server.numClients();
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(wrong.find("authentication failed"), std::string::npos) << wrong;
  EXPECT_NE(none.find("authentication failed"), std::string::npos) << none;
  EXPECT_NE(none.find("requires the job secret"), std::string::npos) << none;
  // Wrong and replayed: refused for the MAC; none: closed before authenticating. Each names the peer.
  EXPECT_EQ(count(log, "refused a connection from 127.0.0.1:"), 3) << log;
  EXPECT_EQ(count(log, "authentication failed (wrong job secret)"), 2) << log;
  EXPECT_EQ(count(log, "closed before authenticating"), 1) << log;
  for (const std::string& text : {log, wrong, none}) EXPECT_EQ(text.find(kSecret), std::string::npos) << text;
}

// A clone (the parameter server's store connections, the etcd lease's) carries the secret: it used to
// connect without it and fail to authenticate.
TEST(Auth, AStoreCloneProvesTheSecretToo) {
  TcpStoreServer server("127.0.0.1", 0, kSecret);
  TcpStore store("127.0.0.1", server.port(), 5s, kSecret);
  store.set("k", toBytes("v"));
  auto clone = store.clone();
  EXPECT_EQ(toString(clone->get("k")), "v");
  clone->set("k2", toBytes("w"));
  EXPECT_EQ(toString(store.get("k2")), "w");
}

TEST(Auth, WithoutSecretsNothingChangesAndOneSidedSecretsFail) {
  TcpStoreServer open_server("127.0.0.1", 0);
  TcpStore plain("127.0.0.1", open_server.port(), 5s);
  plain.set("k", toBytes("v"));
  EXPECT_EQ(toString(plain.get("k")), "v");
  const std::string msg = errorOf([&] { TcpStore("127.0.0.1", open_server.port(), 2s, kSecret).get("k"); });
  EXPECT_NE(msg.find("authentication failed"), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not ask"), std::string::npos) << msg;
}

// While ranks 0 and 1 form a tcp group with the secret, a stranger (rank 2 of the test) tries rank 0's
// listener with a wrong secret, with none, and with a hello and MAC captured from another connection:
// all refused and logged by rank 0, and the group then forms and works.
TEST(Auth, TransportListenerRefusesStrangersAndTheGroupForms) {
  StoreServer server;
  auto results = runRanks(3, [&](int rank) {
    auto store = server.client();
    if (rank == 2) {
      const std::string addr = toString(store->get("tcp/addr/0"));
      const std::string host = addr.substr(0, addr.rfind(':'));
      const auto port = static_cast<uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1)));
      comm::transport::TcpHello hello;
      hello.rank = 1;
      hello.size = 2;
      Greeted wrong = greet(host, port);
      EXPECT_TRUE(wrong.requires_secret);
      EXPECT_EQ(answer(wrong, &hello, sizeof hello,
                       net::computeMac("a guess", "transport", wrong.challenge, &hello, sizeof hello)),
                net::kRefused);
      { Greeted none = greet(host, port); }  // has no secret: reads the greeting and leaves
      // A legitimate connector's hello and MAC, captured: valid for its own challenge only.
      Greeted other = greet(host, port);
      const net::Mac captured = net::computeMac(kSecret, "transport", net::freshChallenge(), &hello, sizeof hello);
      EXPECT_EQ(answer(other, &hello, sizeof hello, captured), net::kRefused);
      store->set("stranger/done", toBytes("1"));
      return;
    }
    if (rank == 1) store->wait({"stranger/done"});  // rank 0 is listening meanwhile
    GroupOptions o;
    o.transport = "tcp";
    o.secret = kSecret;
    o.timeout = 30s;
    auto pg = ProcessGroup::create(store, rank, 2, o);
    float x = static_cast<float>(rank + 1);
    pg->allreduce(&x, 1, comm::DType::f32, comm::ReduceOp::sum)->wait();
    EXPECT_EQ(x, 3.0f);
  });
  expectAllOk(results);
  ASSERT_EQ(results.size(), 3u);
  const std::string& log0 = results[0].output;
  EXPECT_EQ(count(log0, "tcp transport: refused a connection from 127.0.0.1:"), 3) << log0;
  EXPECT_EQ(count(log0, "authentication failed (wrong job secret)"), 2) << log0;
  for (const auto& r : results) EXPECT_EQ(r.output.find(kSecret), std::string::npos) << r.output;
}

// A rank with another secret fails naming authentication; the rank it dialled times out naming it.
TEST(Auth, ARankWithAnotherSecretFails) {
  StoreServer server;
  auto results = runRanks(2, [&](int rank) {
    GroupOptions o;
    o.transport = "tcp";
    o.secret = rank == 0 ? kSecret : "another job's secret";
    o.timeout = 3s;
    const std::string msg = errorOf([&] { ProcessGroup::create(server.client(), rank, 2, o); });
    if (rank == 1) {
      EXPECT_NE(msg.find("authentication failed"), std::string::npos) << msg;
      EXPECT_NE(msg.find("rank 0 at"), std::string::npos) << msg;
    } else {
      EXPECT_NE(msg.find("ranks 1 did not connect"), std::string::npos) << msg;
    }
  });
  expectAllOk(results);
}

TEST(Auth, SecretFileMustBeTheOwnersOnly) {
  TempDir dir;
  const std::string path = dir.path() + "/secret";
  std::ofstream(path) << "s3cret\n";
  ::chmod(path.c_str(), 0600);
  EXPECT_EQ(comm::jobSecretFrom(nullptr, path.c_str()), "s3cret");
  EXPECT_EQ(comm::jobSecretFrom("given", nullptr), "given");
  EXPECT_EQ(comm::jobSecretFrom(nullptr, nullptr), "");
  EXPECT_EQ(comm::jobSecretFrom("", ""), "");
  ::chmod(path.c_str(), 0640);
  std::string msg = errorOf([&] { comm::jobSecretFrom(nullptr, path.c_str()); });
  EXPECT_NE(msg.find("chmod 600"), std::string::npos) << msg;
  EXPECT_NE(msg.find("0640"), std::string::npos) << msg;
  msg = errorOf([&] { comm::jobSecretFrom("a", path.c_str()); });
  EXPECT_NE(msg.find("both DTRAIN_SECRET and DTRAIN_SECRET_FILE"), std::string::npos) << msg;
  msg = errorOf([&] { comm::jobSecretFrom(nullptr, (dir.path() + "/missing").c_str()); });
  EXPECT_NE(msg.find("DTRAIN_SECRET_FILE"), std::string::npos) << msg;
  std::ofstream(dir.path() + "/empty").flush();
  ::chmod((dir.path() + "/empty").c_str(), 0600);
  msg = errorOf([&] { comm::jobSecretFrom(nullptr, (dir.path() + "/empty").c_str()); });
  EXPECT_NE(msg.find("empty"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("s3cret"), std::string::npos);
}

}  // namespace
}  // namespace dtrain::test
