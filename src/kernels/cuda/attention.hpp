// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// Slice attention on NVIDIA GPUs (sm_90a first): the CUDA side of the attention contract.
//
// Contract (mirrors kernels/cpu): slices are in BUFFER coordinates: q rows index the Q buffer, k rows
// the K/V buffer, so a stage (owned queries against a separate buffer of fetched KV rows) is the same
// call. Layouts (element strides are int64 and free, the last dimension is contiguous):
//   Q [q_rows, Hq, Dqk]  K [kv_rows, Hkv, Dqk]  V [kv_rows, Hkv, Dv]  O [q_rows, Hq, Dv]   bf16 or fp16 (`dtype`, one
//   for all of them)
//   LSE [q_rows, Hq] fp32, natural log of the softmax denominator over this call's keys.
// A query row with no visible key gets LSE = -inf and O = 0. GQA: q head h reads kv head h / (Hq/Hkv).
// Backward reads the COMPLETE O (or a ready Dsum) and LSE and ADDS into fp32 dQ, dK, dV, so stages of
// one layer accumulate into the same buffers; zero them before the first stage.
//
// Work is described by a TilePlan, built on the host from the slices in time proportional to the
// tiles touched (never from a dense mask), uploaded once, and reused by every layer and head with the
// same geometry. Sizes are runtime values: a new tree never recompiles anything.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/cuda/attention_dims.hpp"
#include "kernels/cuda/dtype.hpp"
#include "kernels/cuda/tiles.hpp"
#include "kernels/slice.hpp"

namespace treecp::cuda {

// A run of visited tiles in a tile list: tiles [tile_begin, tile_end) on the other side (KV tiles in
// a query-major list and vice versa), all with the same visibility test. `mask_count == 0`: every
// pair of these tiles is visible (no element check). Otherwise the visible pairs are those inside
// any of the `mask_count` slices TilePlan::slices[mask_index[mask_begin + i]] (slices are disjoint,
// so "any" is exact). Runs keep the lists proportional to the slices, not to the tiles: an
// ancestor's 8,192 keys are one entry, not 128.
struct TileEntry {
  int32_t tile_begin;
  int32_t tile_end;
  int32_t mask_begin;  // first position in TileLists::mask_index
  int32_t mask_count;  // 0 = full tiles
};

// A slice as the kernels read it: q in [q0,q1), k in [k0,k1), dmin <= q-k < dmax (int32, buffer rows).
struct DeviceSlice {
  int32_t q0, q1, k0, k1, dmin, dmax, pad0, pad1;
};

// Run-length tile lists of one geometry (major side q or k).
struct TileLists {
  int32_t major_tile_rows = 0;  // tokens per major tile
  int32_t minor_tile_rows = 0;  // tokens per minor tile
  int32_t num_major = 0;
  std::vector<int32_t> offsets;  // num_major + 1: runs of major tile t are [offsets[t], offsets[t+1])
  std::vector<TileEntry> entries;
  std::vector<int32_t> order;       // major tiles, most visited tiles first (longest processing time first)
  std::vector<int32_t> mask_index;  // slice ids of the partial runs
  int64_t full_tiles = 0, partial_tiles = 0;  // visited tile pairs by kind
  // Key-major lists only: major tile t holds KV rows [major_start[t], major_start[t+1]), at most
  // major_tile_rows of them. Tiles start at the slices' key boundaries (segment starts) unless that would
  // leave a tile shorter than a quarter of major_tile_rows (kKeyTileMinFraction), so a KV tile rarely mixes
  // keys of two segments: such a tile would compute every query tile of both segments' readers at full width
  // for part of its keys.
  std::vector<int32_t> major_start;
  // Query-major lists only: key tile t holds KV rows [minor_start[t], minor_start[t+1]), at most
  // minor_tile_rows of them, cut at key boundaries the same way.
  std::vector<int32_t> minor_start;
  // Key-major lists only: the major tiles in groups of at most kSegmentChunk tiles of one segment (the slice
  // key range holding the tile's first key): a segment's tiles longest first, cut into chunks; the chunks by
  // their longest walk, then in the segments' order (longest segment first). Position i of segment_order is in
  // the group at positions [segment_first[i], segment_end[i]). The warp-specialised backward can run one
  // group's tiles for one KV head together (DeviceTilePlan::bwd_segment_order).
  std::vector<int32_t> segment_order, segment_first, segment_end;
  std::vector<int32_t> segment_of;  // key-major lists only, host only: per major tile, its segment's rank
  // Key-major lists only: per entry i, the query tiles [upper_live[2 i], upper_live[2 i + 1]) outside which the
  // upper half of its KV tile (keys from major_start + kBwdBlockKeys / 2: warpgroup 1's in the warp-specialised
  // backward) sees no query of the tile. A hull: tiles inside it may still see none.
  std::vector<int32_t> upper_live;
};

// Everything the kernels need about one geometry (slices, q_rows, kv_rows, GQA group size).
struct TilePlan {
  int64_t q_rows = 0, kv_rows = 0;
  int32_t group = 1;                      // Hq / Hkv; q tiles hold kBlockRows / group tokens
  int64_t visible_pairs = 0;              // sum of slice areas (per head)
  TileLists fwd;                          // query-major: per q tile, the KV tiles it visits
  TileLists bwd;                          // key-major: per KV tile, the q tiles that see it
  std::vector<DeviceSlice> slices;        // the non-empty input slices, shared by both lists
};

// Builds the plan; throws treecp::Error naming the argument if slices leave the buffers or the group
// does not fit a tile. Time is linear in the number of visited tiles plus the slices.
TilePlan build_tile_plan(const std::vector<Slice>& slices, int64_t q_rows, int64_t kv_rows, int32_t group);

// The plan in device memory (owning, one allocation). upload() copies a new plan in, reusing the
// allocation when it is large enough (a new tree per step costs one copy, no cudaMalloc).
// What DeviceTilePlan::bwd_segment_order decides from, taken from a host plan's key-major lists.
struct SegmentOrderRule {
  static constexpr int32_t kFewBlocks = 8;
  std::vector<int32_t> order_segments;  // distinct segments among order[0 .. i]
  int32_t first_segment_tiles = 0;      // tiles of the first group of segment_order (one segment's)
  static SegmentOrderRule of(const TileLists& bwd);
  // blocks per (segment, KV head) in the first wave, one block per SM: fewer than kFewBlocks in the default
  // order, and more in the segment order
  bool pays(int32_t hkv, int32_t sms) const;
};

class DeviceTilePlan {
 public:
  DeviceTilePlan() = default;
  explicit DeviceTilePlan(const TilePlan& plan, cudaStream_t stream = nullptr) { upload(plan, stream); }
  void upload(const TilePlan& plan, cudaStream_t stream = nullptr);
  ~DeviceTilePlan();
  DeviceTilePlan(const DeviceTilePlan&) = delete;
  DeviceTilePlan& operator=(const DeviceTilePlan&) = delete;
  DeviceTilePlan(DeviceTilePlan&& other) noexcept;
  DeviceTilePlan& operator=(DeviceTilePlan&& other) noexcept;

  struct Lists {
    const int32_t* offsets = nullptr;
    const TileEntry* entries = nullptr;
    const int32_t* order = nullptr;
    const int32_t* mask_index = nullptr;
    const int32_t* major_start = nullptr;  // key-major lists: TileLists::major_start
    const int32_t* minor_start = nullptr;  // query-major lists: TileLists::minor_start
    const int32_t* segment_order = nullptr;  // key-major lists: TileLists::segment_order
    const int32_t* segment_first = nullptr;  // key-major lists: TileLists::segment_first
    const int32_t* segment_end = nullptr;    // key-major lists: TileLists::segment_end
    const int2* upper_live = nullptr;        // key-major lists: TileLists::upper_live, as pairs
    int32_t num_major = 0, major_tile_rows = 0, minor_tile_rows = 0;
  };
  Lists fwd, bwd;
  const DeviceSlice* slices = nullptr;
  // Whether the warp-specialised backward should take its blocks in the segment order with every walk
  // reversed, on a GPU of `sms` SMs at `hkv` KV heads. In the default order (longest tile first, the heads of
  // a tile adjacent) the first wave of blocks, one per SM, shares Q, dO and dQ through the L2 cache only
  // among the blocks of one (segment, KV head); when the first wave mixes many segments that is a few blocks
  // each. The segment order puts a whole segment's tiles of one head in the wave, walking in step from the
  // common end of their lists. Taken when the default's first wave has fewer than SegmentOrderRule::kFewBlocks
  // blocks per (segment, head) and the segment order's has more (docs/benchmarks-gpu.md, change AA).
  bool bwd_segment_order(int32_t hkv, int32_t sms) const { return bwd_segments_.pays(hkv, sms); }
  int64_t q_rows = 0, kv_rows = 0;
  int32_t group = 1;

 private:
  void release();
  SegmentOrderRule bwd_segments_;
  void* block_ = nullptr;  // one allocation holds every array
  size_t capacity_ = 0;
  std::vector<unsigned char> staging_;
};

// Main loop of a kernel: kDefault is the measured fastest (docs/benchmarks-gpu.md); the others stay
// selectable so the tests cover every path and the benchmark measures them in the same run.
// kMmaSync: mma.sync m16n8k16 (any sm_80+ part); kWgmma: Hopper warpgroup MMA (sm_90a; the backward
// has it for head dim 128 only); kWgmmaWs: the warp-specialised wgmma kernels with a TMA producer warpgroup
// (head dim 128; the forward needs G dividing 128: attention_fwd_ws.cu, Q in registers, intra-warpgroup
// overlap; the backward G dividing 64: attention_bwd_ws.cu). kDefault takes kWgmmaWs where it applies,
// else kWgmma (head dim 64 backward: kMmaSync).
enum class Mainloop : int32_t { kDefault = 0, kMmaSync = 1, kWgmma = 2, kWgmmaWs = 3 };

using bf16_t = uint16_t;  // storage type on the host side of the interface (bit pattern of bf16, or of fp16)

// The params structs travel by value inside the kernels' arguments, so each `dtype` sits in a gap of its struct's
// layout (here: beside a narrowed rows_per_warp) and the fields the kernels read keep their offsets.
struct AttentionForwardParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;     // out, dtype
  float* lse = nullptr;  // fp32 out
  int64_t q_row_stride = 0, q_head_stride = 0;  // elements
  int64_t k_row_stride = 0, k_head_stride = 0;
  int64_t v_row_stride = 0, v_head_stride = 0;
  int64_t o_row_stride = 0, o_head_stride = 0;
  int64_t lse_row_stride = 0, lse_head_stride = 0;
  int32_t hq = 0, hkv = 0, head_dim = 0;
  float scale = 0.f;  // softmax scale, typically 1/sqrt(D)
  // Query rows per warp of the mma.sync forward main loop: 0 = the default (kFwdRowsPerWarp; 16 at Dv = 256), 16 or 32
  // (kept selectable so the benchmark can measure both; docs/kernels.md says which wins and why).
  int8_t rows_per_warp = 0;
  DType dtype = DType::kBf16;  // of q, k, v and o
  // Columns of V and O (Dv); 0 = head_dim. head_dim is Dqk (the columns of Q and K). The supported (Dqk, Dv) pairs
  // are kAttentionDims. (Host-only, like rows_per_warp and dtype: it sits in their gap and no kernel reads it.)
  int16_t value_dim = 0;
  using Mainloop = cuda::Mainloop;
  Mainloop mainloop = Mainloop::kDefault;
  // Optional device workspace of attention_forward_workspace_bytes() bytes. With it, the warp-specialised forward runs
  // persistent (one block per SM taking query tiles from a counter in the workspace, which also carries each tile's
  // description one tile ahead: the next tile's loads overlap the current one's end; runs 84-85 measured it 8.5%
  // faster on fixed5k and varied5k and 0.8-3.4% on dominant and art-fixed5k, docs/benchmarks-gpu.md), and its softmax
  // holds each row's offset instead of a running max (about 15% faster again, runs 98-106; O then differs from the
  // workspace-less call's by bf16 rounding, ~2e-3 relative); without it, one block per tile. A workspace given must be
  // 16-byte aligned and large enough (else the call throws). The call zeroes its counter on `stream`; two calls in
  // flight at once need two workspaces.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Bytes of AttentionForwardParams::workspace for the current device.
size_t attention_forward_workspace_bytes();

struct AttentionBackwardParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;   // the COMPLETE output; unused when dsum_ready
  const void* d_o = nullptr;  // gradient of the complete output
  const float* lse = nullptr;  // complete LSE
  float* dsum = nullptr;  // [q_rows, Hq] contiguous fp32 workspace: rowsum(dO * O) (filled unless ready)
  bool dsum_ready = false;  // true: dsum already holds the value (e.g. from merge_sink_backward)
  DType dtype = DType::kBf16;  // of q, k, v, o and d_o
  int16_t value_dim = 0;       // columns of V, O, dO and dV (Dv); 0 = head_dim (Dqk: Q, K, dQ, dK); kAttentionDims
  // dv's strides (elements) where they differ from dk's (Dv != Dqk with contiguous rows): 0 = dk_row_stride /
  // dk_head_stride. int32 and split over two gaps of the layout (here and after `mainloop`) so that the fields the
  // existing kernels read keep their offsets.
  int32_t dv_row_stride = 0;
  float* dq = nullptr;    // fp32 [q_rows, Hq, Dqk], added into (atomics: many KV tiles per q row)
  float* dk = nullptr;    // fp32 [kv_rows, Hkv, Dqk], added into (each KV tile owned by one block)
  float* dv = nullptr;    // fp32 [kv_rows, Hkv, Dv], same strides as dk
  int64_t q_row_stride = 0, q_head_stride = 0;
  int64_t k_row_stride = 0, k_head_stride = 0;
  int64_t v_row_stride = 0, v_head_stride = 0;
  int64_t o_row_stride = 0, o_head_stride = 0;    // for o and d_o
  int64_t lse_row_stride = 0, lse_head_stride = 0;
  int64_t dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_row_stride = 0, dk_head_stride = 0;  // for dk and dv
  int32_t hq = 0, hkv = 0, head_dim = 0;
  float scale = 0.f;
  using Mainloop = cuda::Mainloop;
  Mainloop mainloop = Mainloop::kDefault;  // kDefault: ws / wgmma at head dim 128, mma.sync elsewhere
  int32_t dv_head_stride = 0;  // see dv_row_stride; 0 = dk_head_stride
};

// Dv of a params struct: its value_dim, or head_dim where that is 0.
inline int32_t value_dim_of(const AttentionForwardParams& p) { return p.value_dim != 0 ? p.value_dim : p.head_dim; }
inline int32_t value_dim_of(const AttentionBackwardParams& p) { return p.value_dim != 0 ? p.value_dim : p.head_dim; }

// Launch on `stream`; throw treecp::Error on bad arguments or a failed launch.
void attention_forward(const AttentionForwardParams& p, const DeviceTilePlan& plan, cudaStream_t stream = nullptr);
void attention_backward(const AttentionBackwardParams& p, const DeviceTilePlan& plan,
                        cudaStream_t stream = nullptr);

// Fused merge of stage partials plus the learned sink, on [rows, H, D] tensors (contiguous).
//   L = logaddexp_r L_r;  o = sum_r exp(L_r - L) o_r;  w = exp(L - logaddexp(L, sink[h]));  y = w o.
// Without a sink (sink == nullptr) w = 1. Rows whose parts are all -inf give y = 0, L = -inf.
inline constexpr int kMaxMergeParts = 8;
struct MergeSinkForwardParams {
  int32_t num_parts = 0;
  DType dtype = DType::kBf16;                   // of o_parts, y and o_merged
  const void* o_parts[kMaxMergeParts] = {};     // [rows, H, D]
  const float* lse_parts[kMaxMergeParts] = {};  // fp32 [rows, H]
  const float* sink = nullptr;                  // fp32 [H] or nullptr
  void* y = nullptr;                            // out, after the sink
  void* o_merged = nullptr;                     // optional out, before the sink
  float* lse = nullptr;                         // fp32 out, merged (before the sink)
  int64_t rows = 0;
  int32_t heads = 0, head_dim = 0;
};
// Backward from g = dJ/dy. Writes, per row: d_o = w g (dtype: the gradient of the complete pre-sink
// output, which is what attention_backward takes as d_o), dsum = dot(d_o, o) - dJ/dL (ready for
// attention_backward with dsum_ready = true: it folds the sink's LSE gradient into the softmax
// backward), optional per-part gradients dJ/do_r = exp(L_r - L) d_o and
// dJ/dL_r = exp(L_r - L) (dot(d_o, o_r - o) + dJ/dL), and ADDS dJ/da into d_sink[h].
struct MergeSinkBackwardParams {
  int32_t num_parts = 0;
  DType dtype = DType::kBf16;                  // of o_parts, g, d_o and d_o_parts
  const void* o_parts[kMaxMergeParts] = {};
  const float* lse_parts[kMaxMergeParts] = {};
  const float* sink = nullptr;
  const void* g = nullptr;                     // dJ/dy
  void* d_o = nullptr;                         // out; may be null (not written: without a sink it is g
                                               // where a row has keys, and rows without keys read no d_o)
  float* dsum = nullptr;                       // fp32 out [rows, H]
  void* d_o_parts[kMaxMergeParts] = {};        // optional outs
  float* d_lse_parts[kMaxMergeParts] = {};     // optional fp32 outs
  float* d_sink = nullptr;                     // fp32 [H], added into (needed when sink != nullptr)
  int64_t rows = 0;
  int32_t heads = 0, head_dim = 0;
};
void merge_sink_forward(const MergeSinkForwardParams& p, cudaStream_t stream = nullptr);
void merge_sink_backward(const MergeSinkBackwardParams& p, cudaStream_t stream = nullptr);

// Throws treecp::Error("<what>: <cuda error>") when `status` is not cudaSuccess.
void check_cuda(cudaError_t status, const char* what);

}  // namespace treecp::cuda
