// libFuzzer harness: the TcpStore server (src/comm/store/tcp_store_server.cc) reading a client's bytes:
// frame headers, every command's payload and key lists, parked GET/WAIT, and with a job secret the
// authentication answer (net/auth). Input: byte 0 picks the server without or with a secret; the rest
// is what a client sends, then it half-closes. The server must answer or close the connection (within
// 5 s), never crash, and keep serving a well-formed client afterwards.
#include <cstring>
#include <memory>

#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"
#include "fuzz_util.h"

using namespace dtrain::comm;  // NOLINT(google-build-using-namespace)
namespace comm = dtrain::comm;
namespace fuzz = dtrain::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static comm::TcpStoreServer plain("127.0.0.1", 0);
  static comm::TcpStoreServer locked("127.0.0.1", 0, "fuzz-secret");
  static comm::TcpStore client("127.0.0.1", plain.port(), std::chrono::seconds(5));
  static comm::TcpStore locked_client("127.0.0.1", locked.port(), std::chrono::seconds(5), "fuzz-secret");
  const bool secret = data[0] & 1;
  const int fd = fuzz::connectLoopback(secret ? locked.port() : plain.port());
  if (fd < 0) fuzz::die("cannot connect to the store server");
  fuzz::sendSome(fd, data + 1, size - 1, std::chrono::milliseconds(2000));
  ::shutdown(fd, SHUT_WR);
  const bool closed = fuzz::drainUntilClosed(fd, std::chrono::milliseconds(5000));
  ::close(fd);
  if (!closed) fuzz::die("the store server kept a connection open 5 s after the client's end of input");
  // Still serving: a client's ADD on the server that got the bytes.
  static int64_t count[2] = {0, 0};
  comm::TcpStore& c = secret ? locked_client : client;
  if (c.add("fuzz/alive", 1) != ++count[secret]) fuzz::die("the store server lost a counter");
  return 0;
}
