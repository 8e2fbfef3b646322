// The first bytes a TCP connector sends: who it is, and the group it belongs to (a random nonce chosen
// by rank 0 for each group), so that the acceptor can drop anything else.
#pragma once
#include <cstdint>

#include "comm/transport/transport.h"

namespace dtrain::comm::transport {

struct TcpHello {
  static constexpr uint16_t kKind = 0x4845;  // "HE"
  uint32_t magic = kFrameMagic;
  uint16_t version = kFrameVersion;
  uint16_t kind = kKind;
  uint64_t nonce = 0;
  int32_t rank = -1;
  int32_t size = 0;
};

}  // namespace dtrain::comm::transport
