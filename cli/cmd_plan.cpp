// treecp plan: ownership, waves and predicted milliseconds for one row, every layout side by side.
#include <cstdio>
#include <iostream>
#include <string>

#include "command.hpp"
#include "core/error.hpp"
#include "plan/cost.hpp"
#include "plan/plan.hpp"
#include "plan/planner.hpp"
#include "tree/presets.hpp"
#include "tree/row.hpp"
#include "viz/plan_svg.hpp"

namespace treecp::cli {
namespace {

int plan_command(const std::vector<std::string>& argv) {
  Args args("plan", argv);
  args.value("--tree").value("--preset").value("--cp").value("--seed").value("--window").value("--layout");
  args.value("--costs").value("--chunk").value("--waves").value("--out").value("--svg").value("--hq").value("--hkv")
      .value("--d").value("--dv").flag("--json");
  args.parse();
  require(args.has("--tree") != args.has("--preset"), "plan: give exactly one of --tree FILE or --preset NAME");
  const int64_t cp = args.get_int("--cp");
  require(cp >= 1 && cp <= 4096, "--cp must be in [1, 4096], got ", cp);
  const int64_t seed = args.get_int_or("--seed", 0);
  require(seed >= 0, "--seed must be >= 0, got ", seed);
  PlanOptions options;
  options.layout = parse_layout(args.get_or("--layout", "searched"));
  // The layer planned for: DESIGN.md's benchmark shape unless given.
  AttentionShape shape;
  shape.hq = static_cast<int>(args.get_int_or("--hq", shape.hq));
  shape.hkv = static_cast<int>(args.get_int_or("--hkv", shape.hkv));
  shape.d = static_cast<int>(args.get_int_or("--d", shape.d));
  shape.dv = static_cast<int>(args.get_int_or("--dv", shape.d));
  shape.window = args.get_int_or("--window", 0);
  require(shape.window >= 0, "--window must be >= 0 (0 = none), got ", shape.window);
  shape.validate();
  options.chunk_tokens = args.get_int_or("--chunk", 0);
  require(options.chunk_tokens >= 0, "--chunk must be >= 1 token (or 0 = choose), got ", options.chunk_tokens);
  const int64_t waves = args.get_int_or("--waves", options.max_waves);
  require(waves >= 1 && waves <= 16, "--waves (most waves tried) must be in [1, 16], got ", waves);
  options.max_waves = static_cast<int>(waves);
  const std::string svg_path = args.get_or("--svg", "");
  require(!args.has("--svg") || (!svg_path.empty() && svg_path != "-"), "plan: --svg needs a file path, got '",
          svg_path, "'");
  const CostModel costs = args.has("--costs") ? load_costs(args.get("--costs")) : CostModel{};
  const Row row = args.has("--tree")
                      ? load_row(args.get("--tree"))
                      : make_preset(args.get("--preset"), static_cast<int>(cp), static_cast<uint64_t>(seed));

  PlanReport report;
  const Plan plan = make_plan(row, static_cast<int>(cp), shape, costs, options, &report);
  validate_plan(plan, row, shape.window, static_cast<int>(cp));
  if (!svg_path.empty()) {
    viz::PlanPicture picture;
    picture.title = args.has("--tree") ? args.get("--tree")
                                       : args.get("--preset") + " (seed " + std::to_string(seed) + ")";
    picture.title += ", cp " + std::to_string(cp) + ", layout " + layout_name(plan.layout);
    picture.subtitle = "cost coefficients: " + (args.has("--costs") ? args.get("--costs")
                                                                      : std::string("built-in defaults (one H200 per rank)"));
    write_output(svg_path, viz::plan_svg(row, plan, simulate_plan_timeline(plan, shape, costs), picture));
  }

  if (args.get_flag("--json")) {
    json::Value v = plan_to_json(plan);
    v.set("planning_ms", report.planning_ms);
    v.set("chunk_tokens", report.chunk_tokens);
    json::Value layouts = json::Value::array();
    for (const LayoutResult& l : report.layouts) {
      json::Value jl = json::Value::object();
      jl.set("layout", std::string(layout_name(l.layout)));
      jl.set("num_waves", static_cast<int64_t>(l.num_waves));
      jl.set("chunks", l.chunks);
      jl.set("makespan_ms", l.makespan_ms);
      jl.set("peak_memory_bytes", l.peak_memory_bytes);
      jl.set("fits_memory", l.fits_memory);
      layouts.push_back(jl);
    }
    v.set("layouts", layouts);
    write_output(args.get_or("--out", "-"), json::dump(v) + "\n");
    return 0;
  }

  const int64_t kv = costs.kv_bytes_per_token(shape);
  std::printf("row: %lld tokens, %d segments, %lld visible pairs%s\n", static_cast<long long>(row.tokens()),
              row.num_segments(), static_cast<long long>(plan.visible_pairs),
              shape.window > 0 ? (", window " + std::to_string(shape.window)).c_str() : "");
  std::printf(
      "plan: layout %s, cp %d, %zu chunks (chunk size %lld), %d wave%s; KV %lld B/token "
      "(Hkv %lld, D %lld, Dv %lld)\n",
      layout_name(plan.layout), plan.cp, plan.chunk_owner.size(), static_cast<long long>(report.chunk_tokens),
      plan.num_waves, plan.num_waves == 1 ? "" : "s", static_cast<long long>(kv),
      static_cast<long long>(shape.hkv), static_cast<long long>(shape.d), static_cast<long long>(shape.dv));
  std::printf("%4s %9s %6s %15s %15s %13s %13s %9s %9s %9s\n", "rank", "tokens", "ranges", "visible_pairs",
              "remote_pairs", "kv_bytes_in", "kv_bytes_out", "fwd_ms", "bwd_ms", "total_ms");
  for (int r = 0; r < plan.cp; ++r) {
    const RankPlan& rp = plan.ranks[r];
    int64_t in = 0, out = 0, remote = 0;
    for (size_t w = 1; w < rp.stages.size(); ++w) {
      remote += rp.stages[w].pairs;
      for (const auto& p : rp.stages[w].recv) {
        for (const TokenRange& t : p) in += t.size();
      }
      for (const auto& p : rp.stages[w].send) {
        for (const TokenRange& t : p) out += t.size();
      }
    }
    std::printf("%4d %9lld %6zu %15lld %15lld %13lld %13lld %9.3f %9.3f %9.3f\n", r,
                static_cast<long long>(rp.owned_tokens()), rp.owned.size(), static_cast<long long>(rp.pairs()),
                static_cast<long long>(remote), static_cast<long long>(in * kv), static_cast<long long>(out * kv),
                rp.predicted_forward_ms, rp.predicted_backward_ms, rp.predicted_forward_ms + rp.predicted_backward_ms);
  }
  std::printf("predicted makespan %.3f ms (slowest rank forward + backward)\n\n", plan.predicted_makespan_ms);
  std::printf("%-12s", "layout");
  for (const LayoutResult& l : report.layouts) std::printf(" %12s", layout_name(l.layout));
  std::printf("\n%-12s", "makespan_ms");
  for (const LayoutResult& l : report.layouts) std::printf(" %12.3f", l.makespan_ms);
  std::printf("\n%-12s", "waves");
  for (const LayoutResult& l : report.layouts) std::printf(" %12d", l.num_waves);
  std::printf("\n%-12s", "chunks");
  for (const LayoutResult& l : report.layouts) std::printf(" %12lld", static_cast<long long>(l.chunks));
  std::printf("\n%-12s", "peak_GiB");
  for (const LayoutResult& l : report.layouts) {
    std::printf(" %11.2f%s", static_cast<double>(l.peak_memory_bytes) / (1 << 30), l.fits_memory ? " " : "!");
  }
  std::printf("\nplanned in %.3f ms (%d evaluations, %d search moves)\n", report.planning_ms, report.evaluations,
              report.search_moves);
  return 0;
}

const Register kPlan("plan",
                     "(--tree FILE | --preset NAME) --cp N [--seed S] [--window W] [--layout searched|contiguous|"
                     "zigzag|perdoc|family] [--costs FILE] [--chunk C] [--waves MAX] [--hq H] [--hkv H] [--d D] "
                     "[--dv D] [--json] [--out FILE] [--svg FILE]",
                     plan_command);

}  // namespace
}  // namespace treecp::cli
