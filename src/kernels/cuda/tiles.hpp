// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// The CUDA attention kernels' tile sizes (kernels/cuda/attention.hpp includes them): plain constants
// without CUDA headers, so that the cost model (plan/cost.hpp, kernel_tiles "cuda") prices a slice's
// padded pairs with the kernels' own numbers on machines without a CUDA toolkit.
#pragma once

namespace treecp::cuda {

// Tile sizes of the kernels, in packed rows (a packed row is one (token, q head of a GQA group)).
inline constexpr int kFwdBlockRows = 128;  // 16 tokens x 8 q heads at GQA 32/4; O of 128 x 128 fits the
                                           // registers of 4 warps x 32 rows or 8 warps x 16 rows
inline constexpr int kFwdBlockKeys = 64;   // one K and one V tile of 64 x 128 bf16 each, two stages
inline constexpr int kFwdRowsPerWarp = 32; // mma.sync main loop: half the shared-memory reads of 16
inline constexpr int kBwdBlockRows = 64;   // 64 packed query rows per step of the key-major walk
inline constexpr int kBwdBlockKeys = 128;  // 8 warps x 16 keys (dK, dV of 16 x D per warp in registers);
                                           // 128 rather than 64 halves the dQ atomics per FLOP
inline constexpr int kSegmentChunk = 16;        // tiles of one segment that run together in the segment order
inline constexpr int kKeyTileMinFraction = 4;  // a key tile starts at a key boundary only a quarter tile or
                                               // more past the previous start (tiny segments share a tile)

}  // namespace treecp::cuda
