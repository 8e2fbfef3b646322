// libFuzzer harness: the tcp transport (src/comm/transport/tcp/transport.cc) of rank 0 in a 2-rank group,
// with the harness as rank 1: the acceptor reading a stranger's bytes where a Hello is due, then the
// frames of a collective from a peer that passed the Hello (frame headers, fingerprints, lengths,
// payloads, abort frames with their messages). Input: byte 0's bits pick whether a stranger connects
// first with the input as its Hello and whether rank 0 reduces what it receives; the rest is the peer's
// frames, after which it half-closes. Rank 0 must finish its collective or fail with a dtrain::Error
// (within its 2 s timeout), never crash.
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "comm/net/auth.h"
#include "comm/transport/tcp/hello.h"
#include "comm/transport/transport.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"
#include "fuzz_util.h"

using namespace dtrain::comm;  // NOLINT(google-build-using-namespace)
namespace comm = dtrain::comm;
namespace fuzz = dtrain::fuzz;
using comm::transport::Op;

namespace {
void sum(void* out, const void* a, const void* b, size_t count, DType, ReduceOp) {
  for (size_t i = 0; i < count; ++i)
    static_cast<float*>(out)[i] = static_cast<const float*>(a)[i] + static_cast<const float*>(b)[i];
}

// Connects as rank 1 of the group whose rank 0 published in `store`: reads the greeting, sends `hello`.
int connectAsPeer(comm::Store& store, const void* hello, size_t n) {
  const std::string addr = toString(store.get("tcp/addr/0"));
  const int fd = fuzz::connectLoopback(static_cast<uint16_t>(std::stoi(addr.substr(addr.rfind(':') + 1))));
  if (fd < 0) return -1;
  uint8_t greeting[comm::net::kGreetingBytes];
  size_t got = 0;
  while (got < sizeof greeting) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 2000) <= 0) break;
    ssize_t r = ::recv(fd, greeting + got, sizeof greeting - got, 0);
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  fuzz::sendSome(fd, static_cast<const uint8_t*>(hello), n, std::chrono::milliseconds(500));
  return fd;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static comm::TcpStoreServer server("127.0.0.1", 0);
  // One client each: a GET parks its connection until the key exists.
  static auto mine = std::make_shared<comm::TcpStore>("127.0.0.1", server.port(), std::chrono::seconds(5));
  static auto rank0s = std::make_shared<comm::TcpStore>("127.0.0.1", server.port(), std::chrono::seconds(5));
  static int run = 0;
  const std::string prefix = fmt::format("fuzz{}", run++);
  comm::PrefixStore store(prefix, mine), rank0_store(prefix, rank0s);
  const bool stranger = data[0] & 1, reduce = data[0] & 2;
  std::atomic<bool> done{false};
  std::thread rank0([&] {
    try {
      comm::transport::TransportOptions o;
      o.timeout = std::chrono::seconds(2);
      auto t = comm::transport::createTransport("tcp", rank0_store, 0, 2, o);
      std::vector<float> in(64, 1.0f), out(64, 0.0f);
      comm::transport::Label label;
      label.op = comm::transport::OpCode::allreduce;
      label.seq = 0;
      label.fp.op = static_cast<uint16_t>(comm::transport::OpCode::allreduce);
      label.fp.dtype = static_cast<uint8_t>(DType::f32);
      label.fp.count = 64;
      label.what = "allreduce seq=0 f32 x 64";
      label.timeout = o.timeout;
      std::vector<Op> ops{comm::transport::sendOp(1, 0, in.data(), sizeof(float) * in.size()),
                          comm::transport::recvOp(1, 0, out.data(), sizeof(float) * out.size())};
      if (reduce) {
        ops[1].reduce = sum;
        ops[1].dtype = DType::f32;
      }
      t->run(ops, comm::net::deadlineAfter(o.timeout), label);
    } catch (const dtrain::Error& e) {
      if (std::getenv("FUZZ_VERBOSE")) std::fprintf(stderr, "rank 0: %s\n", e.what());
    }
    done = true;
  });
  if (stranger) {
    const int fd = connectAsPeer(store, data + 1, size - 1);
    if (fd >= 0) ::close(fd);
  }
  comm::transport::TcpHello hello;
  hello.nonce = std::stoull(toString(store.get("tcp/nonce")));
  hello.rank = 1;
  hello.size = 2;
  const int fd = connectAsPeer(store, &hello, sizeof hello);
  if (fd >= 0) {
    fuzz::sendSome(fd, data + 1, size - 1, std::chrono::milliseconds(1000));
    ::shutdown(fd, SHUT_WR);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(6);
  while (!done && std::chrono::steady_clock::now() < until) fuzz::drainUntilClosed(fd, std::chrono::milliseconds(20));
  if (fd >= 0) ::close(fd);
  if (!done) fuzz::die("rank 0's collective did not end within 6 s (its timeout is 2 s)");
  rank0.join();
  return 0;
}
