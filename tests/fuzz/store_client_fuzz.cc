// libFuzzer harness: the TcpStore client (src/comm/store/tcp_store_client.cc) reading a server's bytes:
// the greeting and the authentication verdict (net/auth), then an answer's header and payload for
// each request kind. Input: byte 0 picks the request (and a secret or none), the rest is everything
// the "server" sends before it closes. The client must return or throw a dtrain::Error, never crash,
// never wait past its timeout.
#include <thread>

#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"
#include "fuzz_util.h"

using namespace dtrain::comm;  // NOLINT(google-build-using-namespace)
namespace comm = dtrain::comm;
namespace fuzz = dtrain::fuzz;

namespace {
void request(comm::Store& s, uint8_t which) {
  switch (which % 8) {
    case 0: s.set("k", Bytes{1, 2, 3}); break;
    case 1: s.get("k"); break;
    case 2: s.add("k", 5); break;
    case 3: s.compareSet("k", Bytes{1}, Bytes{2}); break;
    case 4: s.deleteKey("k"); break;
    case 5: s.check({"a", "b", "c"}); break;
    case 6: s.wait({"a", "b"}, std::chrono::milliseconds(300)); break;
    default: s.numKeys(); break;
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static uint16_t port = 0;
  static const int listener = fuzz::listenLoopback(port);
  if (listener < 0) fuzz::die("cannot listen");
  // The fake server: accepts the client, sends the input, reads what the client sends, closes.
  std::thread server([&] {
    pollfd p{listener, POLLIN, 0};
    if (::poll(&p, 1, 2000) <= 0) return;
    int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    fuzz::resetOnClose(fd);
    fuzz::sendSome(fd, data + 1, size - 1, std::chrono::milliseconds(1000));
    ::shutdown(fd, SHUT_WR);
    fuzz::drainUntilClosed(fd, std::chrono::milliseconds(2000));
    ::close(fd);
  });
  const auto start = std::chrono::steady_clock::now();
  try {
    comm::TcpStore store("127.0.0.1", port, std::chrono::milliseconds(300), (data[0] & 8) ? "fuzz-secret" : "");
    request(store, data[0]);
  } catch (const dtrain::Error&) {
  }
  const auto took = std::chrono::steady_clock::now() - start;
  server.join();
  if (took > std::chrono::seconds(3)) fuzz::die("the store client waited past its timeout");
  return 0;
}
