// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// Internal: the kernels' argument blocks and the per-head-dim launchers (one translation unit each).
#pragma once

#include "kernels/cuda/attention.hpp"

namespace treecp::cuda::detail {

struct FwdArgs {
  AttentionForwardParams p;
  DeviceTilePlan::Lists lists;  // query-major
  const DeviceSlice* slices;
  int32_t q_rows, kv_rows, group;
};

struct BwdArgs {
  AttentionBackwardParams p;
  DeviceTilePlan::Lists lists;  // key-major
  const DeviceSlice* slices;
  int32_t q_rows, kv_rows, group;
};

void launch_fwd_d64(const FwdArgs& a, int rows_per_warp, cudaStream_t stream);
void launch_fwd_d128(const FwdArgs& a, int rows_per_warp, cudaStream_t stream);
void launch_fwd_wgmma_d64(const FwdArgs& a, cudaStream_t stream);
void launch_fwd_wgmma_d128(const FwdArgs& a, cudaStream_t stream);
void launch_bwd_d64(const BwdArgs& a, cudaStream_t stream);
void launch_bwd_d128(const BwdArgs& a, cudaStream_t stream);
void launch_bwd_wgmma_d128(const BwdArgs& a, cudaStream_t stream);
void launch_bwd_dsum(const BwdArgs& a, cudaStream_t stream);
// The warp-specialised TMA forward (attention_fwd_ws.cu); false when it does not apply: head dim 128 and
// G dividing 128 only, and a driver that provides cuTensorMapEncodeTiled.
// variant 0: plain, 1: Q in registers, 2: Q in registers + intra-warpgroup overlap, 3: 2 with O stored by TMA;
// 4 (bench only): 3 writing kFwdTraceWords clock64 values per block into `trace` (blocks x words):
// [0] SM, [1] start, [2] Q ready, [10] first K/V ready, [3] first S ready, [4] last P V retired, [6] steps,
// [5] / [7] warpgroup 0 / 1's O stores have read shared memory, [8] / [9] producer: Q / first K/V issued,
// [11] / [12] %globaltimer (ns) at [1] / [5].
constexpr int kFwdTraceWords = 16;
// 5: the persistent form of 3, one block per SM taking items from a counter; `counter` is a workspace of
// fwd_ws_workspace_bytes() (its counter is zeroed here on `stream`; each block passes its items through the rest);
// 6: 5 with each item published one item ahead (attention_fwd_ws.cu, kPrefetch); 7: 6 with the held-offset softmax
// (attention_fwd_wgmma.cuh, fwd_tile_p_held); 8: 7 with P packed before the held path's vote.
bool launch_fwd_ws_d128(const FwdArgs& a, cudaStream_t stream, int variant, unsigned long long* trace = nullptr,
                        int* counter = nullptr);
// The warp-specialised TMA backward (attention_bwd_ws.cu); false when it does not apply: head dim 128, G
// dividing 64, a driver with cuTensorMapEncodeTiled. variant bit 0: dQ by TMA bulk reductions from a producer warp
// (two dQ buffers) where dQ allows them (16-byte aligned, strides multiples of 4), else by red.global.add; bit 1:
// every block walks forward (without it the first wave, one block per SM, walks in reverse); bit 2: every block
// walks in reverse; bit 3: blocks take (tile, head) in the key-major segment order (TileLists::segment_order: one
// segment's tiles for one KV head together) instead of `order` with the heads of a tile adjacent; bit 4: with dQ
// by TMA, warpgroup 1 does not skip the steps its 64 keys see no query of (it does without the bit); bit 6: with dQ
// by TMA, dK and dV are added by TMA bulk reductions too (where they are 16-byte aligned with strides of whole
// 16-byte units), not read back and written by the consumer threads. Two Q/dO stages. attention_backward uses
// 1 | 64, or 1 | 4 | 8 | 64 where DeviceTilePlan::bwd_segment_order says so.
bool launch_bwd_ws_d128(const BwdArgs& a, cudaStream_t stream, int variant);

// SMs of the current device, cached per device (attention_bwd_ws.cu).
int sm_count();
// Bytes of the persistent forward's workspace on the current device: 32 for the item counter, 64 per block.
inline size_t fwd_ws_workspace_bytes() { return 32 + 64 * static_cast<size_t>(sm_count()); }

}  // namespace treecp::cuda::detail
