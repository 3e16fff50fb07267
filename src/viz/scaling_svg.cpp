#include "viz/scaling_svg.hpp"

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

#include "core/error.hpp"
#include "viz/axis.hpp"
#include "viz/svg.hpp"

namespace treecp::viz {
namespace {

constexpr int kPanelsPerRow = 3;
constexpr double kPanelWidthPx = 320, kPanelHeightPx = 230;
constexpr double kPlotLeftPx = 52, kPlotRightPx = 16, kPlotTopPx = 28, kPlotBottomPx = 40;
constexpr double kMarginPx = 16, kHeaderPx = 64;

int index_of(std::vector<std::string>& names, const std::string& name) {
  auto it = std::find(names.begin(), names.end(), name);
  if (it != names.end()) return static_cast<int>(it - names.begin());
  names.push_back(name);
  return static_cast<int>(names.size()) - 1;
}

// An SVG transform turning text a quarter counter-clockwise about (x, y).
std::string rotate_about(double x, double y) {
  std::string t = "rotate(-90 ";
  t += px(x);
  t += ' ';
  t += px(y);
  t += ')';
  return t;
}

}  // namespace

std::string weak_scaling_svg(const std::vector<ScalingSeries>& series, const std::string& title) {
  require(!series.empty(), "weak_scaling_svg: no series");
  std::vector<std::string> presets, methods;
  std::set<std::pair<std::string, std::string>> seen;
  for (const ScalingSeries& s : series) {
    const std::string what = "weak_scaling_svg: series '" + s.method + "' of '" + s.preset + "'";
    require(!s.points.empty(), what, " has no points");
    require(seen.insert({s.preset, s.method}).second, what, " is given twice");
    for (size_t i = 0; i < s.points.size(); ++i) {
      const ScalingPoint& p = s.points[i];
      require(p.cp >= 1, what, ": point ", i, " has cp ", p.cp, ", expected >= 1");
      require(i == 0 || p.cp > s.points[i - 1].cp, what, ": cp must increase, point ", i, " has cp ", p.cp,
              " after ", s.points[i - 1].cp);
      require(std::isfinite(p.ms) && p.ms >= 0, what, ": point ", i, " (cp ", p.cp, ") has ", p.ms,
              " ms, expected a finite time >= 0");
    }
    index_of(presets, s.preset);
    index_of(methods, s.method);
  }
  const int columns = std::min<int>(kPanelsPerRow, static_cast<int>(presets.size()));
  const int rows = (static_cast<int>(presets.size()) + columns - 1) / columns;
  const double W = 2 * kMarginPx + columns * kPanelWidthPx, H = kHeaderPx + rows * kPanelHeightPx + kMarginPx;
  Svg svg(W, H);
  svg.element("rect", {{"width", "100%"}, {"height", "100%"}, {"fill", "#ffffff"}});
  svg.element("text", {{"x", px(kMarginPx)}, {"y", "22"}, {"font-size", "15"}, {"font-weight", "bold"}},
              title.empty() ? "weak scaling" : title);
  // Legend: one line and marker per method.
  svg.open("g", {{"class", "legend"}});
  double lx = kMarginPx;
  for (size_t m = 0; m < methods.size(); ++m) {
    const std::string colour = rank_colour(static_cast<int>(m));
    svg.element("line", {{"x1", px(lx)}, {"y1", "42"}, {"x2", px(lx + 22)}, {"y2", "42"}, {"stroke", colour},
                         {"stroke-width", "2"}});
    svg.element("circle", {{"cx", px(lx + 11)}, {"cy", "42"}, {"r", "3"}, {"fill", colour}});
    svg.element("text", {{"x", px(lx + 28)}, {"y", "46"}, {"font-size", "11"}}, methods[m]);
    lx += 28 + 6.5 * static_cast<double>(methods[m].size()) + 20;
  }
  svg.close();

  for (size_t pi = 0; pi < presets.size(); ++pi) {
    const double ox = kMarginPx + static_cast<double>(pi % columns) * kPanelWidthPx;
    const double oy = kHeaderPx + static_cast<double>(pi / columns) * kPanelHeightPx;
    const double x0 = ox + kPlotLeftPx, x1 = ox + kPanelWidthPx - kPlotRightPx;
    const double y0 = oy + kPanelHeightPx - kPlotBottomPx, y1 = oy + kPlotTopPx;
    // The panel's CP values, evenly spaced in log2 CP; its time axis from 0.
    std::set<int> cps;
    double max_ms = 0;
    for (const ScalingSeries& s : series) {
      if (s.preset != presets[pi]) continue;
      for (const ScalingPoint& p : s.points) {
        cps.insert(p.cp);
        max_ms = std::max(max_ms, p.ms);
      }
    }
    const double lo = std::log2(*cps.begin()), hi = std::log2(*cps.rbegin());
    auto x_of = [&](int cp) { return hi > lo ? x0 + (std::log2(cp) - lo) / (hi - lo) * (x1 - x0) : (x0 + x1) / 2; };
    // The time axis ends at the first tick at or above the longest time.
    const double step = nice_ticks(max_ms > 0 ? max_ms : 1.0, 5).step;
    const int top_tick = std::max(1, static_cast<int>(std::ceil(max_ms / step - 1e-9)));
    const double top_ms = top_tick * step;
    auto y_of = [&](double ms) { return y0 - ms / top_ms * (y0 - y1); };

    svg.open("g", {{"class", "panel"}, {"data-preset", presets[pi]}});
    svg.element("text", {{"x", px((x0 + x1) / 2)}, {"y", px(oy + 16)}, {"text-anchor", "middle"}, {"font-size", "12"},
                         {"font-weight", "bold"}},
                presets[pi]);
    for (int i = 0; i <= top_tick; ++i) {
      const double t = i * step;
      svg.element("line", {{"x1", px(x0)}, {"y1", px(y_of(t))}, {"x2", px(x1)}, {"y2", px(y_of(t))},
                           {"stroke", t == 0 ? "#555555" : "#e2e2e2"}, {"stroke-width", "0.8"}});
      svg.element("text", {{"x", px(x0 - 5)}, {"y", px(y_of(t) + 3)}, {"text-anchor", "end"}, {"font-size", "9"},
                           {"fill", "#444444"}},
                  tick_label(t, step));
    }
    svg.element("line", {{"x1", px(x0)}, {"y1", px(y0)}, {"x2", px(x0)}, {"y2", px(y1)}, {"stroke", "#555555"},
                         {"stroke-width", "0.8"}});
    for (int cp : cps) {
      svg.element("line", {{"x1", px(x_of(cp))}, {"y1", px(y0)}, {"x2", px(x_of(cp))}, {"y2", px(y0 + 3)},
                           {"stroke", "#555555"}, {"stroke-width", "0.8"}});
      svg.element("text", {{"x", px(x_of(cp))}, {"y", px(y0 + 13)}, {"text-anchor", "middle"}, {"font-size", "9"},
                           {"fill", "#444444"}},
                  std::to_string(cp));
    }
    svg.element("text", {{"x", px((x0 + x1) / 2)}, {"y", px(y0 + 28)}, {"text-anchor", "middle"}, {"font-size", "10"}},
                "CP (ranks)");
    svg.element("text", {{"x", px(ox + 12)}, {"y", px((y0 + y1) / 2)}, {"text-anchor", "middle"}, {"font-size", "10"},
                         {"transform", rotate_about(ox + 12, (y0 + y1) / 2)}},
                "ms");
    for (const ScalingSeries& s : series) {
      if (s.preset != presets[pi]) continue;
      const std::string colour = rank_colour(index_of(methods, s.method));
      std::string points;
      for (const ScalingPoint& p : s.points) {
        if (!points.empty()) points += ' ';
        points += px(x_of(p.cp));
        points += ',';
        points += px(y_of(p.ms));
      }
      svg.open("g", {{"class", "series"}, {"data-method", s.method}});
      svg.element("polyline", {{"points", points}, {"fill", "none"}, {"stroke", colour}, {"stroke-width", "2"}});
      for (const ScalingPoint& p : s.points) {
        char tip[128];
        std::snprintf(tip, sizeof tip, "%s, %s, cp %d: %.3f ms", s.method.c_str(), s.preset.c_str(), p.cp, p.ms);
        svg.element("circle",
                    {{"class", "point"}, {"data-cp", std::to_string(p.cp)}, {"data-ms", value(p.ms)},
                     {"cx", px(x_of(p.cp))}, {"cy", px(y_of(p.ms))}, {"r", "3.2"}, {"fill", colour}},
                    {}, tip);
      }
      svg.close();
    }
    svg.close();
  }
  return svg.finish();
}

}  // namespace treecp::viz
