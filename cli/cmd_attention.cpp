// treecp attention: whole-row tree attention (forward, and backward with --dout), in one process or,
// with --ranks N, as dense attention CP over N MPI ranks planned like `treecp plan` (same files).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "checks.hpp"
#include "command.hpp"
#include "core/error.hpp"
#include "core/npy.hpp"
#include "kernels/cpu/attention.hpp"
#include "launcher.hpp"
#include "output_dir.hpp"
#include "plan/cost.hpp"
#include "plan/planner.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/dense_attention.hpp"
#include "runtime/redistribute.hpp"
#include "runtime/reference.hpp"
#include "tree/row.hpp"


namespace treecp::cli {
namespace {

struct Inputs {
  RankOptions ranks;
  std::string out_dir;
  PlanOptions plan;
  CostModel costs;
  Plan cp_plan;  // the plan for ranks.count > 1 ranks
  Row row;
  NpyArray q, k, v, sink, dout;
  DType dtype = DType::F32;
  bool has_sink = false, has_dout = false;
  AttentionShape shape;  // from the arrays' shapes, --window and --scale
};

// Every file the command may write; those a run does not write are removed from --out at commit.
const std::vector<std::string> kOutputs = {"o.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy", "dsink.npy"};

// Computes everything and returns (file name, bytes) pairs; writes nothing.
template <class T>
OutputFiles compute(const Inputs& in) {
  const std::vector<T> q = values<T>(in.q), k = values<T>(in.k), v = values<T>(in.v);
  std::vector<T> sink, dout;
  AttentionInputs<T> p;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  if (in.has_sink) {
    sink = values<T>(in.sink);
    p.sink = sink.data();
  }
  if (in.has_dout) {
    dout = values<T>(in.dout);
    p.dout = dout.data();
  }
  const AttentionResult<T> r = attention_reference(in.row, in.shape, p);
  const int64_t S = in.row.tokens();
  OutputFiles files;
  files.emplace_back("o.npy", npy_of<T>({S, in.shape.hq, in.shape.dv}, r.o));
  files.emplace_back("lse.npy", npy_of<T>({S, in.shape.hq}, r.lse));
  if (in.has_dout) {
    files.emplace_back("dq.npy", npy_of<T>({S, in.shape.hq, in.shape.d}, r.dq));
    files.emplace_back("dk.npy", npy_of<T>({S, in.shape.hkv, in.shape.d}, r.dk));
    files.emplace_back("dv.npy", npy_of<T>({S, in.shape.hkv, in.shape.dv}, r.dv));
    if (in.has_sink) files.emplace_back("dsink.npy", npy_of<T>({in.shape.hq}, r.dsink));
  }
  return files;
}

// The same files through dense attention CP on comm's ranks; every rank holds the whole inputs (read
// from the files), runs its owned rows, and the results are gathered on rank 0, which alone returns files.
template <class T>
OutputFiles compute_cp(const Inputs& in, Communicator& comm, const Plan& plan) {
  const int64_t S = in.row.tokens();
  const int64_t qw = in.shape.q_width(), kw = in.shape.k_width(), vw = in.shape.v_width(), ow = in.shape.o_width();
  CpuBackend<T> be;
  DenseAttentionCP<CpuBackend<T>> cp(plan, in.row, in.shape, comm, be);
  const auto& owned = plan.ranks[static_cast<size_t>(comm.rank())].owned;
  const auto q = rows_of<T>(in.q.data, qw, owned), k = rows_of<T>(in.k.data, kw, owned),
             v = rows_of<T>(in.v.data, vw, owned);
  const std::vector<T> sink = in.has_sink ? values<T>(in.sink) : std::vector<T>();
  const int64_t rows = cp.owned_rows();
  std::vector<T> y(static_cast<size_t>(rows * ow)), lse(static_cast<size_t>(rows * in.shape.hq));
  cp.forward(q, k, v, in.has_sink ? &sink : nullptr, y, lse);
  std::vector<T> dq(static_cast<size_t>(rows * qw)), dk(static_cast<size_t>(rows * kw)), dv(static_cast<size_t>(rows * vw)),
      dsink(static_cast<size_t>(in.shape.hq), T(0));
  if (in.has_dout) {
    cp.backward(rows_of<T>(in.dout.data, ow, owned), dq, dk, dv, in.has_sink ? &dsink : nullptr);
    comm.all_reduce_sum(dsink.data(), in.shape.hq, CpuBackend<T>::comm_type);  // the sink is replicated: reduce it
  }
  const Ownership owners = plan_ownership(plan);
  auto gather = [&](const std::vector<T>& a, int64_t width) { return gather_to_root(comm, be, a, owners, width); };
  OutputFiles files;
  const auto o0 = gather(y, ow), lse0 = gather(lse, in.shape.hq);
  files.emplace_back("o.npy", npy_of<T>({S, in.shape.hq, in.shape.dv}, o0));
  files.emplace_back("lse.npy", npy_of<T>({S, in.shape.hq}, lse0));
  if (in.has_dout) {
    const auto dq0 = gather(dq, qw), dk0 = gather(dk, kw), dv0 = gather(dv, vw);
    files.emplace_back("dq.npy", npy_of<T>({S, in.shape.hq, in.shape.d}, dq0));
    files.emplace_back("dk.npy", npy_of<T>({S, in.shape.hkv, in.shape.d}, dk0));
    files.emplace_back("dv.npy", npy_of<T>({S, in.shape.hkv, in.shape.dv}, dv0));
    if (in.has_sink) files.emplace_back("dsink.npy", npy_of<T>({in.shape.hq}, dsink));
  }
  if (comm.rank() != 0) files.clear();
  return files;
}

void declare_options(Args& args) {
  declare_rank_options(args);
  args.value("--tree").value("--q").value("--k").value("--v").value("--window").value("--sink").value("--scale");
  args.value("--dout").value("--out").value("--layout").value("--costs").value("--chunk");
}

// Every input and option checked, in this process: the launcher calls it before any rank starts, and
// every rank again on the same files.
Inputs prepare(const Args& args) {
  Inputs in;
  in.ranks = rank_options(args, 1);
  in.plan.layout = layout_option(args);
  in.plan.chunk_tokens = args.get_int_or("--chunk", 0);
  require_chunk(in.plan.chunk_tokens);
  in.out_dir = args.get("--out");
  in.row = load_row(args.get("--tree"));
  in.shape.window = args.get_int_in("--window", 0, 0, Row::kMaxTokens);
  in.q = load_npy(args.get("--q"));
  in.k = load_npy(args.get("--k"));
  in.v = load_npy(args.get("--v"));
  in.has_sink = args.has("--sink");
  in.has_dout = args.has("--dout");
  if (in.has_sink) in.sink = load_npy(args.get("--sink"));
  if (in.has_dout) in.dout = load_npy(args.get("--dout"));

  in.dtype = in.q.dtype;
  require_same_dtype(in.k, "k", in.q, "q");
  require_same_dtype(in.v, "v", in.q, "q");
  if (in.has_sink) require_same_dtype(in.sink, "sink", in.q, "q");
  if (in.has_dout) require_same_dtype(in.dout, "dout", in.q, "q");

  const int64_t S = in.row.tokens();
  require_rank3(in.q, "q", S, "[S, Hq, D]");
  require_rank3(in.k, "k", S, "[S, Hkv, D]");
  require_rank3(in.v, "v", S, "[S, Hkv, Dv]");
  in.shape.hq = require_dim(in.q, "q", 1, "Hq", 1, 65536);
  in.shape.d = require_dim(in.q, "q", 2, "D", 1, 65536);
  in.shape.hkv = require_dim(in.k, "k", 1, "Hkv", 1, 65536);
  in.shape.dv = require_dim(in.v, "v", 2, "Dv", 1, 65536);
  require_shape(in.k, "k", {S, in.shape.hkv, in.shape.d});
  require_shape(in.v, "v", {S, in.shape.hkv, in.shape.dv});
  require(in.shape.hq % in.shape.hkv == 0, "q: Hq = ", in.shape.hq, " must be a multiple of k's Hkv = ", in.shape.hkv);
  if (in.has_sink) require_shape(in.sink, "sink", {in.shape.hq});
  if (in.has_dout) require_shape(in.dout, "dout", {S, in.shape.hq, in.shape.dv});

  require_finite(in.q, "q");
  require_finite(in.k, "k");
  require_finite(in.v, "v");
  if (in.has_sink) require_finite(in.sink, "sink", true);
  if (in.has_dout) require_finite(in.dout, "dout");
  in.shape.scale = args.get_double_or("--scale", 1.0 / std::sqrt(static_cast<double>(in.shape.d)));
  require(std::isfinite(in.shape.scale) && in.shape.scale > 0, "option --scale must be a finite number > 0, got ", in.shape.scale);
  in.costs = args.has("--costs") ? load_costs(args.get("--costs")) : CostModel{};

  const int64_t inputs = in.q.numel() + in.k.numel() + in.v.numel() + in.sink.numel() + in.dout.numel();
  const int64_t outputs = S * in.shape.hq * (in.shape.dv + 1) + (in.has_dout ? in.q.numel() + in.k.numel() + in.v.numel() + in.shape.hq : 0);
  const int elem = in.dtype == DType::F64 ? 8 : 4;
  const double plans = in.ranks.count > 1 ? static_cast<double>(in.ranks.count) *
                                                plan_memory_estimate_bytes(in.row, in.shape.window, in.plan.chunk_tokens,
                                                                           static_cast<int>(in.ranks.count))
                                          : 0.0;
  require_memory(arrays_memory_bytes(in.ranks.count, inputs, outputs, elem) + plans,
                 count_of(in.ranks.count, "rank") + " of attention on " + count_of(S, "token"));
  // The plan of the ranks (each makes the same one): a row it cannot plan is refused here.
  if (in.ranks.count > 1) in.cp_plan = make_plan(in.row, static_cast<int>(in.ranks.count), in.shape, in.costs, in.plan);
  return in;
}

void print_summary(const Inputs& in, size_t files, const std::string& how) {
  std::printf("attention: %s, Hq %d, Hkv %d, D %d, Dv %d, %s%s, %s: wrote %s to %s\n",
              count_of(in.row.tokens(), "token").c_str(), in.shape.hq, in.shape.hkv, in.shape.d, in.shape.dv, dtype_name(in.dtype),
              in.has_dout ? ", with backward" : "", how.c_str(), count_of(static_cast<int64_t>(files), "file").c_str(),
              in.out_dir.c_str());
}

int execute(Communicator& comm, const Inputs& in, OutputDir* out) {
  const Plan& plan = in.cp_plan;
  const bool one = comm.size() == 1;
  const auto files = in.dtype == DType::F64 ? (one ? compute<double>(in) : compute_cp<double>(in, comm, plan))
                                            : (one ? compute<float>(in) : compute_cp<float>(in, comm, plan));
  if (comm.rank() != 0) return 0;
  for (const auto& [name, bytes] : files) out->write(name, bytes);
  out->commit();
  print_summary(in, files.size(),
                one ? "one process"
                    : count_of(comm.size(), "rank") + ", " + layout_name(plan.layout) + " plan with " + count_of(plan.num_waves, "wave"));
  return 0;
}

int attention_cmd(const std::vector<std::string>& argv) {
  return run_file_command<Inputs>("attention", argv, declare_options, kOutputs, prepare, execute);
}

const Register kAttention("attention",
                          "--tree T.json --q Q.npy --k K.npy --v V.npy [--window W] [--sink SINK.npy] [--scale X] "
                          "[--dout DO.npy] [--ranks N] [--timeout S] [--layout L] [--chunk C] [--costs FILE] --out DIR",
                          "tree attention, in one process or as CP over N ranks; writes o, lse (and dq, dk, dv, dsink "
                          "with --dout)",
                          attention_cmd);

}  // namespace
}  // namespace treecp::cli
