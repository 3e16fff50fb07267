// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// The 16-bit floating-point type of the CUDA kernels' activations (Q, K, V, O, dO, the merge's parts, the rows the
// runtime moves): bf16 (8 exponent bits, 8 significant bits: unit roundoff 2^-8) or fp16 (5 exponent bits, 11
// significant bits: unit roundoff 2^-11, largest finite value 65504). Both feed the tensor cores with fp32
// accumulation, and statistics (LSE, Dsum, the sink) and gradients stay fp32 for either. On the host side of the
// interfaces an element is its 16-bit pattern (uint16_t).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace treecp::cuda {

// One byte: the kernels' parameter structs hold it in a gap of their layout (attention.hpp).
enum class DType : uint8_t { kBf16 = 0, kF16 = 1 };

inline const char* dtype_name(DType t) { return t == DType::kF16 ? "fp16" : t == DType::kBf16 ? "bf16" : "unknown"; }

// Host conversions between fp32 and a DType's bit pattern, rounding to nearest even (NaN stays a NaN; fp16 overflows
// to inf from 65520 on, the midpoint above its largest finite value), as the device's conversions round. Plain C++
// (no CUDA headers): the CPU suite checks them against every 16-bit pattern (tests/test_dtype.cpp).
inline uint16_t f32_to_bits(float f, DType t) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if (t == DType::kBf16) {
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    x += 0x7fffu + ((x >> 16) & 1u);
    return static_cast<uint16_t>(x >> 16);
  }
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // |f| >= 65520: inf
  // |f| below 2^-14 is a multiple of fp16's subnormal unit 2^-24 after rounding: the significand (implicit bit
  // included) shifted right by 126 - exponent, rounded to nearest even; an fp32 normal from 2^-14 up keeps its top
  // 10 fraction bits, the exponent rebiased (127 -> 15), with the 13 dropped bits rounded (a carry into the exponent
  // is the right result)
  uint32_t h, rem, half;
  if (x < 0x38800000u) {
    const uint32_t e = x >> 23, m = (x & 0x7fffffu) | (e ? 0x800000u : 0u);
    const uint32_t shift = e ? 126 - e : 126;
    if (shift >= 32) return sign;
    h = m >> shift;
    rem = m & ((1u << shift) - 1);
    half = 1u << (shift - 1);
  } else {
    h = (x - 0x38000000u) >> 13;
    rem = x & 0x1fffu;
    half = 0x1000u;
  }
  if (rem > half || (rem == half && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}
inline float bits_to_f32(uint16_t b, DType t) {
  uint32_t x;
  if (t == DType::kBf16) {
    x = static_cast<uint32_t>(b) << 16;
  } else {
    const uint32_t sign = static_cast<uint32_t>(b & 0x8000u) << 16, e = (b >> 10) & 0x1fu, m = b & 0x3ffu;
    if (e == 0) {  // zero or subnormal: m 2^-24, exact in fp32
      const float v = static_cast<float>(m) * 0x1p-24f;
      std::memcpy(&x, &v, 4);
    } else {
      x = (e == 31 ? 0x7f800000u : (e + 112) << 23) | (m << 13);
    }
    x |= sign;
  }
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// Runs f(std::integral_constant<DType, E>{}) for the call's element type E, so that one launcher picks the kernel
// instantiation of either type (the entry points have checked `t` is one of them).
template <class F>
decltype(auto) with_dtype(DType t, F&& f) {
  if (t == DType::kF16) return f(std::integral_constant<DType, DType::kF16>{});
  return f(std::integral_constant<DType, DType::kBf16>{});
}

}  // namespace treecp::cuda
