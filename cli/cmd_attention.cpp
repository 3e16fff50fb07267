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
#include "command.hpp"
#include "core/error.hpp"
#include "core/npy.hpp"
#include "kernels/cpu/attention.hpp"
#include "runtime/reference.hpp"
#include "launcher.hpp"
#include "plan/cost.hpp"
#include "plan/planner.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/dense_attention.hpp"
#include "runtime/redistribute.hpp"
#include "tree/row.hpp"


namespace treecp::cli {
namespace {

struct Inputs {
  Row row;
  NpyArray q, k, v, sink, dout;
  bool has_sink = false, has_dout = false;
  AttentionShape shape;  // from the arrays' shapes, --window and --scale
};

// Computes everything and returns (file name, bytes) pairs; writes nothing.
template <class T>
std::vector<std::pair<std::string, std::string>> compute(const Inputs& in) {
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
  std::vector<std::pair<std::string, std::string>> files;
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
std::vector<std::pair<std::string, std::string>> compute_cp(const Inputs& in, Communicator& comm, const Plan& plan) {
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
  std::vector<std::pair<std::string, std::string>> files;
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

int attention_cmd(const std::vector<std::string>& argv) {
  Args args("attention", argv);
  args.value("--tree").value("--q").value("--k").value("--v").value("--window").value("--sink").value("--scale");
  args.value("--dout").value("--out").value("--ranks").value("--layout").value("--costs").value("--chunk");
  args.parse();
  const int64_t ranks = args.get_int_or("--ranks", 1);
  require(ranks >= 1 && ranks <= 256, "--ranks must be in [1, 256], got ", ranks);
  PlanOptions plan_options;
  plan_options.layout = parse_layout(args.get_or("--layout", "searched"));
  plan_options.chunk_tokens = args.get_int_or("--chunk", 0);
  require(plan_options.chunk_tokens >= 0, "--chunk must be >= 0 (0 = chosen by the planner)");
  const std::string out_dir = args.get("--out");

  Inputs in;
  in.row = load_row(args.get("--tree"));
  in.shape.window = args.get_int_or("--window", 0);
  require(in.shape.window >= 0, "--window must be >= 0 (0 = none), got ", in.shape.window);
  in.q = load_npy(args.get("--q"));
  in.k = load_npy(args.get("--k"));
  in.v = load_npy(args.get("--v"));
  in.has_sink = args.has("--sink");
  in.has_dout = args.has("--dout");
  if (in.has_sink) in.sink = load_npy(args.get("--sink"));
  if (in.has_dout) in.dout = load_npy(args.get("--dout"));

  // One precision for every array: float64 computes in double, float32 in float.
  const DType dtype = in.q.dtype;
  require_same_dtype(in.k, "k", in.q, "q");
  require_same_dtype(in.v, "v", in.q, "q");
  if (in.has_sink) require_same_dtype(in.sink, "sink", in.q, "q");
  if (in.has_dout) require_same_dtype(in.dout, "dout", in.q, "q");

  const int64_t S = in.row.tokens();
  require_rank3(in.q, "q", S, "[S, Hq, D]");
  require_rank3(in.k, "k", S, "[S, Hkv, D]");
  require_rank3(in.v, "v", S, "[S, Hkv, Dv]");
  const int64_t hq = in.q.shape[1], d = in.q.shape[2], hkv = in.k.shape[1], dv = in.v.shape[2];
  require(hq > 0 && d > 0 && hkv > 0 && dv > 0, "q, k, v: head counts and head dims must be > 0");
  require(hq <= 65536 && d <= 65536 && dv <= 65536, "q, v: head counts and head dims must be <= 65536");
  require_shape(in.k, "k", {S, hkv, d});
  require_shape(in.v, "v", {S, hkv, dv});
  require(hq % hkv == 0, "q: Hq = ", hq, " must be a multiple of k's Hkv = ", hkv);
  if (in.has_sink) require_shape(in.sink, "sink", {hq});
  if (in.has_dout) require_shape(in.dout, "dout", {S, hq, dv});
  in.shape.hq = static_cast<int>(hq);
  in.shape.hkv = static_cast<int>(hkv);
  in.shape.d = static_cast<int>(d);
  in.shape.dv = static_cast<int>(dv);

  require_finite(in.q, "q");
  require_finite(in.k, "k");
  require_finite(in.v, "v");
  if (in.has_sink) require_finite(in.sink, "sink", true);
  if (in.has_dout) require_finite(in.dout, "dout");
  in.shape.scale = args.get_double_or("--scale", 1.0 / std::sqrt(static_cast<double>(d)));
  require(std::isfinite(in.shape.scale) && in.shape.scale > 0, "--scale must be a finite number > 0, got ",
          in.shape.scale);

  // Every input (the cost file too) is checked above, in this process, before any rank starts.
  CostModel costs = args.has("--costs") ? load_costs(args.get("--costs")) : CostModel{};
  if (int rc = 0; relaunch_under_mpi("attention", static_cast<int>(ranks), argv, &rc)) return rc;
  std::vector<std::pair<std::string, std::string>> files;
  std::string how = "one process";
  if (ranks == 1) {
    files = dtype == DType::F64 ? compute<double>(in) : compute<float>(in);
  } else {
    RankGroup group(ranks);
    const bool writer = group.run([&](Communicator& comm) {
      const Plan plan = make_plan(in.row, comm.size(), in.shape, costs, plan_options);
      files = dtype == DType::F64 ? compute_cp<double>(in, comm, plan) : compute_cp<float>(in, comm, plan);
      how = std::to_string(ranks) + " ranks, " + layout_name(plan.layout) + " plan with " +
            std::to_string(plan.num_waves) + " waves";
      return comm.rank() == 0 ? 1 : 0;  // rank 0 holds the gathered results and writes them
    });
    if (!writer) return 0;
  }

  write_files(out_dir, files, {"dq.npy", "dk.npy", "dv.npy", "dsink.npy"});
  std::printf("attention: %lld tokens, Hq %lld, Hkv %lld, D %lld, Dv %lld, %s%s, %s: wrote %zu files to %s\n",
              static_cast<long long>(S), static_cast<long long>(hq), static_cast<long long>(hkv),
              static_cast<long long>(d), static_cast<long long>(dv), dtype_name(dtype),
              in.has_dout ? ", with backward" : "", how.c_str(), files.size(), out_dir.c_str());
  return 0;
}

const Register kAttention("attention",
                          "--tree T.json --q Q.npy --k K.npy --v V.npy [--window W] [--sink SINK.npy] [--scale X] "
                          "[--dout DO.npy] [--ranks N] [--layout L] --out DIR: tree attention, in one process or as CP "
                          "over N ranks (o, lse; dq, dk, dv, dsink)",
                          attention_cmd);

}  // namespace
}  // namespace treecp::cli
