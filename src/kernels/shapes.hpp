// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// The shape of each layer kind, one struct per kind: filled once where a layer is described (the
// CLI, a binding, a test), checked once there by validate(), and passed unchanged to the planner
// (byte terms, tiles), the runtime (buffer widths) and the kernels. Plain values, no tensors.
#pragma once

#include <cmath>
#include <cstdint>

namespace treecp {

// Attention: Q [S, hq, d], K [S, hkv, d], V [S, hkv, dv], O [S, hq, dv]; query head h reads KV head
// h / (hq / hkv). The window is part of the layer (a layer with another window has other slices and
// needs its own plan: runtime/dense_attention.hpp refuses a plan for another window).
struct AttentionShape {
  int hq = 32, hkv = 4;     // query heads, KV heads (hq a multiple of hkv)
  int d = 128, dv = 128;    // query/key head dim, value head dim (0: keys only, a sparse MLA indexer)
  int64_t window = 0;       // sliding window on logical positions, 0 = none
  double scale = 0.0;       // softmax scale; <= 0 means 1 / sqrt(d)

  int group() const { return hq / hkv; }  // query heads per KV head
  double softmax_scale() const { return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(d)); }
  int64_t q_width() const { return int64_t{hq} * d; }   // elements per token of Q (and dQ)
  int64_t k_width() const { return int64_t{hkv} * d; }  // of K
  int64_t v_width() const { return int64_t{hkv} * dv; } // of V
  int64_t o_width() const { return int64_t{hq} * dv; }  // of O
  // Throws treecp::Error naming the field when a size is out of range or the window is negative.
  void validate() const;
};

// The state geometry of an affine-state recurrence (runtime/affine_cp.hpp): per head a rows x cols state
// S and, for a run of tokens, S_out = M S_in + E with M rows x rows. GDN/KDA: rows = dk, cols = dv;
// Mamba-2: rows = 1 (a scalar decay), cols = N P. A summary is every head's M then E, one block each.
struct AffineShape {
  int heads = 1, rows = 1, cols = 1;
  int64_t state_elements() const { return int64_t{heads} * rows * cols; }  // one state, every head
  int64_t map_block() const { return int64_t{rows} * (rows + cols); }       // one head's (M, E)
  int64_t map_elements() const { return heads * map_block(); }               // one summary, every head
};

// Gated DeltaNet / KDA (kernels/cpu/gdn.hpp): per token and head q, k [dk], v [dv], a log-decay g
// (one per head for GDN, one per key channel for KDA) and beta; the state per head is dk x dv.
enum class GdnGate {
  Scalar,      // GDN: g [S, H]
  PerChannel,  // KDA: g [S, H, dk]
};

struct GdnShape {
  int heads = 32;
  int dk = 128, dv = 128;
  GdnGate gate = GdnGate::Scalar;
  double scale = 1.0;  // y = scale S^T q
  int chunk = 64;      // tokens per chunk of the chunked form

  int64_t qk_width() const { return int64_t{heads} * dk; }  // elements per token of q and k
  int64_t v_width() const { return int64_t{heads} * dv; }   // of v and y
  int64_t g_width() const { return gate == GdnGate::Scalar ? heads : int64_t{heads} * dk; }  // of g
  AffineShape affine() const { return {heads, dk, dv}; }  // the state: dk x dv per head
  void validate() const;
};

// Causal depthwise conv1d along logical paths (kernels/cpu/conv1d.hpp): x [S, channels], weight
// [channels, width], an optional bias, SiLU optionally applied.
struct ConvShape {
  int channels = 1;
  int width = 4;
  bool silu = false;
  void validate() const;
};

}  // namespace treecp
