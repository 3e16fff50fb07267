#include "tree/slice.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "tree/row.hpp"

namespace treecp {

namespace {

// Consecutive ancestors on a root path whose tokens are contiguous in the packed row: keys
// [k_begin, k_end), each at logical position k + offset.
struct KeyRun {
  int64_t k_begin, k_end, offset;
};

}  // namespace

std::vector<Slice> row_slices(const Row& row, int64_t window) {
  require(window >= 0, "window must be >= 0 (0 = none), got ", window);
  std::vector<Slice> out;
  out.reserve(static_cast<size_t>(window > 0 ? std::min(row.slice_count(), row.num_segments() * int64_t{2}) : row.slice_count()));
  // The runs above the current segment, root first, kept along the DFS: a segment that continues its
  // parent extends the last run, any other starts one. saved[d] restores them to what they were
  // before the path's segment of depth d + 1 joined (only the last run's end ever changes).
  std::vector<KeyRun> runs;
  std::vector<std::pair<size_t, int64_t>> saved;
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    const size_t level = static_cast<size_t>(row.depth(s) - 1);
    if (level < saved.size()) {
      runs.resize(saved[level].first);
      if (!runs.empty()) runs.back().k_end = saved[level].second;
      saved.resize(level);
    }
    const int64_t qs = row.start(s), qe = row.end(s);
    // logical(q) - logical(k) = (q - k) + shift, shift = s_off - run.offset
    const int64_t s_off = row.logical_start(s) - qs;
    // Logical positions along the path are contiguous and increase run by run: with a window, runs
    // wholly before logical_start(s) - window + 1 have no visible pair and are skipped by bisection.
    auto first = runs.begin();
    if (window > 0) {
      const int64_t lowest = row.logical_start(s) - window + 1;
      first = std::partition_point(runs.begin(), runs.end(), [&](const KeyRun& r) { return r.k_end + r.offset <= lowest; });
    }
    for (auto it = first; it != runs.end(); ++it) {
      const int64_t shift = s_off - it->offset;
      const int64_t dmin = qs - (it->k_end - 1);  // every key of an ancestor precedes every query
      const int64_t dmax = window > 0 ? window - shift : qe - it->k_begin;
      const Slice slice = make_slice(qs, qe, it->k_begin, it->k_end, dmin, dmax);
      if (!slice.empty()) out.push_back(slice);
    }
    const Slice self = make_slice(qs, qe, qs, qe, 0, window > 0 ? window : qe - qs);
    if (!self.empty()) out.push_back(self);
    saved.emplace_back(runs.size(), runs.empty() ? 0 : runs.back().k_end);
    if (row.continues_parent(s)) {
      runs.back().k_end = qe;
    } else {
      runs.push_back({qs, qe, s_off});
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
