#include "plan/ownership.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace treecp {

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

int64_t tokens_of(const std::vector<TokenRange>& ranges) {
  int64_t n = 0;
  for (const TokenRange& r : ranges) n += r.size();
  return n;
}

Ownership contiguous_ownership(int64_t tokens, int ranks) {
  require(ranks >= 1, "ownership: ranks must be >= 1, got ", ranks);
  require(tokens >= 0, "ownership: tokens must be >= 0, got ", tokens);
  Ownership out(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    const TokenRange t{tokens * r / ranks, tokens * (r + 1) / ranks};
    if (t.size() > 0) out[static_cast<size_t>(r)].push_back(t);
  }
  return out;
}

Ownership gathered_ownership(int64_t tokens, int ranks, int root) {
  require(ranks >= 1 && root >= 0 && root < ranks, "ownership: root ", root, " outside [0, ", ranks, ")");
  Ownership out(static_cast<size_t>(ranks));
  if (tokens > 0) out[static_cast<size_t>(root)].push_back({0, tokens});
  return out;
}

void validate_ownership(const Ownership& ownership, int64_t tokens) {
  std::vector<TokenRange> all;
  for (size_t r = 0; r < ownership.size(); ++r) {
    for (size_t i = 0; i < ownership[r].size(); ++i) {
      const TokenRange& t = ownership[r][i];
      require(t.begin < t.end && t.begin >= 0 && t.end <= tokens, "ownership: rank ", r, " range ", i,
              " must be non-empty inside [0, ", tokens, ")");
      require(i == 0 || ownership[r][i - 1].end <= t.begin, "ownership: rank ", r,
              " ranges must be sorted and disjoint");
      all.push_back(t);
    }
  }
  std::sort(all.begin(), all.end(), [](const TokenRange& a, const TokenRange& b) { return a.begin < b.begin; });
  int64_t at = 0;
  for (const TokenRange& t : all) {
    require(t.begin == at, "ownership: token ", at, " must be held by exactly one rank");
    at = t.end;
  }
  require(at == tokens, "ownership: tokens from ", at, " on are held by no rank");
}

int owner_of(const Ownership& ownership, int64_t t) {
  for (size_t r = 0; r < ownership.size(); ++r) {
    const auto& rs = ownership[r];
    auto it = std::upper_bound(rs.begin(), rs.end(), t, [](int64_t x, const TokenRange& q) { return x < q.begin; });
    if (it != rs.begin() && t < std::prev(it)->end) return static_cast<int>(r);
  }
  fail("ownership: token ", t, " is held by no rank");
}

bool tokens_move(const Ownership& from, const Ownership& to) {
  for (size_t i = 0; i < from.size(); ++i)
    for (size_t j = 0; j < to.size(); ++j)
      if (i != j && !intersect(from[i], to[j]).empty()) return true;
  return false;
}

}  // namespace treecp
