// plan/: pure data between the row and the runtime: ownership, the dense and GDN/KDA planners, their
// cost models, and the Plans they produce (no tensor values).
//
// The GDN/KDA planner (beside the dense one, plan/planner.hpp): where each segment of a packed row
// runs in a GDN/KDA layer under context parallelism, what that is predicted to cost, and the bounded
// search over chained sets. Pure data: no tensor values.
//
// A segment is either LOCAL (all its tokens on one rank, its state passed on inside that rank) or
// CHAINED (split over all ranks in rank order; ranks exchange shard summaries in a prefix scan).
// A local UNIT is a maximal connected set of local segments: it runs on one rank, parents before
// children. Dependencies form a DAG processed by depth in alternating steps
//     local phase 0, chain phase 1, local phase 1, chain phase 2, ...
// A local segment's phase is its parent's (0 for a root); a chained segment's phase is one more than
// its parent's (1 for a root). The final state of a chained segment is held by the last rank.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "kernels/shapes.hpp"
#include "plan/cost.hpp"
#include "plan/ownership.hpp"
#include "tree/row.hpp"

namespace treecp {

// The one cost model of the GDN planner, simulator and benchmark report, in the dense model's units
// (plan/cost.hpp: ms, bytes/ms). Coefficients are calibrated by bench_gdn on the machine that runs the
// layer; the defaults (config/gdn_costs_cpu.json holds the same numbers) were measured by it on the
// 2-core development container (CPU backend, float, OpenMPI over shared memory, 2 ranks).
struct GdnCostModel {
  double madds_per_ms = 1724137.9310344828;  // chunked work, forward + backward, multiply-adds per ms (0.58 ns each)
  Link link{0.0011, 6.7e5};             // one all-to-all round (scan round or state exchange), per rank pair
  double step_overhead_ms = 0.005;      // per DAG step that has work (not measured separately)
  int64_t state_bytes_per_element = 4;  // float states and summaries on the wire
};

// Reads a coefficient file; keys not present keep their defaults, unknown keys are refused.
GdnCostModel gdn_costs_from_json(const json::Value& v);
GdnCostModel load_gdn_costs(const std::string& path);
json::Value to_json(const GdnCostModel& c);

// Multiply-adds of the chunked forward per token and head.
double gdn_forward_madds(const GdnShape& s);
// Multiply-adds of the chunked form per token and head, forward + backward (a local token).
double gdn_token_madds(const GdnShape& s);
// Extra multiply-adds per token and head on a chained shard: its summary and the state-only backward.
double gdn_chain_token_extra_madds(const GdnShape& s);

struct GdnPlan {
  int ranks = 1;
  std::vector<uint8_t> chained;            // per segment
  std::vector<int32_t> owner;              // per segment: the rank of a local segment, -1 if chained
  std::vector<std::vector<int64_t>> cuts;  // per chained segment: ranks + 1 physical cut points; rank r
                                           // holds [cuts[r], cuts[r+1]) (possibly empty)
  std::vector<int32_t> phase;              // per segment (see the header comment)
  int32_t num_phases = 1;                  // local phases 0 .. num_phases-1; chain phases 1 .. num_phases-1
  // Filled by gdn_predict / plan_gdn.
  double predicted_ms = 0.0;
  std::vector<double> predicted_rank_busy_ms;

  int chained_segments() const;
  json::Value to_json() const;
  // Reads what to_json wrote; validate against the row with validate_gdn_plan.
  static GdnPlan from_json(const json::Value& v);
};

// The DAG steps of a plan as the runtime walks them: step 2p is local phase p, step 2p - 1 chain
// phase p. Before a step, the final states its segments start from travel from their holders: a
// transfer moves the final state of row.parent(seg) from `src` (its holder: the owner of a local
// segment, the last rank for a chain) to `dst` (the rank that starts seg: its owner, or rank 0 of a
// chain); the backward sends the gradient of that state the other way. A local child of a local
// parent needs no transfer (same unit, same rank, same step).
struct GdnTransfer {
  int32_t seg;
  int src, dst;
};
struct GdnSchedule {
  int steps = 1;
  std::vector<std::vector<GdnTransfer>> transfers;  // per step
  std::vector<std::vector<int32_t>> segments;       // per step, in DFS order
};
GdnSchedule gdn_schedule(const Row& row, const GdnPlan& plan);
// The rank that holds a segment's final state: its owner, or the last rank for a chained segment.
int gdn_holder(const GdnPlan& plan, int32_t seg);
// The step a segment runs in.
int gdn_step(const GdnPlan& plan, int32_t seg);

// Physical ranges rank r holds, sorted and merged: its buffers lay them out in this order.
std::vector<TokenRange> gdn_rank_ranges(const Row& row, const GdnPlan& plan, int rank);
// Every rank's gdn_rank_ranges.
Ownership gdn_ownership(const Row& row, const GdnPlan& plan);

// A plan with the given chained set: chained segments split evenly over the ranks, local units placed
// longest first on the least loaded rank of their phase. Throws on size mismatch.
GdnPlan make_gdn_plan(const Row& row, int ranks, const std::vector<uint8_t>& chained);
// Validates a plan against its row (cuts cover each chained segment, owners in range, phases).
void validate_gdn_plan(const Row& row, const GdnPlan& plan);

// Predicted forward + backward time of a plan: per DAG step, the slowest rank's work plus that
// step's communication (parent-state exchange; for chain steps the scan rounds of both directions).
// Fills plan.predicted_ms and plan.predicted_rank_busy_ms.
double gdn_predict(const Row& row, GdnPlan& plan, const GdnShape& shape, const GdnCostModel& model);

// Bounded search: candidate chained sets are the k longest segments, k = 0 .. min(segments, 32);
// the cheapest prediction wins (ties keep fewer chains).
GdnPlan plan_gdn(const Row& row, int ranks, const GdnShape& shape, const GdnCostModel& model = GdnCostModel{});

}  // namespace treecp
