#include "tree/slice.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "tree/row.hpp"

namespace treecp {

std::vector<Slice> row_slices(const Row& row, int64_t window) {
  require(window >= 0, "window must be >= 0 (0 = none), got ", window);
  std::vector<Slice> out;
  out.reserve(static_cast<size_t>(row.num_segments()) * 2);
  std::vector<int32_t> chain;
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    chain.clear();
    for (int32_t a = s; a != -1; a = row.parent(a)) chain.push_back(a);
    const int64_t qs = row.start(s), qe = row.end(s);
    // logical(q) - logical(k) = (q - k) + shift, shift = (ls_s - ps_s) - (ls_a - ps_a)
    const int64_t s_off = row.logical_start(s) - qs;
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      const int32_t a = *it;
      const int64_t ks = row.start(a), ke = row.end(a);
      const int64_t shift = s_off - (row.logical_start(a) - ks);
      const int64_t dmin = a == s ? 0 : qs - (ke - 1);  // ancestors: every key precedes every query
      const int64_t dmax = window > 0 ? window - shift : qe - ks;
      Slice slice = make_slice(qs, qe, ks, ke, dmin, dmax);
      if (!slice.empty()) out.push_back(slice);
    }
  }
  return out;
}

std::vector<Slice> split_slices(const std::vector<Slice>& slices, const std::vector<int64_t>& bounds) {
  require(bounds.size() >= 2, "split_slices: bounds need at least a start and an end");
  require(std::is_sorted(bounds.begin(), bounds.end()), "split_slices: bounds must be sorted");
  std::vector<Slice> out;
  out.reserve(slices.size());
  auto first_chunk = [&](int64_t pos) {
    return static_cast<size_t>(std::upper_bound(bounds.begin(), bounds.end(), pos) - bounds.begin()) - 1;
  };
  for (const Slice& s : slices) {
    if (s.empty()) continue;
    require(s.q_begin >= bounds.front() && s.q_end <= bounds.back() && s.k_begin >= bounds.front() &&
                s.k_end <= bounds.back(),
            "split_slices: slice ", to_string(s), " outside the bounds");
    for (size_t qi = first_chunk(s.q_begin); qi + 1 < bounds.size() && bounds[qi] < s.q_end; ++qi) {
      for (size_t ki = first_chunk(s.k_begin); ki + 1 < bounds.size() && bounds[ki] < s.k_end; ++ki) {
        Slice piece = cut_slice(s, bounds[qi], bounds[qi + 1], bounds[ki], bounds[ki + 1]);
        if (!piece.empty()) out.push_back(piece);
      }
    }
  }
  return out;
}

}  // namespace treecp
