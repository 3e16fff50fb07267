// treecp plan: ownership, waves and predicted milliseconds for one row, every layout side by side.
#include <climits>
#include <cstdio>
#include <iostream>
#include <string>

#include "checks.hpp"
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
  Args args(argv);
  args.value("--tree").value("--preset").value("--ranks").alias("--cp", "--ranks").value("--seed").value("--window");
  args.value("--layout").value("--costs").value("--chunk").value("--waves").value("--out").value("--svg").flag("--json");
  args.value("--hq").value("--hkv").value("--d").value("--dv");
  args.parse();
  require(args.has("--tree") != args.has("--preset"), "give exactly one of --tree FILE or --preset NAME");
  const int64_t cp = args.get_int_in("--ranks", 0, 1, 4096);
  const int64_t seed = args.get_int_in("--seed", 0, 0, INT64_MAX);
  PlanOptions options;
  options.layout = layout_option(args);
  // The layer planned for: DESIGN.md's benchmark shape unless given.
  AttentionShape shape;
  shape.hq = static_cast<int>(args.get_int_in("--hq", shape.hq, 1, 65536));
  shape.hkv = static_cast<int>(args.get_int_in("--hkv", shape.hkv, 1, 65536));
  shape.d = static_cast<int>(args.get_int_in("--d", shape.d, 1, 65536));
  shape.dv = static_cast<int>(args.get_int_in("--dv", shape.d, 1, 65536));
  shape.window = args.get_int_in("--window", 0, 0, Row::kMaxTokens);
  shape.validate();
  options.chunk_tokens = args.get_int_or("--chunk", 0);
  require_chunk(options.chunk_tokens);
  options.max_waves = static_cast<int>(args.get_int_in("--waves", options.max_waves, 1, 16));
  const std::string out = args.get_or("--out", "-");
  check_output_file(out);
  const std::string svg_path = args.get_or("--svg", "");
  require(!args.has("--svg") || (!svg_path.empty() && svg_path != "-"), "option --svg needs a file path, got '",
          printable(svg_path), "'");
  if (!svg_path.empty()) check_output_file(svg_path);
  const CostModel costs = args.has("--costs") ? load_costs(args.get("--costs")) : CostModel{};
  const Row row = args.has("--tree")
                      ? load_row(args.get("--tree"))
                      : make_preset(args.get("--preset"), static_cast<int>(cp), static_cast<uint64_t>(seed));
  require_memory(plan_memory_estimate_bytes(row, shape.window, options.chunk_tokens, static_cast<int>(cp)),
                 "planning " + count_of(row.tokens(), "token") + " for " + count_of(cp, "rank"));

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
    write_output(out, json::dump(v) + "\n");
    return 0;
  }

  const int64_t kv = costs.kv_bytes_per_token(shape);
  std::printf("row: %s, %s, %s%s\n", count_of(row.tokens(), "token").c_str(),
              count_of(row.num_segments(), "segment").c_str(), count_of(plan.visible_pairs, "visible pair").c_str(),
              shape.window > 0 ? (", window " + std::to_string(shape.window)).c_str() : "");
  std::printf(
      "plan: layout %s, %s, %s (chunk size %lld), %s; KV %lld B/token "
      "(Hkv %lld, D %lld, Dv %lld)\n",
      layout_name(plan.layout), count_of(plan.cp, "rank").c_str(), count_of(static_cast<int64_t>(plan.chunk_owner.size()), "chunk").c_str(),
      static_cast<long long>(report.chunk_tokens), count_of(plan.num_waves, "wave").c_str(), static_cast<long long>(kv),
      static_cast<long long>(shape.hkv), static_cast<long long>(shape.d),
      static_cast<long long>(shape.dv));
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
  std::printf("\nplanned in %.3f ms (%s, %s)\n", report.planning_ms, count_of(report.evaluations, "evaluation").c_str(),
              count_of(report.search_moves, "search move").c_str());
  return 0;
}

const Register kPlan("plan",
                     "(--tree FILE | --preset NAME) --ranks N [--seed S] [--window W] [--layout L] [--costs FILE] "
                     "[--chunk C] [--waves MAX] [--hq H] [--hkv H] [--d D] [--dv D] [--json] [--out FILE] [--svg FILE]",
                     "ownership, waves and predicted milliseconds of every layout for one row (and its picture)",
                     plan_command);

}  // namespace
}  // namespace treecp::cli
