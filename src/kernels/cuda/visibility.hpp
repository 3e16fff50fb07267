// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// The visibility arithmetic of the attention kernels' tiles, in host and device code so that the host tests check it
// against a per-element brute force (tests/cuda/test_attention_cuda.cpp) where no GPU runs.
//
// A thread's 16 columns of a 64-wide accumulator tile are base + 8 nb + c (nb < 8, c < 2), and its element
// 4 nb + 2 h + c belongs to column base + 8 nb + c of its row pair h (the wgmma and mma.sync layouts alike). A
// slice shows a row one contiguous run of columns, so a row's bits are one run of 2 nb + c, spread to the element
// positions: a few integer operations per slice instead of a test per element.
#pragma once

#include <cstdint>

#include "kernels/cuda/attention.hpp"

#if defined(__CUDACC__)
#define TREECP_HD __host__ __device__ __forceinline__
#else
#define TREECP_HD inline
#endif

namespace treecp::cuda::detail {

TREECP_HD int imin(int a, int b) { return a < b ? a : b; }
TREECP_HD int imax(int a, int b) { return a > b ? a : b; }

// Bit 2 nb + c: column base + 8 nb + c lies in [lo, hi). The columns increase with 2 nb + c, so the bits are one
// run: how many lie below lo and below hi, clamped to the tile.
TREECP_HD uint32_t run_bits16(int base, int lo, int hi) {
  const auto below = [&](int x) {
    const int d = imin(imax(x - base, 0), 64);
    return 2 * (d >> 3) + imin(d & 7, 2);
  };
  const int a = below(lo), b = below(hi);
  return b > a ? (1u << b) - (1u << a) : 0u;
}

// Bit 2 nb + c of 16 bits moved to bit 4 nb + c: the element of column block nb for row pair h = 0 (h = 1: << 2).
TREECP_HD uint32_t spread_bit_pairs(uint32_t x) {
  x = (x | (x << 8)) & 0x00FF00FFu;
  x = (x | (x << 4)) & 0x0F0F0F0Fu;
  return (x | (x << 2)) & 0x33333333u;
}

// Forward: the keys [lo, hi) that slice sl shows query token t (in the slice's query range) below key k_end:
// dmin <= t - k < dmax and k0 <= k < min(k1, k_end).
struct ColumnRun {
  int lo, hi;
};
TREECP_HD ColumnRun slice_key_run(const DeviceSlice& sl, int t, int k_end) {
  return ColumnRun{imax(sl.k0, t - sl.dmax + 1), imin(imin(sl.k1, k_end), t - sl.dmin + 1)};
}

// Backward: the packed rows [lo, hi) of a query tile starting at token t0 (G packed rows per token, rows below
// valid_rows real, at most rows of them) that slice sl shows key k (in the slice's key range): tokens
// [max(q0, k + dmin), min(q1, k + dmax)), clamped to the tile before scaling by G.
TREECP_HD ColumnRun slice_row_run(const DeviceSlice& sl, int key, int t0, int G, int valid_rows, int rows) {
  const int lo = imin(imax(imax(sl.q0, key + sl.dmin) - t0, 0), rows);
  const int hi = imin(imax(imin(sl.q1, key + sl.dmax) - t0, 0), rows);
  return ColumnRun{G * lo, imin(G * hi, valid_rows)};
}

}  // namespace treecp::cuda::detail
