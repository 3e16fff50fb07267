// tree/: packed prefix-tree rows: segments, positions, visibility as slices, workload presets, accounting.
//
// A row's visibility as slices (kernels/slice.hpp holds the band itself): per segment, one slice
// against each strict ancestor and one against itself, in token ids; and slices cut at chunk bounds.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/slice.hpp"

namespace treecp {

class Row;

// The slice decomposition of a row's visibility (DESIGN.md): per segment, one slice against each run of
// consecutive ancestors that are contiguous in the packed row (full, or windowed; a chain of segments
// is one run) and one against itself (causal, or banded with a window). window <= 0 means no window.
// Slices with no visible pair are dropped. Ordered by query segment, then by key run from the root
// down. Sum of areas == visible pairs; time and memory linear in the slices (row.slice_count() at most).
std::vector<Slice> row_slices(const Row& row, int64_t window = 0);

// Cuts every slice at the given boundaries (sorted, starting at 0 and ending at the row length);
// both the query and the key side are cut. Areas are preserved; empty pieces are dropped.
std::vector<Slice> split_slices(const std::vector<Slice>& slices, const std::vector<int64_t>& bounds);

}  // namespace treecp
