#include "kernels/cpu/attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <string_view>

#include "core/error.hpp"
#include "kernels/cpu/tiles.hpp"

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

// Keys of query row q in slice s: [key_lo(q), key_hi(q)), both nondecreasing in q
// (from k_begin <= k < k_end and diag_min <= q - k < diag_max).
inline int64_t key_lo(const Slice& s, int64_t q) { return std::max(s.k_begin, q - s.diag_max + 1); }
inline int64_t key_hi(const Slice& s, int64_t q) { return std::min(s.k_end, q - s.diag_min + 1); }

// Merges a partial result (acc / l, m + log l) into the running (o, lse) of one row and head.
template <class T>
void merge_into(T* o, T* lse, const T* acc, T m, T l, int dv) {
  const T part_lse = m + std::log(l);
  if (*lse == kNegInf<T>) {
    const T inv = T(1) / l;
    for (int i = 0; i < dv; ++i) o[i] = acc[i] * inv;
    *lse = part_lse;
    return;
  }
  const T mx = std::max(*lse, part_lse);
  const T a = std::exp(*lse - mx), b = std::exp(part_lse - mx);
  const T inv = T(1) / (a + b);
  const T wa = a * inv, wb = b * inv / l;
  for (int i = 0; i < dv; ++i) o[i] = wa * o[i] + wb * acc[i];
  *lse = mx + std::log(a + b);
}

// Tiles of a slice: per KV head, blocks of query rows, each row a (query, head) pair of the group in
// query-major order, r = (q - qb) * G + hh. Scratch buffers are reused across slices of one call.
template <class T>
struct Workspace {
  int64_t block_q = 0;  // queries per block
  std::vector<T> qp, dop, kt, vt, s, p, ds, acc, m, l, lse, delta, dqp;

  explicit Workspace(const AttentionShape& sh) {
    const int G = sh.group();
    block_q = std::max<int64_t>(1, kTileRows / G);
    const auto rows = static_cast<size_t>(block_q * G);
    qp.resize(rows * sh.d);
    dop.resize(rows * sh.dv);
    kt.resize(static_cast<size_t>(kKeyBlock * sh.d));
    vt.resize(static_cast<size_t>(kKeyBlock * sh.dv));
    s.resize(rows * kKeyBlock);
    p.resize(rows * kKeyBlock);
    ds.resize(rows * kKeyBlock);
    acc.resize(rows * sh.dv);
    dqp.resize(rows * sh.d);
    m.resize(rows);
    l.resize(rows);
    lse.resize(rows);
    delta.resize(rows);
  }
};

// Rows [ra, rz) of a query block [qb, qe) that see at least one key of [kb, ke) in slice s.
struct RowSpan {
  int64_t ra, rz;
};
inline RowSpan rows_touching(const Slice& s, int64_t qb, int64_t qe, int64_t kb, int64_t ke, int G) {
  // key_hi(q) > kb  <=>  q >= kb + diag_min;   key_lo(q) < ke  <=>  q < ke + diag_max - 1
  const int64_t qa = std::max(qb, kb + s.diag_min), qz = std::min(qe, ke + s.diag_max - 1);
  if (qz <= qa) return {0, 0};
  return {(qa - qb) * G, (qz - qb) * G};
}

// Kt[i][j] = K[kb + j][g][i]: keys become the contiguous dimension of the score tile's B operand.
template <class T>
void pack_transposed(const HeadView<const T>& x, int g, int64_t kb, int64_t nk, int dim, T* out) {
  for (int64_t j = 0; j < nk; ++j) {
    const T* row = x.at(kb + j, g);
    for (int i = 0; i < dim; ++i) out[i * nk + j] = row[i];
  }
}

// One slice of the forward pass: per KV head and query block, S = Q K^T per key block, an online
// softmax (running max m, denominator l, unnormalised acc += P V), merged into O/LSE at the end.
template <class Isa, class T>
TREECP_TILE_INLINE void forward_slice(const AttnForwardArgs<T>& a, const Slice& s, Workspace<T>& w) {
  const AttentionShape& sh = a.shape;
  const int G = sh.group();
  const int d = sh.d, dv = sh.dv;
  const T scale = static_cast<T>(sh.softmax_scale());
  for (int g = 0; g < sh.hkv; ++g) {
    for (int64_t qb = s.q_begin; qb < s.q_end; qb += w.block_q) {
      const int64_t qe = std::min(qb + w.block_q, s.q_end);
      const int64_t rows = (qe - qb) * G;
      for (int64_t r = 0; r < rows; ++r) {
        std::copy_n(a.q.at(qb + r / G, g * G + r % G), d, w.qp.data() + r * d);
      }
      std::fill_n(w.m.data(), rows, kNegInf<T>);
      std::fill_n(w.l.data(), rows, T(0));
      std::fill_n(w.acc.data(), rows * dv, T(0));
      const int64_t k_lo = key_lo(s, qb), k_hi = key_hi(s, qe - 1);
      for (int64_t kb = k_lo; kb < k_hi; kb += kKeyBlock) {
        const int64_t ke = std::min(kb + kKeyBlock, k_hi), nk = ke - kb;
        const auto [ra, rz] = rows_touching(s, qb, qe, kb, ke, G);
        if (rz <= ra) continue;
        pack_transposed(a.k, g, kb, nk, d, w.kt.data());
        std::fill(w.s.data() + ra * nk, w.s.data() + rz * nk, T(0));
        gemm_acc<Isa>(rz - ra, nk, d, w.qp.data() + ra * d, d, 1, w.kt.data(), nk, w.s.data() + ra * nk, nk);
        for (int64_t r = ra; r < rz; ++r) {
          const int64_t q = qb + r / G;
          const int64_t j0 = std::max(kb, key_lo(s, q)) - kb, j1 = std::min(ke, key_hi(s, q)) - kb;
          T* sr = w.s.data() + r * nk;
          T* pr = w.p.data() + r * nk;
          std::fill(pr, pr + nk, T(0));
          if (j0 >= j1) continue;
          T mx = kNegInf<T>;
          for (int64_t j = j0; j < j1; ++j) {
            sr[j] *= scale;
            mx = std::max(mx, sr[j]);
          }
          const T m_new = std::max(w.m[r], mx);
          if (m_new > w.m[r] && w.l[r] > 0) {
            const T corr = std::exp(w.m[r] - m_new);
            w.l[r] *= corr;
            T* acc = w.acc.data() + r * dv;
            for (int i = 0; i < dv; ++i) acc[i] *= corr;
          }
          w.m[r] = m_new;
          for (int64_t j = j0; j < j1; ++j) pr[j] = sr[j] - m_new;
          exp_inplace<Isa>(pr + j0, j1 - j0);
          T sum = 0;
          for (int64_t j = j0; j < j1; ++j) sum += pr[j];
          w.l[r] += sum;
        }
        gemm_acc<Isa>(rz - ra, dv, nk, w.p.data() + ra * nk, nk, 1, a.v.at(kb, g), a.v.row_stride,
                    w.acc.data() + ra * dv, dv);
      }
      for (int64_t r = 0; r < rows; ++r) {
        if (!(w.l[r] > 0)) continue;  // no key of this slice for the row
        const int64_t q = qb + r / G;
        const int h = g * G + static_cast<int>(r % G);
        merge_into(a.o.at(q, h), a.lse.at(q, h), w.acc.data() + r * dv, w.m[r], w.l[r], dv);
      }
    }
  }
}

// One slice of the backward pass with the complete LSE and delta = dot(dO, O) - dLSE, per key block:
// P = exp(S - LSE), dS = P (dO V^T - delta) scale; dV += P^T dO, dK += dS^T Q, dQ += dS K.
template <class Isa, class T>
TREECP_TILE_INLINE void backward_slice(const AttnBackwardArgs<T>& a, const Slice& s, const std::vector<T>& delta,
                                       Workspace<T>& w) {
  const AttentionShape& sh = a.shape;
  const int G = sh.group();
  const int d = sh.d, dv = sh.dv;
  const T scale = static_cast<T>(sh.softmax_scale());
  for (int g = 0; g < sh.hkv; ++g) {
    for (int64_t qb = s.q_begin; qb < s.q_end; qb += w.block_q) {
      const int64_t qe = std::min(qb + w.block_q, s.q_end);
      const int64_t rows = (qe - qb) * G;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t q = qb + r / G;
        const int h = g * G + static_cast<int>(r % G);
        std::copy_n(a.q.at(q, h), d, w.qp.data() + r * d);
        std::copy_n(a.dout.at(q, h), dv, w.dop.data() + r * dv);
        w.lse[r] = *a.lse.at(q, h);
        w.delta[r] = delta[static_cast<size_t>(q * sh.hq + h)];
      }
      std::fill_n(w.dqp.data(), rows * d, T(0));
      const int64_t k_lo = key_lo(s, qb), k_hi = key_hi(s, qe - 1);
      for (int64_t kb = k_lo; kb < k_hi; kb += kKeyBlock) {
        const int64_t ke = std::min(kb + kKeyBlock, k_hi), nk = ke - kb;
        const auto [ra, rz] = rows_touching(s, qb, qe, kb, ke, G);
        if (rz <= ra) continue;
        pack_transposed(a.k, g, kb, nk, d, w.kt.data());
        pack_transposed(a.v, g, kb, nk, dv, w.vt.data());
        std::fill(w.s.data() + ra * nk, w.s.data() + rz * nk, T(0));
        std::fill(w.ds.data() + ra * nk, w.ds.data() + rz * nk, T(0));
        gemm_acc<Isa>(rz - ra, nk, d, w.qp.data() + ra * d, d, 1, w.kt.data(), nk, w.s.data() + ra * nk, nk);
        // ds holds dP = dO V^T until it is turned into dS below
        gemm_acc<Isa>(rz - ra, nk, dv, w.dop.data() + ra * dv, dv, 1, w.vt.data(), nk, w.ds.data() + ra * nk, nk);
        for (int64_t r = ra; r < rz; ++r) {
          const int64_t q = qb + r / G;
          const int64_t j0 = std::max(kb, key_lo(s, q)) - kb, j1 = std::min(ke, key_hi(s, q)) - kb;
          const T* sr = w.s.data() + r * nk;
          T* pr = w.p.data() + r * nk;
          T* dsr = w.ds.data() + r * nk;
          const T lse = w.lse[r], dl = w.delta[r];
          std::fill(pr, pr + nk, T(0));
          // LSE = -inf with a visible key is inconsistent input; such a row contributes nothing
          if (j0 >= j1 || lse == kNegInf<T>) {
            std::fill(dsr, dsr + nk, T(0));
            continue;
          }
          for (int64_t j = j0; j < j1; ++j) pr[j] = sr[j] * scale - lse;
          exp_inplace<Isa>(pr + j0, j1 - j0);
          for (int64_t j = 0; j < nk; ++j) dsr[j] = pr[j] * (dsr[j] - dl) * scale;
        }
        const int64_t nr = rz - ra;
        gemm_acc<Isa>(nk, dv, nr, w.p.data() + ra * nk, 1, nk, w.dop.data() + ra * dv, dv, a.dv.at(kb, g),
                    a.dv.row_stride);
        gemm_acc<Isa>(nk, d, nr, w.ds.data() + ra * nk, 1, nk, w.qp.data() + ra * d, d, a.dk.at(kb, g),
                    a.dk.row_stride);
        gemm_acc<Isa>(nr, d, nk, w.ds.data() + ra * nk, nk, 1, a.k.at(kb, g), a.k.row_stride, w.dqp.data() + ra * d, d);
      }
      for (int64_t r = 0; r < rows; ++r) {
        axpy(a.dq.at(qb + r / G, g * G + static_cast<int>(r % G)), T(1), w.dqp.data() + r * d, d);
      }
    }
  }
}

template <class Isa, class T>
TREECP_TILE_INLINE void forward_slices(const AttnForwardArgs<T>& a, const std::vector<Slice>& slices, Workspace<T>& w) {
  for (const Slice& s : slices) {
    if (!s.empty()) forward_slice<Isa>(a, s, w);
  }
}
template <class Isa, class T>
TREECP_TILE_INLINE void backward_slices(const AttnBackwardArgs<T>& a, const std::vector<Slice>& slices,
                                        const std::vector<T>& delta, Workspace<T>& w) {
  for (const Slice& s : slices) {
    if (!s.empty()) backward_slice<Isa>(a, s, delta, w);
  }
}

#if TREECP_X86_DISPATCH
template <class T>
__attribute__((target("avx2,fma"))) void forward_slices_avx2(const AttnForwardArgs<T>& a,
                                                              const std::vector<Slice>& slices, Workspace<T>& w) {
  forward_slices<IsaAvx2>(a, slices, w);
}
template <class T>
__attribute__((target("avx2,fma"))) void backward_slices_avx2(const AttnBackwardArgs<T>& a,
                                                               const std::vector<Slice>& slices,
                                                               const std::vector<T>& delta, Workspace<T>& w) {
  backward_slices<IsaAvx2>(a, slices, delta, w);
}
#endif
template <class T>
void forward_slices_baseline(const AttnForwardArgs<T>& a, const std::vector<Slice>& slices, Workspace<T>& w) {
  forward_slices<IsaBaseline>(a, slices, w);
}
template <class T>
void backward_slices_baseline(const AttnBackwardArgs<T>& a, const std::vector<Slice>& slices,
                              const std::vector<T>& delta, Workspace<T>& w) {
  backward_slices<IsaBaseline>(a, slices, delta, w);
}

// The one place that picks an instruction set: x86-64 builds target the SSE2 baseline; the slice
// loops have a second copy for AVX2 + FMA (about 3x faster), chosen at run time.
// TREECP_CPU_ISA=baseline in the environment forces the baseline copy (tests run both copies).
#if TREECP_X86_DISPATCH
bool use_avx2() {
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const char* forced = std::getenv("TREECP_CPU_ISA");
  return supported && !(forced && std::string_view(forced) == "baseline");
}
#endif

template <class T>
void run_forward(const AttnForwardArgs<T>& a, const std::vector<Slice>& slices, Workspace<T>& w) {
#if TREECP_X86_DISPATCH
  if (use_avx2()) return forward_slices_avx2(a, slices, w);
#endif
  forward_slices_baseline(a, slices, w);
}
template <class T>
void run_backward(const AttnBackwardArgs<T>& a, const std::vector<Slice>& slices, const std::vector<T>& delta,
                  Workspace<T>& w) {
#if TREECP_X86_DISPATCH
  if (use_avx2()) return backward_slices_avx2(a, slices, delta, w);
#endif
  backward_slices_baseline(a, slices, delta, w);
}

void require_view(const void* data, int64_t rows, const char* name) {
  require(rows == 0 || data != nullptr, "attention: ", name, " is null");
}

}  // namespace

void validate_slices(int64_t q_rows, int64_t kv_rows, const std::vector<Slice>& slices) {
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice& s = slices[i];
    if (s.empty()) continue;
    require(s.q_begin >= 0 && s.q_end <= q_rows && s.k_begin >= 0 && s.k_end <= kv_rows, "attention: slice ", i, " ",
            to_string(s), " outside the buffers q[0,", q_rows, ") k[0,", kv_rows, ")");
  }
}

namespace {

// The checks forward and backward share: shape, slices inside the buffers, scale, Q/K/V/O/LSE views.
template <class Args>
void check_common_args(const Args& args, const std::vector<Slice>& slices, const char* what) {
  args.shape.validate();
  require(args.q_rows >= 0 && args.kv_rows >= 0, what, ": q_rows and kv_rows must be >= 0, got ", args.q_rows, ", ",
          args.kv_rows);
  validate_slices(args.q_rows, args.kv_rows, slices);
  require_view(args.q.data, args.q_rows, "q");
  require_view(args.k.data, args.kv_rows, "k");
  require_view(args.v.data, args.kv_rows, "v");
  require_view(args.o.data, args.q_rows, "o");
  require_view(args.lse.data, args.q_rows, "lse");
}

}  // namespace

template <class T>
void attention_forward(const AttnForwardArgs<T>& args, const std::vector<Slice>& slices) {
  const AttentionShape& sh = args.shape;
  check_common_args(args, slices, "attention_forward");
  for (int64_t q = 0; q < args.q_rows; ++q) {
    for (int h = 0; h < sh.hq; ++h) {
      std::fill(args.o.at(q, h), args.o.at(q, h) + sh.dv, T(0));
      *args.lse.at(q, h) = kNegInf<T>;
    }
  }
  Workspace<T> work(sh);
  run_forward(args, slices, work);
}

template <class T>
void attention_backward(const AttnBackwardArgs<T>& args, const std::vector<Slice>& slices) {
  const AttentionShape& sh = args.shape;
  check_common_args(args, slices, "attention_backward");
  require_view(args.dout.data, args.q_rows, "dout");
  require_view(args.dq.data, args.q_rows, "dq");
  require_view(args.dk.data, args.kv_rows, "dk");
  require_view(args.dv.data, args.kv_rows, "dv");
  // delta[q * hq + h] = dot(dO, O) - dLSE of the complete output
  std::vector<T> delta(static_cast<size_t>(args.q_rows * sh.hq));
  for (int64_t q = 0; q < args.q_rows; ++q) {
    for (int h = 0; h < sh.hq; ++h) {
      T dl = dot(args.dout.at(q, h), args.o.at(q, h), sh.dv);
      if (args.dlse.data) dl -= *args.dlse.at(q, h);
      delta[static_cast<size_t>(q * sh.hq + h)] = dl;
    }
  }
  Workspace<T> work(sh);
  run_backward(args, slices, delta, work);
}

template <class T>
void merge_forward(const MergeArgs<T>& a) {
  require(a.rows >= 0 && a.heads > 0 && a.dv > 0, "merge: rows >= 0, heads > 0, dv > 0 expected");
  require(a.parts >= 0, "merge: parts must be >= 0");
  require(a.parts == 0 || (a.o_parts && a.lse_parts), "merge: o_parts and lse_parts are null");
  std::vector<T> w(static_cast<size_t>(a.parts));
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int h = 0; h < a.heads; ++h) {
      T* o = a.o.at(r, h);
      T mx = kNegInf<T>;
      for (int p = 0; p < a.parts; ++p) mx = std::max(mx, *a.lse_parts[p].at(r, h));
      std::fill(o, o + a.dv, T(0));
      if (mx == kNegInf<T>) {  // no part saw a key
        *a.lse.at(r, h) = kNegInf<T>;
        continue;
      }
      T sum = 0;
      for (int p = 0; p < a.parts; ++p) {
        w[p] = std::exp(*a.lse_parts[p].at(r, h) - mx);
        sum += w[p];
      }
      const T inv = T(1) / sum;
      for (int p = 0; p < a.parts; ++p) {
        if (w[p] > 0) axpy(o, w[p] * inv, a.o_parts[p].at(r, h), a.dv);
      }
      *a.lse.at(r, h) = mx + std::log(sum);
    }
  }
}

template <class T>
void merge_backward(const MergeBackwardArgs<T>& a) {
  const MergeArgs<T>& f = a.fwd;
  require(f.parts == 0 || (a.dout_parts && a.dlse_parts), "merge_backward: dout_parts and dlse_parts are null");
  for (int64_t r = 0; r < f.rows; ++r) {
    for (int h = 0; h < f.heads; ++h) {
      const T lse = *f.lse.at(r, h);
      const T* o = f.o.at(r, h);
      const T* g = a.dout.at(r, h);
      const T gl = a.dlse.data ? *a.dlse.at(r, h) : T(0);
      const T go = dot(g, o, f.dv);
      for (int p = 0; p < f.parts; ++p) {
        T* dop = a.dout_parts[p].at(r, h);
        const T lp = *f.lse_parts[p].at(r, h);
        // w_r = exp(L_r - L) <= 1; zero for an empty part or an empty merged row
        const T w = (lse == kNegInf<T> || lp == kNegInf<T>) ? T(0) : std::exp(lp - lse);
        for (int i = 0; i < f.dv; ++i) dop[i] = w * g[i];
        // dot(g, o_r - o) = dot(g, o_r) - dot(g, o)
        *a.dlse_parts[p].at(r, h) = w == T(0) ? T(0) : w * (dot(g, f.o_parts[p].at(r, h), f.dv) - go + gl);
      }
    }
  }
}

namespace {
// Token weight w = exp(L - logaddexp(L, a)) and 1 - w, both from the maximum-subtracted form so that
// neither loses precision by cancellation. L = -inf gives w = 0 (the sink takes all mass, o = 0).
template <class T>
void sink_weights(T lse, T sink, T& w, T& one_minus_w) {
  if (lse == kNegInf<T>) {
    w = 0;
    one_minus_w = 1;
    return;
  }
  if (sink == kNegInf<T>) {
    w = 1;
    one_minus_w = 0;
    return;
  }
  const T mx = std::max(lse, sink);
  const T a = std::exp(lse - mx), b = std::exp(sink - mx);
  w = a / (a + b);
  one_minus_w = b / (a + b);
}

template <class T>
void check_sink(const SinkArgs<T>& a) {
  require(a.rows >= 0 && a.hq > 0 && a.dv > 0, "sink: rows >= 0, hq > 0, dv > 0 expected");
  require(a.sink != nullptr, "sink: sink logits are null");
  for (int h = 0; h < a.hq; ++h) {
    require(!std::isnan(a.sink[h]) && a.sink[h] != std::numeric_limits<T>::infinity(), "sink: logit of head ", h,
            " must be finite or -inf, got ", a.sink[h]);
  }
}
}  // namespace

template <class T>
void sink_forward(const SinkArgs<T>& a) {
  check_sink(a);
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int h = 0; h < a.hq; ++h) {
      T w, wc;
      sink_weights(*a.lse.at(r, h), a.sink[h], w, wc);
      const T* o = a.o.at(r, h);
      T* y = a.y.at(r, h);
      for (int i = 0; i < a.dv; ++i) y[i] = w * o[i];
    }
  }
}

template <class T>
void sink_backward(const SinkBackwardArgs<T>& a) {
  const SinkArgs<T>& f = a.fwd;
  check_sink(f);
  // dJ/da sums over every row of the call: accumulated in double so that a float run loses no more
  // than one rounding per head to it
  std::vector<double> dsink(static_cast<size_t>(f.hq), 0.0);
  for (int64_t r = 0; r < f.rows; ++r) {
    for (int h = 0; h < f.hq; ++h) {
      T w, wc;
      sink_weights(*f.lse.at(r, h), f.sink[h], w, wc);
      const T* o = f.o.at(r, h);
      const T* g = a.dy.at(r, h);
      T* dout = a.dout.at(r, h);
      for (int i = 0; i < f.dv; ++i) dout[i] = w * g[i];
      const T c = w * wc * dot(g, o, f.dv);
      *a.dlse.at(r, h) = c;
      dsink[static_cast<size_t>(h)] += static_cast<double>(c);
    }
  }
  if (a.dsink) {
    for (int h = 0; h < f.hq; ++h) a.dsink[h] -= static_cast<T>(dsink[static_cast<size_t>(h)]);
  }
}

#define TREECP_INSTANTIATE(T)                                                                     \
  template void attention_forward<T>(const AttnForwardArgs<T>&, const std::vector<Slice>&);      \
  template void attention_backward<T>(const AttnBackwardArgs<T>&, const std::vector<Slice>&);    \
  template void merge_forward<T>(const MergeArgs<T>&);                                            \
  template void merge_backward<T>(const MergeBackwardArgs<T>&);                                   \
  template void sink_forward<T>(const SinkArgs<T>&);                                              \
  template void sink_backward<T>(const SinkBackwardArgs<T>&);

TREECP_INSTANTIATE(float)
TREECP_INSTANTIATE(double)
#undef TREECP_INSTANTIATE

}  // namespace treecp::cpu
