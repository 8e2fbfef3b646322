// Helpers for the comm tests: typed element access for every DType, deterministic per-rank inputs,
// and a group built in a forked child from the parent's store server.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "comm/collectives/kernels.h"
#include "dtrain/comm/process_group.h"
#include "harness.h"

namespace dtrain::test {

using comm::DType;
using comm::ReduceOp;

inline double getElem(const void* buf, DType t, size_t i) { return comm::loadElement(buf, t, i); }
inline void setElem(void* buf, DType t, size_t i, double v) { comm::storeElement(buf, t, i, v); }

// A byte buffer of count elements of t.
struct Buf {
  DType t;
  size_t count;
  std::vector<uint8_t> bytes;
  Buf(DType t_, size_t n) : t(t_), count(n), bytes(n * comm::dtypeSize(t_) + 1, 0xEE) {}
  void* data() { return bytes.data(); }
  double at(size_t i) const { return getElem(bytes.data(), t, i); }
  void set(size_t i, double v) { setElem(bytes.data(), t, i, v); }
};

// Rank r's i-th input: small integers, so sums, products and averages are exact or nearly so in
// every dtype (u8 and bf16 included). Products use {1, 2} to stay small over 5 ranks.
inline double inputValue(int rank, size_t i, ReduceOp op) {
  if (op == ReduceOp::prod) return 1 + static_cast<double>((rank + i) % 2);
  return 1 + static_cast<double>((static_cast<size_t>(rank + 1) * 7 + i * 3) % 5);
}

// The reduction of inputValue over ranks, as the dtype would hold it.
inline double expectedReduce(int world, size_t i, ReduceOp op, DType t) {
  double acc = inputValue(0, i, op);
  for (int r = 1; r < world; ++r) {
    double v = inputValue(r, i, op);
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg: acc += v; break;
      case ReduceOp::prod: acc *= v; break;
      case ReduceOp::min: acc = std::min(acc, v); break;
      case ReduceOp::max: acc = std::max(acc, v); break;
    }
  }
  if (op == ReduceOp::avg) {
    if (comm::isFloating(t)) acc /= world;
    else acc = std::floor(acc / world);
  }
  return acc;
}

inline bool close(double got, double want, DType t) {
  if (!comm::isFloating(t)) return got == want;
  double tol = (t == DType::f16 || t == DType::bf16) ? 1e-2 : 1e-6;
  return std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want));
}

}  // namespace dtrain::test
