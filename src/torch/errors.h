// Exception helpers shared by the torch layer's sources (internal; not installed).
#pragma once
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <exception>
#include <string>

namespace dtrain::detail {

// e.what(), without the C++ backtrace a c10::Error carries: the message is what a user needs.
std::string errorText(const std::exception& e);

// Rethrows the current exception as the same dtrain type (ProtocolError, TimeoutError, IoError,
// RendezvousError, InvalidArgument; anything else as dtrain::Error) with `context` in front.
[[noreturn]] void rethrowWithContext(const std::string& context);

// An exception of e's dtrain type (as above) carrying msg.
std::exception_ptr sameType(const std::exception& e, const std::string& msg);

// A shape as error messages show it: "[4, 16]".
std::string shapeText(c10::IntArrayRef sizes);

}  // namespace dtrain::detail
