// viz/: pictures and traces of plans and runs (SVG, Chrome trace), from plans and measured spans.
//
// Axis ticks for the pictures: round steps (1, 2 or 5 times a power of ten) and labels with as many
// decimals as the step needs.
#pragma once

#include <string>
#include <vector>

namespace treecp::viz {

struct Ticks {
  double step = 1;
  std::vector<double> at;  // 0, step, 2 step, ... up to max
};

// At most `target` intervals over [0, max]; max > 0.
Ticks nice_ticks(double max, int target);
std::string tick_label(double v, double step);

}  // namespace treecp::viz
