// tree/: packed prefix-tree rows: segments, positions, visibility as slices, workload presets, accounting.
//
// Accounting for a packed row: what sharing saves against storing every trajectory separately.
#pragma once

#include <cstdint>

#include "core/json.hpp"

namespace treecp {

class Row;

struct RowStats {
  int64_t physical_tokens = 0;
  int64_t flattened_tokens = 0;         // sum of trajectory lengths (every trajectory stored alone)
  int64_t trajectories = 0;             // leaves
  int64_t visible_pairs = 0;            // in the tree (with the window when given)
  int64_t flattened_visible_pairs = 0;  // each trajectory as its own causal sequence (same window)
  int32_t depth = 0;                    // most segments on one root-to-leaf path
  int64_t families = 0;                 // roots
  int64_t segments = 0;
  int64_t slices = 0;                   // slices in the decomposition
  int64_t window = 0;                   // 0 = none
};

// Visible pairs of one causal sequence of n tokens under a window (window <= 0: none).
int64_t causal_pairs(int64_t n, int64_t window);

RowStats row_stats(const Row& row, int64_t window = 0);
json::Value to_json(const RowStats& stats);

}  // namespace treecp
