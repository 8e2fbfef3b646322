/// @file
/// Element types and reduction operators understood by dtrain::comm. Buffers are plain pointers plus a
/// DType and an element count: the comm layer never sees a torch::Tensor.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

/// The communication layer: stores, rendezvous, process groups and their collectives over plain buffers
/// (pointer, DType, element count); no libtorch.
namespace dtrain::comm {

/// The element type of a buffer.
enum class DType : uint8_t {
  f32,   ///< 32-bit IEEE float
  f64,   ///< 64-bit IEEE float
  f16,   ///< 16-bit IEEE half float
  bf16,  ///< bfloat16
  i32,   ///< 32-bit signed integer
  i64,   ///< 64-bit signed integer
  u8     ///< unsigned byte
};
/// How a reduction combines the ranks' elements.
enum class ReduceOp : uint8_t {
  sum,  ///< the sum
  avg,  ///< the sum divided by the number of ranks
  min,  ///< the smallest
  max,  ///< the largest
  prod  ///< the product
};

/// How allreduce runs (see docs/ARCHITECTURE.md).
enum class AllreduceAlgorithm : uint8_t {
  /// Chosen by size and transport: direct on shared memory, else recursive doubling for small buffers
  /// and the ring for large ones; hierarchical when the group spans several hosts and some host has
  /// more than one rank.
  automatic,
  ring,                ///< the ring, forced
  recursive_doubling,  ///< recursive doubling, forced
  /// Every rank reads the others' staged data in shared memory (falls back to automatic where there is
  /// none, e.g. over tcp).
  direct,
  /// In stages when the group spans several hosts (shared memory within each host, TCP across;
  /// docs/SLOW-LINKS.md); falls back to automatic in a group on one host.
  hierarchical
};
/// The algorithm's short name: "auto", "ring", "rd", "direct", "hierarchical".
const char* allreduceAlgorithmName(AllreduceAlgorithm a);

/// Every DType, for loops over types (tests, benchmarks).
inline constexpr DType kAllDTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                       DType::i32, DType::i64, DType::u8};
/// Every ReduceOp, for loops over operators (tests, benchmarks).
inline constexpr ReduceOp kAllReduceOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::min,
                                             ReduceOp::max, ReduceOp::prod};

/// Bytes per element of t.
size_t dtypeSize(DType t);
/// t's short name: "f32", "f64", "f16", "bf16", "i32", "i64", "u8".
const char* dtypeName(DType t);
/// op's name, as in messages.
const char* reduceOpName(ReduceOp op);
/// True for the floating-point types f32, f64, f16 and bf16.
bool isFloating(DType t);
/// Parses "f32", "float32", "float", ...; throws InvalidArgument naming the text otherwise.
DType parseDType(const std::string& s);

}  // namespace dtrain::comm
