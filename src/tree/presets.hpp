// tree/: packed prefix-tree rows: segments, positions, visibility as slices, workload presets, accounting.
//
// Workload presets of DESIGN.md "Workloads": one family repeated until the row (base x CP tokens)
// fills, the last segment clipped. Random draws come from a seeded mt19937_64 with our own
// Box-Muller transform, so a (preset, cp, seed) triple gives the same row on every platform.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tree/row.hpp"

namespace treecp {

struct PresetInfo {
  std::string name;
  std::string family;            // a one-line description
  int64_t base_tokens_per_rank;  // row length = base x cp
};

const std::vector<PresetInfo>& presets();
const PresetInfo& preset_info(const std::string& name);  // throws naming the known presets

// Builds the preset's row for `cp` ranks; throws treecp::Error on an unknown name or cp < 1.
Row make_preset(const std::string& name, int cp, uint64_t seed = 0);

// The same tree with every segment length divided by `divisor` (at least 1 token each): a preset's
// shape at a CPU-sized scale.
Row scale_row(const Row& row, int64_t divisor);

// A round(N(mean, stddev)) draw clipped to [lo, hi]; exposed for tests.
class PresetRng {
 public:
  explicit PresetRng(uint64_t seed);
  double normal();  // standard normal
  int64_t clipped_normal(double mean, double stddev, int64_t lo, int64_t hi);
  int64_t uniform_int(int64_t lo, int64_t hi);  // inclusive

 private:
  uint64_t next();
  uint64_t state_[4];
  bool has_spare_ = false;
  double spare_ = 0.0;
};

}  // namespace treecp
