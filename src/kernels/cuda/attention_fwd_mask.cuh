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
// k_end on belong to the next tile. M fragments share each slice's per-key test.
template <int BN, int M>
__device__ __forceinline__ void fwd_visible_bits(const FwdArgs& args, const TileEntry& e, int k0, int k_end, int lane,
                                                 const int (&tok)[M][2], uint32_t (&vis)[M]) {
  const auto& L = args.lists;
  const int kbase = k0 + 2 * (lane % 4);
  uint32_t in_tile = 0;  // bit nb * 2 + c: the key is this tile's
#pragma unroll
  for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
    for (int c = 0; c < 2; ++c)
      if (kbase + nb * 8 + c < k_end) in_tile |= 1u << (nb * 2 + c);
#pragma unroll
  for (int f = 0; f < M; ++f) vis[f] = 0;
  if (e.mask_count == 0) {
    uint32_t all = 0;
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (in_tile >> (nb * 2 + (c & 1)) & 1u) all |= 1u << (nb * 4 + c);
#pragma unroll
    for (int f = 0; f < M; ++f) vis[f] = all;
  }
  for (int j = 0; j < e.mask_count; ++j) {
    const DeviceSlice sl = load_slice(args.slices + L.mask_index[e.mask_begin + j]);
    // the per-column key test and the per-row query test hoisted out of the element loop
    uint32_t key_ok = 0;  // bit nb * 2 + c
#pragma unroll
    for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        if (in_range(kbase + nb * 8 + c, sl.k0, sl.k1)) key_ok |= 1u << (nb * 2 + c);
    key_ok &= in_tile;
#pragma unroll
    for (int f = 0; f < M; ++f)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (!in_range(tok[f][h], sl.q0, sl.q1)) continue;
#pragma unroll
        for (int nb = 0; nb < BN / 8; ++nb)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            if ((key_ok >> (nb * 2 + c) & 1u) && in_range(tok[f][h] - (kbase + nb * 8 + c), sl.dmin, sl.dmax))
              vis[f] |= 1u << (nb * 4 + 2 * h + c);
      }
  }
}

}  // namespace treecp::cuda::detail
