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

int64_t RowMap::find(int64_t token) const {
  auto it = std::upper_bound(by_begin_.begin(), by_begin_.end(), token,
                             [&](int64_t t, size_t i) { return t < ranges_[i].begin; });
  if (it == by_begin_.begin()) return -1;
  const size_t i = *(it - 1);
  return token < ranges_[i].end ? offsets_[i] + (token - ranges_[i].begin) : -1;
}

int64_t RowMap::row_of(int64_t token) const {
  const int64_t row = find(token);
  require(row >= 0, "row map: token ", token, " is not held here");
  return row;
}

int64_t RowMap::row_of_range(int64_t begin, int64_t end) const {
  const int64_t first = row_of(begin);
  require(end > begin && row_of(end - 1) == first + (end - 1 - begin), "row map: tokens [", begin, ", ", end,
          ") are not contiguous in the buffer");
  return first;
}

std::vector<size_t> RowMap::overlapping(int64_t begin, int64_t end) const {
  // The first range ending after `begin`: ranges are disjoint, so ends increase with begins.
  auto it = std::upper_bound(by_begin_.begin(), by_begin_.end(), begin,
                             [&](int64_t t, size_t i) { return t < ranges_[i].end; });
  std::vector<size_t> out;
  for (; it != by_begin_.end() && ranges_[*it].begin < end; ++it) out.push_back(*it);
  return out;
}

std::vector<Slice> to_buffer(const std::vector<Slice>& slices, const RowMap& q_map, const RowMap& k_map) {
  std::vector<Slice> out;
  out.reserve(slices.size());
  for (const Slice& s : slices) {
    if (s.empty()) continue;
    const std::vector<size_t> ks = k_map.overlapping(s.k_begin, s.k_end);
    for (size_t qi : q_map.overlapping(s.q_begin, s.q_end)) {
      const TokenRange& qr = q_map.ranges()[qi];
      for (size_t ki : ks) {
        const TokenRange& kr = k_map.ranges()[ki];
        const Slice piece = cut_slice(s, qr.begin, qr.end, kr.begin, kr.end);
        if (piece.empty()) continue;
        // q_buf = q + dq, k_buf = k + dk, so q_buf - k_buf = (q - k) + (dq - dk)
        const int64_t dq = q_map.offset(qi) - qr.begin, dk = k_map.offset(ki) - kr.begin;
        out.push_back(Slice{piece.q_begin + dq, piece.q_end + dq, piece.k_begin + dk, piece.k_end + dk,
                            piece.diag_min + dq - dk, piece.diag_max + dq - dk});
      }
    }
  }
  return out;
}

}  // namespace treecp
