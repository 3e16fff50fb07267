// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// The CPU attention kernel's tile (kernels/cpu/attention.cpp): the numbers the kernel loops by and
// the cost model (plan/cost.hpp, kernel_tiles "cpu") prices a slice's padded pairs with.
#pragma once

#include <cstdint>

namespace treecp::cpu {

// Rows of a tile: (query, head) pairs of one KV head, about 128 of them so that a key block's scores
// (128 x 64) and the packed Q/dO rows stay in L2 while the block is processed; a tile holds
// max(1, kTileRows / G) queries at G query heads per KV head.
inline constexpr int64_t kTileRows = 128;
// Keys per block: 64 keys x (D + Dv = 128) x 8 bytes = 64 KiB in double, 32 KiB in float.
inline constexpr int64_t kKeyBlock = 64;

}  // namespace treecp::cpu
