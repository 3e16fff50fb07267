// GDN / KDA context parallelism over a packed prefix-tree row (CPU backend, any Communicator).
//
// Every rank holds the tokens of gdn_rank_ranges(row, plan, rank), laid out in that order, and calls
// these functions with the same row and plan. The protocol is the affine-state one of
// runtime/affine_cp.hpp with the state S a dk x dv matrix per head: parent states travel to the
// segments that start from them, chained segments run an exclusive prefix scan of their shard
// summaries (M, E) over the ranks in ceil(log2 N) rounds, and the backward mirrors both.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.hpp"
#include "kernels/cpu/gdn.hpp"
#include "runtime/affine_cp.hpp"
#include "runtime/gdn_plan.hpp"
#include "tree/row.hpp"

namespace treecp {

// What the forward keeps for the backward on this rank (states [H][dk][dv], chain M [H][dk][dk]).
template <class T>
using GdnSaved = AffineSaved<T>;

// `local` describes this rank's tokens (local.tokens == tokens of its ranges). Writes y for them.
template <class T>
GdnSaved<T> gdn_cp_forward(Communicator& comm, const Row& row, const GdnPlan& plan, const GdnParams<T>& local, T* y);

// Adds this rank's gradients into `grads` (zero them first). `dy` is laid out like y.
template <class T>
void gdn_cp_backward(Communicator& comm, const Row& row, const GdnPlan& plan, const GdnParams<T>& local,
                     const GdnSaved<T>& saved, const T* dy, const GdnGrads<T>& grads);

}  // namespace treecp
