// Internal: the small kernels a GDN/KDA layer needs beside its chunk kernels, in gdn_device.cuh's two-executor
// style (bodies take (block, thread, threads, shared memory) and use only block barriers; launch sequences are
// templates over the executor), so tests/test_gdn_cuda_emulated.cpp runs the very code the GPU runs:
//   - the summary algebra on the runtime's interleaved maps (runtime/backend.hpp: item i holds every head's M
//     [rows][rows] then E [rows][cols]), by gathering blocks into the contiguous [count][..] arrays that
//     gdn_compose_on / gdn_apply_on / gdn_apply_transposed_on take, and scattering the results back;
//   - the q/k L2 normalisation (kernels/cpu/gdn.hpp's l2norm_forward / l2norm_backward);
//   - the causal depthwise conv1d along logical predecessors (kernels/cpu/conv1d.hpp).
// Inputs are 16-bit bit patterns (bf16 or fp16, the kernels' template argument E), states, maps and gradients fp32.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "core/error.hpp"
#include "kernels/cpu/gdn.hpp"  // kL2NormEps
#include "kernels/cuda/gdn_device.cuh"
#include "kernels/cuda/layer_ops_types.hpp"
#include "kernels/shapes.hpp"

namespace treecp::cuda::detail {

// Gradient accumulation that several blocks may reach at once (conv1d's dx rows shared by a parent's children,
// dweight over token tiles).
TREECP_GDN_FN void atomic_add_f32(float* p, float v) {
#if defined(__CUDA_ARCH__)
  atomicAdd(p, v);
#else
  std::atomic_ref<float>(*p).fetch_add(v, std::memory_order_relaxed);
#endif
}

// ---- block moves: `count` blocks of rows x cols fp32 at a stride each; one block per (block b, row i)
enum class BlockOp : int32_t { Copy, Transpose, Zero, Identity };  // Transpose: rows == cols
struct BlockMoveArgs {
  int64_t count;
  int32_t rows, cols;
  BlockOp op;
  const float* src;  // Copy / Transpose: src + b * src_stride, row-major rows x cols
  int64_t src_stride;
  float* dst;
  int64_t dst_stride;
};
struct BlockMoveKernel {
  using Args = BlockMoveArgs;
  static constexpr const char* kName = "affine block move";
  static size_t smem_bytes(const Args&) { return 0; }
  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float*) {
    const int64_t b = block / a.rows;
    const int i = static_cast<int>(block % a.rows);
    float* d = a.dst + b * a.dst_stride + static_cast<int64_t>(i) * a.cols;
    const float* s = a.src ? a.src + b * a.src_stride : nullptr;
    for (int j = tid; j < a.cols; j += nthr) {
      float x = 0.f;
      if (a.op == BlockOp::Copy)
        x = s[static_cast<int64_t>(i) * a.cols + j];
      else if (a.op == BlockOp::Transpose)
        x = s[static_cast<int64_t>(j) * a.cols + i];
      else if (a.op == BlockOp::Identity)
        x = i == j ? 1.f : 0.f;
      d[j] = x;
    }
  }
};

template <class X>
void block_move_on(X& x, const BlockMoveArgs& a) {
  if (a.count > 0 && a.rows > 0 && a.cols > 0) x.template launch<BlockMoveKernel>(a.count * a.rows, a);
}

// ---- the summary algebra on interleaved maps. Per head h of an item at `map`: M at map + h * block, E at
// map + h * block + rows * rows, block = AffineShape::map_block(). States are [heads][rows][cols], contiguous.
inline void affine_check(const AffineShape& sh) {
  require(sh.heads >= 0 && sh.rows >= 1 && sh.cols >= 1, "affine (cuda): state of ", sh.rows, " x ", sh.cols, " for ",
          sh.heads, " heads");
  gdn_check_algebra(sh.heads, sh.rows, sh.cols);
}

// Floats of scratch the algebra below needs for `items` items: two gathered (M, E) pairs.
inline int64_t affine_workspace_floats(const AffineShape& sh, int64_t items) {
  return 2 * items * sh.heads * sh.map_block();
}

// Gathered (M, E) of `count` heads in the contiguous layout of gdn_compose_on: M [count][r][r], E [count][r][c].
struct Gathered {
  float* M;
  float* E;
};
inline Gathered gathered_at(const AffineShape& sh, int64_t count, float* scratch) {
  return {scratch, scratch + count * sh.rows * sh.rows};
}

template <class X>
void gather_maps_on(X& x, const AffineShape& sh, int64_t count, const float* maps, Gathered g) {
  const int64_t blk = sh.map_block(), rr = int64_t{sh.rows} * sh.rows, rc = int64_t{sh.rows} * sh.cols;
  block_move_on(x, {count, sh.rows, sh.rows, BlockOp::Copy, maps, blk, g.M, rr});
  block_move_on(x, {count, sh.rows, sh.cols, BlockOp::Copy, maps + rr, blk, g.E, rc});
}
// M is written where m_src is given (zeroed where `zero_m`), E always.
template <class X>
void scatter_maps_on(X& x, const AffineShape& sh, int64_t count, const float* m_src, bool zero_m, const float* e_src,
                     int64_t e_stride, float* maps) {
  const int64_t blk = sh.map_block(), rr = int64_t{sh.rows} * sh.rows;
  if (m_src) block_move_on(x, {count, sh.rows, sh.rows, BlockOp::Copy, m_src, rr, maps, blk});
  if (zero_m) block_move_on(x, {count, sh.rows, sh.rows, BlockOp::Zero, nullptr, 0, maps, blk});
  block_move_on(x, {count, sh.rows, sh.cols, BlockOp::Copy, e_src, e_stride, maps + rr, blk});
}

template <class X>
void affine_identity_on(X& x, const AffineShape& sh, float* map) {
  affine_check(sh);
  const int64_t blk = sh.map_block();
  block_move_on(x, {sh.heads, sh.rows, sh.rows, BlockOp::Identity, nullptr, 0, map, blk});
  block_move_on(x, {sh.heads, sh.rows, sh.cols, BlockOp::Zero, nullptr, 0, map + int64_t{sh.rows} * sh.rows, blk});
}

// later = later ∘ earlier for `items` items (earlier runs first).
template <class X>
void affine_compose_on(X& x, const AffineShape& sh, int64_t items, float* later, const float* earlier, float* scratch) {
  affine_check(sh);
  const int64_t count = items * sh.heads;
  if (count == 0) return;
  const Gathered L = gathered_at(sh, count, scratch), E = gathered_at(sh, count, scratch + count * sh.map_block());
  gather_maps_on(x, sh, count, later, L);
  gather_maps_on(x, sh, count, earlier, E);
  gdn_compose_on(x, count, sh.rows, sh.cols, L.M, L.E, E.M, E.E, L.M, L.E);
  scatter_maps_on(x, sh, count, L.M, false, L.E, int64_t{sh.rows} * sh.cols, later);
}

// (M, E) -> (0, M s + E); without a state (0, E).
template <class X>
void affine_seed_on(X& x, const AffineShape& sh, float* map, const float* state, float* scratch) {
  affine_check(sh);
  if (state) {
    const Gathered g = gathered_at(sh, sh.heads, scratch);
    gather_maps_on(x, sh, sh.heads, map, g);
    gdn_apply_on(x, sh.heads, sh.rows, sh.cols, g.M, g.E, state, g.E);
    scatter_maps_on(x, sh, sh.heads, nullptr, true, g.E, int64_t{sh.rows} * sh.cols, map);
  } else {
    block_move_on(x, {sh.heads, sh.rows, sh.rows, BlockOp::Zero, nullptr, 0, map, sh.map_block()});
  }
}

// A run's gradient map into `out`: (Mᵀ, a), or with dL/dS_out g: (0, Mᵀ g + a).
template <class X>
void affine_adjoint_on(X& x, const AffineShape& sh, const float* map, const float* a, const float* g, float* out,
                       float* scratch) {
  affine_check(sh);
  const int64_t blk = sh.map_block(), rc = int64_t{sh.rows} * sh.cols;
  if (g) {
    const Gathered m = gathered_at(sh, sh.heads, scratch);
    block_move_on(x, {sh.heads, sh.rows, sh.rows, BlockOp::Copy, map, blk, m.M, int64_t{sh.rows} * sh.rows});
    gdn_apply_transposed_on(x, sh.heads, sh.rows, sh.cols, m.M, a, g, m.E);
    scatter_maps_on(x, sh, sh.heads, nullptr, true, m.E, rc, out);
  } else {
    block_move_on(x, {sh.heads, sh.rows, sh.rows, BlockOp::Transpose, map, blk, out, blk});
    block_move_on(x, {sh.heads, sh.rows, sh.cols, BlockOp::Copy, a, rc, out + int64_t{sh.rows} * sh.rows, blk});
  }
}

// state = E of the item at `map`.
template <class X>
void affine_state_on(X& x, const AffineShape& sh, const float* map, float* state) {
  affine_check(sh);
  const int64_t rr = int64_t{sh.rows} * sh.rows, rc = int64_t{sh.rows} * sh.cols;
  block_move_on(x, {sh.heads, sh.rows, sh.cols, BlockOp::Copy, map + rr, sh.map_block(), state, rc});
}

template <class X>
void affine_interleave_on(X& x, const AffineShape& sh, const float* M, const float* E, float* map) {
  affine_check(sh);
  scatter_maps_on(x, sh, sh.heads, M, false, E, int64_t{sh.rows} * sh.cols, map);
}

// ---- L2 normalisation of `groups` vectors of `dim`: one block per tile of vectors, staged in shared memory
// (coalesced loads), each vector's sums in kL2Parts partial sums, then the elementwise pass.
constexpr int kL2Parts = 8;
constexpr int kL2MaxDim = 4096;
// Vectors per block: 32 of dim <= 128, fewer for longer ones, so the staged tile stays within 64 KiB.
inline int l2norm_tile(int dim) { return dim <= 128 ? 32 : std::max(1, 4096 / dim); }

struct L2NormArgs {
  const uint16_t* x;  // [groups][dim] 16-bit (l2norm_on's dtype)
  const float* dy;    // backward: [groups][dim]
  uint16_t* y;        // forward: [groups][dim] 16-bit
  float* dx;          // backward: added into
  int64_t groups;
  int32_t dim, tile;
  float eps;
};
template <DType E>
struct L2NormKernel {
  using Args = L2NormArgs;
  static constexpr const char* kName = "l2norm";
  static bool backward(const Args& a) { return a.dy != nullptr; }
  static size_t smem_bytes(const Args& a) {
    const int arrays = backward(a) ? 2 : 1;
    return static_cast<size_t>(arrays) * a.tile * (a.dim + kL2Parts) * sizeof(float);
  }
  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float* smem) {
    const bool bwd = a.dy != nullptr;
    const int64_t g0 = block * a.tile;
    const int n = static_cast<int>(a.groups - g0 < a.tile ? a.groups - g0 : a.tile);
    const int dim = a.dim;
    float* xs = smem;                    // [tile][dim]
    float* gs = xs + a.tile * dim;       // backward: dy [tile][dim]
    float* ss = smem + (bwd ? 2 : 1) * a.tile * dim;  // [tile][parts]: Σ x², then (backward) Σ x dy
    float* xg = ss + a.tile * kL2Parts;
    const int64_t base = g0 * dim;
    for (int idx = tid; idx < n * dim; idx += nthr) {
      xs[idx] = gdn_from16<E>(a.x[base + idx]);
      if (bwd) gs[idx] = a.dy[base + idx];
    }
    block_sync();
    for (int idx = tid; idx < n * kL2Parts; idx += nthr) {
      const int v = idx / kL2Parts, part = idx % kL2Parts;
      float s = 0.f, sg = 0.f;
      for (int i = part; i < dim; i += kL2Parts) {
        const float xi = xs[v * dim + i];
        s += xi * xi;
        if (bwd) sg += xi * gs[v * dim + i];
      }
      ss[idx] = s;
      if (bwd) xg[idx] = sg;
    }
    block_sync();
    for (int idx = tid; idx < n * dim; idx += nthr) {
      const int v = idx / dim;
      float s = 0.f, sg = 0.f;
      for (int p = 0; p < kL2Parts; ++p) {
        s += ss[v * kL2Parts + p];
        if (bwd) sg += xg[v * kL2Parts + p];
      }
      const float inv = 1.f / sqrtf(s + a.eps);
      if (bwd) {
        // y = x inv: dJ/dx = inv dy - x inv³ (x·dy)
        a.dx[base + idx] += inv * gs[idx] - sg * inv * inv * inv * xs[idx];
      } else {
        a.y[base + idx] = gdn_to16<E>(xs[idx] * inv);
      }
    }
  }
};

inline L2NormArgs l2norm_args(const uint16_t* x, const float* dy, uint16_t* y, float* dx, int64_t groups, int dim) {
  return {x, dy, y, dx, groups, dim, l2norm_tile(dim), static_cast<float>(kL2NormEps)};
}

// Launches K<E> for the element type t (bf16 or fp16; anything else is refused naming `what`). The type is the
// launch's argument, not a field of the kernel's Args, so that the bf16 kernels' parameters are what they were.
template <template <DType> class K, class X>
void launch_dtype(X& x, const char* what, DType t, int64_t blocks, const typename K<DType::kBf16>::Args& a) {
  require(t == DType::kBf16 || t == DType::kF16, what, " (cuda): dtype must be bf16 or fp16, got ", static_cast<int>(t));
  with_dtype(t, [&](auto e) { x.template launch<K<decltype(e)::value>>(blocks, a); });
}

// x and y 16-bit of type `dtype`.
template <class X>
void l2norm_on(X& x, const L2NormArgs& a, DType dtype) {
  require(a.groups >= 0, "l2norm (cuda): groups must be >= 0, got ", a.groups);
  require(a.dim >= 1 && a.dim <= kL2MaxDim, "l2norm (cuda): dim must be in [1, ", kL2MaxDim, "], got ", a.dim);
  if (a.groups == 0) return;
  require(a.x && (a.dy ? a.dx != nullptr : a.y != nullptr), "l2norm (cuda): null input or output");
  launch_dtype<L2NormKernel>(x, "l2norm", dtype, (a.groups + a.tile - 1) / a.tile, a);
}

// ---- causal depthwise conv1d along logical predecessors: one block per (tile of kConvRows output rows, tile of
// kConvChannels channels); each thread owns channels (weights, and in the backward its dweight / dbias sums, in
// shared memory at [tap][channel]) and walks the tile's rows in order: z_t[c] = bias[c] + Σ_i w[c][K-1-i]
// x[pred^i(t)][c].
constexpr int kConvRows = 64;
constexpr int kConvChannels = 256;

struct ConvArgs {
  const uint16_t* x;       // [rows][C] 16-bit (conv1d_on's dtype): outputs' rows, then halo rows
  const int64_t* prev;     // [rows] logical predecessor row or -1
  const uint16_t* weight;  // [C][K] 16-bit
  const uint16_t* bias;    // [C] 16-bit or null
  int64_t out_rows;
  int32_t channels, width;
  bool silu;
  uint16_t* y;       // forward: [out_rows][C] 16-bit
  const float* dy;   // backward: [out_rows][C]
  float* dx;         // backward, added into: [rows][C]
  float* dweight;    // backward, added into: [C][K]
  float* dbias;      // backward, added into: [C] or null
};
template <DType E>
struct ConvKernel {
  using Args = ConvArgs;
  static constexpr const char* kName = "conv1d";
  static TREECP_GDN_HD int64_t channel_tiles(const Args& a) { return (a.channels + kConvChannels - 1) / kConvChannels; }
  static size_t smem_bytes(const Args& a) {
    return static_cast<size_t>(a.dy ? 2 : 1) * a.width * kConvChannels * sizeof(float);
  }
  static TREECP_GDN_FN float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }
  static TREECP_GDN_FN void run(const Args& a, int64_t block, int tid, int nthr, float* smem) {
    const bool bwd = a.dy != nullptr;
    const int C = a.channels, K = a.width;
    const int64_t ct = channel_tiles(a);
    const int64_t t0 = (block / ct) * kConvRows;
    const int c0 = static_cast<int>(block % ct) * kConvChannels;
    const int64_t t1 = a.out_rows - t0 < kConvRows ? a.out_rows : t0 + kConvRows;
    float* ws = smem;                        // [K][kConvChannels]: ws[j][cl] = w[c0 + cl][j]
    float* dws = smem + K * kConvChannels;   // backward: the block's dweight sums, same layout
    for (int cl = tid; cl < kConvChannels; cl += nthr) {
      const int c = c0 + cl;
      if (c >= C) continue;
      for (int j = 0; j < K; ++j) {
        ws[j * kConvChannels + cl] = gdn_from16<E>(a.weight[static_cast<int64_t>(c) * K + j]);
        if (bwd) dws[j * kConvChannels + cl] = 0.f;
      }
      const float b = a.bias ? gdn_from16<E>(a.bias[c]) : 0.f;
      float db = 0.f;
      for (int64_t t = t0; t < t1; ++t) {
        float z = b;
        int64_t r = t;
        for (int i = 0; i < K && r >= 0; ++i, r = a.prev[r])
          z += ws[(K - 1 - i) * kConvChannels + cl] * gdn_from16<E>(a.x[r * C + c]);
        if (!bwd) {
          a.y[t * C + c] = gdn_to16<E>(a.silu ? z * sigmoid(z) : z);
          continue;
        }
        float dz = a.dy[t * C + c];
        if (a.silu) {
          const float s = sigmoid(z);
          dz *= s * (1.f + z * (1.f - s));  // d silu(z) / dz
        }
        db += dz;
        r = t;
        for (int i = 0; i < K && r >= 0; ++i, r = a.prev[r]) {
          const int j = K - 1 - i;
          atomic_add_f32(a.dx + r * C + c, ws[j * kConvChannels + cl] * dz);
          dws[j * kConvChannels + cl] += gdn_from16<E>(a.x[r * C + c]) * dz;
        }
      }
      if (!bwd) continue;
      for (int j = 0; j < K; ++j) atomic_add_f32(a.dweight + static_cast<int64_t>(c) * K + j, dws[j * kConvChannels + cl]);
      if (a.dbias) atomic_add_f32(a.dbias + c, db);
    }
  }
};

inline ConvArgs conv_args(const Conv1dDeviceParams& p, uint16_t* y, const float* dy, float* dx, float* dweight,
                          float* dbias) {
  return {p.x, p.prev, p.weight, p.bias, p.out_rows, p.shape.channels, p.shape.width, p.shape.silu,
          y, dy, dx, dweight, dbias};
}

// The 16-bit arrays of type `dtype`.
template <class X>
void conv1d_on(X& x, const ConvArgs& a, DType dtype) {
  require(a.channels >= 1 && a.width >= 1 && a.width <= 64, "conv1d (cuda): ", a.channels, " channels of width ",
          a.width, " (channels >= 1, width in [1, 64])");
  require(a.out_rows >= 0, "conv1d (cuda): out_rows must be >= 0, got ", a.out_rows);
  if (a.out_rows == 0) return;
  require(a.x && a.prev && a.weight, "conv1d (cuda): x, prev and weight must be given");
  require(a.dy ? (a.dx && a.dweight) : a.y != nullptr, "conv1d (cuda): null output");
  launch_dtype<ConvKernel>(x, "conv1d", dtype,
                           (a.out_rows + kConvRows - 1) / kConvRows * ConvKernel<DType::kBf16>::channel_tiles(a), a);
}

}  // namespace treecp::cuda::detail
