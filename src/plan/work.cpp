#include "plan/work.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "tree/row.hpp"

namespace treecp {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The element of sorted `v` nearest to `target` inside [lo, hi], or -1.
int64_t nearest_in(const std::vector<int64_t>& v, int64_t target, int64_t lo, int64_t hi) {
  auto it = std::lower_bound(v.begin(), v.end(), target);
  int64_t best = -1;
  auto consider = [&](int64_t x) {
    if (x < lo || x > hi) return;
    if (best < 0 || std::abs(x - target) < std::abs(best - target)) best = x;
  };
  if (it != v.end()) consider(*it);
  if (it != v.begin()) consider(*std::prev(it));
  return best;
}
}  // namespace

int64_t default_chunk_tokens(int64_t tokens, int cp) {
  require(cp >= 1, "cp must be >= 1, got ", cp);
  if (tokens <= 0) return 1;
  int64_t chunk = 512;
  const int64_t budget = chunk_budget(cp);
  if (ceil_div(tokens, chunk) > budget) chunk = ceil_div(ceil_div(tokens, budget), kKernelTileTokens) * kKernelTileTokens;
  if (ceil_div(tokens, chunk) < cp) chunk = std::max<int64_t>(1, tokens / cp);
  return chunk;
}

std::vector<int64_t> make_chunk_bounds(const Row& row, int64_t chunk_tokens) {
  require(chunk_tokens >= 1, "chunk size must be >= 1 token, got ", chunk_tokens);
  const int64_t S = row.tokens();
  std::vector<int64_t> family_starts, segment_starts;
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    segment_starts.push_back(row.start(s));
    if (row.parent(s) == -1) family_starts.push_back(row.start(s));
  }
  std::vector<int64_t> bounds{0};
  const int64_t c = chunk_tokens;
  int64_t pos = 0;
  while (pos < S) {
    if (S - pos <= c + c / 4) break;
    const int64_t target = pos + c;
    int64_t cut = c >= 8 ? nearest_in(family_starts, target, pos + c / 2, pos + c + c / 2) : -1;
    if (cut < 0 && c >= 8) cut = nearest_in(segment_starts, target, pos + c - c / 4, pos + c + c / 4);
    if (cut <= pos || cut >= S) cut = target;
    bounds.push_back(cut);
    pos = cut;
  }
  if (S > 0) bounds.push_back(S);
  return bounds;
}

std::vector<int64_t> perdoc_chunk_bounds(const Row& row, int cp, int64_t min_piece) {
  require(cp >= 1 && min_piece >= 1, "perdoc_chunk_bounds: cp and min_piece must be >= 1");
  std::vector<int64_t> bounds{0};
  const int64_t pieces = 2 * static_cast<int64_t>(cp);
  for (int32_t r : row.roots()) {
    const int64_t begin = row.start(r), end = row.subtree_token_end(r), len = end - begin;
    if (len >= pieces * min_piece) {
      if (bounds.back() != begin) bounds.push_back(begin);  // close a group of small families
      // piece p = [begin + p * len / pieces, begin + (p + 1) * len / pieces)
      for (int64_t p = 1; p <= pieces; ++p) bounds.push_back(begin + p * len / pieces);
    } else if (end - bounds.back() >= min_piece) {
      bounds.push_back(end);
    }
  }
  if (bounds.back() != row.tokens()) bounds.push_back(row.tokens());
  if (row.tokens() == 0) bounds = {0};
  return bounds;
}

int32_t chunk_of(const std::vector<int64_t>& bounds, int64_t pos) {
  return static_cast<int32_t>(std::upper_bound(bounds.begin(), bounds.end(), pos) - bounds.begin()) - 1;
}

int64_t tile_padded_area(const Slice& s, int64_t tile_q, int64_t tile_k) {
  if (tile_q <= 0 || tile_k <= 0 || s.empty()) return s.area();
  int64_t total = 0;
  for (int64_t a = s.q_begin; a < s.q_end; a += tile_q) {
    const int64_t b = std::min(s.q_end, a + tile_q);
    // Keys rows [a, b) see: q - diag_max < k <= q - diag_min, inside the slice.
    const int64_t lo = std::max(s.k_begin, a - s.diag_max + 1), hi = std::min(s.k_end, b - s.diag_min);
    if (hi <= lo) continue;
    const int64_t key_tiles = (hi - 1 - s.k_begin) / tile_k - (lo - s.k_begin) / tile_k + 1;
    total += tile_q * tile_k * key_tiles;
  }
  return total;
}

WorkMatrix build_work_matrix(const std::vector<Slice>& slices, std::vector<int64_t> bounds, int64_t tile_q,
                             int64_t tile_k) {
  require(bounds.size() >= 1 && bounds.front() == 0, "work matrix: chunk bounds must start at 0");
  for (size_t i = 1; i < bounds.size(); ++i) {
    require(bounds[i] > bounds[i - 1], "work matrix: chunk bounds must increase strictly (at ", i, ")");
  }
  WorkMatrix w;
  w.bounds = std::move(bounds);
  const int32_t n = w.num_chunks();
  // Consecutive slices mostly start in the chunk the previous one did: test it before searching.
  int32_t q_hint = 0, k_hint = 0;
  auto near = [&w](int64_t pos, int32_t& hint) {
    if (pos < w.bounds[hint] || pos >= w.bounds[hint + 1]) hint = chunk_of(w.bounds, pos);
    return hint;
  };
  // Slices by query chunk (a counting sort of their (slice, query chunk) pairs): each chunk's row is
  // then summed densely over key chunks, in memory O(slices + entries) rather than O(pieces).
  std::vector<int64_t> first(static_cast<size_t>(n) + 1, 0);
  std::vector<std::pair<int32_t, int32_t>> q_span(slices.size(), {0, -1});
  for (size_t x = 0; x < slices.size(); ++x) {
    const Slice& s = slices[x];
    if (s.empty()) continue;
    if (!(s.q_begin >= 0 && s.k_begin >= 0 && s.q_end <= w.tokens() && s.k_end <= w.tokens())) {
      fail("work matrix: slice ", to_string(s), " outside the row [0, ", w.tokens(), ")");
    }
    const int32_t q0 = near(s.q_begin, q_hint);
    const int32_t q1 = s.q_end <= w.bounds[q0 + 1] ? q0 : chunk_of(w.bounds, s.q_end - 1);
    q_span[x] = {q0, q1};
    for (int32_t i = q0; i <= q1; ++i) first[i + 1]++;
  }
  for (int32_t i = 0; i < n; ++i) first[i + 1] += first[i];
  std::vector<int32_t> by_chunk(static_cast<size_t>(first[n]));
  {
    std::vector<int64_t> fill(first.begin(), first.end() - 1);
    for (size_t x = 0; x < slices.size(); ++x) {
      for (int32_t i = q_span[x].first; i <= q_span[x].second; ++i) by_chunk[fill[i]++] = static_cast<int32_t>(x);
    }
  }
  auto padded = [](int64_t len, int64_t tile) { return tile > 0 ? ceil_div(len, tile) * tile : len; };
  const bool tiled = tile_q > 0 && tile_k > 0;
  // One query chunk's row: pairs and computed pairs per key chunk, plus key chunks every query of a
  // piece sees in full, added as ranges (coefficients of the chunk's tokens, differences at the ends):
  // a slice over many whole key chunks costs O(1) per query chunk, not O(key chunks).
  std::vector<int64_t> pairs(n, 0), compute(n, 0), full(static_cast<size_t>(n) + 1, 0),
      full_compute(static_cast<size_t>(n) + 1, 0);
  w.row_start.assign(static_cast<size_t>(n) + 1, 0);
  w.q_weight.assign(n, 0);
  for (int32_t i = 0; i < n; ++i) {
    int32_t lo = n, hi = -1;
    for (int64_t e = first[i]; e < first[i + 1]; ++e) {
      const Slice& s = slices[static_cast<size_t>(by_chunk[e])];
      // Keys the chunk's queries can see: q - diag_max < k <= q - diag_min, inside the slice; every
      // one of them sees [fa, fb).
      const int64_t qa = std::max(s.q_begin, w.bounds[i]), qb = std::min(s.q_end, w.bounds[i + 1]);
      const int64_t ka = std::max(s.k_begin, qa - s.diag_max + 1), kb = std::min(s.k_end, qb - s.diag_min);
      if (kb <= ka) continue;
      const int64_t fa = std::max(ka, qb - s.diag_max), fb = std::min(kb, qa - s.diag_min + 1);
      const int32_t j0 = near(ka, k_hint), j1 = kb <= w.bounds[j0 + 1] ? j0 : chunk_of(w.bounds, kb - 1);
      // Whole key chunks inside [fa, fb): [f0, f1) (a piece in one key chunk is cut like any other).
      int32_t f0 = j1 + 1, f1 = j1 + 1;
      if (fa < fb && j1 > j0) {
        f0 = chunk_of(w.bounds, fa);
        if (w.bounds[f0] < fa) ++f0;
        f1 = std::max(f0, chunk_of(w.bounds, fb));
      }
      for (int32_t j = j0; j <= j1; ++j) {
        if (j == f0 && f0 < f1) {
          full[f0] += qb - qa;
          full[f1] -= qb - qa;
          full_compute[f0] += padded(qb - qa, tile_q);
          full_compute[f1] -= padded(qb - qa, tile_q);
          j = f1 - 1;
          continue;
        }
        const Slice piece = cut_slice(s, qa, qb, w.bounds[j], w.bounds[j + 1]);
        const int64_t a = piece.area();
        if (a <= 0) continue;
        pairs[j] += a;
        compute[j] += tile_padded_area(piece, tile_q, tile_k);
      }
      lo = std::min(lo, j0);
      hi = std::max(hi, j1);
    }
    int64_t full_rows = 0, full_compute_rows = 0;
    for (int32_t j = lo; j <= hi; ++j) {
      full_rows += full[j];
      full_compute_rows += full_compute[j];
      const int64_t p = pairs[j] + full_rows * w.chunk_tokens(j);
      const int64_t c = compute[j] + (tiled ? full_compute_rows * padded(w.chunk_tokens(j), tile_k) : full_rows * w.chunk_tokens(j));
      pairs[j] = compute[j] = full[j] = full_compute[j] = 0;
      if (p <= 0) continue;
      w.col.push_back(j);
      w.pairs.push_back(p);
      w.compute.push_back(c);
      w.row_start[i + 1]++;
      w.q_weight[i] += p;
      w.total_pairs += p;
    }
    if (hi >= 0) full[hi + 1] = full_compute[hi + 1] = 0;
  }
  for (int32_t i = 0; i < n; ++i) w.row_start[i + 1] += w.row_start[i];
  return w;
}

}  // namespace treecp
