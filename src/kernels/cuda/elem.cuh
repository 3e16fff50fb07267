// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// Device side of DType (dtype.hpp): the CUDA type of each element type and its conversions from and to fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/cuda/dtype.hpp"

namespace treecp::cuda::detail {

// The CUDA type of a DType's elements. Every kernel takes its DType as a template argument; the memory layouts,
// copies and fragment layouts are the same for both (16-bit elements), only the MMA instructions and the
// conversions from fp32 differ.
template <DType E>
struct Elem;
template <>
struct Elem<DType::kBf16> {
  using T = __nv_bfloat16;
  static __device__ __forceinline__ float to_float(T x) { return __bfloat162float(x); }
  static __device__ __forceinline__ T from_float(float x) { return __float2bfloat16(x); }
  static __device__ __forceinline__ float2 to_float2(uint32_t bits) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  }
};
template <>
struct Elem<DType::kF16> {
  using T = __half;
  static __device__ __forceinline__ float to_float(T x) { return __half2float(x); }
  static __device__ __forceinline__ T from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ float2 to_float2(uint32_t bits) {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
};
template <DType E>
using elem_t = typename Elem<E>::T;

// Two fp32 values rounded to nearest even into one register of two elements (lo in the low half), as the MMA
// operands and the stores take them.
template <DType E = DType::kBf16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (E == DType::kF16) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

}  // namespace treecp::cuda::detail
