// Where canonical tokens live in a rank's buffers. A RowMap lays a sorted list of disjoint canonical
// ranges out contiguously: buffer row of token t in ranges[i] = offsets[i] + (t - ranges[i].begin).
// Kernels see slices in buffer coordinates; to_buffer() shifts a canonical slice into them.
#pragma once

#include <cstdint>
#include <vector>

#include "plan/plan.hpp"
#include "kernels/slice.hpp"

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
  // Buffer row of the first token of [begin, end), requiring the whole range to be contiguous there.
  int64_t row_of_range(int64_t begin, int64_t end) const;

 private:
  std::vector<TokenRange> ranges_;
  std::vector<int64_t> offsets_;
  std::vector<size_t> by_begin_;  // indices of ranges sorted by begin, for lookup
  int64_t rows_ = 0;
};

// The slice in buffer coordinates of (q_map, k_map): rows shift, and the band shifts by the
// difference of the two shifts so that q - k keeps its meaning.
Slice to_buffer(const Slice& s, const RowMap& q_map, const RowMap& k_map);
std::vector<Slice> to_buffer(const std::vector<Slice>& slices, const RowMap& q_map, const RowMap& k_map);

// Intersection of two sorted disjoint range lists, sorted.
std::vector<TokenRange> intersect(const std::vector<TokenRange>& a, const std::vector<TokenRange>& b);

// The rows of a full [S, width] array that `ranges` select, in order (a rank's share of a row),
// converted to Out.
template <class Out, class In>
std::vector<Out> rows_of(const std::vector<In>& full, int64_t width, const std::vector<TokenRange>& ranges) {
  std::vector<Out> out;
  for (const TokenRange& r : ranges) out.insert(out.end(), full.begin() + r.begin * width, full.begin() + r.end * width);
  return out;
}

// Near-equal contiguous shards: rank r of n holds [r*S/n, (r+1)*S/n) (the data loader's split).
TokenRange contiguous_shard(int64_t tokens, int rank, int ranks);

}  // namespace treecp
