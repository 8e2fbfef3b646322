/// @file
/// What differs between the libtorch generations dtrain builds against: Debian's 1.13, the 2.x of the
/// PyPI `torch` wheel and pytorch.org's zip (C++17 up to 2.13, C++20 from 2.14). The only file that tests
/// TORCH_VERSION_*; everything else calls these names and never asks which libtorch it is.
///
/// \code
///   #include <dtrain/compat.h>
///   auto it = optimizer.state().find(dtrain::compat::optimizerStateKey(param));  // both generations
///   std::cout << "built with libtorch " << dtrain::compat::kTorchVersion << "\n";
/// \endcode
///
/// A custom torch::optim::Optimizer (like dtrain's Lars and Lamb) keys its state_ map with
/// optimizerStateKey(p), as torch::optim's own optimizers do.
#pragma once
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>  // from about 2.10 it forwards to torch/headeronly/version.h

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

/// What differs between the libtorch versions dtrain builds against, behind one set of names.
namespace dtrain::compat {

#define DTRAIN_COMPAT_STR2(x) #x
#define DTRAIN_COMPAT_STR(x) DTRAIN_COMPAT_STR2(x)
/// "MAJOR.MINOR.PATCH" of the libtorch headers this translation unit was compiled against.
inline constexpr const char* kTorchVersion =
    DTRAIN_COMPAT_STR(TORCH_VERSION_MAJOR) "." DTRAIN_COMPAT_STR(TORCH_VERSION_MINOR) "." DTRAIN_COMPAT_STR(TORCH_VERSION_PATCH);
#undef DTRAIN_COMPAT_STR
#undef DTRAIN_COMPAT_STR2

// ---- Optimizer::state()'s key ----
// Up to 2.1 the map is keyed by the parameter's TensorImpl address as text (c10::guts::to_string, i.e.
// `ostream << ptr`, "0x..."); from 2.2 (pytorch#108748) by the address itself, a void*, and
// c10::guts::to_string is gone.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2)
/// The key type of Optimizer::state(): the parameter's TensorImpl address (from 2.2).
using OptimizerStateKey = void*;
/// The key under which Optimizer::state() holds param's state.
inline OptimizerStateKey optimizerStateKey(const at::Tensor& param) { return param.unsafeGetTensorImpl(); }
#else
/// The key type of Optimizer::state(): the parameter's TensorImpl address as text (up to 2.1).
using OptimizerStateKey = std::string;
/// The key under which Optimizer::state() holds param's state.
inline OptimizerStateKey optimizerStateKey(const at::Tensor& param) {
  std::ostringstream s;
  s << static_cast<const void*>(param.unsafeGetTensorImpl());
  return s.str();
}
#endif
// A release that changes the key again fails here, at compile time, rather than finding no state.
static_assert(std::is_same_v<OptimizerStateKey, typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>()
                                                                                    .state())>::key_type>,
              "dtrain/compat.h: this libtorch keys Optimizer::state() differently; update optimizerStateKey");

// ---- parameter groups of a custom optimizer ----
/// Gives each installed parameter group of a custom optimizer the options it was given.
///
/// libtorch 2.15 (not 2.11) merges a parameter group's own options with the optimizer's defaults in
/// Optimizer::add_param_group, field by field, for its own six optimizers only; for any other optimizer
/// (dtrain's Lars and Lamb, a user's) it installs the defaults and drops the group's options, silently.
/// 1.13 and 2.11 keep them. A custom optimizer's constructor calls this after the base class's, with the
/// groups it was given, to keep each group's options as given (whole, as 1.13 does) on every libtorch.
inline void keepGroupOptions(std::vector<torch::optim::OptimizerParamGroup>& installed,
                             const std::vector<torch::optim::OptimizerParamGroup>& given) {
  for (size_t i = 0; i < installed.size() && i < given.size(); ++i)
    if (given[i].has_options()) installed[i].set_options(given[i].options().clone());
}

// ---- Optimizer::zero_grad ----
/// What zero_grad() does by default: set the gradients to none on 2.x (true), zero them on 1.13 (false).
inline constexpr bool kZeroGradSetsToNone = TORCH_VERSION_MAJOR >= 2;
/// Clears the gradients of every parameter of `opt`, as libtorch 2.x's zero_grad(set_to_none) does:
/// set_to_none makes them undefined (2.x's default: the optimizer then skips a parameter that gets no
/// gradient before the next step), otherwise they are zeroed in place (1.13's zero_grad(), which has no
/// argument). The same on both generations.
inline void zeroGrad(torch::optim::Optimizer& opt, bool set_to_none) {
#if TORCH_VERSION_MAJOR >= 2
  opt.zero_grad(set_to_none);
#else
  if (!set_to_none) return opt.zero_grad();
  for (auto& group : opt.param_groups())
    for (auto& p : group.params()) p.mutable_grad().reset();
#endif
}

// ---- autograd ----
/// What torch::autograd::impl::grad_accumulator(param) returns, to hold the node (and the hooks added to
/// it) alive: std::shared_ptr<Node> in 1.13, c10::intrusive_ptr<Node> in 2.15.
using GradAccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

}  // namespace dtrain::compat
