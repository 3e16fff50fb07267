// The host conversions between fp32 and the CUDA kernels' 16-bit types (kernels/cuda/dtype.hpp; plain C++, so
// they are checked here without a GPU) against their definitions, on every 16-bit pattern: the decoded value of
// each pattern; every finite value converts back to its own pattern; values at, just above and just below the
// midpoint of two neighbours round to the even one, the upper and the lower (fp16's largest finite value 65504 and
// the next step, 65536, meet at 65520, which must give inf); NaN stays NaN.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/cuda/dtype.hpp"

namespace treecp::cuda {
namespace {

// The value a pattern stands for, from the format's definition (sign, exponent, fraction), in double.
double defined_value(uint16_t b, DType t) {
  const int exp_bits = t == DType::kF16 ? 5 : 8, frac_bits = 15 - exp_bits;
  const int bias = (1 << (exp_bits - 1)) - 1, e = (b >> frac_bits) & ((1 << exp_bits) - 1);
  const double frac = b & ((1 << frac_bits) - 1), sign = (b & 0x8000u) ? -1.0 : 1.0;
  if (e == (1 << exp_bits) - 1) return frac != 0 ? NAN : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(frac, 1 - bias - frac_bits);
  return sign * std::ldexp(1.0 + std::ldexp(frac, -frac_bits), e - bias);
}

void check_all_patterns(DType t) {
  const std::string name = dtype_name(t);
  const uint16_t inf = t == DType::kF16 ? 0x7c00 : 0x7f80;
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const auto bits = static_cast<uint16_t>(b);
    const double want = defined_value(bits, t);
    const float got = bits_to_f32(bits, t);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << name << " pattern " << b;
      ASSERT_TRUE(std::isnan(bits_to_f32(f32_to_bits(got, t), t))) << name << " pattern " << b;
      continue;
    }
    ASSERT_EQ(static_cast<double>(got), want) << name << " pattern " << b;
    ASSERT_EQ(std::signbit(got), (b & 0x8000u) != 0) << name << " pattern " << b;
    ASSERT_EQ(f32_to_bits(got, t), bits) << name << " pattern " << b;
    // the midpoint to the next pattern up in magnitude (past the largest finite value: the next power of two,
    // which rounds to inf); exact in fp32, which has more significand bits than either type
    const uint16_t mag = b & 0x7fffu;
    if (mag >= inf) continue;
    const uint16_t sign = b & 0x8000u;
    const double next = mag + 1 == inf ? std::ldexp(1.0, t == DType::kF16 ? 16 : 128) : std::fabs(defined_value(mag + 1, t));
    const double mid = (std::fabs(want) + next) / 2;
    const float midf = static_cast<float>(mid);
    ASSERT_EQ(static_cast<double>(midf), mid) << name << " pattern " << b;
    const float s = sign ? -1.f : 1.f;
    const uint16_t lower = sign | mag, upper = sign | static_cast<uint16_t>(mag + 1);
    ASSERT_EQ(f32_to_bits(s * midf, t), (mag & 1u) ? upper : lower) << name << " midpoint above " << b;
    ASSERT_EQ(f32_to_bits(s * std::nextafter(midf, INFINITY), t), upper) << name << " above the midpoint of " << b;
    ASSERT_EQ(f32_to_bits(s * std::nextafter(midf, 0.f), t), lower) << name << " below the midpoint of " << b;
  }
}

TEST(CudaDType, Fp16ConversionsRoundToNearestEvenOnEveryPattern) { check_all_patterns(DType::kF16); }
TEST(CudaDType, Bf16ConversionsRoundToNearestEvenOnEveryPattern) { check_all_patterns(DType::kBf16); }

TEST(CudaDType, Fp16RangeEnds) {
  EXPECT_EQ(bits_to_f32(f32_to_bits(65504.f, DType::kF16), DType::kF16), 65504.f);
  EXPECT_EQ(bits_to_f32(f32_to_bits(60000.f, DType::kF16), DType::kF16), 60000.f);
  EXPECT_TRUE(std::isinf(bits_to_f32(f32_to_bits(65520.f, DType::kF16), DType::kF16)));
  EXPECT_TRUE(std::isinf(bits_to_f32(f32_to_bits(1e30f, DType::kF16), DType::kF16)));
  EXPECT_EQ(bits_to_f32(f32_to_bits(0x1p-24f, DType::kF16), DType::kF16), 0x1p-24f);  // smallest subnormal
  EXPECT_EQ(f32_to_bits(0x1p-25f, DType::kF16), 0);                                   // the tie below it: even (0)
  EXPECT_EQ(f32_to_bits(1e-30f, DType::kF16), 0);
  EXPECT_EQ(f32_to_bits(-1e-30f, DType::kF16), 0x8000);
}

}  // namespace
}  // namespace treecp::cuda
