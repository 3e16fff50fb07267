// Row-wise kernels: the fused merge + sink (forward, backward) and the backward preprocess
// Dsum = rowsum(dO * O). Memory-bound; one warp per (row, head), lanes stride over the head dim.
#include "core/error.hpp"
#include "kernels/cuda/elem.cuh"
#include "kernels/cuda/launch.hpp"

namespace treecp::cuda {
namespace {

using detail::Elem;
using detail::elem_t;

constexpr int kWarps = 8;        // rows of one head per block step
constexpr int kRowsPerBlock = 64;  // one d_sink atomic per block and head

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Merge statistics of one (row, head): L = logaddexp over parts (max subtracted, all -inf guarded).
struct MergeStats {
  float lse;                  // -inf when no part has a key
  float w[kMaxMergeParts];    // exp(L_r - L)
};

template <class P>
__device__ MergeStats merge_stats(const P& p, int64_t idx) {
  MergeStats s;
  float mx = -INFINITY;
  for (int r = 0; r < p.num_parts; ++r) mx = fmaxf(mx, p.lse_parts[r][idx]);
  if (mx == -INFINITY) {
    s.lse = -INFINITY;
    for (int r = 0; r < kMaxMergeParts; ++r) s.w[r] = 0.f;
    return s;
  }
  float sum = 0.f;
  for (int r = 0; r < p.num_parts; ++r) sum += expf(p.lse_parts[r][idx] - mx);
  s.lse = mx + logf(sum);
  for (int r = 0; r < kMaxMergeParts; ++r) s.w[r] = r < p.num_parts ? expf(p.lse_parts[r][idx] - s.lse) : 0.f;
  return s;
}

// Sink weight w = exp(L - logaddexp(L, a)); 0 when L = -inf, 1 without a sink.
__device__ __forceinline__ float sink_weight(float lse, const float* sink, int h) {
  if (!sink) return lse == -INFINITY ? 0.f : 1.f;
  if (lse == -INFINITY) return 0.f;
  const float a = sink[h];
  const float mx = fmaxf(lse, a);
  return expf(lse - (mx + logf(expf(lse - mx) + expf(a - mx))));
}

template <DType E>
__global__ void merge_sink_fwd_kernel(const MergeSinkForwardParams p) {
  const int h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp;
       row < p.rows && row < static_cast<int64_t>(blockIdx.x + 1) * kRowsPerBlock; row += kWarps) {
    const int64_t idx = row * p.heads + h;
    const MergeStats st = merge_stats(p, idx);
    const float w = sink_weight(st.lse, p.sink, h);
    if (lane == 0) p.lse[idx] = st.lse;
    for (int d = lane; d < p.head_dim; d += 32) {
      const int64_t at = idx * p.head_dim + d;
      float o = 0.f;
      for (int r = 0; r < p.num_parts; ++r)
        o += st.w[r] * Elem<E>::to_float(static_cast<const elem_t<E>*>(p.o_parts[r])[at]);
      static_cast<elem_t<E>*>(p.y)[at] = Elem<E>::from_float(w * o);
      if (p.o_merged) static_cast<elem_t<E>*>(p.o_merged)[at] = Elem<E>::from_float(o);
    }
  }
}

template <DType E>
__global__ void merge_sink_bwd_kernel(const MergeSinkBackwardParams p) {
  const int h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ float block_dsink[kWarps];
  float my_dsink = 0.f;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp;
       row < p.rows && row < static_cast<int64_t>(blockIdx.x + 1) * kRowsPerBlock; row += kWarps) {
    const int64_t idx = row * p.heads + h;
    const MergeStats st = merge_stats(p, idx);
    const float w = sink_weight(st.lse, p.sink, h);
    // pass 1: dot(g, o) with o recomputed from the parts
    float gdot = 0.f;
    for (int d = lane; d < p.head_dim; d += 32) {
      const int64_t at = idx * p.head_dim + d;
      float o = 0.f;
      for (int r = 0; r < p.num_parts; ++r)
        o += st.w[r] * Elem<E>::to_float(static_cast<const elem_t<E>*>(p.o_parts[r])[at]);
      gdot += Elem<E>::to_float(static_cast<const elem_t<E>*>(p.g)[at]) * o;
    }
    gdot = warp_sum(gdot);
    const float dl_sink = p.sink ? w * (1.f - w) * gdot : 0.f;  // dJ/dL through the sink
    my_dsink -= dl_sink;                                         // dJ/da = -w (1 - w) dot(g, o)
    // pass 2: d_o = w g, per-part gradients; dot(d_o, o_r - o) for dJ/dL_r
    float part_dot[kMaxMergeParts] = {};
    for (int d = lane; d < p.head_dim; d += 32) {
      const int64_t at = idx * p.head_dim + d;
      float orv[kMaxMergeParts];
      float o = 0.f;
#pragma unroll
      for (int r = 0; r < kMaxMergeParts; ++r) {
        orv[r] = r < p.num_parts ? Elem<E>::to_float(static_cast<const elem_t<E>*>(p.o_parts[r])[at]) : 0.f;
        o += st.w[r] * orv[r];
      }
      const float g_o = w * Elem<E>::to_float(static_cast<const elem_t<E>*>(p.g)[at]);
      static_cast<elem_t<E>*>(p.d_o)[at] = Elem<E>::from_float(g_o);
#pragma unroll
      for (int r = 0; r < kMaxMergeParts; ++r) {
        if (r >= p.num_parts) break;
        part_dot[r] += g_o * (orv[r] - o);
        if (p.d_o_parts[r]) static_cast<elem_t<E>*>(p.d_o_parts[r])[at] = Elem<E>::from_float(st.w[r] * g_o);
      }
    }
    // dsum = dot(d_o, o) - dJ/dL = w dot(g, o) - dJ/dL
    if (lane == 0) p.dsum[idx] = w * gdot - dl_sink;
#pragma unroll
    for (int r = 0; r < kMaxMergeParts; ++r) {
      if (r >= p.num_parts) break;
      const float s = warp_sum(part_dot[r]);
      if (lane == 0 && p.d_lse_parts[r]) p.d_lse_parts[r][idx] = st.w[r] * (s + dl_sink);
    }
  }
  if (lane == 0) block_dsink[warp] = my_dsink;
  __syncthreads();
  if (threadIdx.x == 0 && p.sink) {
    float s = 0.f;
    for (int w = 0; w < kWarps; ++w) s += block_dsink[w];
    atomicAdd(p.d_sink + h, s);
  }
}

// Dsum = rowsum(dO * O) per (row, q head): D/8 lanes per (row, head), one 16-byte load of O and of dO
// each (rows are 16-byte aligned, checked), so a warp covers 2 (D = 128) or 4 (D = 64) pairs at once
// with no loop. The earlier form (one warp per pair, 2-byte loads, D/32 dependent steps) took 0.23 ms
// for 40,960 x 32 pairs at D = 128 on an H200, this one 0.16 ms (docs/benchmarks-gpu.md, runs 22 and 24).
template <int D, DType E>
__global__ void dsum_kernel(const detail::BwdArgs a) {
  constexpr int kLanes = D / 8;
  const AttentionBackwardParams& p = a.p;
  const int64_t pair = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
  const int sub = threadIdx.x % kLanes;
  const bool ok = pair < static_cast<int64_t>(a.q_rows) * p.hq;  // no early return: the shuffles need every lane
  const int64_t t = ok ? pair / p.hq : 0;
  const int h = ok ? static_cast<int>(pair % p.hq) : 0;
  float s = 0.f;
  if (ok) {
    const int64_t at = t * p.o_row_stride + h * p.o_head_stride + sub * 8;
    const uint4 ov = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.o) + at);
    const uint4 gv = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.d_o) + at);
    const auto* o2 = reinterpret_cast<const uint32_t*>(&ov);
    const auto* g2 = reinterpret_cast<const uint32_t*>(&gv);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 of = Elem<E>::to_float2(o2[i]), gf = Elem<E>::to_float2(g2[i]);
      s = fmaf(of.x, gf.x, fmaf(of.y, gf.y, s));
    }
  }
#pragma unroll
  for (int m = kLanes / 2; m >= 1; m /= 2) s += __shfl_xor_sync(0xffffffffu, s, m);
  if (ok && sub == 0) p.dsum[pair] = s;
}

// ---- the vectorised forms (head dims whose D / 8 divides a warp, 16-byte aligned rows): L = D / 8 lanes
// per (row, head), each with one 16-byte load of every tensor; the block keeps one head, so the sink
// gradient is one atomic per block. The scalar forms above (one warp per (row, head), 2-byte loads) ran the
// backward of 40,960 rows x 32 heads at D 128 in about 1.3 ms on an H200 (docs/benchmarks-gpu.md, run 111).
template <int L>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int m = L / 2; m >= 1; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

template <DType E>
__device__ __forceinline__ void load8(const void* base, int64_t at, float (&x)[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + at);
  const auto* h2 = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = Elem<E>::to_float2(h2[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}
template <DType E>
__device__ __forceinline__ void store8(void* base, int64_t at, const float (&x)[8], float scale) {
  uint4 v;
  auto* h2 = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h2[i] = detail::pack2<E>(scale * x[2 * i], scale * x[2 * i + 1]);
  *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + at) = v;
}

constexpr int kVecThreads = 256;

template <int L, DType E>
__global__ void merge_sink_fwd_vec_kernel(const MergeSinkForwardParams p) {
  const int h = blockIdx.y;
  const int group = threadIdx.x / L, sub = threadIdx.x % L;
  constexpr int kGroups = kVecThreads / L;
  const int64_t end = min(static_cast<int64_t>(blockIdx.x + 1) * kRowsPerBlock, p.rows);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + group; row < end; row += kGroups) {
    const int64_t idx = row * p.heads + h;
    const MergeStats st = merge_stats(p, idx);
    const float w = sink_weight(st.lse, p.sink, h);
    if (sub == 0) p.lse[idx] = st.lse;
    const int64_t at = idx * p.head_dim + sub * 8;
    float o[8] = {};
    for (int r = 0; r < p.num_parts; ++r) {
      if (st.w[r] == 0.f) continue;  // a part with no key for this row (its O is 0)
      float x[8];
      load8<E>(p.o_parts[r], at, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = fmaf(st.w[r], x[i], o[i]);
    }
    store8<E>(p.y, at, o, w);
    if (p.o_merged) store8<E>(p.o_merged, at, o, 1.f);
  }
}

template <int L, DType E>
__global__ void merge_sink_bwd_vec_kernel(const MergeSinkBackwardParams p) {
  const int h = blockIdx.y;
  const int group = threadIdx.x / L, sub = threadIdx.x % L;
  constexpr int kGroups = kVecThreads / L;
  __shared__ float block_dsink[kGroups];
  bool any_part_grad = false;
  for (int r = 0; r < p.num_parts; ++r) any_part_grad = any_part_grad || p.d_o_parts[r] || p.d_lse_parts[r];
  float my_dsink = 0.f;
  const int64_t end = min(static_cast<int64_t>(blockIdx.x + 1) * kRowsPerBlock, p.rows);
  // Every group runs the same number of iterations (the shuffles need all 32 lanes of a warp).
  for (int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; row0 < end; row0 += kGroups) {
    const int64_t row = row0 + group;
    const bool ok = row < end;
    const int64_t idx = ok ? row * p.heads + h : 0;
    MergeStats st{};
    float w = 0.f;
    float g[8] = {}, o[8] = {};
    const int64_t at = idx * p.head_dim + sub * 8;
    if (ok) {
      st = merge_stats(p, idx);
      w = sink_weight(st.lse, p.sink, h);
      load8<E>(p.g, at, g);
      for (int r = 0; r < p.num_parts; ++r) {
        if (st.w[r] == 0.f) continue;
        float x[8];
        load8<E>(p.o_parts[r], at, x);
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = fmaf(st.w[r], x[i], o[i]);
      }
    }
    float gdot = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) gdot = fmaf(g[i], o[i], gdot);
    gdot = group_sum<L>(gdot);
    const float dl_sink = p.sink ? w * (1.f - w) * gdot : 0.f;  // dJ/dL through the sink
    if (ok) {
      if (p.d_o) store8<E>(p.d_o, at, g, w);
      if (sub == 0) {
        p.dsum[idx] = w * gdot - dl_sink;  // dot(d_o, o) - dJ/dL
        my_dsink -= dl_sink;               // dJ/da = -w (1 - w) dot(g, o)
      }
    }
    if (any_part_grad) {
      for (int r = 0; r < p.num_parts; ++r) {
        float x[8] = {}, dot = 0.f;
        if (ok) load8<E>(p.o_parts[r], at, x);
#pragma unroll
        for (int i = 0; i < 8; ++i) dot = fmaf(w * g[i], x[i] - o[i], dot);
        dot = group_sum<L>(dot);
        if (!ok) continue;
        if (p.d_o_parts[r]) store8<E>(p.d_o_parts[r], at, g, st.w[r] * w);
        if (sub == 0 && p.d_lse_parts[r]) p.d_lse_parts[r][idx] = st.w[r] * (dot + dl_sink);
      }
    }
  }
  if (sub == 0) block_dsink[group] = my_dsink;
  __syncthreads();
  if (threadIdx.x == 0 && p.sink) {
    float s = 0.f;
    for (int i = 0; i < kGroups; ++i) s += block_dsink[i];
    atomicAdd(p.d_sink + h, s);
  }
}

bool aligned16(const void* ptr) { return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The vectorised kernels' condition: D / 8 lanes dividing a warp, every tensor 16-byte aligned.
template <class P>
bool vec_ok(const P& p) {
  if (p.head_dim % 8 != 0 || (32 % (p.head_dim / 8)) != 0) return false;
  for (int r = 0; r < p.num_parts; ++r)
    if (!aligned16(p.o_parts[r])) return false;
  return true;
}

template <class P>
void check_merge_params(const P& p, const char* who) {
  require(p.num_parts >= 1 && p.num_parts <= kMaxMergeParts, who, ": num_parts must be in [1, ", kMaxMergeParts,
          "], got ", p.num_parts);
  require(p.rows >= 0 && p.heads >= 1 && p.head_dim >= 1, who, ": rows, heads, head_dim must be positive");
  for (int r = 0; r < p.num_parts; ++r)
    require(p.o_parts[r] && p.lse_parts[r], who, ": part ", r, " needs o_parts and lse_parts");
  require(p.dtype == DType::kBf16 || p.dtype == DType::kF16, who, ": dtype must be kBf16 or kF16, got ",
          static_cast<int>(p.dtype));
}

}  // namespace

void merge_sink_forward(const MergeSinkForwardParams& p, cudaStream_t stream) {
  check_merge_params(p, "merge_sink_forward");
  require(p.y && p.lse, "merge_sink_forward: y and lse are required");
  if (p.rows == 0) return;
  const dim3 grid(static_cast<unsigned>((p.rows + kRowsPerBlock - 1) / kRowsPerBlock), p.heads);
  with_dtype(p.dtype, [&](auto e) {
    constexpr DType E = decltype(e)::value;
    if (vec_ok(p) && aligned16(p.y) && aligned16(p.o_merged)) {
      switch (p.head_dim / 8) {
        case 1: merge_sink_fwd_vec_kernel<1, E><<<grid, kVecThreads, 0, stream>>>(p); break;
        case 2: merge_sink_fwd_vec_kernel<2, E><<<grid, kVecThreads, 0, stream>>>(p); break;
        case 4: merge_sink_fwd_vec_kernel<4, E><<<grid, kVecThreads, 0, stream>>>(p); break;
        case 8: merge_sink_fwd_vec_kernel<8, E><<<grid, kVecThreads, 0, stream>>>(p); break;
        case 16: merge_sink_fwd_vec_kernel<16, E><<<grid, kVecThreads, 0, stream>>>(p); break;
        default: merge_sink_fwd_vec_kernel<32, E><<<grid, kVecThreads, 0, stream>>>(p); break;
      }
    } else {
      merge_sink_fwd_kernel<E><<<grid, kWarps * 32, 0, stream>>>(p);
    }
  });
  check_cuda(cudaGetLastError(), "merge_sink_forward: launch");
}

void merge_sink_backward(const MergeSinkBackwardParams& p, cudaStream_t stream) {
  check_merge_params(p, "merge_sink_backward");
  require(p.g && p.dsum, "merge_sink_backward: g and dsum are required");
  require(!p.sink || p.d_sink, "merge_sink_backward: d_sink is required with a sink");
  if (p.rows == 0) return;
  const dim3 grid(static_cast<unsigned>((p.rows + kRowsPerBlock - 1) / kRowsPerBlock), p.heads);
  bool vec = vec_ok(p) && aligned16(p.g) && aligned16(p.d_o);
  for (int r = 0; r < p.num_parts; ++r) vec = vec && aligned16(p.d_o_parts[r]);
  require(vec || p.d_o, "merge_sink_backward: d_o is required where the vectorised kernel does not apply");
  with_dtype(p.dtype, [&](auto e) {
    constexpr DType E = decltype(e)::value;
    if (vec) {
      switch (p.head_dim / 8) {
        case 1: merge_sink_bwd_vec_kernel<1, E><<<grid, kVecThreads, 0, stream>>>(p); break;
        case 2: merge_sink_bwd_vec_kernel<2, E><<<grid, kVecThreads, 0, stream>>>(p); break;
        case 4: merge_sink_bwd_vec_kernel<4, E><<<grid, kVecThreads, 0, stream>>>(p); break;
        case 8: merge_sink_bwd_vec_kernel<8, E><<<grid, kVecThreads, 0, stream>>>(p); break;
        case 16: merge_sink_bwd_vec_kernel<16, E><<<grid, kVecThreads, 0, stream>>>(p); break;
        default: merge_sink_bwd_vec_kernel<32, E><<<grid, kVecThreads, 0, stream>>>(p); break;
      }
    } else {
      merge_sink_bwd_kernel<E><<<grid, kWarps * 32, 0, stream>>>(p);
    }
  });
  check_cuda(cudaGetLastError(), "merge_sink_backward: launch");
}

namespace detail {
void launch_bwd_dsum(const BwdArgs& a, cudaStream_t stream) {
  const int64_t pairs = static_cast<int64_t>(a.q_rows) * a.p.hq;
  if (pairs == 0) return;
  const int dv = value_dim_of(a.p);  // O and dO have Dv columns
  require(dv == 64 || dv == 128 || dv == 256, "attention_backward: the Dsum kernel takes Dv 64, 128 or 256, got ", dv);
  const int64_t threads = pairs * (dv / 8);
  with_dtype(a.p.dtype, [&](auto e) {
    constexpr DType E = decltype(e)::value;
    const unsigned blocks = static_cast<unsigned>((threads + 255) / 256);
    if (dv == 64) dsum_kernel<64, E><<<blocks, 256, 0, stream>>>(a);
    else if (dv == 128) dsum_kernel<128, E><<<blocks, 256, 0, stream>>>(a);
    else dsum_kernel<256, E><<<blocks, 256, 0, stream>>>(a);
  });
  check_cuda(cudaGetLastError(), "attention_backward: dsum launch");
}
}  // namespace detail

}  // namespace treecp::cuda
