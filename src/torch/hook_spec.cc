// --comm-hook texts to hooks (see dtrain/hook_spec.h).
#include "dtrain/hook_spec.h"

#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "dtrain/comm/error.h"
#include "dtrain/powersgd.h"
#include "dtrain/topk.h"

namespace dtrain {

namespace {

constexpr const char* kAccepted =
    "none, fp16[:always], bf16[:always], topk:RATIO (0 < RATIO <= 1) or powersgd:R[:START] (R >= 1, START >= 2)";

[[noreturn]] void bad(const std::string& option, const std::string& value, const std::string& why) {
  throw InvalidArgument(fmt::format("{} '{}': {} (expected {})", option, value, why, kAccepted));
}

}  // namespace

CommHookSpec parseCommHookSpec(const std::string& value, const std::string& option) {
  CommHookSpec s;
  s.text = value;
  const size_t colon = value.find(':');
  s.kind = value.substr(0, colon);
  const std::string arg = colon == std::string::npos ? "" : value.substr(colon + 1);
  if (s.kind == "none") {
    if (colon != std::string::npos) bad(option, value, "takes no parameter");
    return s;
  }
  if (s.kind == "fp16" || s.kind == "bf16") {
    if (colon != std::string::npos && arg != "always") bad(option, value, "the only parameter is 'always'");
    s.always = colon != std::string::npos;
    return s;
  }
  if (s.kind != "topk" && s.kind != "powersgd") bad(option, value, "unknown hook");
  if (arg.empty()) bad(option, value, fmt::format("{} needs a parameter after ':'", s.kind));
  char* end = nullptr;
  errno = 0;
  if (s.kind == "topk") {
    s.ratio = std::strtod(arg.c_str(), &end);
    if (*end || errno || !std::isfinite(s.ratio)) bad(option, value, "RATIO is not a number");
    if (!(s.ratio > 0 && s.ratio <= 1)) bad(option, value, "RATIO must be in (0, 1]");
  } else {
    const size_t colon2 = arg.find(':');
    const std::string r_text = arg.substr(0, colon2);
    const long r = std::strtol(r_text.c_str(), &end, 10);
    if (r_text.empty() || *end || errno) bad(option, value, "R is not an integer");
    if (r < 1 || r > 1 << 20) bad(option, value, "R must be at least 1");
    s.rank = static_cast<int>(r);
    if (colon2 != std::string::npos) {
      const std::string start = arg.substr(colon2 + 1);
      const long long v = std::strtoll(start.c_str(), &end, 10);
      if (start.empty() || *end || errno) bad(option, value, "START is not an integer");
      if (v < 2) bad(option, value, "START must be at least 2 (DDP rebuilds its buckets after the first step)");
      s.start = v;
    }
  }
  return s;
}

std::shared_ptr<CommHook> makeCommHook(const CommHookSpec& spec) {
  if (spec.kind == "none") return nullptr;
  if (spec.kind == "fp16") return fp16CompressHook(spec.always);
  if (spec.kind == "bf16") return bf16CompressHook(spec.always);
  if (spec.kind == "topk") {
    TopKOptions o;
    o.ratio = spec.ratio;
    return topKHook(o);
  }
  if (spec.kind == "powersgd") {
    PowerSGDOptions o;
    o.matrix_approximation_rank = spec.rank;
    o.start_powerSGD_iter = spec.start;
    return powerSGDHook(o);
  }
  throw InvalidArgument(fmt::format("makeCommHook: unknown hook kind '{}' (expected {})", spec.kind, kAccepted));
}

}  // namespace dtrain
