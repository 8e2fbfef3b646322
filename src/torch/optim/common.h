// What the large-batch optimizers (lars.cc, lamb.cc) share: option checks, the trust ratio and the tagged save/load (internal; not installed).
#pragma once
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <string>

namespace dtrain::optim::detail {

// Throws dtrain::InvalidArgument "<who>: <what> (got <value>) in <where>" unless ok.
void checkOption(bool ok, const char* who, const char* what, double value, const std::string& where);

// The loss of the closure, run with gradients enabled (torch::optim's convention); undefined without one.
torch::Tensor evaluate(const torch::optim::Optimizer::LossClosure& closure);

// "the defaults" or "parameter group i".
std::string groupName(size_t index);

// InvalidArgument naming the optimizer for sparse gradients.
void checkDense(const torch::Tensor& grad, const char* who);

// numerator / denominator, or 1 when either is 0 (the trust ratio's convention).
double trustRatio(double numerator, double denominator);

// The optimizer's name is saved next to torch::optim's state, so loading another optimizer's state
// fails with a message naming both instead of a deep assertion.
void writeTag(torch::serialize::OutputArchive& archive, const char* name);
void checkTag(torch::serialize::InputArchive& archive, const char* name);

}  // namespace dtrain::optim::detail
