// The parameter server's wire format: op names and the helpers both sides share (see protocol.h).
#include "protocol.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "dtrain/comm/error.h"

namespace dtrain::ps {

const char* opName(uint16_t op) {
  switch (op) {
    case kDeclare: return "declare";
    case kDeclareRows: return "declareRows";
    case kPush: return "push";
    case kPull: return "pull";
    case kPushPull: return "pushPull";
    case kPushRows: return "pushRows";
    case kPullRows: return "pullRows";
    case kClock: return "clock";
    case kBye: return "goodbye";
    case kGetState: return "getState";
    case kSetState: return "setState";
    case kAck: return "ack";
    case kValues: return "values";
    case kError: return "error";
    default: return "unknown";
  }
}

at::Tensor floatCpu(const at::Tensor& t, const char* what) {
  DTRAIN_CHECK(t.defined(), InvalidArgument, "ps: {} is undefined", what);
  DTRAIN_CHECK((t.device().is_cpu() || t.device().is_cuda()) && t.scalar_type() == at::kFloat, InvalidArgument,
               "ps: {} must be a float32 CPU or CUDA tensor (got {} on {})", what, c10::toString(t.scalar_type()),
               t.device().str());
  return t.device().is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();  // CUDA: through the host
}

comm::GroupOptions groupOptions(std::chrono::milliseconds timeout) {
  comm::GroupOptions g = comm::GroupOptions::fromEnv();
  g.timeout = timeout;
  return g;
}

std::shared_ptr<comm::Store> pairStore(const std::shared_ptr<comm::Store>& store, int w, int s) {
  return std::make_shared<comm::PrefixStore>(fmt::format("ps/w{}s{}", w, s), store);
}


}  // namespace dtrain::ps
