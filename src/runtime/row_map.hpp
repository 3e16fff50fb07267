// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// Where canonical tokens live in a rank's buffers: the one token-to-buffer-row map. A RowMap lays a
// list of disjoint canonical ranges out contiguously, in the list's order: buffer row of token t in
// ranges[i] = offset(i) + (t - ranges[i].begin). Kernels see slices in buffer coordinates; to_buffer()
// moves canonical slices into them.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/slice.hpp"
#include "plan/ownership.hpp"

namespace treecp {

class RowMap {
 public:
  RowMap() = default;
  // `ranges` in buffer order; they need not be sorted (received waves list ranges per peer).
  explicit RowMap(std::vector<TokenRange> ranges);

  int64_t rows() const { return rows_; }
  const std::vector<TokenRange>& ranges() const { return ranges_; }
  int64_t offset(size_t i) const { return offsets_[i]; }
  // Buffer row of canonical token t; throws treecp::Error when t is not mapped.
  int64_t row_of(int64_t token) const;
  // Buffer row of canonical token t, or -1 when t is not mapped.
  int64_t find(int64_t token) const;
  // Buffer row of the first token of [begin, end), requiring the whole range to be contiguous there.
  int64_t row_of_range(int64_t begin, int64_t end) const;
  // Indices of the ranges that overlap [begin, end), by increasing begin.
  std::vector<size_t> overlapping(int64_t begin, int64_t end) const;

 private:
  std::vector<TokenRange> ranges_;
  std::vector<int64_t> offsets_;
  std::vector<size_t> by_begin_;  // indices of ranges sorted by begin, for lookup
  int64_t rows_ = 0;
};

// The pairs of `slices` (canonical ids) whose query q_map holds and whose key k_map holds, as slices
// in buffer coordinates: each slice is cut at the maps' ranges, rows shift, and the band shifts by the
// difference of the two shifts so that q - k keeps its meaning; pairs outside the maps are dropped, so
// a caller can pass a whole row's slices and get one stage's share. A slice inside one range of each
// map (every slice of a validated Plan's stage) comes out as one slice.
// Example (DESIGN.md's tree): queries {4,5,6} against fetched keys {2,3}: q_map {[4,7)}, k_map {[2,4)};
// the row's slice q[4,7) k[0,4) becomes q[0,3) k[0,2).
std::vector<Slice> to_buffer(const std::vector<Slice>& slices, const RowMap& q_map, const RowMap& k_map);

// The rows of a full [S, width] array that `ranges` select, in order (a rank's share of a row),
// converted to Out.
template <class Out, class In>
std::vector<Out> rows_of(const std::vector<In>& full, int64_t width, const std::vector<TokenRange>& ranges) {
  std::vector<Out> out;
  for (const TokenRange& r : ranges) out.insert(out.end(), full.begin() + r.begin * width, full.begin() + r.end * width);
  return out;
}

}  // namespace treecp
