// GDN / KDA context parallelism over a packed prefix-tree row (CPU backend, any Communicator).
//
// Every rank holds the tokens of gdn_rank_ranges(row, plan, rank), laid out in that order, and calls
// these functions with the same row and plan. The DAG steps of the plan run in order; before each
// step the final states its segments start from travel from their holders in one all-to-all (zero
// counts where nothing moves). A chain step computes each rank's shard summary (M, E), runs an
// exclusive prefix scan over the ranks in ceil(log2 N) doubling rounds of all-to-all, and applies
// the true incoming state. The backward runs the steps in reverse: the final-state gradient of a
// segment is the sum over its children of their incoming-state gradients, and a chain's suffix scan
// gives each shard its true outgoing-state gradient (dS_in = Fᵀ dY + Mᵀ dS_out).
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.hpp"
#include "kernels/cpu/gdn.hpp"
#include "plan/gdn_plan.hpp"
#include "tree/row.hpp"

namespace treecp {

// What the forward keeps for the backward on this rank: the state each of its runs started from
// and, per chained segment, its shard's M. Indexed by segment; empty where this rank runs nothing.
template <class T>
struct GdnSaved {
  std::vector<std::vector<T>> state_in;  // [H][dk][dv] per segment this rank runs (a piece for chains)
  std::vector<std::vector<T>> chain_m;   // [H][dk][dk] per chained segment
};

// `local` describes this rank's tokens (local.tokens == tokens of its ranges). Writes y for them.
template <class T>
GdnSaved<T> gdn_cp_forward(Communicator& comm, const Row& row, const GdnPlan& plan, const GdnParams<T>& local, T* y);

// Adds this rank's gradients into `grads` (zero them first). `dy` is laid out like y.
template <class T>
void gdn_cp_backward(Communicator& comm, const Row& row, const GdnPlan& plan, const GdnParams<T>& local,
                     const GdnSaved<T>& saved, const T* dy, const GdnGrads<T>& grads);

// Exclusive prefix scan of affine maps over the ranks: `own` holds, per item, H blocks of
// (A [dk][dk], B [dk][dv]); the composition is (A2, B2) ∘ (A1, B1) = (A2 A1, A2 B1 + B2) with 1
// before 2. direction +1 scans in rank order, -1 in reverse rank order. On return `excl` holds the
// composition of all earlier ranks' items (in scan order), and the result is false on the first rank,
// which has none. ceil(log2 N) all-to-all rounds; every rank calls it.
template <class T>
bool gdn_exclusive_scan(Communicator& comm, int direction, int64_t items, int heads, int dk, int dv,
                        const std::vector<T>& own, std::vector<T>& excl);

}  // namespace treecp
