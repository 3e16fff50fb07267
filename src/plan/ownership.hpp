// plan/: pure data between the row and the runtime: ownership, the dense, GDN/KDA, Mamba-2 and sparse MLA
// planners, their cost models, and the Plans they produce (no tensor values).
//
// Ownership: which rank holds which tokens of a row (DESIGN.md's second object, beside visibility
// and schedule). A token range is a physical [begin, end); an Ownership lists, per rank, the sorted
// disjoint ranges that rank holds, and a rank's buffers hold its tokens in that order. Every layer
// kind's plan yields one (plan/plan.hpp: the dense plan's owned chunks; plan/gdn_plan.hpp: local
// units and chain cuts); the data loader's contiguous shards and "everything on one rank" are two
// more. runtime/redistribute.hpp moves arrays between any two.
#pragma once

#include <cstdint>
#include <vector>

namespace treecp {

struct TokenRange {
  int64_t begin = 0, end = 0;  // physical [begin, end)
  int64_t size() const { return end - begin; }
  bool operator==(const TokenRange&) const = default;
};

// Per rank, the sorted disjoint ranges it holds.
using Ownership = std::vector<std::vector<TokenRange>>;

// Intersection of two sorted disjoint range lists, sorted.
std::vector<TokenRange> intersect(const std::vector<TokenRange>& a, const std::vector<TokenRange>& b);

// Tokens in a list of ranges.
int64_t tokens_of(const std::vector<TokenRange>& ranges);

// The data loader's split: rank r of n holds [r*S/n, (r+1)*S/n) (nothing when that is empty).
Ownership contiguous_ownership(int64_t tokens, int ranks);

// Everything on `root`; the other ranks hold nothing.
Ownership gathered_ownership(int64_t tokens, int ranks, int root);

// Throws treecp::Error unless every token of [0, tokens) is held by exactly one rank, each rank's
// ranges sorted, disjoint and non-empty.
void validate_ownership(const Ownership& ownership, int64_t tokens);

// True when some token is held by different ranks in the two ownerships (then moving an array from one
// to the other needs an exchange; otherwise every rank holds the same tokens in the same order).
bool tokens_move(const Ownership& from, const Ownership& to);

// The rank holding token t (the ranges must be an Ownership's); throws if none does.
int owner_of(const Ownership& ownership, int64_t t);

}  // namespace treecp
