// libFuzzer harness: the etcd store's reading of etcd's answers (src/comm/store/etcd_store.cc,
// etcd_http.cc): the JSON of the v3 gateway's range, put, txn, delete and lease answers, base64 keys and
// values, revisions, error codes. A fake etcd answers every HTTP request with the input as its body
// (byte 0 picks the store operation and the HTTP status). The store must return or throw a
// dtrain::Error, never crash, never wait past its timeout.
#include <thread>

#include "dtrain/comm/error.h"
#include "dtrain/comm/etcd.h"
#include "dtrain/comm/store.h"
#include "fuzz_util.h"

using namespace dtrain::comm;  // NOLINT(google-build-using-namespace)
namespace comm = dtrain::comm;
namespace fuzz = dtrain::fuzz;

namespace {
void request(comm::EtcdStore& s, uint8_t which) {
  switch (which % 9) {
    case 0: s.set("k", Bytes{1, 2, 3}); break;
    case 1: s.get("k"); break;
    case 2: s.add("k", 5); break;
    case 3: s.compareSet("k", Bytes{1}, Bytes{2}); break;
    case 4: s.deleteKey("k"); break;
    case 5: s.check({"a", "b"}); break;
    case 6: s.numKeys(); break;
    case 7: s.list("n/"); break;
    default: s.wait({"a"}, std::chrono::milliseconds(200)); break;
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static uint16_t port = 0;
  static const int listener = fuzz::listenLoopback(port);
  if (listener < 0) fuzz::die("cannot listen");
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  const std::string answer = fmt::format("HTTP/1.1 {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n"
                                         "Connection: close\r\n\r\n{}",
                                         (data[0] & 0x80) ? "400 Bad Request" : "200 OK", body.size(), body);
  std::atomic<bool> stop{false};
  std::thread etcd([&] {  // answers every request until the store is done
    while (!stop) {
      pollfd p{listener, POLLIN, 0};
      if (::poll(&p, 1, 10) <= 0) continue;
      int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      fuzz::resetOnClose(fd);
      char buf[8192];
      pollfd q{fd, POLLIN, 0};
      if (::poll(&q, 1, 500) > 0) (void)::recv(fd, buf, sizeof buf, MSG_DONTWAIT);  // the request
      fuzz::sendSome(fd, reinterpret_cast<const uint8_t*>(answer.data()), answer.size(), std::chrono::milliseconds(500));
      ::shutdown(fd, SHUT_WR);
      fuzz::drainUntilClosed(fd, std::chrono::milliseconds(200));
      ::close(fd);
    }
  });
  const auto start = std::chrono::steady_clock::now();
  try {
    comm::EtcdStore store(fmt::format("127.0.0.1:{}", port), "/fuzz/", std::chrono::milliseconds(400));
    request(store, data[0]);
  } catch (const dtrain::Error&) {
  }
  const auto took = std::chrono::steady_clock::now() - start;
  stop = true;
  etcd.join();
  if (took > std::chrono::seconds(4)) fuzz::die("the etcd store waited past its timeout");
  return 0;
}
