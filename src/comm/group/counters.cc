// Process-wide counters of the comm layer: the payload bytes sent by every group's algorithms
// (algo::Context::run adds to it), read through comm::bytesSent() (dtrain/comm/process_group.h).
#include <atomic>
#include <cstdint>

#include "comm/collectives/collectives.h"
#include "dtrain/comm/process_group.h"

namespace dtrain::comm {

namespace algo {
std::atomic<uint64_t> bytes_sent{0};
}  // namespace algo

uint64_t bytesSent() { return algo::bytes_sent.load(std::memory_order_relaxed); }

}  // namespace dtrain::comm
