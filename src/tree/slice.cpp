#include "tree/slice.hpp"

#include <algorithm>
#include <sstream>

#include "core/error.hpp"
#include "tree/row.hpp"

namespace treecp {

const char* slice_kind_name(SliceKind kind) {
  switch (kind) {
    case SliceKind::Full: return "full";
    case SliceKind::Causal: return "causal";
    case SliceKind::Window: return "window";
    case SliceKind::Band: return "band";
  }
  return "?";
}

int64_t pairs_below_diagonal(int64_t q0, int64_t q1, int64_t k0, int64_t k1, int64_t d) {
  if (q1 <= q0 || k1 <= k0) return 0;
  // For query q the keys k in [max(k0, q-d+1), k1) count: all of them while q <= k0+d-1, then one
  // fewer per row until none remain at q >= k1+d-1.
  const int64_t full_end = std::clamp(k0 + d, q0, q1);      // rows [q0, full_end) see k1-k0 keys
  const int64_t part_end = std::clamp(k1 + d - 1, q0, q1);  // rows [full_end, part_end) see k1-q+d-1
  __int128 total = static_cast<__int128>(full_end - q0) * (k1 - k0);
  if (part_end > full_end) {
    // sum_{q=a}^{b-1} (k1 + d - 1 - q) = n*(k1+d-1) - (a+b-1)*n/2
    const __int128 a = full_end, b = part_end, n = b - a;
    total += n * (k1 + d - 1) - (a + b - 1) * n / 2;
  }
  return static_cast<int64_t>(total);
}

int64_t Slice::area() const {
  if (empty()) return 0;
  return pairs_below_diagonal(q_begin, q_end, k_begin, k_end, diag_max) -
         pairs_below_diagonal(q_begin, q_end, k_begin, k_end, diag_min);
}

SliceKind Slice::kind() const {
  // The band is clipped to the rectangle: a bound binds only if it cuts off a corner.
  const bool lower = diag_min > q_begin - (k_end - 1);
  const bool upper = diag_max < (q_end - 1) - k_begin + 1;
  if (lower && upper) return SliceKind::Band;
  if (lower) return SliceKind::Causal;
  if (upper) return SliceKind::Window;
  return SliceKind::Full;
}

Slice make_slice(int64_t q_begin, int64_t q_end, int64_t k_begin, int64_t k_end, int64_t diag_min,
                 int64_t diag_max) {
  if (q_end <= q_begin || k_end <= k_begin || diag_max <= diag_min) return Slice{};
  // Rows with at least one key: k in [max(k0, q-dmax+1), min(k1-1, q-dmin)] non-empty.
  const int64_t q0 = std::max(q_begin, k_begin + diag_min);
  const int64_t q1 = std::min(q_end, k_end - 1 + diag_max);
  if (q1 <= q0) return Slice{};
  // Keys seen by at least one of those rows: q in [max(q0, k+dmin), min(q1-1, k+dmax-1)].
  const int64_t k0 = std::max(k_begin, q0 - diag_max + 1);
  const int64_t k1 = std::min(k_end, q1 - diag_min);
  if (k1 <= k0) return Slice{};
  Slice s{q0, q1, k0, k1, 0, 0};
  s.diag_min = std::max(diag_min, q0 - (k1 - 1));
  s.diag_max = std::min(diag_max, (q1 - 1) - k0 + 1);
  return s;
}

Slice cut_slice(const Slice& s, int64_t q_begin, int64_t q_end, int64_t k_begin, int64_t k_end) {
  return make_slice(std::max(s.q_begin, q_begin), std::min(s.q_end, q_end), std::max(s.k_begin, k_begin),
                    std::min(s.k_end, k_end), s.diag_min, s.diag_max);
}

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

std::string to_string(const Slice& s) {
  std::ostringstream out;
  out << "q[" << s.q_begin << "," << s.q_end << ") k[" << s.k_begin << "," << s.k_end << ") d["
      << s.diag_min << "," << s.diag_max << ") " << slice_kind_name(s.kind());
  return out.str();
}

}  // namespace treecp
