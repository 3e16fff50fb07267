// A scalar for error models of bf16 tensor-core arithmetic: a double whose every multiplication first rounds both
// factors to bf16 (8-bit significand, round to nearest even, unit roundoff 2^-8), then multiplies and adds in double.
// kernels/cpu's GDN chunked form instantiated on it is the reference of GdnPrecision::bf16_tensor: it rounds each
// factor where the device rounds a product operand (L⁻¹ diag(β), e^G ⊙ K, D, the chunk-start state, ...), and also
// where the device multiplies in fp32 (the gates' scaling, the scans' state), so its error vs the double recurrence
// is the model's bound on the device's, not an estimate of it.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace treecp {

// x rounded to the nearest bf16 (through fp32; NaN stays NaN).
inline double round_to_bf16(double x) {
  const float f = static_cast<float>(x);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;
  u += 0x7fffu + ((u >> 16) & 1u);
  u &= 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

struct Bf16Product {
  double v = 0;
  Bf16Product() = default;
  Bf16Product(double x) : v(x) {}  // NOLINT: implicit, as a double's literals and conversions
  operator double() const { return v; }  // NOLINT: std::exp, std::sqrt and comparisons take the double

  Bf16Product& operator+=(Bf16Product o) { v += o.v; return *this; }
  Bf16Product& operator-=(Bf16Product o) { v -= o.v; return *this; }
  Bf16Product& operator*=(Bf16Product o) { v = round_to_bf16(v) * round_to_bf16(o.v); return *this; }
  Bf16Product& operator/=(Bf16Product o) { v /= o.v; return *this; }
  Bf16Product operator-() const { return -v; }

  friend Bf16Product operator+(Bf16Product a, Bf16Product b) { return a.v + b.v; }
  friend Bf16Product operator-(Bf16Product a, Bf16Product b) { return a.v - b.v; }
  friend Bf16Product operator*(Bf16Product a, Bf16Product b) { return round_to_bf16(a.v) * round_to_bf16(b.v); }
  friend Bf16Product operator/(Bf16Product a, Bf16Product b) { return a.v / b.v; }
  // With a plain number on either side (exact matches, so no built-in operator competes through the conversion).
  template <class A, class = std::enable_if_t<std::is_arithmetic_v<A>>>
  friend Bf16Product operator+(Bf16Product a, A b) { return a + Bf16Product(static_cast<double>(b)); }
  template <class A, class = std::enable_if_t<std::is_arithmetic_v<A>>>
  friend Bf16Product operator+(A a, Bf16Product b) { return Bf16Product(static_cast<double>(a)) + b; }
  template <class A, class = std::enable_if_t<std::is_arithmetic_v<A>>>
  friend Bf16Product operator-(Bf16Product a, A b) { return a - Bf16Product(static_cast<double>(b)); }
  template <class A, class = std::enable_if_t<std::is_arithmetic_v<A>>>
  friend Bf16Product operator-(A a, Bf16Product b) { return Bf16Product(static_cast<double>(a)) - b; }
  template <class A, class = std::enable_if_t<std::is_arithmetic_v<A>>>
  friend Bf16Product operator*(Bf16Product a, A b) { return a * Bf16Product(static_cast<double>(b)); }
  template <class A, class = std::enable_if_t<std::is_arithmetic_v<A>>>
  friend Bf16Product operator*(A a, Bf16Product b) { return Bf16Product(static_cast<double>(a)) * b; }
  template <class A, class = std::enable_if_t<std::is_arithmetic_v<A>>>
  friend Bf16Product operator/(Bf16Product a, A b) { return a / Bf16Product(static_cast<double>(b)); }
  template <class A, class = std::enable_if_t<std::is_arithmetic_v<A>>>
  friend Bf16Product operator/(A a, Bf16Product b) { return Bf16Product(static_cast<double>(a)) / b; }
};

}  // namespace treecp
