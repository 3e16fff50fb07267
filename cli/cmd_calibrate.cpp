// treecp calibrate: fits the cost coefficients (plan/calibrate.hpp) to what `treecp bench cp --json` measured —
// every stage's load and median time, every rank's passes, the all-to-all link probe — and writes a costs file
// naming the machine. Records alternate between the fit and the judgement: the odd ones are held out, and the
// report gives mean |log(measured / predicted)| of their slowest-rank forward+backward under the base and the
// fitted coefficients (the same plans, re-priced).
#include <cstdio>
#include <sstream>

#include "checks.hpp"
#include "command.hpp"
#include "core/error.hpp"
#include "core/json.hpp"
#include "plan/calibrate.hpp"
#include "plan/cost.hpp"
#include "plan/planner.hpp"

namespace treecp::cli {
namespace {

struct Samples {
  std::vector<StageSample> stages;
  std::vector<PassSample> passes;
  std::vector<LinkSample> links;
  std::vector<std::pair<Plan, double>> held_out, fitted_on;  // plan, measured forward+backward ms
  AttentionShape shape;  // the layer the bench planned for (its "shape"; every file must agree)
  bool have_shape = false;
  std::string machine;
};

void read_bench(const std::string& path, Samples& s) {
  const json::Value doc = json::parse(json::read_file(path));
  require(doc.is_object() && doc.contains("records"), path, ": not the JSON of `treecp bench cp --json`");
  if (s.machine.empty() && doc.contains("machine")) s.machine = doc.at("machine").as_string();
  require(doc.contains("shape"), path, ": no \"shape\" (written by `treecp bench cp --json` since the layer shape left "
          "the cost model); run the bench again");
  const json::Value& sh = doc.at("shape");
  AttentionShape shape;
  shape.hq = static_cast<int>(sh.at("hq").as_int());
  shape.hkv = static_cast<int>(sh.at("hkv").as_int());
  shape.d = static_cast<int>(sh.at("d").as_int());
  shape.dv = static_cast<int>(sh.at("dv").as_int());
  shape.validate();
  require(!s.have_shape || (shape.hq == s.shape.hq && shape.hkv == s.shape.hkv && shape.d == s.shape.d &&
                            shape.dv == s.shape.dv),
          path, ": another layer shape than the files before it");
  s.shape = shape;
  s.have_shape = true;
  const json::Value& recs = doc.at("records");
  for (size_t i = 0; i < recs.size(); ++i) {
    const json::Value& r = recs[i];
    if (!r.contains("plan")) continue;
    const bool hold_out = i % 2 == 1;
    Plan plan = plan_from_json(r.at("plan"));
    (hold_out ? s.held_out : s.fitted_on).push_back({plan, r.at("forward_backward_ms").as_double()});
    if (hold_out) continue;
    const json::Value& stages = r.at("stages");
    for (size_t k = 0; k < stages.size(); ++k) {
      const json::Value& st = stages[k];
      StageSample x;
      x.load.pairs = st.at("pairs").as_int();
      x.load.compute_pairs = st.at("compute_pairs").as_int();
      x.load.query_tokens = st.at("query_tokens").as_int();
      x.load.ranges = st.at("ranges").as_int();
      x.remote = st.at("stage").as_int() > 0;
      x.pass = st.at("pass").as_string() == "forward" ? Pass::Forward : Pass::Backward;
      x.measured_ms = st.at("measured_ms").as_double();
      s.stages.push_back(x);
    }
    const json::Value& ranks = r.at("ranks");
    for (size_t k = 0; k < ranks.size(); ++k) {
      const json::Value& rv = ranks[k];
      for (Pass pass : {Pass::Forward, Pass::Backward}) {
        const bool f = pass == Pass::Forward;
        s.passes.push_back({pass, rv.at("owned_tokens").as_int(), rv.at(f ? "forward_ms" : "backward_ms").as_double(),
                            rv.at(f ? "forward_stages_ms" : "backward_stages_ms").as_double()});
      }
    }
  }
  if (doc.contains("links")) {
    const json::Value& links = doc.at("links");
    for (size_t i = 0; i < links.size(); ++i)
      s.links.push_back({static_cast<int>(links[i].at("ranks").as_int()), links[i].at("bytes_per_peer").as_int(),
                         links[i].at("ms").as_double()});
  }
}

// Each plan re-priced at the bench's layer (its window the plan's).
double judge(const std::vector<std::pair<Plan, double>>& plans, const AttentionShape& shape, const CostModel& c) {
  std::vector<std::pair<double, double>> mp;
  for (const auto& [plan, measured] : plans) {
    AttentionShape layer = shape;
    layer.window = plan.window;
    mp.push_back({measured, simulate_plan(plan, layer, c).makespan_ms});
  }
  return mean_abs_log_error(mp);
}

int calibrate_main(const std::vector<std::string>& argv) {
  Args args(argv);
  args.value("--bench").value("--base").value("--out").value("--machine");
  args.parse();
  const std::string out = args.get("--out");
  check_output_file(out);
  const CostModel base = load_costs(args.get_or("--base", config_file("costs_default.json")));
  Samples s;
  std::stringstream list(args.get("--bench"));
  std::vector<std::string> files;
  for (std::string f; std::getline(list, f, ',');)
    if (!f.empty()) files.push_back(f);
  require(!files.empty(), "--bench: give one or more bench JSON files, comma-separated");
  for (const std::string& f : files) read_bench(f, s);
  require(!s.stages.empty(), "--bench: no stage measurements in ", args.get("--bench"),
          " (made by `treecp bench cp --json`?)");
  const std::string machine = args.get_or("--machine", s.machine.empty() ? "unnamed machine" : s.machine);
  const Calibration cal = calibrate(base, s.stages, s.passes, s.links);
  json::Value costs = to_json(cal.costs);
  costs.set("source", "treecp calibrate on " + machine + " from " + args.get("--bench"));
  costs.set("note", std::to_string(cal.stage_samples) + " stages, " + std::to_string(cal.pass_samples) + " passes, " +
                        std::to_string(cal.link_samples) + " link probes fitted; held-out plans: mean |log| " +
                        std::to_string(judge(s.held_out, s.shape, cal.costs)));
  write_output(out, json::dump(costs, 2) + "\n");

  std::printf("treecp calibrate: %s; fitted on %zu plans (%d stages, %d passes, %d link probes), judged on %zu held out\n",
              machine.c_str(), s.fitted_on.size(), cal.stage_samples, cal.pass_samples, cal.link_samples,
              s.held_out.size());
  std::printf("%-34s %14s %14s\n", "coefficient", "base", "fitted");
  auto row = [](const char* name, double a, double b) { std::printf("%-34s %14.6g %14.6g\n", name, a, b); };
  row("local_forward_pairs_per_ms", base.local_forward_pairs_per_ms, cal.costs.local_forward_pairs_per_ms);
  row("remote_forward_pairs_per_ms", base.remote_forward_pairs_per_ms, cal.costs.remote_forward_pairs_per_ms);
  row("local_backward_pairs_per_ms", base.local_backward_pairs_per_ms, cal.costs.local_backward_pairs_per_ms);
  row("remote_backward_pairs_per_ms", base.remote_backward_pairs_per_ms, cal.costs.remote_backward_pairs_per_ms);
  row("stage_launch_ms", base.stage_launch_ms, cal.costs.stage_launch_ms);
  row("merge_ms_per_query_token", base.merge_ms_per_query_token, cal.costs.merge_ms_per_query_token);
  row("range_ms", base.range_ms, cal.costs.range_ms);
  row("token_local_forward_ms_per_token", base.token_local_forward_ms_per_token,
      cal.costs.token_local_forward_ms_per_token);
  row("token_local_backward_ms_per_token", base.token_local_backward_ms_per_token,
      cal.costs.token_local_backward_ms_per_token);
  row("intra_node.latency_ms", base.intra_node.latency_ms, cal.costs.intra_node.latency_ms);
  row("intra_node.bandwidth_bytes_per_ms", base.intra_node.bandwidth_bytes_per_ms,
      cal.costs.intra_node.bandwidth_bytes_per_ms);
  row("rank_bandwidth_bytes_per_ms", base.rank_bandwidth_bytes_per_ms, cal.costs.rank_bandwidth_bytes_per_ms);
  std::printf("\nmean |log(measured / predicted)|      base      fitted\n");
  std::printf("  stages fitted on                   %7.3f   %7.3f\n", [&] {
    std::vector<std::pair<double, double>> mp;
    for (const StageSample& x : s.stages)
      if (x.measured_ms > 0) mp.push_back({x.measured_ms, stage_ms(base, x.load, x.remote, x.pass)});
    return mean_abs_log_error(mp);
  }(), cal.stage_fit_error);
  std::printf("  plans fitted on (fwd+bwd)          %7.3f   %7.3f\n", judge(s.fitted_on, s.shape, base), judge(s.fitted_on, s.shape, cal.costs));
  std::printf("  plans held out (fwd+bwd)           %7.3f   %7.3f\n", judge(s.held_out, s.shape, base), judge(s.held_out, s.shape, cal.costs));
  std::printf("wrote %s\n", out.c_str());
  return 0;
}

const Register kCalibrate("calibrate", "--bench A.json[,B.json] --out COSTS.json [--base COSTS.json] [--machine NAME]",
                          "fit the cost coefficients to `treecp bench cp --json` measurements; report held-out errors",
                          calibrate_main);

}  // namespace
}  // namespace treecp::cli
