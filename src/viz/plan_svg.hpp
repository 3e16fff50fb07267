// viz/: pictures and traces of plans and runs (SVG, Chrome trace), from plans and measured spans.
//
// The picture of a plan (`treecp plan --svg FILE`): the row's segments as bars in physical order, one
// row of bars per depth, coloured by the rank that owns each token; below it one lane per rank with the
// simulated forward and backward schedule (stages, waits, KV fetches, dK/dV returns, the makespan).
// Segments too narrow to draw are aggregated per pixel column, so rows of any size stay readable.
//
// Every drawn part carries data-* attributes (owner, token range, span kind, begin and end ms) so that
// tools and tests can read the picture back without measuring pixels.
#pragma once

#include <string>

#include "plan/cost.hpp"
#include "plan/plan.hpp"

namespace treecp {
class Row;
}

namespace treecp::viz {

struct PlanPicture {
  std::string title;              // first line, e.g. "varied5k, cp 8"
  std::string subtitle;           // second line (the coefficients used, say); may be empty
  double width_px = 1200.0;
  double min_segment_px = 2.0;    // narrower pieces are aggregated per pixel column
};

// `timeline` is simulate_plan_timeline(plan, costs). Throws treecp::Error when the plan does not fit
// the row or the timeline does not fit the plan.
std::string plan_svg(const Row& row, const Plan& plan, const Timeline& timeline, const PlanPicture& picture);

}  // namespace treecp::viz
