// The forward's visibility bits for one accumulator fragment, shared by the mma.sync kernel (attention_fwd.cuh)
// and the wgmma kernels (attention_fwd_wgmma.cuh, attention_fwd_ws.cu). Both hold a row pair of a BN-key tile
// the same way: a thread's element 4 nb + 2 h + c is (row h: token tok[h], key k0 + 8 nb + 2 (lane % 4) + c).
#pragma once

#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/mma.cuh"

namespace treecp::cuda::detail {

// vis[f] bit 4 nb + 2 h + c: that element of fragment f (rows tok[f][0], tok[f][1]) is a visible pair of run
// entry e over the key tile [k0, k_end). A full run (mask_count 0) sees every key of the tile; a partial one the
// keys any listed slice makes visible from the row (slices are disjoint, so "in any of them" is exact). Keys from
// k_end on belong to the next tile. A slice shows row t the one key run [max(k0, t - dmax + 1), min(k1, t - dmin
// + 1)), so each row costs a few integer operations per slice, not a test per element.
template <int BN, int M>
__device__ __forceinline__ void fwd_visible_bits(const FwdArgs& args, const TileEntry& e, int k0, int k_end, int lane,
                                                 const int (&tok)[M][2], uint32_t (&vis)[M]) {
  static_assert(BN == 64, "16 keys per thread: 8 column blocks of 2");
  const auto& L = args.lists;
  const int kbase = k0 + 2 * (lane % 4);
  if (e.mask_count == 0) {
    const uint32_t row = spread_bit_pairs(run_bits16(kbase, kbase, k_end));
#pragma unroll
    for (int f = 0; f < M; ++f) vis[f] = row | (row << 2);
    return;
  }
#pragma unroll
  for (int f = 0; f < M; ++f) vis[f] = 0;
  for (int j = 0; j < e.mask_count; ++j) {
    const DeviceSlice sl = load_slice(args.slices + L.mask_index[e.mask_begin + j]);
#pragma unroll
    for (int f = 0; f < M; ++f)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int t = tok[f][h];
        if (!in_range(t, sl.q0, sl.q1)) continue;
        const ColumnRun r = slice_key_run(sl, t, k_end);
        vis[f] |= spread_bit_pairs(run_bits16(kbase, r.lo, r.hi)) << (2 * h);
      }
  }
}

}  // namespace treecp::cuda::detail
