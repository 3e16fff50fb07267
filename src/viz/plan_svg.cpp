#include "viz/plan_svg.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>

#include "core/error.hpp"
#include "tree/row.hpp"
#include "viz/axis.hpp"
#include "viz/schedule.hpp"
#include "viz/svg.hpp"

namespace treecp::viz {
namespace {

// Layout in pixels.
constexpr double kLeftPx = 92, kRightPx = 24;
constexpr double kTreeRowPx = 12, kTreeGapPx = 3;
constexpr double kLaneGapPx = 5;

// Fills that are not a rank's own colour.
constexpr const char* kTokenLocalFill = "#c9c9c9";
constexpr const char* kFetchFill = "#34466b";
constexpr const char* kReturnFill = "#8c4f86";
constexpr const char* kIdleFill = "#e9e9e9";
constexpr const char* kNestFill = "#e6e6e6";
constexpr double kBackwardLighten = 0.5;  // backward stages: the rank's colour half-way to white

const char* kHatchDefs =
    "<pattern id=\"wait\" width=\"5\" height=\"5\" patternUnits=\"userSpaceOnUse\" "
    "patternTransform=\"rotate(45)\"><rect width=\"5\" height=\"5\" fill=\"#fbe3e3\"/>"
    "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"5\" stroke=\"#d04848\" stroke-width=\"2\"/></pattern>";

// Dark text on light fills, white on dark ones.
const char* text_on(const std::string& hex) {
  const int r = std::stoi(hex.substr(1, 2), nullptr, 16), g = std::stoi(hex.substr(3, 2), nullptr, 16),
            b = std::stoi(hex.substr(5, 2), nullptr, 16);
  return 0.299 * r + 0.587 * g + 0.114 * b < 150 ? "#ffffff" : "#222222";
}

struct OwnedRun {
  int64_t begin, end;
  int owner;
};

// Maximal runs of consecutive chunks with one owner, in physical order.
std::vector<OwnedRun> owned_runs(const Plan& plan) {
  std::vector<OwnedRun> runs;
  for (size_t c = 0; c < plan.chunk_owner.size(); ++c) {
    const int64_t b = plan.chunk_bounds[c], e = plan.chunk_bounds[c + 1];
    const int o = plan.chunk_owner[c];
    if (!runs.empty() && runs.back().owner == o && runs.back().end == b) {
      runs.back().end = e;
    } else {
      runs.push_back({b, e, o});
    }
  }
  return runs;
}

// Token axis and time axis labels.
std::string token_label(double v) {
  char buf[32];
  if (v >= 1e6 && std::fmod(v, 1e5) == 0) {
    std::snprintf(buf, sizeof buf, "%gM", v / 1e6);
  } else if (v >= 1e4 && std::fmod(v, 1e3) == 0) {
    std::snprintf(buf, sizeof buf, "%gk", v / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.0f", v);
  }
  return buf;
}

// 1234567 -> "1,234,567".
std::string grouped(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string ms_text(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, ms >= 100 ? "%.1f" : ms >= 1 ? "%.3f" : "%.4f", ms);
  return buf;
}

// The tree: one row of bars per depth; behind the bars of depth d + 1, the token span of every
// depth-d segment's descendants (grey), which is where its children are drawn.
int draw_tree(Svg& svg, const Row& row, const std::vector<OwnedRun>& runs, double top, double plot_w,
              double min_px) {
  const int64_t S = row.tokens();
  const double scale = plot_w / static_cast<double>(S);
  auto x_of = [&](int64_t pos) { return kLeftPx + static_cast<double>(pos) * scale; };
  const int depth = row.max_depth();
  int aggregated = 0;
  svg.open("g", {{"class", "tree"}, {"data-tokens", std::to_string(S)}, {"data-depths", std::to_string(depth)}});
  // Owners: the ownership of every token, whatever its depth.
  const double owner_y = top;
  svg.element("text", {{"x", px(kLeftPx - 6)}, {"y", px(owner_y + kTreeRowPx - 2)}, {"text-anchor", "end"},
                       {"font-size", "10"}},
              "owner");
  svg.open("g", {{"class", "owners"}});
  for (const OwnedRun& r : runs) {
    svg.element("rect",
                {{"class", "owned"}, {"data-owner", std::to_string(r.owner)}, {"data-begin", std::to_string(r.begin)},
                 {"data-end", std::to_string(r.end)}, {"x", px(x_of(r.begin))}, {"y", px(owner_y)},
                 {"width", px(x_of(r.end) - x_of(r.begin))}, {"height", px(kTreeRowPx)},
                 {"fill", rank_colour(r.owner)}},
                {}, "rank " + std::to_string(r.owner) + ": tokens [" + std::to_string(r.begin) + ", " +
                        std::to_string(r.end) + ")");
  }
  svg.close();

  // Segments by depth, in physical order.
  std::vector<std::vector<int32_t>> by_depth(static_cast<size_t>(depth) + 1);
  for (int32_t s = 0; s < row.num_segments(); ++s) by_depth[static_cast<size_t>(row.depth(s))].push_back(s);
  for (int d = 1; d <= depth; ++d) {
    const double y = top + (kTreeRowPx + kTreeGapPx) * d + 3;
    svg.element("text", {{"x", px(kLeftPx - 6)}, {"y", px(y + kTreeRowPx - 2)}, {"text-anchor", "end"},
                         {"font-size", "10"}},
                d == 1 ? "roots" : "depth " + std::to_string(d));
    svg.open("g", {{"class", "tree-row"}, {"data-depth", std::to_string(d)}});
    // Where depth-d segments may lie: under the descendants of depth d - 1, merged below a pixel.
    if (d > 1) {
      double nest_b = -1, nest_e = -1;
      auto flush = [&] {
        if (nest_e > nest_b) {
          svg.element("rect", {{"class", "nest"}, {"x", px(nest_b)}, {"y", px(y)}, {"width", px(nest_e - nest_b)},
                               {"height", px(kTreeRowPx)}, {"fill", kNestFill}});
        }
      };
      for (int32_t p : by_depth[static_cast<size_t>(d) - 1]) {
        if (row.is_leaf(p)) continue;
        const double b = x_of(row.end(p)), e = x_of(row.subtree_token_end(p));
        if (b - nest_e < 1.0) {
          nest_e = e;
        } else {
          flush();
          nest_b = b, nest_e = e;
        }
      }
      flush();
    }
    // Pieces: one segment's tokens of one owner. Wide ones are drawn as they are; narrow ones go to the
    // pixel column of their centre, drawn in the column's majority owner with the column's coverage as opacity.
    std::map<int64_t, std::map<int, int64_t>> bins;  // column -> owner -> tokens
    std::map<int64_t, std::pair<int64_t, int64_t>> bin_span;
    size_t run = 0;
    for (int32_t s : by_depth[static_cast<size_t>(d)]) {
      const int64_t sb = row.start(s), se = row.end(s);
      while (runs[run].end <= sb) ++run;
      bool narrow = false;
      for (size_t k = run; k < runs.size() && runs[k].begin < se; ++k) {
        const int64_t b = std::max(sb, runs[k].begin), e = std::min(se, runs[k].end);
        const int owner = runs[k].owner;
        const double w = x_of(e) - x_of(b);
        if (w >= min_px) {
          Attrs a = {{"class", "piece"}, {"data-segment", std::to_string(s)}, {"data-owner", std::to_string(owner)},
                     {"data-begin", std::to_string(b)}, {"data-end", std::to_string(e)}, {"x", px(x_of(b))},
                     {"y", px(y)}, {"width", px(w)}, {"height", px(kTreeRowPx)}, {"fill", rank_colour(owner)}};
          // A white edge between neighbouring segments, where there is room for it.
          if (w >= 3 * min_px) a.insert(a.end(), {{"stroke", "#ffffff"}, {"stroke-width", "0.6"}});
          svg.element("rect", a, {},
                      "segment " + std::to_string(s) + ", depth " + std::to_string(d) + ": [" + std::to_string(b) +
                          ", " + std::to_string(e) + ") on rank " + std::to_string(owner));
        } else {
          narrow = true;
          const auto col = static_cast<int64_t>(std::floor((x_of(b) + x_of(e)) / 2));
          bins[col][owner] += e - b;
          auto [it, fresh] = bin_span.try_emplace(col, b, e);
          if (!fresh) it->second = {std::min(it->second.first, b), std::max(it->second.second, e)};
        }
      }
      aggregated += narrow ? 1 : 0;
    }
    const double tokens_per_px = 1.0 / scale;
    for (const auto& [col, owners] : bins) {
      int best = -1;
      int64_t best_tokens = -1, total = 0;
      for (const auto& [o, t] : owners) {
        total += t;
        if (t > best_tokens) best = o, best_tokens = t;
      }
      const double coverage = std::min(1.0, static_cast<double>(total) / tokens_per_px);
      svg.element("rect",
                  {{"class", "bin"}, {"data-owner", std::to_string(best)}, {"data-tokens", std::to_string(total)},
                   {"data-begin", std::to_string(bin_span[col].first)},
                   {"data-end", std::to_string(bin_span[col].second)}, {"x", px(static_cast<double>(col))},
                   {"y", px(y)}, {"width", "1"}, {"height", px(kTreeRowPx)}, {"fill", rank_colour(best)},
                   {"fill-opacity", px(0.3 + 0.7 * coverage)}});
    }
    svg.close();
  }
  // Token axis.
  const double axis_y = top + (kTreeRowPx + kTreeGapPx) * (depth + 1) + 5;
  svg.element("line", {{"x1", px(kLeftPx)}, {"y1", px(axis_y)}, {"x2", px(kLeftPx + plot_w)}, {"y2", px(axis_y)},
                       {"stroke", "#555555"}, {"stroke-width", "0.8"}});
  for (double t : nice_ticks(static_cast<double>(S), 10).at) {
    const double x = kLeftPx + t * scale;
    svg.element("line", {{"x1", px(x)}, {"y1", px(axis_y)}, {"x2", px(x)}, {"y2", px(axis_y + 3)},
                         {"stroke", "#555555"}, {"stroke-width", "0.8"}});
    svg.element("text", {{"x", px(x)}, {"y", px(axis_y + 13)}, {"text-anchor", "middle"}, {"font-size", "9"},
                         {"fill", "#444444"}},
                token_label(t));
  }
  svg.element("text", {{"x", px(kLeftPx - 14)}, {"y", px(axis_y + 13)}, {"text-anchor", "end"}, {"font-size", "9"},
                       {"fill", "#444444"}},
              "tokens");
  svg.close();
  return aggregated;
}

}  // namespace

std::string plan_svg(const Row& row, const Plan& plan, const Timeline& timeline, const PlanPicture& picture) {
  const int cp = plan.cp;
  require(plan.tokens == row.tokens() && row.tokens() > 0, "plan_svg: the plan has ", plan.tokens,
          " tokens, the row ", row.tokens());
  require(cp >= 1 && static_cast<int>(plan.ranks.size()) == cp && plan.chunk_bounds.size() == plan.chunk_owner.size() + 1,
          "plan_svg: malformed plan (cp ", cp, ", ", plan.ranks.size(), " ranks)");
  const Prediction& pred = timeline.prediction;
  require(static_cast<int>(pred.forward_ms.size()) == cp && static_cast<int>(pred.backward_ms.size()) == cp,
          "plan_svg: the timeline has ", pred.forward_ms.size(), " ranks, the plan ", cp);
  require(picture.width_px >= 400, "plan_svg: width_px must be >= 400, got ", picture.width_px);
  require(picture.min_segment_px > 0, "plan_svg: min_segment_px must be > 0");
  for (const ScheduleSpan& s : timeline.spans) {
    require(s.rank >= 0 && s.rank < cp, "plan_svg: a span has rank ", s.rank, " for cp = ", cp);
  }
  const double W = picture.width_px, plot_w = W - kLeftPx - kRightPx;
  const std::vector<OwnedRun> runs = owned_runs(plan);

  // Transfers of one rank overlap one another only in backward (returns); each goes to the first
  // transfer row that is free when it starts.
  std::vector<int> row_of(timeline.spans.size(), 0), transfer_rows(static_cast<size_t>(cp), 1);
  {
    std::vector<size_t> order(timeline.spans.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      const ScheduleSpan &x = timeline.spans[a], &y = timeline.spans[b];
      return x.rank != y.rank ? x.rank < y.rank : x.begin_ms < y.begin_ms;
    });
    std::vector<std::vector<double>> free_at(static_cast<size_t>(cp));
    for (size_t i : order) {
      const ScheduleSpan& s = timeline.spans[i];
      if (!is_transfer(s.kind)) continue;
      std::vector<double>& rows = free_at[static_cast<size_t>(s.rank)];
      size_t k = 0;
      while (k < rows.size() && rows[k] > s.begin_ms) ++k;
      if (k == rows.size()) rows.push_back(0);
      rows[k] = s.end_ms;
      row_of[i] = static_cast<int>(k);
      transfer_rows[static_cast<size_t>(s.rank)] = std::max<int>(transfer_rows[static_cast<size_t>(s.rank)], static_cast<int>(k) + 1);
    }
  }

  // Vertical layout.
  const int depth = row.max_depth();
  const double compute_px = cp <= 16 ? 16 : std::max(4.0, 256.0 / cp), transfer_px = std::max(3.0, compute_px / 2);
  const double tree_top = 70;
  const double tree_bottom = tree_top + (kTreeRowPx + kTreeGapPx) * (depth + 1) + 20;
  const double lanes_top = tree_bottom + 44;
  std::vector<double> lane_y(static_cast<size_t>(cp) + 1);
  lane_y[0] = lanes_top;
  for (int r = 0; r < cp; ++r) {
    lane_y[static_cast<size_t>(r) + 1] =
        lane_y[static_cast<size_t>(r)] + compute_px + 1 + transfer_rows[static_cast<size_t>(r)] * (transfer_px + 1) + kLaneGapPx;
  }
  const double lanes_bottom = lane_y[static_cast<size_t>(cp)] - kLaneGapPx;
  const double legend_y = lanes_bottom + 44;
  const double height = legend_y + 44;

  Svg svg(W, height);
  svg.defs(kHatchDefs);
  svg.element("rect", {{"width", "100%"}, {"height", "100%"}, {"fill", "#ffffff"}});
  svg.element("text", {{"x", px(kLeftPx)}, {"y", "22"}, {"font-size", "15"}, {"font-weight", "bold"}},
              picture.title.empty() ? "treecp plan" : picture.title);
  char line[512];
  std::snprintf(line, sizeof line,
                "%s tokens, %s segments, %s visible pairs%s; layout %s, cp %d, %zu chunks, %d wave%s; "
                "predicted makespan %s ms (rank %d)",
                grouped(row.tokens()).c_str(), grouped(row.num_segments()).c_str(), grouped(plan.visible_pairs).c_str(),
                plan.window > 0 ? (", window " + std::to_string(plan.window)).c_str() : "", layout_name(plan.layout), cp,
                plan.chunk_owner.size(), plan.num_waves, plan.num_waves == 1 ? "" : "s",
                ms_text(pred.makespan_ms).c_str(), pred.slowest_rank);
  svg.element("text", {{"x", px(kLeftPx)}, {"y", "40"}, {"font-size", "11"}, {"fill", "#333333"}}, line);
  if (!picture.subtitle.empty()) {
    svg.element("text", {{"x", px(kLeftPx)}, {"y", "54"}, {"font-size", "10"}, {"fill", "#666666"}},
                picture.subtitle);
  }

  const int aggregated = draw_tree(svg, row, runs, tree_top, plot_w, picture.min_segment_px);

  // Lanes: per rank a compute row (token-local work, stages, waits, the idle tail up to the makespan)
  // and transfer rows (KV fetches, dK/dV returns).
  const double span_ms = std::max(pred.makespan_ms, 1e-9);
  const double t_scale = plot_w / span_ms;
  auto x_of = [&](double ms) { return kLeftPx + ms * t_scale; };
  svg.element("text", {{"x", px(kLeftPx)}, {"y", px(lanes_top - 22)}, {"font-size", "12"}, {"font-weight", "bold"}},
              "Simulated schedule per rank: forward, then backward (cost model)");
  svg.open("g", {{"class", "schedule"}, {"data-makespan-ms", value(pred.makespan_ms)},
                 {"data-ranks", std::to_string(cp)}});
  for (int r = 0; r < cp; ++r) {
    const double y = lane_y[static_cast<size_t>(r)];
    const std::string colour = rank_colour(r), light = lighten(colour, kBackwardLighten);
    const double fwd = pred.forward_ms[static_cast<size_t>(r)], total = fwd + pred.backward_ms[static_cast<size_t>(r)];
    // The label centred on the compute row; smaller where many ranks make the rows thin.
    const double label_px = std::min(10.0, compute_px + 2);
    svg.element("rect", {{"x", px(kLeftPx - 24)}, {"y", px(y + compute_px * 0.15)}, {"width", "10"},
                         {"height", px(compute_px * 0.7)}, {"fill", colour}});
    svg.element("text", {{"x", px(kLeftPx - 28)}, {"y", px(y + compute_px / 2 + 0.35 * label_px)},
                         {"text-anchor", "end"}, {"font-size", px(label_px)}},
                "rank " + std::to_string(r));
    svg.open("g", {{"class", "lane"}, {"data-rank", std::to_string(r)}, {"data-lane", "compute"},
                   {"data-forward-ms", value(fwd)}, {"data-total-ms", value(total)}});
    svg.element("rect", {{"x", px(kLeftPx)}, {"y", px(y)}, {"width", px(plot_w)}, {"height", px(compute_px)},
                         {"fill", "#fafafa"}});
    auto draw = [&](const ScheduleSpan* s, const std::string& kind, double b, double e, double yy, double h,
                    const std::string& fill, const std::string& label, const std::string& tip) {
      Attrs a = {{"class", "span"}, {"data-kind", kind}, {"data-begin-ms", value(b)}, {"data-end-ms", value(e)}};
      if (s != nullptr) {
        a.push_back({"data-pass", s->pass == Pass::Forward ? "forward" : "backward"});
        a.push_back({"data-wave", std::to_string(s->wave)});
      }
      const double w = x_of(e) - x_of(b);
      for (const auto& kv : Attrs{{"x", px(x_of(b))}, {"y", px(yy)}, {"width", px(w)}, {"height", px(h)}, {"fill", fill}}) {
        a.push_back(kv);
      }
      // A white edge between neighbouring stages of one colour, where there is room for it.
      if (w >= 4) a.insert(a.end(), {{"stroke", "#ffffff"}, {"stroke-width", "0.8"}});
      char times[96];
      std::snprintf(times, sizeof times, ": %s - %s ms (%s ms)", ms_text(b).c_str(), ms_text(e).c_str(),
                    ms_text(e - b).c_str());
      svg.element("rect", a, {}, "rank " + std::to_string(r) + " " + tip + times);
      if (!label.empty() && w >= 7.0 * static_cast<double>(label.size()) + 4 && h >= 9) {
        svg.element("text", {{"x", px(x_of(b) + w / 2)}, {"y", px(yy + h / 2 + 3.5)}, {"text-anchor", "middle"},
                             {"font-size", "9"}, {"fill", fill[0] == '#' ? text_on(fill) : "#222222"},
                             {"pointer-events", "none"}},
                    label);
      }
    };
    static const char* const kKindNames[] = {"token-local", "local", "remote", "wait", "fetch", "return"};
    for (size_t i = 0; i < timeline.spans.size(); ++i) {
      const ScheduleSpan& s = timeline.spans[i];
      if (s.rank != r || is_transfer(s.kind)) continue;
      const bool fwd_pass = s.pass == Pass::Forward;
      std::string fill = s.kind == SpanKind::TokenLocal ? kTokenLocalFill
                         : s.kind == SpanKind::Wait     ? "url(#wait)"
                         : fwd_pass                     ? colour
                                                        : light;
      const std::string label = s.kind == SpanKind::LocalStage    ? "L"
                                : s.kind == SpanKind::RemoteStage ? std::to_string(s.wave + 1)
                                                                  : "";
      draw(&s, kKindNames[static_cast<int>(s.kind)], s.begin_ms, s.end_ms, y, compute_px, fill, label, span_name(s));
    }
    if (total < pred.makespan_ms) {
      draw(nullptr, "idle", total, pred.makespan_ms, y, compute_px, kIdleFill, "", "idle until the makespan");
    }
    // Where this rank's backward begins.
    svg.element("line", {{"class", "pass-boundary"}, {"x1", px(x_of(fwd))}, {"y1", px(y - 1.5)}, {"x2", px(x_of(fwd))},
                         {"y2", px(y + compute_px + 1.5)}, {"stroke", "#000000"}, {"stroke-width", "1.2"}});
    svg.close();
    for (int k = 0; k < transfer_rows[static_cast<size_t>(r)]; ++k) {
      const double ty = y + compute_px + 1 + k * (transfer_px + 1);
      svg.open("g", {{"class", "lane"}, {"data-rank", std::to_string(r)}, {"data-lane", "transfer"},
                     {"data-row", std::to_string(k)}});
      svg.element("rect", {{"x", px(kLeftPx)}, {"y", px(ty)}, {"width", px(plot_w)}, {"height", px(transfer_px)},
                           {"fill", "#f4f4f8"}});
      for (size_t i = 0; i < timeline.spans.size(); ++i) {
        const ScheduleSpan& s = timeline.spans[i];
        if (s.rank != r || !is_transfer(s.kind) || row_of[i] != k) continue;
        draw(&s, kKindNames[static_cast<int>(s.kind)], s.begin_ms, s.end_ms, ty, transfer_px,
             s.kind == SpanKind::Fetch ? kFetchFill : kReturnFill, "", span_name(s));
      }
      svg.close();
    }
  }
  // Time axis and the makespan.
  const double axis_y = lanes_bottom + 4;
  svg.element("line", {{"x1", px(kLeftPx)}, {"y1", px(axis_y)}, {"x2", px(kLeftPx + plot_w)}, {"y2", px(axis_y)},
                       {"stroke", "#555555"}, {"stroke-width", "0.8"}});
  const Ticks ticks = nice_ticks(span_ms, 10);
  for (double t : ticks.at) {
    svg.element("line", {{"x1", px(x_of(t))}, {"y1", px(axis_y)}, {"x2", px(x_of(t))}, {"y2", px(axis_y + 3)},
                         {"stroke", "#555555"}, {"stroke-width", "0.8"}});
    svg.element("text", {{"x", px(x_of(t))}, {"y", px(axis_y + 13)}, {"text-anchor", "middle"}, {"font-size", "9"},
                         {"fill", "#444444"}},
                tick_label(t, ticks.step));
  }
  svg.element("text", {{"x", px(kLeftPx - 14)}, {"y", px(axis_y + 13)}, {"text-anchor", "end"}, {"font-size", "9"},
                       {"fill", "#444444"}},
              "ms");
  const double mx = x_of(pred.makespan_ms);
  svg.element("line", {{"class", "makespan"}, {"data-ms", value(pred.makespan_ms)}, {"x1", px(mx)},
                       {"y1", px(lanes_top - 12)}, {"x2", px(mx)}, {"y2", px(axis_y)}, {"stroke", "#c0392b"},
                       {"stroke-width", "1.5"}, {"stroke-dasharray", "4 2"}});
  svg.element("text", {{"x", px(mx - 4)}, {"y", px(lanes_top - 4)}, {"text-anchor", "end"}, {"font-size", "10"},
                       {"fill", "#c0392b"}},
              "makespan " + ms_text(pred.makespan_ms) + " ms (rank " + std::to_string(pred.slowest_rank) + ")");
  svg.close();

  // Legend and notes.
  struct Entry {
    std::string fill, text;
  };
  const std::vector<Entry> legend = {{rank_colour(0), "forward stage (rank's colour)"},
                                     {lighten(rank_colour(0), kBackwardLighten), "backward stage"},
                                     {kTokenLocalFill, "token-local work"},
                                     {"url(#wait)", "wait (KV not landed / dKV returning)"},
                                     {kIdleFill, "idle until the makespan"},
                                     {kFetchFill, "KV fetch"},
                                     {kReturnFill, "dKV return"}};
  svg.open("g", {{"class", "legend"}});
  double lx = kLeftPx;
  for (const Entry& e : legend) {
    svg.element("rect", {{"x", px(lx)}, {"y", px(legend_y - 9)}, {"width", "14"}, {"height", "10"}, {"fill", e.fill},
                         {"stroke", "#999999"}, {"stroke-width", "0.5"}});
    svg.element("text", {{"x", px(lx + 18)}, {"y", px(legend_y)}, {"font-size", "10"}}, e.text);
    lx += 18 + 5.6 * static_cast<double>(e.text.size()) + 16;
  }
  svg.close();
  std::string note =
      "Tree: one row of bars per depth, physical order; grey = the span of a parent's descendants. "
      "Lanes: compute on top, transfers below; L = local stage, 1..W = waves; black tick = start of backward.";
  svg.element("text", {{"x", px(kLeftPx)}, {"y", px(legend_y + 18)}, {"font-size", "9.5"}, {"fill", "#555555"}},
              note);
  if (aggregated > 0) {
    char agg[256];
    std::snprintf(agg, sizeof agg,
                  "%d segment%s narrower than %.3g px %s drawn per pixel column: the column's majority owner, "
                  "opacity = share of the column's tokens.",
                  aggregated, aggregated == 1 ? "" : "s", picture.min_segment_px, aggregated == 1 ? "is" : "are");
    svg.element("text", {{"x", px(kLeftPx)}, {"y", px(legend_y + 32)}, {"font-size", "9.5"}, {"fill", "#555555"}},
                agg);
  }
  return svg.finish();
}

}  // namespace treecp::viz
