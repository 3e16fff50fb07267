#include "runtime/conv_cp.hpp"

#include <algorithm>
#include <set>

#include "core/error.hpp"
#include "runtime/row_map.hpp"

namespace treecp {
namespace {

// The token before t on its logical path, or -1 at a root's first token.
int64_t logical_pred(const Row& row, int64_t t) {
  const int32_t s = row.segment_of(t);
  if (t > row.start(s)) return t - 1;
  const int32_t p = row.parent(s);
  return p < 0 ? -1 : row.end(p) - 1;
}

// Sorted halo tokens of one rank: predecessors within width-1 steps of its tokens that it does not hold.
std::vector<int64_t> halo_of(const Row& row, const std::vector<TokenRange>& ranges, int width) {
  const RowMap held(ranges);
  std::set<int64_t> halo;
  for (const TokenRange& r : ranges) {
    for (int32_t s = row.segment_of(r.begin); s < row.num_segments() && row.start(s) < r.end; ++s) {
      const int64_t a = std::max(r.begin, row.start(s)), b = std::min(r.end, row.end(s));
      // Deeper tokens of the run find all their predecessors inside it.
      for (int64_t t = a; t < std::min(b, a + width - 1); ++t) {
        int64_t u = t;
        for (int i = 1; i < width; ++i) {
          u = logical_pred(row, u);
          if (u < 0) break;
          if (held.find(u) < 0) halo.insert(u);
        }
      }
    }
  }
  return {halo.begin(), halo.end()};
}

}  // namespace

ConvHalo make_conv_halo(const Row& row, const Ownership& layout, int rank, int width) {
  const int n = static_cast<int>(layout.size());
  require(rank >= 0 && rank < n, "conv1d: rank ", rank, " outside the layout's ", n, " ranks");
  require(width >= 1, "conv1d: width must be >= 1, got ", width);
  ConvHalo h;
  const auto& mine = layout[static_cast<size_t>(rank)];
  const RowMap held(mine);
  h.owned_rows = held.rows();
  h.halo_tokens = halo_of(row, mine, width);
  auto row_of = [&](int64_t t) -> int64_t {
    if (t < 0) return -1;
    const int64_t o = held.find(t);
    if (o >= 0) return o;
    auto it = std::lower_bound(h.halo_tokens.begin(), h.halo_tokens.end(), t);
    if (it == h.halo_tokens.end() || *it != t) return -1;  // beyond what any output reaches
    return h.owned_rows + (it - h.halo_tokens.begin());
  };
  for (const TokenRange& r : mine)
    for (int64_t t = r.begin; t < r.end; ++t) h.prev.push_back(row_of(logical_pred(row, t)));
  for (int64_t t : h.halo_tokens) h.prev.push_back(row_of(logical_pred(row, t)));
  // Traffic: what each peer needs from this rank, and what this rank needs from each peer, both in
  // token order, so that the two sides agree without sending indices.
  h.send_rows.assign(static_cast<size_t>(n), {});
  h.recv_rows.assign(static_cast<size_t>(n), {});
  for (size_t i = 0; i < h.halo_tokens.size(); ++i)
    h.recv_rows[static_cast<size_t>(owner_of(layout, h.halo_tokens[i]))].push_back(h.owned_rows +
                                                                                   static_cast<int64_t>(i));
  for (int p = 0; p < n; ++p) {
    if (p == rank) continue;
    for (int64_t t : halo_of(row, layout[static_cast<size_t>(p)], width)) {
      const int64_t o = held.find(t);
      if (o >= 0) h.send_rows[static_cast<size_t>(p)].push_back(o);
    }
  }
  return h;
}

}  // namespace treecp
