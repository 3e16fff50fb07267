#include "kernels/slice.hpp"

#include <algorithm>
#include <sstream>

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

std::string to_string(const Slice& s) {
  std::ostringstream out;
  out << "q[" << s.q_begin << "," << s.q_end << ") k[" << s.k_begin << "," << s.k_end << ") d["
      << s.diag_min << "," << s.diag_max << ") " << slice_kind_name(s.kind());
  return out.str();
}

}  // namespace treecp
