/// @file
/// One element of a typed buffer read or written as a double: how tests and benchmarks fill and check
/// buffers of every DType (f16 and bf16 round to nearest even, integers convert like static_cast).
/// Implemented in dtrain::comm (src/comm/collectives/kernels.cc, next to the reduction kernels).
///
/// \code
///   std::vector<uint16_t> buf(n);                                   // n x f16
///   for (size_t i = 0; i < n; ++i) dtrain::comm::storeElement(buf.data(), DType::f16, i, rank + 1);
///   pg->allreduce(buf.data(), n, DType::f16)->wait();
///   bool ok = dtrain::comm::loadElement(buf.data(), DType::f16, 0) == world * (world + 1) / 2;
/// \endcode
#pragma once
#include <cstddef>

#include "dtrain/comm/types.h"

namespace dtrain::comm {

/// Element i of buf (elements of type t) as a double.
double loadElement(const void* buf, DType t, size_t i);
/// Writes v into element i of buf (elements of type t), rounded or converted to t.
void storeElement(void* buf, DType t, size_t i, double v);

/// n floats to f16 or bf16 (round to nearest even) and back, vectorised where the CPU has AVX2 and F16C:
/// what a 16-bit compression hook does before and after its allreduce. `t` must be f16 or bf16.
void floatsTo16(const float* in, void* out, size_t n, DType t);
/// n f16 or bf16 values (`t`) back to floats: the inverse of floatsTo16().
void floatsFrom16(const void* in, float* out, size_t n, DType t);

}  // namespace dtrain::comm
