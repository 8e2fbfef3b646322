/// @file
/// Communication hooks named by a short text, as programs take them on their command line
/// (`--comm-hook fp16`): one parser and one factory for milnce, example-ddp and dtrain-bench.
///
/// \code
///   auto spec = dtrain::parseCommHookSpec(value, "--comm-hook");   // InvalidArgument naming the option
///   if (auto hook = dtrain::makeCommHook(spec)) ddp.registerCommHook(hook);
/// \endcode
///
/// Accepted values:
/// \verbatim
///   none           no hook: DDP's allreduce (average) of each bucket
///   fp16, bf16     the bucket travels as 16-bit floats (fp16CompressHook, bf16CompressHook), except
///                  over shared memory, where that cannot pay; fp16:always, bf16:always compress there too
///   topk:RATIO     top-k with error feedback (topk.h), RATIO in (0, 1], e.g. topk:0.01;
///                  momentum correction off, no warm-up (use topKHook directly for those)
///   powersgd:R[:START]  PowerSGD of rank R >= 1 (powersgd.h) from step START (default 1000, as
///                  PyTorch's start_powerSGD_iter; at least 2), error feedback and warm start on
/// \endverbatim
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "dtrain/ddp.h"

namespace dtrain {

/// A parsed `--comm-hook` value: which hook, and its parameters.
struct CommHookSpec {
  std::string kind = "none";  ///< none, fp16, bf16, topk, powersgd
  double ratio = 0;           ///< topk
  int rank = 0;               ///< powersgd
  int64_t start = 1000;       ///< powersgd
  bool always = false;        ///< fp16, bf16: compress over shared memory too
  std::string text = "none";  ///< as given, for logs
};

/// InvalidArgument naming `option` and the accepted values when `value` is not one of them.
CommHookSpec parseCommHookSpec(const std::string& value, const std::string& option = "--comm-hook");

/// The hook, or nullptr for "none".
std::shared_ptr<CommHook> makeCommHook(const CommHookSpec& spec);

}  // namespace dtrain
