// Names and sizes of dtrain::comm element types and reduction operators.
#include "dtrain/comm/types.h"

#include "dtrain/comm/error.h"
#include "dtrain/comm/store.h"

namespace dtrain::comm {

size_t dtypeSize(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::f16: return 2;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
  }
  throw InvalidArgument(fmt::format("unknown dtype code {}", static_cast<int>(t)));
}

const char* dtypeName(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "?";
}

const char* allreduceAlgorithmName(AllreduceAlgorithm a) {
  switch (a) {
    case AllreduceAlgorithm::automatic: return "auto";
    case AllreduceAlgorithm::ring: return "ring";
    case AllreduceAlgorithm::recursive_doubling: return "rd";
    case AllreduceAlgorithm::direct: return "direct";
    case AllreduceAlgorithm::hierarchical: return "hierarchical";
  }
  return "?";
}

const char* reduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
    case ReduceOp::prod: return "prod";
  }
  return "?";
}

bool isFloating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::f16 || t == DType::bf16;
}

DType parseDType(const std::string& s) {
  if (s == "f32" || s == "float" || s == "float32") return DType::f32;
  if (s == "f64" || s == "double" || s == "float64") return DType::f64;
  if (s == "f16" || s == "half" || s == "float16") return DType::f16;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  if (s == "i32" || s == "int" || s == "int32") return DType::i32;
  if (s == "i64" || s == "long" || s == "int64") return DType::i64;
  if (s == "u8" || s == "uint8" || s == "byte") return DType::u8;
  throw InvalidArgument(fmt::format("unknown dtype '{}' (expected f32 f64 f16 bf16 i32 i64 u8)", s));
}

Bytes toBytes(const std::string& s) { return Bytes(s.begin(), s.end()); }
std::string toString(const Bytes& b) { return std::string(b.begin(), b.end()); }

}  // namespace dtrain::comm
