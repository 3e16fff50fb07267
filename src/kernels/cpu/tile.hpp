// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// The CPU kernels' shared inner pieces (kernels/cpu only, not a public header): 32-byte vector types,
// the register-tiled GEMM, the vector exp, dot and axpy with fixed lane order, and the instruction-set
// dispatch.
//
// Everything sits in an unnamed namespace on purpose: each kernel file compiles its own copies, once
// per instruction set (force-inlined into its AVX2 and baseline entry points), so the linker can never
// pick a copy built for AVX2 to serve a caller on the baseline path.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string_view>

namespace treecp::cpu {
namespace {

template <class T>
constexpr T kNegInf = -std::numeric_limits<T>::infinity();

// dot(a, b) with kLanes independent partial sums: the lanes map onto SIMD registers, which a compiler
// cannot do for one running sum without reassociating it (-ffast-math). 32 bytes of lanes: 8 float, 4 double.
template <class T>
inline T dot(const T* __restrict a, const T* __restrict b, int n) {
  constexpr int kLanes = 32 / sizeof(T);
  T acc[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  T tail = 0;
  for (; i < n; ++i) tail += a[i] * b[i];
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0] + tail;
}

// y += alpha * x
template <class T>
inline void axpy(T* __restrict y, T alpha, const T* __restrict x, int n) {
  for (int i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// 32 bytes of T as one GCC/Clang vector (two SSE2 registers or one AVX register), and the integer
// vector of the same lanes. Spelling the register tile out in vectors keeps the compiler from
// re-vectorising it another way. (The attribute is spelled per type: on a dependent alias GCC drops
// it silently.)
template <class T>
struct VecOf;
template <>
struct VecOf<float> {
  typedef float type __attribute__((vector_size(32)));
  typedef int32_t int_type __attribute__((vector_size(32)));
};
template <>
struct VecOf<double> {
  typedef double type __attribute__((vector_size(32)));
  typedef int64_t int_type __attribute__((vector_size(32)));
};
template <class T>
using Vec = typename VecOf<T>::type;
template <class T>
using IntVec = typename VecOf<T>::int_type;
static_assert(sizeof(Vec<float>) == 32 && sizeof(Vec<double>) == 32, "32-byte vectors expected");
template <class T>
constexpr int kVecLen = 32 / sizeof(T);

// Everything on the hot path is compiled once per instruction set (see use_avx2) and forced
// inline, so that no copy built for one instruction set is shared with the other.
#if defined(__GNUC__) && defined(__x86_64__)
#define TREECP_TILE_INLINE inline __attribute__((always_inline))
#define TREECP_X86_DISPATCH 1
#else
#define TREECP_TILE_INLINE inline
#define TREECP_X86_DISPATCH 0
#endif

// Per instruction set: column vectors per GEMM register tile, and whether exp is evaluated in vectors.
struct IsaBaseline {
  // SSE2: one 32-byte vector is two of the 16 registers, so 4 x 1 tiles (8 registers) do not spill;
  // a vector exp without FMA is slower than the C library's.
  static constexpr int kTileVectors = 1;
  static constexpr bool kVectorExp = false;
};
struct IsaAvx2 {
  // AVX2 + FMA: 4 x 2 tiles give 8 independent FMA chains, enough to cover the latency on two ports.
  static constexpr int kTileVectors = 2;
  static constexpr bool kVectorExp = true;
};

// A register tile of C += A B: MR rows of A, each element broadcast against NV vectors of B's
// contiguous columns; MR x NV accumulators stay in registers across the K loop.
template <int MR, int NV, class T>
TREECP_TILE_INLINE void gemm_tile(int K, const T* A, int64_t a_ms, int64_t a_ks, const T* B, int64_t ldb, T* C,
                                  int64_t ldc) {
  constexpr int W = kVecLen<T>;
  // memcpy is an unaligned vector load/store (vectors are never passed by value: no ABI question)
  Vec<T> acc[MR][NV];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV; ++v) std::memcpy(&acc[m][v], C + m * ldc + v * W, sizeof(Vec<T>));
  }
  for (int k = 0; k < K; ++k) {
    Vec<T> b[NV];
    for (int v = 0; v < NV; ++v) std::memcpy(&b[v], B + k * ldb + v * W, sizeof(Vec<T>));
    for (int m = 0; m < MR; ++m) {
      const T a = A[m * a_ms + k * a_ks];
      for (int v = 0; v < NV; ++v) acc[m][v] += a * b[v];
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NV; ++v) std::memcpy(C + m * ldc + v * W, &acc[m][v], sizeof(Vec<T>));
  }
}

// C[m][n] += sum_k A[m*a_ms + k*a_ks] * B[k*ldb + n] for m < M, n < N, k < K (row-major C, ldc).
template <class Isa, class T>
TREECP_TILE_INLINE void gemm_acc(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_ms, int64_t a_ks, const T* B,
                                 int64_t ldb, T* C, int64_t ldc) {
  constexpr int MR = 4;
  constexpr int NV = Isa::kTileVectors;
  constexpr int W = kVecLen<T>;
  const int k = static_cast<int>(K);
  int64_t n0 = 0;
  for (; n0 + NV * W <= N; n0 += NV * W) {
    int64_t m0 = 0;
    for (; m0 + MR <= M; m0 += MR) gemm_tile<MR, NV>(k, A + m0 * a_ms, a_ms, a_ks, B + n0, ldb, C + m0 * ldc + n0, ldc);
    for (; m0 < M; ++m0) gemm_tile<1, NV>(k, A + m0 * a_ms, a_ms, a_ks, B + n0, ldb, C + m0 * ldc + n0, ldc);
  }
  for (; n0 + W <= N; n0 += W) {
    int64_t m0 = 0;
    for (; m0 + MR <= M; m0 += MR) gemm_tile<MR, 1>(k, A + m0 * a_ms, a_ms, a_ks, B + n0, ldb, C + m0 * ldc + n0, ldc);
    for (; m0 < M; ++m0) gemm_tile<1, 1>(k, A + m0 * a_ms, a_ms, a_ks, B + n0, ldb, C + m0 * ldc + n0, ldc);
  }
  if (n0 == N) return;
  for (int64_t m = 0; m < M; ++m) {
    T* c = C + m * ldc;
    for (int64_t kk = 0; kk < K; ++kk) {
      const T a = A[m * a_ms + kk * a_ks];
      const T* b = B + kk * ldb;
      for (int64_t n = n0; n < N; ++n) c[n] += a * b[n];
    }
  }
}

// exp in vectors: e^x = 2^n e^r with n = round(x / ln2), r = x - n ln2 (ln2 split in two for exactness),
// e^r from its Taylor series (|r| <= ln2/2: degree 7 leaves 5e-9 relative in float, degree 13 4e-18 in
// double), 2^n built in the exponent bits. Inputs below kLo (e^x underflows; -inf marks a masked key)
// give exactly 0. Measured against the C library: 1.2e-7 (float) and 2.2e-16 (double) relative.
template <class T>
struct ExpConstants;
template <>
struct ExpConstants<float> {
  static constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  static constexpr float kLo = -87.3f, kHi = 88.7f;
  static constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187e-06f;
  static constexpr int kMantissaBits = 23, kExponentBias = 127, kDegree = 7;
};
template <>
struct ExpConstants<double> {
  static constexpr double kRound = 6755399441055744.0;  // 1.5 * 2^52
  static constexpr double kLo = -708.3, kHi = 709.7;
  static constexpr double kLn2Hi = 0.6931471803691238164902, kLn2Lo = 1.9082149292705877e-10;
  static constexpr int kMantissaBits = 52, kExponentBias = 1023, kDegree = 13;
};
template <class T>
constexpr T kInverse[14] = {0,         1,         T(1) / 2,  T(1) / 3,  T(1) / 4,  T(1) / 5,  T(1) / 6,
                            T(1) / 7,  T(1) / 8,  T(1) / 9,  T(1) / 10, T(1) / 11, T(1) / 12, T(1) / 13};

template <class T>
TREECP_TILE_INLINE void exp_vec(Vec<T>& x) {
  using E = ExpConstants<T>;
  const Vec<T> zero{};
  Vec<T> xc = x < E::kLo ? zero + E::kLo : x;
  xc = xc > E::kHi ? zero + E::kHi : xc;
  const Vec<T> t = xc * T(1.4426950408889634) + E::kRound;  // low mantissa bits of t hold n
  const Vec<T> n = t - E::kRound;
  const Vec<T> r = (xc - n * E::kLn2Hi) - n * E::kLn2Lo;
  // Horner form of the Taylor series: 1 + r (1 + r/2 (1 + r/3 (...)))
  Vec<T> p = zero + T(1);
#pragma GCC unroll 16
  for (int k = E::kDegree; k >= 1; --k) p = T(1) + p * r * kInverse<T>[k];
  const Vec<T> round_vec = zero + E::kRound;
  IntVec<T> t_bits, round_bits;
  std::memcpy(&t_bits, &t, sizeof t_bits);
  std::memcpy(&round_bits, &round_vec, sizeof round_bits);
  const IntVec<T> pow2_bits = (t_bits - round_bits + E::kExponentBias) << E::kMantissaBits;  // bits of 2^n
  Vec<T> pow2;
  std::memcpy(&pow2, &pow2_bits, sizeof pow2);
  x = x < E::kLo ? zero : p * pow2;
}

// x[i] = exp(x[i]) for i < n.
template <class Isa, class T>
TREECP_TILE_INLINE void exp_inplace(T* x, int64_t n) {
  if constexpr (Isa::kVectorExp) {
    constexpr int W = kVecLen<T>;
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      Vec<T> v;
      std::memcpy(&v, x + i, sizeof v);
      exp_vec<T>(v);
      std::memcpy(x + i, &v, sizeof v);
    }
    if (i < n) {
      T tail[W];
      std::fill(tail, tail + W, T(0));
      std::copy(x + i, x + n, tail);
      Vec<T> v;
      std::memcpy(&v, tail, sizeof v);
      exp_vec<T>(v);
      std::memcpy(tail, &v, sizeof v);
      std::copy(tail, tail + (n - i), x + i);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
  }
}

// The one place that picks an instruction set: x86-64 builds target the SSE2 baseline; every kernel's
// loops have a second copy for AVX2 + FMA (about 3x faster), chosen at run time by this function.
// TREECP_CPU_ISA=baseline in the environment forces the baseline copy (tests run both copies).
#if TREECP_X86_DISPATCH
inline bool use_avx2() {
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const char* forced = std::getenv("TREECP_CPU_ISA");
  return supported && !(forced && std::string_view(forced) == "baseline");
}
#endif

}  // namespace
}  // namespace treecp::cpu
