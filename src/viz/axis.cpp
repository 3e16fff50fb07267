#include "viz/axis.hpp"

#include <cmath>
#include <cstdio>

#include "core/error.hpp"

namespace treecp::viz {

Ticks nice_ticks(double max, int target) {
  require(std::isfinite(max) && max > 0 && target >= 1, "nice_ticks: need max > 0 and target >= 1, got ", max,
          " and ", target);
  const double raw = max / target, power = std::pow(10.0, std::floor(std::log10(raw)));
  Ticks t;
  t.step = 10 * power;
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * power >= raw) {
      t.step = m * power;
      break;
    }
  }
  // The last tick may miss max by rounding: allow a millionth of a step.
  for (int i = 0; i * t.step <= max * (1 + 1e-9); ++i) t.at.push_back(i * t.step);
  return t;
}

std::string tick_label(double v, double step) {
  const int decimals = step >= 1 ? 0 : static_cast<int>(std::ceil(-std::log10(step) - 1e-9));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

}  // namespace treecp::viz
