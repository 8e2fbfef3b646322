#include "errors.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (in format.h up to fmt 10)

#include "dtrain/comm/error.h"

namespace dtrain::detail {

std::string errorText(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

[[noreturn]] void rethrowWithContext(const std::string& context) {
  try {
    throw;
  } catch (const std::exception& e) {
    std::rethrow_exception(sameType(e, context + errorText(e)));
  }
}

std::exception_ptr sameType(const std::exception& e, const std::string& msg) {
  if (dynamic_cast<const ProtocolError*>(&e)) return std::make_exception_ptr(ProtocolError(msg));
  if (dynamic_cast<const TimeoutError*>(&e)) return std::make_exception_ptr(TimeoutError(msg));
  if (dynamic_cast<const IoError*>(&e)) return std::make_exception_ptr(IoError(msg));
  if (dynamic_cast<const RendezvousError*>(&e)) return std::make_exception_ptr(RendezvousError(msg));
  if (dynamic_cast<const InvalidArgument*>(&e)) return std::make_exception_ptr(InvalidArgument(msg));
  return std::make_exception_ptr(Error(msg));
}

std::string shapeText(c10::IntArrayRef sizes) { return fmt::format("[{}]", fmt::join(sizes, ", ")); }

}  // namespace dtrain::detail
