/// @file
/// The exceptions dtrain raises. Every message starts with "[rank r]" when a rank is known and names
/// the operation, its sequence number, the peer and the timeout where they apply, e.g.
/// \verbatim
///   [rank 2] allreduce seq=41 f32 x 6291456 timed out after 30s waiting for rank 3 (10.0.0.2:41233)
/// \endverbatim
/// The library never calls exit() or abort(): callers decide.
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace dtrain {

/// The base of every exception dtrain throws: catch it for any of them.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
/// A socket or shared-memory peer failed: connection reset, peer process gone, short read.
class IoError : public Error {
 public:
  using Error::Error;
};
/// A blocking wait passed its deadline.
class TimeoutError : public Error {
 public:
  using Error::Error;
};
/// A peer sent bytes that are not a valid dtrain frame (bad magic, version, op, tag or length), or
/// ranks called different collectives (op, dtype, count, reduce op, root, counts) at the same point:
/// "collective mismatch: this rank called ... but rank r called ...", on every rank of the group.
class ProtocolError : public Error {
 public:
  using Error::Error;
};
/// The processes could not find each other: missing or inconsistent environment, store unreachable.
class RendezvousError : public Error {
 public:
  using Error::Error;
};
/// The caller passed something invalid: negative count, rank out of range, mismatched sizes.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

}  // namespace dtrain

/// Throws ExcType with a formatted message plus the source location, when cond is false.
#define DTRAIN_CHECK(cond, ExcType, ...)                                                         \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      throw ExcType(fmt::format("{} ({}:{})", fmt::format(__VA_ARGS__), __FILE__, __LINE__)); \
    }                                                                                            \
  } while (0)

// Argument checks that print both sides: DTRAIN_CHECK_EQ(a, b, "what") -> "what: expected a == b (3 vs 4)".
#define DTRAIN_CHECK_OP_(a, b, op, ExcType, what)                                                    \
  do {                                                                                             \
    const auto& dtrain_a_ = (a);                                                                   \
    const auto& dtrain_b_ = (b);                                                                   \
    if (!(dtrain_a_ op dtrain_b_)) {                                                               \
      throw ExcType(fmt::format("{}: expected {} {} {} ({} vs {}) ({}:{})", what, #a, #op, #b,      \
                                dtrain_a_, dtrain_b_, __FILE__, __LINE__));                        \
    }                                                                                              \
  } while (0)
/// Throws InvalidArgument unless a == b, naming `what`, both expressions and both values.
#define DTRAIN_CHECK_EQ(a, b, what) DTRAIN_CHECK_OP_(a, b, ==, ::dtrain::InvalidArgument, what)
/// Throws InvalidArgument unless a < b, printing both values (as DTRAIN_CHECK_EQ).
#define DTRAIN_CHECK_LT(a, b, what) DTRAIN_CHECK_OP_(a, b, <, ::dtrain::InvalidArgument, what)
/// Throws InvalidArgument unless a <= b, printing both values (as DTRAIN_CHECK_EQ).
#define DTRAIN_CHECK_LE(a, b, what) DTRAIN_CHECK_OP_(a, b, <=, ::dtrain::InvalidArgument, what)
/// Throws InvalidArgument unless a >= b, printing both values (as DTRAIN_CHECK_EQ).
#define DTRAIN_CHECK_GE(a, b, what) DTRAIN_CHECK_OP_(a, b, >=, ::dtrain::InvalidArgument, what)
