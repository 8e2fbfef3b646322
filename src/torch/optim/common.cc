// Shared helpers of the large-batch optimizers (see common.h).
#include "common.h"

#include <fmt/format.h>

#include "dtrain/comm/error.h"

namespace dtrain::optim::detail {

namespace {
constexpr const char* kTagKey = "dtrain_optimizer";
}

void checkOption(bool ok, const char* who, const char* what, double value, const std::string& where) {
  if (!ok) throw InvalidArgument(fmt::format("{}: {} (got {}) in {}", who, what, value, where));
}

torch::Tensor evaluate(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  at::AutoGradMode enable_grad(true);
  return closure();
}

std::string groupName(size_t index) { return fmt::format("parameter group {}", index); }

void checkDense(const torch::Tensor& grad, const char* who) {
  DTRAIN_CHECK(!grad.is_sparse(), InvalidArgument, "{}: sparse gradients are not supported", who);
}

double trustRatio(double numerator, double denominator) {
  return numerator > 0 && denominator > 0 ? numerator / denominator : 1.0;
}

void writeTag(torch::serialize::OutputArchive& archive, const char* name) {
  archive.write(kTagKey, c10::IValue(std::string(name)));
}

void checkTag(torch::serialize::InputArchive& archive, const char* name) {
  c10::IValue tag;
  std::string got = archive.try_read(kTagKey, tag) && tag.isString() ? tag.toStringRef() : "";
  DTRAIN_CHECK(got == name, InvalidArgument, "{}::load: the archive holds {}, not {} state", name,
               got.empty() ? std::string("another optimizer's state (no dtrain tag)") : got + " state", name);
}

}  // namespace dtrain::optim::detail
