// treecp run: the main job. Builds a row (a preset at a CPU-sized scale by default), plans it, runs
// dense attention forward and backward on N ranks, checks the result against the single-process
// reference, and prints a report: plan summary, predicted and measured per-rank time, bytes moved,
// peak memory, max error. Exits non-zero when the result does not match.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "checks.hpp"
#include "command.hpp"
#include "gpu.hpp"
#include "run_report.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "core/json.hpp"
#include "core/random.hpp"
#include "core/trace.hpp"
#include "kernels/cpu/attention.hpp"
#include "launcher.hpp"
#include "runtime/reference.hpp"
#include "plan/cost.hpp"
#include "plan/planner.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/dense_attention.hpp"
#include "runtime/redistribute.hpp"
#include "runtime/span_gather.hpp"
#include "tree/accounting.hpp"
#include "tree/presets.hpp"
#include "tree/row.hpp"
#include "viz/schedule.hpp"


namespace treecp::cli {
namespace {

// Every option of `treecp run`, read and checked in one place: a new option is one line in
// declare_options() and its check in read_options().
struct RunConfig {
  RankOptions ranks;
  bool gpu = false;          // --device cuda
  std::string preset, tree;  // one of them; the preset by default
  int64_t scale = 64;
  AttentionShape shape{8, 2, 64, 64};  // --hq, --hkv, --d, --dv (= D unless given), --window
  bool sink = false;
  uint64_t seed = 0;
  bool json = false;
  std::string dtype = "float";  // --dtype: what the ranks compute in (CPU: float, double; GPU: bf16, fp16)
  std::string costs_path;
  PlanOptions plan;
  // --trace FILE: every rank's measured spans and the plan's predicted ones, written by rank 0.
  std::string trace_path;
  std::vector<Span> predicted;
  // GPU ranks only.
  bool full = false;
  int reps = 5;
};

void declare_options(Args& args) {
  declare_rank_options(args);
  args.value("--preset").value("--tree").value("--window").value("--layout").value("--scale").value("--seed")
      .value("--costs").value("--chunk").value("--hq").value("--hkv").value("--d").value("--dv").value("--dtype")
      .value("--device").value("--reps").value("--backward-kv").value("--trace").flag("--sink").flag("--json").flag("--full");
}

RunConfig read_options(const Args& args) {
  RunConfig cfg;
  cfg.ranks = rank_options(args, 4);
  cfg.gpu = args.get_choice("--device", "cpu", {"cpu", "cuda"}) == "cuda";
  if (cfg.gpu) require(gpu_support(), "--device cuda: this treecp was built without CUDA and NCCL");
  require(cfg.gpu || (!args.has("--reps") && !args.get_flag("--full")), "--reps and --full go with --device cuda");
  require(!(args.has("--tree") && args.has("--preset")), "give --tree or --preset, not both");
  cfg.tree = args.get_or("--tree", "");
  std::vector<std::string> names;
  for (const PresetInfo& p : presets()) names.push_back(p.name);
  cfg.preset = cfg.tree.empty() ? args.get_choice("--preset", "longchain", names) : "";
  cfg.full = args.get_flag("--full");
  cfg.scale = args.get_int_in("--scale", cfg.gpu && cfg.full ? 1 : 64, 1, Row::kMaxTokens);
  cfg.seed = static_cast<uint64_t>(args.get_int_in("--seed", 0, 0, INT64_MAX));
  AttentionShape& shape = cfg.shape;
  shape.hq = static_cast<int>(args.get_int_in("--hq", cfg.gpu ? 32 : 8, 1, 65536));
  shape.hkv = static_cast<int>(args.get_int_in("--hkv", cfg.gpu ? 4 : 2, 1, shape.hq));
  require(shape.hq % shape.hkv == 0, "option --hq (", shape.hq, ") must be a multiple of --hkv (", shape.hkv, ")");
  shape.d = static_cast<int>(args.get_int_in("--d", cfg.gpu ? 128 : 64, 1, 512));
  shape.dv = static_cast<int>(args.get_int_in("--dv", shape.d, 1, 512));
  if (cfg.gpu) require_gpu_attention_dims(shape.d, shape.dv);
  shape.window = args.get_int_in("--window", 0, 0, Row::kMaxTokens);
  cfg.sink = args.get_flag("--sink");
  cfg.json = args.get_flag("--json");
  // --dtype: the element type the ranks compute in, float or double on CPU ranks, bf16 or fp16 on GPUs
  const std::string dtype = args.get_or("--dtype", cfg.gpu ? "bf16" : "float");
  require(cfg.gpu || (dtype != "bf16" && dtype != "fp16"), "--dtype ", dtype,
          " goes with --device cuda (CPU ranks compute in float or double)");
  require(!cfg.gpu || (dtype != "float" && dtype != "double"), "--dtype ", dtype,
          " goes with --device cpu (GPU ranks compute in bf16 or fp16)");
  cfg.dtype = cfg.gpu ? args.get_choice("--dtype", "bf16", {"bf16", "fp16"})
                      : args.get_choice("--dtype", "float", {"float", "double"});
  // CPU ranks: the coefficients measured on CPU machines (config/costs_cpu.json); GPU ranks: one H200 per
  // rank (config/costs_h200.json, calibrated on one H200); --costs overrides either.
  cfg.costs_path = args.get_or("--costs", config_file(cfg.gpu ? "costs_h200.json" : "costs_cpu.json"));
  cfg.plan.layout = layout_option(args);
  cfg.plan.chunk_tokens = args.get_int_or("--chunk", 0);
  require_chunk(cfg.plan.chunk_tokens);
  // Checked before any rank starts: a trace that cannot be written would be found only after the run.
  cfg.trace_path = args.get_or("--trace", "");
  if (args.has("--trace")) {
    require(!cfg.trace_path.empty() && cfg.trace_path != "-", "option --trace needs a file path, got '",
            printable(cfg.trace_path), "'");
    check_output_file(cfg.trace_path);
  }
  cfg.reps = static_cast<int>(args.get_int_in("--reps", 5, 1, 1000));
  cfg.plan.backward_kv = args.get_choice("--backward-kv", "auto", {"auto", "keep", "refetch"});
  return cfg;
}

// What every rank runs: the checked options, the row, the coefficients and the plan for the ranks.
struct RunJob {
  RunConfig cfg;
  Row row;
  std::string source;
  CostModel costs;
  Plan plan;
  PlanReport report;
};

// Host memory of the whole CPU job on this machine: every rank's shards, redistributed copies, outputs
// and received KV, rank 0's single-process reference (with double copies in float), and the plans.
double job_memory_bytes(const RunJob& job) {
  const RunConfig& c = job.cfg;
  const double S = static_cast<double>(job.row.tokens());
  const double qw = double(c.shape.q_width()), kw = double(c.shape.k_width()), vw = double(c.shape.v_width()),
               ow = double(c.shape.o_width());
  const double full = S * (qw + kw + vw + ow);  // q, k, v and dO (and as many outputs)
  const double elem = c.dtype == "double" ? 8 : 4, ranks = static_cast<double>(c.ranks.count);
  const double cp = elem * (3 * full + ranks * S * (kw + vw));
  const double reference = elem * 3 * full + (elem == 4 ? 16 * full : 0);
  return cp + reference + ranks * plan_memory_estimate_bytes(job.row, c.shape.window, c.plan.chunk_tokens, static_cast<int>(ranks));
}

// Everything a rank would check, checked here: the launcher calls it before any rank starts, and
// every rank again (the same files, the same deterministic planning).
RunJob prepare(const Args& args) {
  RunJob job;
  job.cfg = read_options(args);
  const RunConfig& c = job.cfg;
  if (!c.tree.empty()) {
    job.row = load_row(c.tree);
    job.source = c.tree;
  } else {
    job.row = scale_row(make_preset(c.preset, static_cast<int>(c.ranks.count), c.seed), c.scale);
    job.source = c.preset + " (cp " + std::to_string(c.ranks.count) + ", lengths / " + std::to_string(c.scale) + ")";
  }
  job.costs = load_costs(c.costs_path);
  if (!c.gpu) {
    require_memory(job_memory_bytes(job), count_of(c.ranks.count, "rank") +
                                              " of attention forward and backward and the reference, " +
                                              count_of(job.row.tokens(), "token") + ", Hq " + std::to_string(c.shape.hq) +
                                              ", Hkv " + std::to_string(c.shape.hkv) + ", D " + std::to_string(c.shape.d) +
                                              (c.shape.dv != c.shape.d ? ", Dv " + std::to_string(c.shape.dv) : ""));
  }
  job.plan = make_plan(job.row, static_cast<int>(c.ranks.count), c.shape, job.costs, c.plan, &job.report);
  return job;
}

// Per-rank figures gathered on rank 0, one fixed-size record each.
enum Field { kPeakMiB = kRunCommonFields, kFields };  // after the common fields (run_report.hpp)

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux reports KiB
}

template <class T>
std::vector<T> shard_values(uint64_t seed, const TokenRange& rows, int64_t width) {
  std::vector<T> out(static_cast<size_t>(rows.size() * width));
  for (int64_t i = 0; i < rows.size() * width; ++i) {
    out[static_cast<size_t>(i)] = static_cast<T>(uniform_at(seed, static_cast<uint64_t>(rows.begin * width + i)));
  }
  return out;
}

double rel_error(const std::vector<double>& got, const std::vector<double>& ref) {
  double scale = 1e-30, err = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const bool both_inf = std::isinf(ref[i]) && std::isinf(got[i]) && (ref[i] < 0) == (got[i] < 0);
    if (std::isfinite(ref[i])) scale = std::max(scale, std::abs(ref[i]));
    if (!both_inf) err = std::max(err, std::isfinite(got[i] - ref[i]) ? std::abs(got[i] - ref[i]) : 1e300);
  }
  return err / scale;
}

// The runtime's stage names ("fwd wave 2", "bwd wait 1", "bwd return 1", "fwd merge+sink") as trace categories.
const char* measured_category(const std::string& name) {
  if (name.find(" wait ") != std::string::npos) return "wait";
  if (name.find(" return ") != std::string::npos) return "return";  // waiting for dK/dV, then adding them
  if (name.find("merge") != std::string::npos || name.find("prep") != std::string::npos) return "merge";
  return "stage";
}

template <class T>
int run_typed(Communicator& comm, const Row& row, const Plan& plan, const PlanReport& report, const RunConfig& cfg,
              const std::string& source) {
  const int me = comm.rank(), n = comm.size();
  const int64_t S = row.tokens();
  const AttentionShape& shape = cfg.shape;
  const int64_t qw = shape.q_width(), kw = shape.k_width(), vw = shape.v_width(), ow = shape.o_width();
  CpuBackend<T> be;
  DenseAttentionCP<CpuBackend<T>> cp(plan, row, shape, comm, be);

  // Inputs arrive in the data loader's contiguous shards; move them to the plan's ownership.
  const Ownership loader = contiguous_ownership(S, n), owners = plan_ownership(plan);
  const TokenRange mine = loader[static_cast<size_t>(me)].empty() ? TokenRange{} : loader[static_cast<size_t>(me)][0];
  const uint64_t s = cfg.seed * 16;
  const auto q = redistribute(comm, be, shard_values<T>(s + 1, mine, qw), loader, owners, qw);
  const auto k = redistribute(comm, be, shard_values<T>(s + 2, mine, kw), loader, owners, kw);
  const auto v = redistribute(comm, be, shard_values<T>(s + 3, mine, vw), loader, owners, vw);
  const auto dy = redistribute(comm, be, shard_values<T>(s + 4, mine, ow), loader, owners, ow);
  std::vector<T> sink(static_cast<size_t>(cfg.shape.hq));
  for (int h = 0; h < cfg.shape.hq; ++h) sink[static_cast<size_t>(h)] = static_cast<T>(2 * uniform_at(s + 5, static_cast<uint64_t>(h)));

  const int64_t rows = cp.owned_rows();
  std::vector<T> y(static_cast<size_t>(rows * ow)), lse(static_cast<size_t>(rows * cfg.shape.hq)), dq(static_cast<size_t>(rows * qw)),
      dk(static_cast<size_t>(rows * kw)), dv(static_cast<size_t>(rows * vw)), dsink(static_cast<size_t>(cfg.shape.hq), T(0));
  // Measured spans: the calls this command makes, and the runtime's stages inside them.
  SpanRecorder spans(me);
  comm.barrier();
  spans.reset_origin();  // t = 0 on every rank as the barrier releases them
  const double forward_begin = spans.now_ms();
  cp.forward(q, k, v, cfg.sink ? &sink : nullptr, y, lse);
  const double forward_end = spans.now_ms();
  comm.barrier();
  const double backward_begin = spans.now_ms();
  cp.backward(dy, dq, dk, dv, cfg.sink ? &dsink : nullptr);
  const double backward_end = spans.now_ms();
  spans.record("forward", "pass", forward_begin, forward_end);
  spans.record("barrier", "wait", forward_end, backward_begin);
  spans.record("backward", "pass", backward_begin, backward_end);
  if (!cfg.trace_path.empty()) {
    // The runtime times its stages from its own first mark, taken just after forward_begin; clamping
    // into the pass absorbs that gap so that the stages nest in their pass.
    for (const StageSpan& st : cp.spans()) {
      const bool fwd = st.name.rfind("fwd", 0) == 0;
      const double lo = fwd ? forward_begin : backward_begin, hi = fwd ? forward_end : backward_end;
      const double b = std::clamp(forward_begin + st.begin_ms, lo, hi), e = std::clamp(forward_begin + st.end_ms, b, hi);
      spans.record(st.name, measured_category(st.name), b, e);
    }
  }
  comm.all_reduce_sum(dsink.data(), cfg.shape.hq, CpuBackend<T>::comm_type);  // the sink is a replicated weight

  std::vector<double> mine_stats(kFields, 0.0), all_stats(static_cast<size_t>(kFields * n));
  const RankPlan& rp = plan.ranks[static_cast<size_t>(me)];
  mine_stats[kTokens] = static_cast<double>(rp.owned_tokens());
  mine_stats[kPairs] = static_cast<double>(rp.pairs());
  mine_stats[kPredFwd] = rp.predicted_forward_ms;
  mine_stats[kPredBwd] = rp.predicted_backward_ms;
  mine_stats[kFwd] = cp.traffic().forward_ms;
  mine_stats[kBwd] = cp.traffic().backward_ms;
  mine_stats[kSent] = static_cast<double>(cp.traffic().bytes_sent);
  mine_stats[kRecv] = static_cast<double>(cp.traffic().bytes_received);
  mine_stats[kPeakMiB] = peak_rss_mib();
  comm.all_gather(mine_stats.data(), all_stats.data(), kFields, CommType::F64);
  std::vector<Span> trace;
  if (!cfg.trace_path.empty()) trace = gather_spans(comm, spans.spans(), 0);

  // Everything back on rank 0 in packed order, then the single-process reference there.
  const auto y0 = gather_to_root(comm, be, y, owners, ow);
  const auto lse0 = gather_to_root(comm, be, lse, owners, shape.hq);
  const auto dq0 = gather_to_root(comm, be, dq, owners, qw);
  const auto dk0 = gather_to_root(comm, be, dk, owners, kw);
  const auto dv0 = gather_to_root(comm, be, dv, owners, vw);
  int status = 0;
  if (me == 0) {
    const TokenRange all{0, S};
    const auto fq = shard_values<T>(s + 1, all, qw), fk = shard_values<T>(s + 2, all, kw),
               fv = shard_values<T>(s + 3, all, vw), fdy = shard_values<T>(s + 4, all, ow);
    AttentionInputs<T> prob;
    prob.q = fq.data(), prob.k = fk.data(), prob.v = fv.data(), prob.dout = fdy.data();
    prob.sink = cfg.sink ? sink.data() : nullptr;
    const auto t0 = std::chrono::steady_clock::now();
    const AttentionResult<T> ref = attention_reference(row, shape, prob);
    const double ref_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    // The oracle is a double-precision run on the same (rounded) inputs. In double the CP result must
    // match it to 1e-10; in float it may differ by at most 4x what the one-process float run differs,
    // plus 1e-6 (STYLE.md): float sums in another order differ, they must not differ more.
    auto widen = [](const std::vector<T>& a) { return std::vector<double>(a.begin(), a.end()); };
    AttentionResult<double> ref64;
    if constexpr (sizeof(T) == 8) {
      ref64 = ref;
    } else {
      ref64 = attention_reference_double(row, shape, prob);
    }
    struct Check {
      std::string name;
      double error, bound;
    };
    std::vector<Check> errors;
    auto check = [&](const char* name, const std::vector<T>& got, const std::vector<T>& same_precision,
                     const std::vector<double>& oracle) {
      const double bound = sizeof(T) == 8 ? 1e-10 : 4 * rel_error(widen(same_precision), oracle) + 1e-6;
      errors.push_back({name, rel_error(widen(got), oracle), bound});
    };
    check("o", y0, ref.o, ref64.o);
    check("lse", lse0, ref.lse, ref64.lse);
    check("dq", dq0, ref.dq, ref64.dq);
    check("dk", dk0, ref.dk, ref64.dk);
    check("dv", dv0, ref.dv, ref64.dv);
    if (cfg.sink) check("dsink", dsink, ref.dsink, ref64.dsink);
    for (const Check& e : errors) status = e.error <= e.bound ? status : 3;
    // A run that does not match writes nothing.
    if (status == 0 && !cfg.trace_path.empty()) {
      trace.insert(trace.end(), cfg.predicted.begin(), cfg.predicted.end());
      write_chrome_trace(trace, cfg.trace_path);
    }

    const RowStats st = row_stats(row, cfg.shape.window);
    if (cfg.json) {
      json::Value out = json::Value::object();
      out.set("source", source);
      out.set("ranks", n);
      out.set("tokens", S);
      out.set("visible_pairs", st.visible_pairs);
      out.set("layout", std::string(layout_name(plan.layout)));
      out.set("waves", plan.num_waves);
      out.set("predicted_makespan_ms", plan.predicted_makespan_ms);
      out.set("planning_ms", report.planning_ms);
      out.set("costs", cfg.costs_path);
      json::Value ranks = json::Value::array();
      for (int r = 0; r < n; ++r) {
        const double* f = &all_stats[static_cast<size_t>(r * kFields)];
        json::Value rv = rank_record_json(f);
        rv.set("peak_rss_mib", f[kPeakMiB]);
        ranks.push_back(rv);
      }
      out.set("per_rank", ranks);
      json::Value errs, bounds;
      checks_json(errors, errs, bounds);
      out.set("max_rel_error", errs);
      out.set("error_bound", bounds);
      out.set("ok", status == 0);
      if (status == 0 && !cfg.trace_path.empty()) out.set("trace", cfg.trace_path);
      std::cout << json::dump(out, 2) << "\n";
    } else {
      std::printf("treecp run: %s, %s, %s\n", source.c_str(), count_of(n, "rank").c_str(), sizeof(T) == 8 ? "double" : "float");
      std::printf("row: %s, %s, %s, depth %d, %s%s\n", count_of(S, "token").c_str(),
                  count_of(st.segments, "segment").c_str(), count_of(st.families, "family", "families").c_str(),
                  st.depth, count_of(st.visible_pairs, "visible pair").c_str(),
                  cfg.shape.window > 0 ? (" (window " + std::to_string(cfg.shape.window) + ")").c_str() : "");
      std::printf("attention: Hq %d, Hkv %d, D %d, Dv %d%s\n", cfg.shape.hq, cfg.shape.hkv, cfg.shape.d, cfg.shape.dv,
                  cfg.sink ? ", learned sink" : "");
      std::printf("costs: %s; %s for %s\n", cfg.costs_path.c_str(),
                  count_of(std::thread::hardware_concurrency(), "hardware thread").c_str(), count_of(n, "rank").c_str());
      std::printf("plan: %s, %s of %s, %s (backward KV %s), predicted makespan %.3f ms, planned in %.2f ms\n",
                  layout_name(plan.layout), count_of(static_cast<int64_t>(plan.chunk_owner.size()), "chunk").c_str(),
                  count_of(report.chunk_tokens, "token").c_str(), count_of(plan.num_waves, "wave").c_str(),
                  plan.refetch_backward ? "fetched again" : "kept", plan.predicted_makespan_ms, report.planning_ms);
      std::printf("  layouts (predicted makespan ms):");
      for (const auto& l : report.layouts) std::printf("  %s %.3f", layout_name(l.layout), l.makespan_ms);
      std::printf("\n\n%4s %9s %12s %10s %10s %10s %10s %12s %12s %9s\n", "rank", "tokens", "pairs", "pred_fwd", "fwd_ms",
                  "pred_bwd", "bwd_ms", "bytes_out", "bytes_in", "peak_MiB");
      for (int r = 0; r < n; ++r) {
        const double* f = &all_stats[static_cast<size_t>(r * kFields)];
        std::printf("%4d %9.0f %12.0f %10.3f %10.3f %10.3f %10.3f %12.0f %12.0f %9.1f\n", r, f[kTokens], f[kPairs],
                    f[kPredFwd], f[kFwd], f[kPredBwd], f[kBwd], f[kSent], f[kRecv], f[kPeakMiB]);
      }
      std::printf("\nreference (one process, same kernels, %s): %.1f ms forward+backward\n",
                  sizeof(T) == 8 ? "double" : "float", ref_ms);
      std::printf("max relative error vs the double-precision reference (bound):\n ");
      for (const Check& e : errors) std::printf("  %s %.2e (%.1e)", e.name.c_str(), e.error, e.bound);
      std::printf("\n%s\n", status == 0 ? "OK: every output and gradient matches" : "MISMATCH");
      if (status == 0 && !cfg.trace_path.empty()) {
        std::printf("trace: %s (%zu spans; open in https://ui.perfetto.dev or chrome://tracing)\n",
                    cfg.trace_path.c_str(), trace.size());
      }
    }
  }
  int64_t verdict = status;
  comm.all_reduce_sum(&verdict, 1, CommType::I64);
  return verdict == 0 ? 0 : 3;
}

int execute(Communicator& comm, const RunJob& job) {
  const RunConfig& c = job.cfg;
  if (c.gpu) {
    GpuRunConfig g;
    g.shape = c.shape, g.sink = c.sink, g.seed = c.seed, g.json = c.json;
    g.dtype = c.dtype == "fp16" ? cuda::DType::kF16 : cuda::DType::kBf16;
    g.full = c.full;
    g.reps = c.reps;
    g.costs_path = c.costs_path;
    g.source = job.source;
    g.trace_path = c.trace_path;
    g.timeout_s = c.ranks.timeout_s;
    return run_on_gpus(comm, job.row, job.costs, c.plan, g);
  }
  RunConfig cfg = c;
  if (!cfg.trace_path.empty() && comm.rank() == 0) cfg.predicted = viz::predicted_spans(simulate_plan_timeline(job.plan, c.shape, job.costs));
  return cfg.dtype == "double" ? run_typed<double>(comm, job.row, job.plan, job.report, cfg, job.source)
                               : run_typed<float>(comm, job.row, job.plan, job.report, cfg, job.source);
}

int run_main(const std::vector<std::string>& argv) {
  Args args(argv);
  declare_options(args);
  args.parse();
  if (started_under_mpi()) {
    RankGroup group(rank_options(args, 4));
    return group.run([&](Communicator& comm) {
      RunJob job;
      agree(comm, [&] { job = prepare(args); });
      return execute(comm, job);
    });
  }
  const RunJob job = prepare(args);  // the boundary: what every rank would check, before any starts
  if (job.cfg.ranks.count > 1) return run_under_mpirun("run", job.cfg.ranks, argv);
  RankGroup group(job.cfg.ranks);
  return group.run([&](Communicator& comm) { return execute(comm, job); });
}

const Register kRun("run",
                    "[--preset NAME | --tree FILE] [--ranks N] [--timeout S] [--device cpu|cuda] [--window W] [--sink] "
                    "[--layout L] [--dtype float|double|bf16|fp16] [--scale F] [--seed S] [--hq H] [--hkv H] [--d D] "
                    "[--dv D] [--chunk C] [--costs FILE] [--trace FILE] [--full] [--reps N] "
                    "[--backward-kv auto|keep|refetch] [--json]",
                    "the main job: plan, run dense attention CP forward+backward on N ranks (CPU processes or GPUs), "
                    "check against one process, report",
                    run_main);

}  // namespace
}  // namespace treecp::cli
