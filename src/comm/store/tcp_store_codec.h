// The TcpStore wire format, shared by the server (tcp_store_server.cc) and the client
// (tcp_store_client.cc): frame header, commands, size limits, and the frame Writer and payload Reader.
//
// Wire protocol, little-endian. Every message either way is a 12-byte header and a payload:
//   u32 magic 'DTKV', u16 version, u16 command (request) or status (answer), u32 payload_len
// Payload fields: str = u32 length + bytes, i64 = 8 bytes, u8 = 1 byte.
//   request          payload                              answer payload (status kOk)
//   SET         1    str key, str value                   (empty)
//   GET         2    str key                              str value     parked until the key exists
//   ADD         3    str key, i64 delta                   i64 new value
//   COMPARE_SET 4    str key, str expected, str desired   str value after the operation
//   DELETE      5    str key                              u8 existed
//   CHECK       6    u32 n, n x str key                   n x u8 (1: the key exists)
//   WAIT        7    u32 n, n x str key                   (empty)       parked until all keys exist
//   NUM_KEYS    8    (empty)                              i64 count
// An answer with status kInvalidArgument (ADD on a non-integer) carries a str message instead.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm::tcp_store_wire {

constexpr uint32_t kMagic = 0x564B5444;  // "DTKV" on the wire
constexpr uint16_t kVersion = 1;
constexpr size_t kHeaderBytes = 12;

enum class Cmd : uint16_t {
  kSet = 1,
  kGet = 2,
  kAdd = 3,
  kCompareSet = 4,
  kDelete = 5,
  kCheck = 6,
  kWait = 7,
  kNumKeys = 8,
};
enum Status : uint16_t { kOk = 0, kInvalidArgument = 1 };

// A CHECK/WAIT key list: ~4000 maximal keys or a million short ones.
constexpr size_t kMaxKeyListBytes = 16u << 20;
constexpr size_t kKeyField = 4 + kMaxStoreKeyBytes;
constexpr size_t kValueField = 4 + kMaxStoreValueBytes;
// The largest answer: a value (GET, COMPARE_SET) or one byte per key of the largest key list (CHECK).
constexpr size_t kMaxAnswerPayload = std::max(kValueField, 4 + kMaxKeyListBytes / 4);

inline bool knownCommand(uint16_t c) { return c >= 1 && c <= 8; }

// The largest payload a request may carry; a header claiming more closes the connection.
size_t maxRequestPayload(Cmd cmd);

struct Header {
  uint32_t magic = 0;
  uint16_t version = 0;
  uint16_t code = 0;  // command in a request, status in an answer
  uint32_t len = 0;
};

void putLE(uint8_t* p, uint64_t v, int bytes);
uint64_t getLE(const uint8_t* p, int bytes);
Header decodeHeader(const uint8_t* p);

// Builds one frame: header placeholder, fields, then finish() fills in the header.
class Writer {
 public:
  Writer() : buf_(kHeaderBytes) {}
  Writer& u8(uint8_t v) {
    buf_.push_back(v);
    return *this;
  }
  Writer& u32(uint32_t v) { return fixed(v, 4); }
  Writer& i64(int64_t v) { return fixed(static_cast<uint64_t>(v), 8); }
  Writer& str(const void* p, size_t n) {
    u32(static_cast<uint32_t>(n));
    auto* c = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), c, c + n);
    return *this;
  }
  Writer& str(const std::string& s) { return str(s.data(), s.size()); }
  Writer& str(const Bytes& b) { return str(b.data(), b.size()); }
  Writer& keys(const std::vector<std::string>& ks) {
    u32(static_cast<uint32_t>(ks.size()));
    for (const auto& k : ks) str(k);
    return *this;
  }
  Bytes finish(uint16_t code) {
    putLE(buf_.data(), kMagic, 4);
    putLE(buf_.data() + 4, kVersion, 2);
    putLE(buf_.data() + 6, code, 2);
    putLE(buf_.data() + 8, buf_.size() - kHeaderBytes, 4);
    return std::move(buf_);
  }

 private:
  Writer& fixed(uint64_t v, int bytes) {
    size_t at = buf_.size();
    buf_.resize(at + bytes);
    putLE(buf_.data() + at, v, bytes);
    return *this;
  }
  Bytes buf_;
};

// Parses a payload; every length is checked against its limit and the bytes that remain.
class Reader {
 public:
  explicit Reader(const Bytes& b) : p_(b.data()), left_(b.size()) {}
  uint8_t u8() { return static_cast<uint8_t>(getLE(take(1), 1)); }
  uint32_t u32() { return static_cast<uint32_t>(getLE(take(4), 4)); }
  int64_t i64() { return static_cast<int64_t>(getLE(take(8), 8)); }
  std::string key() {
    size_t n = length(kMaxStoreKeyBytes, "key");
    const uint8_t* p = take(n);
    return std::string(p, p + n);
  }
  Bytes value() {
    size_t n = length(kMaxStoreValueBytes, "value");
    const uint8_t* p = take(n);
    return Bytes(p, p + n);
  }
  std::vector<std::string> keys() {
    uint32_t n = u32();
    // Each key takes at least its 4-byte length: bounds the reserve by the bytes actually present.
    if (n > left_ / 4) throw ProtocolError(fmt::format("key list claims {} keys in {} bytes", n, left_));
    std::vector<std::string> ks;
    ks.reserve(n);
    for (uint32_t i = 0; i < n; ++i) ks.push_back(key());
    return ks;
  }
  void end() const {
    if (left_ != 0) throw ProtocolError(fmt::format("{} unexpected trailing bytes", left_));
  }

 private:
  size_t length(size_t limit, const char* what) {
    uint32_t n = u32();
    if (n > limit) throw ProtocolError(fmt::format("{} of {} bytes exceeds the limit of {}", what, n, limit));
    return n;
  }
  const uint8_t* take(size_t n) {
    if (n > left_) throw ProtocolError(fmt::format("truncated payload: need {} bytes, {} left", n, left_));
    const uint8_t* p = p_;
    p_ += n;
    left_ -= n;
    return p;
  }
  const uint8_t* p_;
  size_t left_;
};

}  // namespace dtrain::comm::tcp_store_wire
