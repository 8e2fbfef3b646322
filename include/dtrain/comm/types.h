// Element types and reduction operators understood by dtrain::comm. Buffers are plain pointers plus a
// DType and an element count: the comm layer never sees a torch::Tensor.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace dtrain::comm {

enum class DType : uint8_t { f32, f64, f16, bf16, i32, i64, u8 };
enum class ReduceOp : uint8_t { sum, avg, min, max, prod };

// How allreduce runs. automatic: chosen by size and transport (see docs/ARCHITECTURE.md): direct on
// shared memory, else recursive doubling for small buffers and the ring for large ones. direct: every
// rank reads the others' staged data in shared memory (falls back to automatic where there is none,
// e.g. over tcp). ring, recursive_doubling: forced. hierarchical: in stages when the group spans several
// hosts (shared memory within each host, TCP across; docs/SLOW-LINKS.md), automatic's choice when some
// host has more than one rank; falls back to automatic in a group on one host.
enum class AllreduceAlgorithm : uint8_t { automatic, ring, recursive_doubling, direct, hierarchical };
// "auto", "ring", "rd", "direct", "hierarchical"
const char* allreduceAlgorithmName(AllreduceAlgorithm a);

inline constexpr DType kAllDTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                                       DType::i32, DType::i64, DType::u8};
inline constexpr ReduceOp kAllReduceOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::min,
                                             ReduceOp::max, ReduceOp::prod};

size_t dtypeSize(DType t);
const char* dtypeName(DType t);
const char* reduceOpName(ReduceOp op);
bool isFloating(DType t);
// Parses "f32", "float32", "float", ...; throws InvalidArgument naming the text otherwise.
DType parseDType(const std::string& s);

}  // namespace dtrain::comm
