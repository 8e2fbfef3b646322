// The TcpStore wire format's out-of-line parts (tcp_store_codec.h describes the format).
#include "comm/store/tcp_store_codec.h"

namespace dtrain::comm::tcp_store_wire {

// The largest payload a request may carry; a header claiming more closes the connection.
size_t maxRequestPayload(Cmd cmd) {
  switch (cmd) {
    case Cmd::kSet: return kKeyField + kValueField;
    case Cmd::kGet:
    case Cmd::kDelete: return kKeyField;
    case Cmd::kAdd: return kKeyField + 8;
    case Cmd::kCompareSet: return kKeyField + 2 * kValueField;
    case Cmd::kCheck:
    case Cmd::kWait: return kMaxKeyListBytes;
    case Cmd::kNumKeys: return 0;
  }
  return 0;
}

void putLE(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t getLE(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

Header decodeHeader(const uint8_t* p) {
  Header h;
  h.magic = static_cast<uint32_t>(getLE(p, 4));
  h.version = static_cast<uint16_t>(getLE(p + 4, 2));
  h.code = static_cast<uint16_t>(getLE(p + 6, 2));
  h.len = static_cast<uint32_t>(getLE(p + 8, 4));
  return h;
}

}  // namespace dtrain::comm::tcp_store_wire
