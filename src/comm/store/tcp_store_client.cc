// TcpStore: the key-value store's client, one connection to a TcpStoreServer (like c10d's TCPStore).
// The wire format is in tcp_store_codec.h.
//
// Timeouts are the client's business: the server parks a GET/WAIT until its keys exist. A client
// whose GET/WAIT passes its deadline drops the connection (the server's late answer goes nowhere and
// the parked request dies with the socket) and reconnects on its next request, so an answer can
// never be matched to the wrong request.
#include <algorithm>
#include <mutex>

#include "comm/net/auth.h"
#include "comm/net/socket.h"
#include "comm/store/quote.h"
#include "comm/store/tcp_store_codec.h"
#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm {
using namespace tcp_store_wire;  // NOLINT(google-build-using-namespace): the wire format's own names

namespace {
std::string msText(Duration d) { return fmt::format("{}ms", d.count()); }
}  // namespace

struct TcpStore::Impl {
  Impl(std::string h, uint16_t p, std::string s)
      : host(std::move(h)), port(p), addr(fmt::format("{}:{}", host, port)), secret(std::move(s)) {}

  // Sends one request and returns the answer's payload. Any failure but a rejected argument drops
  // the connection, so the next request starts on a fresh one and cannot read a stale answer.
  // `awaited`: the keys a GET/WAIT blocks on, named in its timeout message.
  Bytes call(Bytes frame, Duration timeout, const std::string& what,
             const std::vector<std::string>* awaited = nullptr);
  void connect(net::Deadline deadline, Duration timeout, const std::string& what);
  Bytes exchange(const Bytes& frame, net::Deadline deadline);
  std::vector<std::string> missingKeys(const std::vector<std::string>& keys, Duration timeout);
  // The server's greeting read, and with a secret its challenge answered (net/auth.h).
  void authenticate(const net::Socket& s, net::Deadline deadline) const {
    net::authenticate(s, secret, "store", nullptr, 0, deadline, "the store server " + addr);
  }

  const std::string host;
  const uint16_t port;
  const std::string addr;
  const std::string secret;
  std::mutex mu;      // serialises requests: one in flight per connection
  net::Socket sock;   // invalid while disconnected
};

void TcpStore::Impl::connect(net::Deadline deadline, Duration timeout, const std::string& what) {
  net::Socket s;
  try {
    s = net::Socket::connect(host, port, deadline);
  } catch (const Error& e) {
    throw RendezvousError(fmt::format("TcpStore {}: cannot reach the store server {} within {}: {}", what,
                                      addr, msText(timeout), e.what()));
  }
  try {
    authenticate(s, deadline);
  } catch (const Error& e) {
    throw RendezvousError(fmt::format("TcpStore {}: {}", what, e.what()));
  }
  sock = std::move(s);
}

// One request/answer on the current connection; throws what the socket throws, or ProtocolError.
Bytes TcpStore::Impl::exchange(const Bytes& frame, net::Deadline deadline) {
  sock.sendAll(frame.data(), frame.size(), deadline, "store request");
  uint8_t hb[kHeaderBytes];
  sock.recvAll(hb, sizeof hb, deadline, "store answer");
  Header h = decodeHeader(hb);
  if (h.magic != kMagic || h.version != kVersion) {
    throw ProtocolError(fmt::format("answer with bad magic 0x{:08x} or version {}", h.magic, h.version));
  }
  if (h.len > kMaxAnswerPayload) {
    throw ProtocolError(fmt::format("answer claims {} bytes, over the limit of {}", h.len, kMaxAnswerPayload));
  }
  Bytes payload(h.len);
  sock.recvAll(payload.data(), payload.size(), deadline, "store answer");
  if (h.code == kInvalidArgument) {
    Reader r(payload);
    std::string msg = toString(r.value());
    throw InvalidArgument(msg);
  }
  if (h.code != kOk) throw ProtocolError(fmt::format("answer with unknown status {}", h.code));
  return payload;
}

Bytes TcpStore::Impl::call(Bytes frame, Duration timeout, const std::string& what,
                           const std::vector<std::string>* awaited) {
  std::lock_guard<std::mutex> lock(mu);
  const net::Deadline deadline = net::deadlineAfter(timeout);
  if (!sock.valid()) connect(deadline, timeout, what);
  try {
    return exchange(frame, deadline);
  } catch (const InvalidArgument& e) {
    // The server rejected the request and answered in full: the connection is still in step.
    throw InvalidArgument(fmt::format("TcpStore {} (store server {})", e.what(), addr));
  } catch (const TimeoutError& e) {
    sock = net::Socket();
    if (awaited) {
      std::vector<std::string> missing = missingKeys(*awaited, timeout);
      throw TimeoutError(fmt::format("TcpStore {} timed out after {} waiting for key{} {} (store server {})",
                                     what, msText(timeout), missing.size() == 1 ? "" : "s",
                                     quoteKeys(missing), addr));
    }
    throw TimeoutError(fmt::format("TcpStore {}: no answer from the store server {} within {}: {}", what, addr,
                                   msText(timeout), e.what()));
  } catch (const ProtocolError& e) {
    sock = net::Socket();
    throw ProtocolError(fmt::format("TcpStore {}: bad answer from the store server {}: {}", what, addr, e.what()));
  } catch (const std::exception& e) {
    sock = net::Socket();
    throw IoError(fmt::format("TcpStore {}: connection to the store server {} failed: {}", what, addr, e.what()));
  }
}

// After a timed-out WAIT: which of `keys` are still missing. Best effort on a fresh connection with
// a short deadline; when that fails too, every awaited key is reported.
std::vector<std::string> TcpStore::Impl::missingKeys(const std::vector<std::string>& keys, Duration timeout) {
  if (keys.size() <= 1) return keys;
  try {
    net::Deadline deadline = net::deadlineAfter(std::min<Duration>(timeout, std::chrono::seconds(1)));
    sock = net::Socket::connect(host, port, deadline);
    authenticate(sock, deadline);
    Bytes answer = exchange(Writer().keys(keys).finish(static_cast<uint16_t>(Cmd::kCheck)), deadline);
    if (answer.size() != keys.size()) throw ProtocolError("CHECK answer of the wrong size");
    std::vector<std::string> missing;
    for (size_t i = 0; i < keys.size(); ++i)
      if (!answer[i]) missing.push_back(keys[i]);
    return missing.empty() ? keys : missing;  // all arrived just now: still name what was awaited
  } catch (const std::exception&) {
    sock = net::Socket();
    return keys;
  }
}

namespace {
void checkKey(const std::string& key, const char* op) {
  if (key.size() > kMaxStoreKeyBytes) {
    throw InvalidArgument(fmt::format("store {}({}): key of {} bytes exceeds the limit of {}", op, quoteKey(key),
                                      key.size(), kMaxStoreKeyBytes));
  }
}
void checkValue(const std::string& key, const Bytes& value, const char* op) {
  if (value.size() > kMaxStoreValueBytes) {
    throw InvalidArgument(fmt::format("store {}({}): value of {} bytes exceeds the limit of {}", op, quoteKey(key),
                                      value.size(), kMaxStoreValueBytes));
  }
}
void checkKeyList(const std::vector<std::string>& keys, const char* op) {
  size_t bytes = 4;
  for (const auto& k : keys) {
    checkKey(k, op);
    bytes += 4 + k.size();
  }
  if (bytes > kMaxKeyListBytes) {
    throw InvalidArgument(fmt::format("store {}: {} keys take {} bytes, over the limit of {}", op, keys.size(),
                                      bytes, kMaxKeyListBytes));
  }
}
uint16_t code(Cmd c) { return static_cast<uint16_t>(c); }
}  // namespace

TcpStore::TcpStore(const std::string& host, uint16_t port, Duration timeout, std::string secret)
    : Store(timeout), impl_(std::make_unique<Impl>(host, port, std::move(secret))) {
  impl_->connect(net::deadlineAfter(timeout), timeout, "connect");
}

TcpStore::~TcpStore() = default;

void TcpStore::set(const std::string& key, const Bytes& value) {
  checkKey(key, "set");
  checkValue(key, value, "set");
  impl_->call(Writer().str(key).str(value).finish(code(Cmd::kSet)), timeout(),
              fmt::format("set({})", quoteKey(key)));
}

Bytes TcpStore::get(const std::string& key) {
  checkKey(key, "get");
  std::vector<std::string> awaited{key};
  Bytes answer = impl_->call(Writer().str(key).finish(code(Cmd::kGet)), timeout(),
                             fmt::format("get({})", quoteKey(key)), &awaited);
  Reader r(answer);
  Bytes value = r.value();
  r.end();
  return value;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  checkKey(key, "add");
  Bytes answer = impl_->call(Writer().str(key).i64(delta).finish(code(Cmd::kAdd)), timeout(),
                             fmt::format("add({}, {})", quoteKey(key), delta));
  Reader r(answer);
  int64_t v = r.i64();
  r.end();
  return v;
}

Bytes TcpStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  checkKey(key, "compareSet");
  checkValue(key, expected, "compareSet");
  checkValue(key, desired, "compareSet");
  Bytes answer = impl_->call(Writer().str(key).str(expected).str(desired).finish(code(Cmd::kCompareSet)),
                             timeout(), fmt::format("compareSet({})", quoteKey(key)));
  Reader r(answer);
  Bytes value = r.value();
  r.end();
  return value;
}

bool TcpStore::deleteKey(const std::string& key) {
  checkKey(key, "deleteKey");
  Bytes answer = impl_->call(Writer().str(key).finish(code(Cmd::kDelete)), timeout(),
                             fmt::format("deleteKey({})", quoteKey(key)));
  Reader r(answer);
  bool existed = r.u8() != 0;
  r.end();
  return existed;
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  checkKeyList(keys, "check");
  Bytes answer = impl_->call(Writer().keys(keys).finish(code(Cmd::kCheck)), timeout(),
                             fmt::format("check([{}])", quoteKeys(keys)));
  if (answer.size() != keys.size()) {
    throw ProtocolError(fmt::format("TcpStore check: {} answers for {} keys from the store server {}",
                                    answer.size(), keys.size(), impl_->addr));
  }
  return std::all_of(answer.begin(), answer.end(), [](uint8_t b) { return b != 0; });
}

void TcpStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  checkKeyList(keys, "wait");
  impl_->call(Writer().keys(keys).finish(code(Cmd::kWait)), timeout, fmt::format("wait([{}])", quoteKeys(keys)),
              &keys);
}

int64_t TcpStore::numKeys() {
  Bytes answer = impl_->call(Writer().finish(code(Cmd::kNumKeys)), timeout(), "numKeys()");
  Reader r(answer);
  int64_t n = r.i64();
  r.end();
  return n;
}

}  // namespace dtrain::comm

namespace dtrain::comm {
// With the job secret: a clone of a store that proves it must prove it too.
std::shared_ptr<Store> TcpStore::clone() const {
  return std::make_shared<TcpStore>(impl_->host, impl_->port, timeout(), impl_->secret);
}
}  // namespace dtrain::comm
