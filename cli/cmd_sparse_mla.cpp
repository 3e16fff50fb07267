// treecp sparse-mla: sparse multi-head latent attention with a learned indexer over a tree (forward, and
// backward with --dout), in one process or, with --ranks N, as sparse MLA CP over N MPI ranks. With --ids
// the layer reuses another layer's selection (IndexShare): the indexer is skipped.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "checks.hpp"
#include "command.hpp"
#include "core/error.hpp"
#include "core/npy.hpp"
#include "kernels/cpu/sparse_mla.hpp"
#include "launcher.hpp"
#include "plan/sparse_mla_plan.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/redistribute.hpp"
#include "runtime/sparse_mla_cp.hpp"
#include "tree/row.hpp"

namespace treecp::cli {
namespace {

struct Inputs {
  RankOptions ranks;
  std::string out_dir;
  SparseMlaPlanOptions plan_options;
  SparseMlaCosts costs;
  SparseMlaPlan cp_plan;  // the plan for ranks.count > 1 ranks
  DType dtype = DType::F32;
  Row row;
  NpyArray q, kv, qi, ki, w, dout;
  NpyInt64Array ids;
  bool has_ids = false, has_dout = false;
  int64_t window = 0, topk = 0;
  double scale = 0;
  int hi = 0, di = 0, h = 0, dqk = 0, dv = 0;
};

// Every file the command may write; those a run does not write are removed from --out at commit.
const std::vector<std::string> kOutputs = {"o.npy", "lse.npy", "ids.npy", "dq.npy", "dkv.npy"};

// Computes everything and returns the files; writes nothing.
template <class T>
OutputFiles compute(const Inputs& in) {
  const std::vector<T> q = values<T>(in.q), kv = values<T>(in.kv), qi = values<T>(in.qi), ki = values<T>(in.ki),
                       w = values<T>(in.w), dout = values<T>(in.dout);
  cpu::SparseMlaProblem<T> p;
  p.hi = in.hi, p.di = in.di, p.h = in.h, p.dqk = in.dqk, p.dv = in.dv, p.topk = in.topk, p.window = in.window;
  p.scale = static_cast<T>(in.scale);
  p.q = q.data(), p.kv = kv.data();
  if (in.has_ids) {
    p.ids = in.ids.data.data();
  } else {
    p.qi = qi.data(), p.ki = ki.data(), p.w = w.data();
  }
  if (in.has_dout) p.dout = dout.data();
  const cpu::SparseMlaResult<T> r = cpu::sparse_mla_reference(in.row, p);
  const int64_t S = in.row.tokens();
  OutputFiles files;
  files.emplace_back("o.npy", npy_of<T>({S, in.h, in.dv}, r.o));
  files.emplace_back("lse.npy", npy_of<T>({S, in.h}, r.lse));
  files.emplace_back("ids.npy", npy_bytes({S, in.topk}, r.ids.data()));
  if (in.has_dout) {
    files.emplace_back("dq.npy", npy_of<T>({S, in.h, in.dqk}, r.dq));
    files.emplace_back("dkv.npy", npy_of<T>({S, in.dqk}, r.dkv));
  }
  return files;
}

// The same files through sparse MLA CP on comm's ranks; every rank holds the whole inputs (read from the
// files), runs its owned rows, and the results are gathered on rank 0, which alone returns files.
template <class T>
OutputFiles compute_cp(const Inputs& in, Communicator& comm, const SparseMlaPlan& plan) {
  const int64_t S = in.row.tokens(), K = in.topk;
  const int64_t qw = int64_t{in.h} * in.dqk, ow = int64_t{in.h} * in.dv, iw = int64_t{in.hi} * in.di;
  CpuBackend<T> be;
  SparseMlaCP<CpuBackend<T>> cp(plan, in.row, SparseMlaDims{in.hi, in.di, in.h, in.dqk, in.dv, K, in.scale}, comm, be);
  const auto& owned = plan.plan.ranks[static_cast<size_t>(comm.rank())].owned;
  const auto q = rows_of<T>(in.q.data, qw, owned), kv = rows_of<T>(in.kv.data, in.dqk, owned);
  const int64_t rows = cp.owned_rows();
  std::vector<T> o(static_cast<size_t>(rows * ow)), lse(static_cast<size_t>(rows * in.h));
  std::vector<int64_t> ids;
  if (in.has_ids) {
    ids = rows_of<int64_t>(in.ids.data, K, owned);
    cp.forward_shared(ids, q, kv, o, lse);
  } else {
    cp.forward(rows_of<T>(in.qi.data, iw, owned), rows_of<T>(in.ki.data, in.di, owned), rows_of<T>(in.w.data, in.hi, owned),
               q, kv, ids, o, lse);
  }
  std::vector<T> dq(q.size()), dkv(kv.size());
  if (in.has_dout) cp.backward(rows_of<T>(in.dout.data, ow, owned), dq, dkv);
  const Ownership owners = plan_ownership(plan.plan);
  auto gather = [&](const std::vector<T>& a, int64_t width) { return gather_to_root(comm, be, a, owners, width); };
  CpuBackend<int64_t> index_be;
  OutputFiles files;
  const auto o0 = gather(o, ow), lse0 = gather(lse, in.h);
  const auto ids0 = gather_to_root(comm, index_be, ids, owners, K);
  files.emplace_back("o.npy", npy_of<T>({S, in.h, in.dv}, o0));
  files.emplace_back("lse.npy", npy_of<T>({S, in.h}, lse0));
  files.emplace_back("ids.npy", npy_bytes({S, K}, ids0.data()));
  if (in.has_dout) {
    const auto dq0 = gather(dq, qw), dkv0 = gather(dkv, in.dqk);
    files.emplace_back("dq.npy", npy_of<T>({S, in.h, in.dqk}, dq0));
    files.emplace_back("dkv.npy", npy_of<T>({S, in.dqk}, dkv0));
  }
  if (comm.rank() != 0) files.clear();
  return files;
}

void declare_options(Args& args) {
  declare_rank_options(args);
  args.value("--tree").value("--q").value("--kv").value("--dv").value("--qi").value("--ki").value("--w");
  args.value("--topk").value("--window").value("--scale").value("--ids").value("--dout");
  args.value("--layout").value("--costs").value("--chunk").value("--fetch").value("--out");
}

// Every option and input checked: the launcher calls it before any rank starts, and every rank again.
Inputs prepare(const Args& args) {
  Inputs in;
  in.ranks = rank_options(args, 1);
  SparseMlaPlanOptions& plan_options = in.plan_options;
  plan_options.plan.layout = layout_option(args);
  plan_options.plan.chunk_tokens = args.get_int_or("--chunk", 0);
  require_chunk(plan_options.plan.chunk_tokens);
  plan_options.fetch = args.get_choice("--fetch", "auto", {"auto", "waves", "selected"});
  in.out_dir = args.get("--out");
  in.row = load_row(args.get("--tree"));
  const int64_t S = in.row.tokens();
  in.window = args.get_int_in("--window", 0, 0, Row::kMaxTokens);
  in.topk = args.get_int_or("--topk", 0);
  require(args.has("--topk") && in.topk >= 1 && in.topk <= (int64_t{1} << 20), "--topk K is required, in [1, 1048576]",
          args.has("--topk") ? ", got " + std::to_string(in.topk) : std::string());
  in.has_ids = args.has("--ids");
  in.has_dout = args.has("--dout");
  for (const char* name : {"--qi", "--ki", "--w"}) {
    require(in.has_ids != args.has(name), in.has_ids ? std::string(name) + " is not used with --ids (the indexer is skipped)"
                                                     : std::string(name) + " is required (or --ids to reuse a selection)");
  }
  require(!(in.has_ids && plan_options.fetch == "waves"),
          "--fetch waves needs the indexer's waves; with --ids only the selected rows travel");
  in.q = load_npy(args.get("--q"));
  in.kv = load_npy(args.get("--kv"));
  if (in.has_ids) {
    in.ids = load_npy_int64(args.get("--ids"));
  } else {
    in.qi = load_npy(args.get("--qi"));
    in.ki = load_npy(args.get("--ki"));
    in.w = load_npy(args.get("--w"));
  }
  if (in.has_dout) in.dout = load_npy(args.get("--dout"));

  // One precision for every float array: float64 computes in double, float32 in float.
  const DType dtype = in.dtype = in.q.dtype;
  require_same_dtype(in.kv, "kv", in.q, "q");
  if (!in.has_ids) {
    require_same_dtype(in.qi, "qi", in.q, "q");
    require_same_dtype(in.ki, "ki", in.q, "q");
    require_same_dtype(in.w, "w", in.q, "q");
  }
  if (in.has_dout) require_same_dtype(in.dout, "dout", in.q, "q");

  require_rank3(in.q, "q", S, "[S, H, Dqk]");
  const int64_t h = in.q.shape[1], dqk = in.q.shape[2];
  require(h > 0 && dqk > 0 && h <= 65536 && dqk <= 65536, "q: H and Dqk must be in [1, 65536], got ", in.q.shape_string());
  require_shape(in.kv, "kv", {S, dqk});
  const int64_t dv = args.get_int_or("--dv", 0);
  require(args.has("--dv") && dv >= 1 && dv <= dqk, "--dv DV is required, in [1, Dqk = ", dqk, "] (the value is the first DV columns of kv)",
          args.has("--dv") ? ", got " + std::to_string(dv) : std::string());
  int64_t hi = 1, di = 1;
  if (!in.has_ids) {
    require_rank3(in.qi, "qi", S, "[S, Hi, Di]");
    hi = in.qi.shape[1], di = in.qi.shape[2];
    require(hi > 0 && di > 0 && hi <= 65536 && di <= 65536, "qi: Hi and Di must be in [1, 65536], got ", in.qi.shape_string());
    require_shape(in.ki, "ki", {S, di});
    require_shape(in.w, "w", {S, hi});
  } else {
    require(in.ids.shape == (std::vector<int64_t>{S, in.topk}), "ids: expected shape ", shape_string({S, in.topk}),
            " (S, --topk), got ", shape_string(in.ids.shape));
  }
  if (in.has_dout) require_shape(in.dout, "dout", {S, h, dv});
  in.h = static_cast<int>(h), in.dqk = static_cast<int>(dqk), in.dv = static_cast<int>(dv);
  in.hi = static_cast<int>(hi), in.di = static_cast<int>(di);

  require_finite(in.q, "q");
  require_finite(in.kv, "kv");
  if (!in.has_ids) {
    require_finite(in.qi, "qi");
    require_finite(in.ki, "ki");
    require_finite(in.w, "w");
  } else {
    cpu::check_selected_ids(in.row, in.window, in.topk, 0, S, in.ids.data.data());
  }
  if (in.has_dout) require_finite(in.dout, "dout");
  in.scale = args.get_double_or("--scale", 1.0 / std::sqrt(static_cast<double>(dqk)));
  require(std::isfinite(in.scale) && in.scale > 0, "option --scale must be a finite number > 0, got ", in.scale);
  SparseMlaCosts& costs = in.costs;
  costs = args.has("--costs") ? load_sparse_mla_costs(args.get("--costs")) : SparseMlaCosts{};
  costs.shape.hi = hi, costs.shape.di = di, costs.shape.h = h, costs.shape.dqk = dqk, costs.shape.dv = dv;
  costs.shape.bytes_per_element = costs.shape.dkv_bytes_per_element = dtype == DType::F64 ? 8 : 4;
  plan_options.window = in.window;
  plan_options.topk = in.topk;
  plan_options.full_index = !in.has_ids;
  const int64_t inputs = in.q.numel() + in.kv.numel() + in.qi.numel() + in.ki.numel() + in.w.numel() + in.dout.numel() +
                         static_cast<int64_t>(in.ids.data.size());
  const int64_t outputs = S * h * (dv + 1) + S * in.topk + (in.has_dout ? in.q.numel() + in.kv.numel() : 0);
  require_memory(arrays_memory_bytes(in.ranks.count, inputs, outputs, dtype == DType::F64 ? 8 : 4),
                 count_of(in.ranks.count, "rank") + " of sparse MLA on " + count_of(S, "token"));
  // The plan of the ranks (each makes the same one): a row it cannot plan is refused here.
  if (in.ranks.count > 1) in.cp_plan = make_sparse_mla_plan(in.row, static_cast<int>(in.ranks.count), costs, plan_options);
  return in;
}

int execute(Communicator& comm, const Inputs& in, OutputDir* out) {
  const bool one = comm.size() == 1;
  const SparseMlaPlan& plan = in.cp_plan;
  const OutputFiles files = in.dtype == DType::F64 ? (one ? compute<double>(in) : compute_cp<double>(in, comm, plan))
                                                   : (one ? compute<float>(in) : compute_cp<float>(in, comm, plan));
  if (comm.rank() != 0) return 0;
  for (const auto& [name, bytes] : files) out->write(name, bytes);
  out->commit();
  std::string how = "one process";
  if (!one) {
    const std::string asked = layout_name(in.plan_options.plan.layout), got = layout_name(plan.plan.layout);
    how = count_of(comm.size(), "rank") + ", " + asked + (asked == got ? "" : " (" + got + ")") +
          " plan with " + count_of(plan.plan.num_waves, "wave") + ", KV " +
          (plan.fetch == KvFetch::Waves ? "in the waves" : "selected rows only") + " (predicted " +
          std::to_string(plan.prediction.bytes_moved) + " bytes moved; " + kv_fetch_name(plan.other.fetch) + ": " +
          std::to_string(plan.other.bytes_moved) + ")";
  }
  const int64_t S = in.row.tokens();
  std::printf("sparse-mla: %s, H %d, Dqk %d, Dv %d, top-k %lld, %s%s%s, %s: wrote %s to %s\n", count_of(S, "token").c_str(),
              in.h, in.dqk, in.dv, static_cast<long long>(in.topk), dtype_name(in.dtype),
              in.has_ids ? ", ids reused (indexer skipped)" : "", in.has_dout ? ", with backward" : "", how.c_str(),
              count_of(static_cast<int64_t>(files.size()), "file").c_str(), in.out_dir.c_str());
  return 0;
}

int sparse_mla_cmd(const std::vector<std::string>& argv) {
  return run_file_command<Inputs>("sparse-mla", argv, declare_options, kOutputs, prepare, execute);
}

const Register kSparseMla("sparse-mla",
                          "--tree T.json --q Q.npy --kv KV.npy --dv DV (--qi QI.npy --ki KI.npy --w W.npy | --ids IDS.npy) "
                          "--topk K [--window W] [--scale X] [--dout DO.npy] [--ranks N] [--timeout S] [--layout L] "
                          "[--fetch auto|waves|selected] [--costs FILE] [--chunk C] --out DIR",
                          "sparse MLA with a learned indexer, in one process or as CP over N ranks; writes o, lse, ids "
                          "(and dq, dkv with --dout)",
                          sparse_mla_cmd);

}  // namespace
}  // namespace treecp::cli
