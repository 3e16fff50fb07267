// viz/: pictures and traces of plans and runs (SVG, Chrome trace), from plans and measured spans.
//
// Weak-scaling curves (`treecp bench cp --svg FILE`): one panel per preset, x = CP (log scale),
// y = milliseconds, one line per method. Points carry data-cp and data-ms for tools and tests.
#pragma once

#include <string>
#include <vector>

namespace treecp::viz {

struct ScalingPoint {
  int cp = 1;
  double ms = 0;
};

struct ScalingSeries {
  std::string preset, method;
  std::vector<ScalingPoint> points;  // strictly increasing cp
};

// Panels in the order presets first appear, lines (and legend) in the order methods first appear.
// Throws treecp::Error naming the series at fault: no points, cp < 1, cp not increasing, a negative or
// non-finite time, or a (preset, method) given twice.
std::string weak_scaling_svg(const std::vector<ScalingSeries>& series, const std::string& title);

}  // namespace treecp::viz
