// plan/: pure data between the row and the runtime: ownership, the dense, GDN/KDA, Mamba-2 and sparse MLA
// planners, their cost models, and the Plans they produce (no tensor values).
//
// The GDN/KDA planner (beside the dense one, plan/planner.hpp): where each segment of a packed row
// runs in a GDN/KDA layer under context parallelism, what that is predicted to cost, and the bounded
// search over chained sets. Pure data: no tensor values.
//
// A segment is either LOCAL (all its tokens on one rank, its state passed on inside that rank) or
// CHAINED: an ordered list of PIECES (rank, physical range) covering it in token order. A rank may
// hold several pieces of one chain, not necessarily adjacent (a zigzag layout's long document runs
// over ranks 0, 1, .., R-1, R-1, .., 1, 0); consecutive pieces on one rank form one RUN. The runs
// exchange summaries in an exclusive prefix scan over the chain's runs (ceil(log2 runs) rounds:
// log-depth in the ranks for chains whose ranks rise then fall, at most 2R - 1 runs).
// A local UNIT is a maximal connected set of local segments: it runs on one rank, parents before
// children. Dependencies form a DAG processed by depth in alternating steps
//     local phase 0, chain phase 1, local phase 1, chain phase 2, ...
// A local segment's phase is its parent's (0 for a root); a chained segment's phase is one more than
// its parent's (1 for a root). A chain starts on its first piece's rank (which receives the parent's
// state) and its final state is held by its last piece's rank.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
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

// One piece of a chained segment: `rank` holds its physical tokens [begin, end) (empty pieces are
// identities, as the even split of a segment shorter than the ranks makes).
struct GdnPiece {
  int32_t rank = 0;
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const GdnPiece&) const = default;
};

// How a plan lays a row out: the four a caller can ask for (kGdnLayouts), and Attention, the
// ownership the caller's attention layers use (a searched plan may adopt it: no token moves).
//   Contiguous  the row cut into R equal contiguous pieces, rank r holding piece r
//   Zigzag      the row cut into 2R pieces, rank r holding pieces r and 2R-1-r (ring attention's balance)
//   DocZigzag   every long segment cut into 2R ragged pieces zigzag-wise, the others whole on the least
//               loaded rank (long: at least gdn_doc_zigzag_min_tokens)
//   Searched    the cheapest by the cost model of the above, the attention ownership when given, and the
//               bounded search over chained sets (search_affine_plan), token moves included
enum class GdnLayout { Searched, Contiguous, Zigzag, DocZigzag, Attention };
inline constexpr GdnLayout kGdnLayouts[] = {GdnLayout::Searched, GdnLayout::Contiguous, GdnLayout::Zigzag,
                                            GdnLayout::DocZigzag};
// "searched", "contiguous", "zigzag", "doc-zigzag", "attention".
const char* gdn_layout_name(GdnLayout layout);
// The names of kGdnLayouts, in that order: what `treecp gdn --layout` accepts.
const std::vector<std::string>& gdn_layout_names();
// The layout of a name (any of the five); throws treecp::Error naming the known ones.
GdnLayout parse_gdn_layout(std::string_view name);

struct GdnPlan {
  int ranks = 1;
  GdnLayout layout = GdnLayout::Searched;    // where the plan came from (reported, kept in its JSON)
  std::vector<uint8_t> chained;              // per segment
  std::vector<int32_t> owner;                // per segment: the rank of a local segment, -1 if chained
  std::vector<std::vector<GdnPiece>> pieces; // per chained segment, in token order (empty if local)
  std::vector<int32_t> phase;              // per segment (see the header comment)
  int32_t num_phases = 1;                  // local phases 0 .. num_phases-1; chain phases 1 .. num_phases-1
  // Filled by gdn_predict / plan_gdn.
  double predicted_ms = 0.0;
  std::vector<double> predicted_rank_busy_ms;

  int chained_segments() const;
  // The DAG step a segment runs in (local phase k = step 2k, chain phase k = step 2k - 1), the rank
  // that starts it (needs its parent's final state) and the rank that holds its final state.
  int step_of(int32_t s) const { return chained[s] ? 2 * phase[s] - 1 : 2 * phase[s]; }
  int starter(int32_t s) const { return chained[s] ? pieces[s].front().rank : owner[s]; }
  int holder(int32_t s) const { return chained[s] ? pieces[s].back().rank : owner[s]; }
  json::Value to_json() const;
  // Reads what to_json wrote (and the older form: "cuts", ranks + 1 points, rank r holding
  // [cuts[r], cuts[r+1])); validate against the row with validate_gdn_plan.
  static GdnPlan from_json(const json::Value& v);
};

// The DAG steps of a plan as the runtime walks them: step 2p is local phase p, step 2p - 1 chain
// phase p. Before a step, the final states its segments start from travel from their holders: a
// transfer moves the final state of row.parent(seg) from `src` (its holder: the owner of a local
// segment, the last piece's rank for a chain) to `dst` (the rank that starts seg: its owner, or its
// first piece's rank); the backward sends the gradient of that state the other way. A local child of a local
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

// Physical ranges rank r holds, sorted and merged: its buffers lay them out in this order.
std::vector<TokenRange> gdn_rank_ranges(const Row& row, const GdnPlan& plan, int rank);
// Every rank's gdn_rank_ranges.
Ownership gdn_ownership(const Row& row, const GdnPlan& plan);

// The runs of chained segment s: its pieces with consecutive pieces of one rank merged, in token order.
std::vector<GdnPiece> gdn_chain_runs(const GdnPlan& plan, int32_t s);

// A plan with the given chained set: chained segments split evenly over the ranks (rank r holding the
// r-th of R pieces), local units placed longest first on the least loaded rank of their phase. Throws
// on size mismatch.
GdnPlan make_gdn_plan(const Row& row, int ranks, const std::vector<uint8_t>& chained);

// The plan that runs every token where `ownership` holds it: a segment on one rank is local (unless its
// parent is local on another rank: then it is a chain of one piece), a segment over several ranks a
// chain of its intersections with their ranges. Layout Attention.
GdnPlan gdn_plan_for_ownership(const Row& row, const Ownership& ownership);
// The fixed layouts (GdnLayout's comment): Contiguous, Zigzag, DocZigzag.
GdnPlan gdn_layout_plan(const Row& row, int ranks, GdnLayout layout);
// DocZigzag's threshold: a segment of at least this many tokens is cut into 2R pieces. Half a rank's
// share of the row: shorter ones balance whole, and every piece holds at least one token.
int64_t gdn_doc_zigzag_min_tokens(const Row& row, int ranks);
// DocZigzag's pieces for chained segment s (2R near-equal ones, rank r holding pieces r and 2R-1-r).
std::vector<GdnPiece> gdn_zigzag_pieces(const Row& row, int32_t s, int ranks);
// Per segment, the local unit it belongs to (the unit's first segment: a local segment whose parent
// is absent or chained); -1 for a chained segment.
std::vector<int32_t> gdn_local_units(const Row& row, const std::vector<uint8_t>& chained);
// Validates a plan against its row (each chain's pieces cover it in order, ranks and owners in range,
// phases); errors name the segment and the piece.
void validate_gdn_plan(const Row& row, const GdnPlan& plan);

// What pricing a plan of an affine-state recurrence (runtime/affine_cp.hpp) needs: GDN/KDA's come
// from gdn_plan_costs, Mamba-2's from plan/mamba2_plan.hpp.
struct AffinePlanCosts {
  double local_ms_per_token = 0;         // a token of a local segment, forward + backward, all heads
  double chain_ms_per_token = 0;         // a token of a chained shard: plus its summary and state-only backward
  double state_elements = 0;             // one segment's final state, all heads
  double summary_elements = 0;           // one chain's summary (M, E), all heads
  double compose_madds_per_element = 0;  // composing two summaries, per summary element (the state's rows)
  int64_t bytes_per_element = 4;         // states and summaries on the wire
};
AffinePlanCosts gdn_plan_costs(const GdnShape& shape, const GdnCostModel& model);

// Predicted forward + backward time of a plan: per DAG step, the slowest rank's work plus that
// step's communication (parent-state exchange; for chain steps the scan rounds of both directions,
// each round's busiest rank's summaries on the wire and compositions).
// Fills plan.predicted_ms and plan.predicted_rank_busy_ms.
double predict_affine_plan(const Row& row, GdnPlan& plan, const AffinePlanCosts& costs, const GdnCostModel& model);
double gdn_predict(const Row& row, GdnPlan& plan, const GdnShape& shape, const GdnCostModel& model);

// One message of `bytes` over a link, the GDN model's transfer term: latency + bytes / bandwidth.
double link_message_ms(const Link& link, double bytes);

// Rounds of the exclusive scan over `positions` runs (or ranks) in one direction: ceil(log2 positions).
int affine_scan_rounds(int positions);
// Scan rounds of a plan in one direction, summed over its chain steps (a step scans all its chains at
// once: as many rounds as its longest chain, in runs, needs).
int affine_plan_scan_rounds(const Row& row, const GdnPlan& plan);

// Bytes the protocol moves between ranks, forward + backward, summed over ranks: parent states
// (and their gradients) crossing ranks, and every scan round's summaries.
int64_t affine_plan_bytes(const Row& row, const GdnPlan& plan, const AffinePlanCosts& costs);

// Bounded search: candidate chained sets are the k longest segments, k = 0 .. min(segments, 32);
// the cheapest prediction plus extra_ms(candidate) (what the caller adds, e.g. moving tokens into
// the plan's layout) wins, ties keep fewer chains. `variants(chained)` gives the plans tried for
// one chained set (make_gdn_plan's alone by default; the first wins ties).
using GdnPlanVariants = std::function<std::vector<GdnPlan>(const std::vector<uint8_t>& chained)>;
GdnPlan search_affine_plan(const Row& row, int ranks, const AffinePlanCosts& costs, const GdnCostModel& model,
                           const std::function<double(const GdnPlan&)>& extra_ms = nullptr,
                           const GdnPlanVariants& variants = nullptr);

// Moving a layer's tokens from `from` into `to` and back, forward and backward: `in_elements` per token
// in (inputs) and back (their gradients), `out_elements` per token back (outputs) and in (their
// gradients); four all-to-alls, each priced by its busiest rank. Nothing when no token changes rank.
struct TokenMovePrice {
  double ms = 0;
  int64_t bytes = 0;  // summed over ranks
  int rounds = 0;     // all-to-alls
};
TokenMovePrice price_token_move(const Ownership& from, const Ownership& to, int64_t in_elements,
                                int64_t out_elements, int64_t bytes_per_element, const Link& link);

struct GdnPlanOptions {
  GdnLayout layout = GdnLayout::Searched;
  // The ownership the attention layers around this one use (the inputs arrive in it, the outputs go
  // back to it): the searched layout adds the cost of moving the tokens, and may adopt it.
  std::optional<Ownership> attention;
  int64_t activation_bytes_per_element = 4;  // q, k, v, g, beta, y and their gradients on the wire
};
// The cost of moving a GDN/KDA layer's tokens between the attention ownership and the plan's.
TokenMovePrice gdn_move_price(const Row& row, const GdnPlan& plan, const Ownership& attention, const GdnShape& shape,
                              const GdnCostModel& model, int64_t activation_bytes_per_element);
// The plan of options.layout, its prediction filled (gdn_predict: the layer alone; the searched choice
// adds the move from options.attention).
GdnPlan plan_gdn(const Row& row, int ranks, const GdnShape& shape, const GdnCostModel& model = GdnCostModel{},
                 const GdnPlanOptions& options = {});

}  // namespace treecp
