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

// Each launcher takes the instantiation of the params' dtype (bf16 or fp16).
void launch_fwd_d64(const FwdArgs& a, int rows_per_warp, cudaStream_t stream);
void launch_fwd_d128(const FwdArgs& a, int rows_per_warp, cudaStream_t stream);
void launch_fwd_d192(const FwdArgs& a, int rows_per_warp, cudaStream_t stream);  // (Dqk, Dv) = (192, 128)
void launch_fwd_d256(const FwdArgs& a, cudaStream_t stream);                     // (256, 256), 16 rows per warp
void launch_fwd_wgmma_d64(const FwdArgs& a, cudaStream_t stream);
void launch_fwd_wgmma_d128(const FwdArgs& a, cudaStream_t stream);
void launch_fwd_wgmma_d192(const FwdArgs& a, cudaStream_t stream);  // (Dqk, Dv) = (192, 128)
void launch_fwd_wgmma_d256(const FwdArgs& a, cudaStream_t stream);  // (256, 256)
void launch_bwd_d64(const BwdArgs& a, cudaStream_t stream);
void launch_bwd_d128(const BwdArgs& a, cudaStream_t stream);
void launch_bwd_d192(const BwdArgs& a, cudaStream_t stream);  // (Dqk, Dv) = (192, 128)
void launch_bwd_d256(const BwdArgs& a, cudaStream_t stream);  // (256, 256)
void launch_bwd_wgmma_d64(const BwdArgs& a, cudaStream_t stream);
void launch_bwd_wgmma_d128(const BwdArgs& a, cudaStream_t stream);
void launch_bwd_wgmma_d128_f16(const BwdArgs& a, cudaStream_t stream);  // its fp16 instantiation (a unit of its own)
void launch_bwd_dsum(const BwdArgs& a, cudaStream_t stream);
// The warp-specialised TMA forward's configurations (attention_fwd_ws.cuh). Only kDefault and kPersistent are
// compiled into the library (launch_fwd_ws_d128); the measured-and-rejected ones are instantiated by
// bench/cuda/bench_attention.cu through attention_fwd_ws.cuh's launch_fwd_ws<C> (docs/kernels.md lists them).
enum class FwdWsSoftmax : int32_t {
  kOnline,         // running row max, O rescaled when it moves
  kHeld,           // the held offset after an item's first step (fwd_tile_p_held, change AM)
  kHeldEarlyPack,  // kHeld with P packed before the guard's vote
};
struct FwdWsConfig {
  // one block per SM taking items (query tile, KV head) from a counter in the workspace, instead of one per item
  bool persistent = false;
  // One block per item only (the persistent form has all three): Q in registers as S = Q K^T's A operand; FA3's
  // intra-warpgroup overlap (S(n) issued with P V(n - 1)); O staged in shared memory and stored by TMA.
  bool q_in_registers = true;
  bool overlap = true;
  bool o_by_tma = true;
  // One block per item only (bench): kFwdTraceWords clock64 values per block into `trace` (blocks x words):
  // [0] SM, [1] start, [2] Q ready, [10] first K/V ready, [3] first S ready, [4] last P V retired, [6] steps,
  // [5] / [7] warpgroup 0 / 1's O stores have read shared memory, [8] / [9] producer: Q / first K/V issued,
  // [11] / [12] %globaltimer (ns) at [1] / [5].
  bool trace = false;
  // Persistent only: each item published one item ahead (change AI), and the softmax.
  bool prefetch = true;
  FwdWsSoftmax softmax = FwdWsSoftmax::kOnline;

  friend constexpr bool operator==(const FwdWsConfig&, const FwdWsConfig&) = default;
  static const FwdWsConfig kDefault;     // without a workspace: one block per item
  static const FwdWsConfig kPersistent;  // with a workspace (AttentionForwardParams::workspace)
};
constexpr FwdWsConfig FwdWsConfig::kDefault{};
constexpr FwdWsConfig FwdWsConfig::kPersistent{.persistent = true, .softmax = FwdWsSoftmax::kHeldEarlyPack};
constexpr int kFwdTraceWords = 16;

// The warp-specialised TMA forward in config kDefault or kPersistent (any other throws); false when it does not
// apply: head dim 128 and G dividing 128 only, and a driver that provides cuTensorMapEncodeTiled. kPersistent needs
// `counter`, a workspace of fwd_ws_workspace_bytes() (its counter is zeroed here on `stream`; each block passes its
// items through the rest).
bool launch_fwd_ws_d128(const FwdArgs& a, cudaStream_t stream, const FwdWsConfig& config, int* counter = nullptr);

// The warp-specialised TMA backward's configurations (attention_bwd_ws.cu). Every field is a run-time choice of
// the same two kernels (dQ by TMA or by red.global.add), so all of them stay selectable; attention_backward takes
// kDefault, or kSegmentOrder where DeviceTilePlan::bwd_segment_order says so.
enum class BwdWsWalk : int32_t {
  kFirstWaveReversed,  // the first wave (one block per SM) walks its query tiles in reverse, later blocks forward
  kForward,            // every block forward (the default before change X)
  kReversed,           // every block in reverse
};
struct BwdWsConfig {
  BwdWsWalk walk = BwdWsWalk::kFirstWaveReversed;
  // blocks take (tile, head) in the key-major segment order (TileLists::segment_order: one segment's tiles for one
  // KV head together) instead of `order` with the heads of a tile adjacent
  bool segment_order = false;
  // dQ by TMA bulk reductions from a producer warp (two dQ buffers) where dQ allows them (16-byte aligned, strides
  // multiples of 4), else by red.global.add from the consumers
  bool dq_by_tma = true;
  // With dQ by TMA: dK and dV added by TMA bulk reductions too (where they are 16-byte aligned with strides of
  // whole 16-byte units), not read back and written by the consumer threads.
  bool dkdv_by_tma = true;
  // With dQ by TMA: warpgroup 1 skips the steps its 64 keys see no query of (change AB).
  bool skip_idle = true;

  friend constexpr bool operator==(const BwdWsConfig&, const BwdWsConfig&) = default;
  static const BwdWsConfig kDefault;
  static const BwdWsConfig kSegmentOrder;  // the segment order with every walk reversed (change AA)
};
constexpr BwdWsConfig BwdWsConfig::kDefault{};
constexpr BwdWsConfig BwdWsConfig::kSegmentOrder{.walk = BwdWsWalk::kReversed, .segment_order = true};

// The warp-specialised TMA backward in any config, two Q/dO stages; false when it does not apply: head dim 128, G
// dividing 64, a driver with cuTensorMapEncodeTiled.
bool launch_bwd_ws_d128(const BwdArgs& a, cudaStream_t stream, const BwdWsConfig& config);

// SMs of the current device, cached per device (attention_bwd_ws.cu).
int sm_count();
// Bytes of the persistent forward's workspace on the current device: 32 for the item counter, 64 per block.
inline size_t fwd_ws_workspace_bytes() { return 32 + 64 * static_cast<size_t>(sm_count()); }

}  // namespace treecp::cuda::detail
