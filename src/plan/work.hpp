// plan/: pure data between the row and the runtime: ownership, the dense, GDN/KDA, Mamba-2 and sparse MLA
// planners, their cost models, and the Plans they produce (no tensor values).
//
// Chunks and the work matrix (ART §05): the row is cut into contiguous chunks, the planning unit of
// ownership; W[i][j] = visible pairs between query chunk i and key chunk j, built from slices in
// closed form and stored sparse (only non-zero entries; never S x S, never N x N dense).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/slice.hpp"

namespace treecp {

class Row;

// The attention kernels' tile in tokens: grown chunk sizes are multiples of it, and the command line
// accepts no chunk below it.
inline constexpr int64_t kKernelTileTokens = 128;

// Most chunks a plan uses: enough to balance (16 per rank on top of a floor of 128), few enough that
// the search stays in a few milliseconds (ART's runtime uses the same budget).
inline int64_t chunk_budget(int cp) { return 128 + 16 * static_cast<int64_t>(cp); }

// The chunk size the planner chooses: 512 tokens (four 128-token kernel tiles), grown to a multiple
// of 128 when the row would need more than chunk_budget(cp) chunks, shrunk when there would be fewer
// chunks than ranks.
int64_t default_chunk_tokens(int64_t tokens, int cp);

// Chunk bounds [0, ..., S] of about `chunk_tokens` each, snapped to a family boundary within half a
// chunk (else to a segment boundary within a quarter chunk) so that chunks cut few slices.
std::vector<int64_t> make_chunk_bounds(const Row& row, int64_t chunk_tokens);

// Per-document zigzag grid: every family of at least 2 cp x min_piece tokens is cut into 2 cp equal
// pieces; smaller consecutive families are grouped whole into chunks of at least min_piece tokens.
std::vector<int64_t> perdoc_chunk_bounds(const Row& row, int cp, int64_t min_piece);

// Sparse W in compressed rows: entries of query chunk i are [row_start[i], row_start[i + 1]),
// sorted by key chunk.
struct WorkMatrix {
  std::vector<int64_t> bounds;     // chunk c = [bounds[c], bounds[c + 1])
  std::vector<int64_t> row_start;  // size n + 1
  std::vector<int32_t> col;        // key chunk of each entry
  std::vector<int64_t> pairs;      // visible pairs of each entry (> 0)
  std::vector<int64_t> compute;    // pairs a tiled kernel computes for the entry (>= pairs; = pairs untiled)
  std::vector<int64_t> q_weight;   // row sums: the attention pairs of each query chunk
  int64_t total_pairs = 0;

  int32_t num_chunks() const { return static_cast<int32_t>(bounds.size()) - 1; }
  int64_t chunk_tokens(int32_t c) const { return bounds[c + 1] - bounds[c]; }
  int64_t tokens() const { return bounds.back(); }
  int64_t nonzeros() const { return static_cast<int64_t>(col.size()); }
};

// The pairs a kernel computes for a slice when it tiles the slice's queries by `tile_q` tokens and its
// keys by `tile_k` from the slice's own start and computes every tile it touches in full: small or
// triangular slices cost more than their area. tile_q or tile_k <= 0: the exact area.
int64_t tile_padded_area(const Slice& s, int64_t tile_q, int64_t tile_k);

// W for the given bounds from a row's slices (row_slices), with `compute` from tile_padded_area of each
// slice's piece in the entry. Throws if a slice leaves the bounds.
WorkMatrix build_work_matrix(const std::vector<Slice>& slices, std::vector<int64_t> bounds, int64_t tile_q = 0,
                             int64_t tile_k = 0);

// Index of the chunk holding token `pos` (bounds sorted, pos in [bounds.front(), bounds.back())).
int32_t chunk_of(const std::vector<int64_t>& bounds, int64_t pos);

}  // namespace treecp
