// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// The slice band: the one description of visibility that kernels take (CPU and CUDA alike), as
// (q_range, k_range, band) with one closed-form area. Query q sees key k of a slice iff
// q in [q_begin, q_end), k in [k_begin, k_end) and diag_min <= q - k < diag_max.
// Every slice kind is this band: full (band covers the rectangle), causal (diag_min = q_begin-k_begin
// bottom edge at the diagonal, no upper bound) and windowed (upper bound from the sliding window on
// logical positions, which is a constant shift of physical positions inside one segment pair).
// Slices are kept tight: the rectangle is the bounding box of its visible pairs and the band is
// clipped to the rectangle, so `kind` is derived, never stored separately from the geometry.
// The coordinates are token ids (tree/slice.hpp builds a row's slices) or buffer rows (a stage's
// slices, runtime/row_map.hpp); this header knows neither rows nor buffers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

namespace treecp {

enum class SliceKind : uint8_t {
  Full = 0,      // every (q, k) in the rectangle
  Causal = 1,    // q - k >= diag_min only (a lower-left triangle or trapezoid)
  Window = 2,    // q - k < diag_max only (an upper-right cut from a sliding window)
  Band = 3,      // both bounds bind (causal and windowed)
};

const char* slice_kind_name(SliceKind kind);

struct Slice {
  int64_t q_begin = 0, q_end = 0;  // query rows [q_begin, q_end)
  int64_t k_begin = 0, k_end = 0;  // key rows [k_begin, k_end)
  int64_t diag_min = 0;            // q - k >= diag_min
  int64_t diag_max = 0;            // q - k <  diag_max

  int64_t q_len() const { return q_end - q_begin; }
  int64_t k_len() const { return k_end - k_begin; }
  bool empty() const { return q_end <= q_begin || k_end <= k_begin || diag_max <= diag_min; }
  // Keys query q sees in the slice: [key_begin(q), key_end(q)), empty when key_end(q) <= key_begin(q);
  // both nondecreasing in q (from k_begin <= k < k_end and diag_min <= q - k < diag_max).
  int64_t key_begin(int64_t q) const { return std::max(k_begin, q - diag_max + 1); }
  int64_t key_end(int64_t q) const { return std::min(k_end, q - diag_min + 1); }
  bool contains(int64_t q, int64_t k) const {
    return q >= q_begin && q < q_end && k >= k_begin && k < k_end && q - k >= diag_min && q - k < diag_max;
  }
  // Visible pairs in the slice (closed form, O(1)).
  int64_t area() const;
  SliceKind kind() const;
  bool operator==(const Slice&) const = default;
};

// A slice from a rectangle and a band, tightened to the bounding box of its visible pairs.
// Returns an empty slice (all zero) when nothing is visible.
Slice make_slice(int64_t q_begin, int64_t q_end, int64_t k_begin, int64_t k_end, int64_t diag_min,
                 int64_t diag_max);

// The part of `s` inside the rectangle [q_begin, q_end) x [k_begin, k_end), tightened; may be empty.
Slice cut_slice(const Slice& s, int64_t q_begin, int64_t q_end, int64_t k_begin, int64_t k_end);

// Pairs (q, k) with q in [q0, q1), k in [k0, k1) and q - k < d (closed form).
int64_t pairs_below_diagonal(int64_t q0, int64_t q1, int64_t k0, int64_t k1, int64_t d);

std::string to_string(const Slice& s);

}  // namespace treecp
