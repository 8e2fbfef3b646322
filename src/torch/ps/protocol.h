// The parameter server's wire format (internal): the fixed-size request/reply header, its op codes and
// flags, and the sizes both sides derive from PSOptions. See include/dtrain/ps.h for the protocol.
#pragma once
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>

#include "dtrain/comm/process_group.h"
#include "dtrain/comm/store.h"
#include "dtrain/ps.h"
#include "../errors.h"

namespace dtrain::ps {

using comm::DType;
using comm::ProcessGroup;
using comm::WorkPtr;
using Clock = std::chrono::steady_clock;
using detail::rethrowWithContext;
using detail::sameType;

constexpr uint32_t kMagic = 0x50535631;  // "PSV1"
enum Op : uint16_t {
  kDeclare = 1,
  kDeclareRows = 2,
  kPush = 3,
  kPull = 4,
  kPushPull = 5,
  kPushRows = 6,
  kPullRows = 7,
  kClock = 8,
  kBye = 9,
  kGetState = 10,
  kSetState = 11,
  kAck = 20,
  kValues = 21,
  kError = 22,
};
constexpr uint16_t kFlagInit = 1;  // declare: this worker sends the initial values
constexpr uint16_t kFlagRows = 2;  // get/set state: of a sparse table
constexpr uint16_t kFlagSet = 4;   // clock: set to this value (restore), not advance
// push: n bytes follow the gradient, 1 where the push carries a gradient for the element (an element no
// push of a step carries is not updated, its optimizer state neither); without it every element is.
// get/set state of a dense partition: n int64 follow the state, each element's update count (Adam's t),
// once pushes have left some element out.
constexpr uint16_t kFlagUsed = 8;
constexpr int64_t kMaxErrorBytes = 4096;

struct Header {
  uint32_t magic = kMagic;
  uint16_t op = 0;
  uint16_t flags = 0;
  uint32_t key = 0;
  int32_t clock = 0;
  int64_t count = 0;
  int64_t row_dim = 0;
  int64_t aux = 0;
};
static_assert(sizeof(Header) == kHeaderBytes, "wire header size");

// A request or reply header; the fields a message does not use stay 0.
inline Header makeHeader(uint16_t op, uint32_t key, int32_t clock, int64_t count, int64_t row_dim = 0,
                         uint16_t flags = 0, int64_t aux = 0) {
  Header h;
  h.op = op;
  h.flags = flags;
  h.key = key;
  h.clock = clock;
  h.count = count;
  h.row_dim = row_dim;
  h.aux = aux;
  return h;
}

const char* opName(uint16_t op);

inline int64_t partLimit(const PSOptions& o) { return std::max<int64_t>(1, static_cast<int64_t>(o.partition_bytes / 4)); }
inline int64_t maxRowsPerMessage(const PSOptions& o, int64_t dim) { return std::max<int64_t>(1, partLimit(o) / dim); }

// t as a contiguous float32 CPU tensor (a CUDA one copied to the host); InvalidArgument naming `what` for
// another dtype or device.
at::Tensor floatCpu(const at::Tensor& t, const char* what);

comm::GroupOptions groupOptions(std::chrono::milliseconds timeout);

// The store of the (worker w, server s) pair's 2-rank group.
std::shared_ptr<comm::Store> pairStore(const std::shared_ptr<comm::Store>& store, int w, int s);

// Rows of a table that server s of S serves (ids s, s+S, ...).
inline int64_t localRowCount(int64_t num_rows, int s, int S) { return num_rows > s ? (num_rows - s + S - 1) / S : 0; }

}  // namespace dtrain::ps
