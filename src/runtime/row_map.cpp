#include "runtime/row_map.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace treecp {

RowMap::RowMap(std::vector<TokenRange> ranges) : ranges_(std::move(ranges)) {
  offsets_.reserve(ranges_.size());
  for (const TokenRange& r : ranges_) {
    require(r.end >= r.begin, "row map: range [", r.begin, ", ", r.end, ") is reversed");
    offsets_.push_back(rows_);
    rows_ += r.size();
  }
  by_begin_.resize(ranges_.size());
  for (size_t i = 0; i < by_begin_.size(); ++i) by_begin_[i] = i;
  std::sort(by_begin_.begin(), by_begin_.end(), [&](size_t a, size_t b) { return ranges_[a].begin < ranges_[b].begin; });
  for (size_t i = 1; i < by_begin_.size(); ++i) {
    require(ranges_[by_begin_[i - 1]].end <= ranges_[by_begin_[i]].begin, "row map: ranges overlap at token ",
            ranges_[by_begin_[i]].begin);
  }
}

int64_t RowMap::row_of(int64_t token) const {
  auto it = std::upper_bound(by_begin_.begin(), by_begin_.end(), token,
                             [&](int64_t t, size_t i) { return t < ranges_[i].begin; });
  require(it != by_begin_.begin(), "row map: token ", token, " is not held here");
  const size_t i = *(it - 1);
  require(token < ranges_[i].end, "row map: token ", token, " is not held here");
  return offsets_[i] + (token - ranges_[i].begin);
}

int64_t RowMap::row_of_range(int64_t begin, int64_t end) const {
  const int64_t first = row_of(begin);
  require(end > begin && row_of(end - 1) == first + (end - 1 - begin), "row map: tokens [", begin, ", ", end,
          ") are not contiguous in the buffer");
  return first;
}

Slice to_buffer(const Slice& s, const RowMap& q_map, const RowMap& k_map) {
  const int64_t dq = q_map.row_of_range(s.q_begin, s.q_end) - s.q_begin;
  const int64_t dk = k_map.row_of_range(s.k_begin, s.k_end) - s.k_begin;
  // (q + dq) - (k + dk) = (q - k) + (dq - dk)
  return Slice{s.q_begin + dq, s.q_end + dq, s.k_begin + dk, s.k_end + dk, s.diag_min + dq - dk, s.diag_max + dq - dk};
}

std::vector<Slice> to_buffer(const std::vector<Slice>& slices, const RowMap& q_map, const RowMap& k_map) {
  std::vector<Slice> out;
  out.reserve(slices.size());
  for (const Slice& s : slices) out.push_back(to_buffer(s, q_map, k_map));
  return out;
}

std::vector<TokenRange> intersect(const std::vector<TokenRange>& a, const std::vector<TokenRange>& b) {
  std::vector<TokenRange> out;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const int64_t lo = std::max(a[i].begin, b[j].begin), hi = std::min(a[i].end, b[j].end);
    if (lo < hi) out.push_back({lo, hi});
    (a[i].end < b[j].end) ? ++i : ++j;
  }
  return out;
}

int64_t tokens_in(const std::vector<TokenRange>& ranges) {
  int64_t n = 0;
  for (const TokenRange& r : ranges) n += r.size();
  return n;
}

TokenRange contiguous_shard(int64_t tokens, int rank, int ranks) {
  return {tokens * rank / ranks, tokens * (rank + 1) / ranks};
}

}  // namespace treecp
