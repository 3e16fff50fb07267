// treecp mamba2: the Mamba-2 scan (SSD) over a packed tree, forward and, with --dout, backward; in
// one process or, with --ranks N, as context parallelism over N MPI ranks: token owners from the
// dense attention planner (--layout), heads transposed or state summaries scanned (--strategy, by
// default the cheaper as priced by runtime/mamba2_plan). Every input is checked before any rank
// starts; rank 0 gathers the results and writes them.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "checks.hpp"
#include "command.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "core/npy.hpp"
#include "launcher.hpp"
#include "plan/planner.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/mamba2_cp.hpp"
#include "runtime/redistribute.hpp"
#include "tree/row.hpp"

namespace treecp::cli {
namespace {

struct Inputs {
  RankOptions ranks;
  std::string out_dir;
  std::optional<Mamba2Strategy> force;
  PlanOptions attention;
  GdnCostModel costs;
  Row row;
  NpyArray x, dt, a, b, c, d, dout;
  bool has_d = false, has_dout = false;
  Mamba2Shape shape;
  DType dtype = DType::F32;
};

// Every file the command may write; those a run does not write are removed from --out at commit.
const std::vector<std::string> kOutputs = {"y.npy", "dx.npy", "ddt.npy", "da.npy", "db.npy", "dc.npy", "dd.npy"};

// Every element of `a` satisfies `ok`; the message names the array, the element and the rule.
template <class Ok>
void require_each(const NpyArray& a, const std::string& name, Ok ok, const char* rule) {
  for (size_t i = 0; i < a.data.size(); ++i)
    require(ok(a.data[i]), name, ": element ", i, " is ", a.data[i], " (", rule, ")");
}

void declare_options(Args& args) {
  declare_rank_options(args);
  args.value("--tree").value("--x").value("--dt").value("--a").value("--b").value("--c").value("--d").value("--dout");
  args.value("--strategy").value("--layout").value("--chunk").value("--costs").value("--out");
}

// Every option and input checked (the messages name the array and what was expected): the launcher
// calls it before any rank starts, and every rank again on the same files.
Inputs prepare(const Args& args) {
  Inputs in;
  in.ranks = rank_options(args, 1);
  in.force = parse_mamba2_strategy(args.get_or("--strategy", "auto"));
  in.attention.layout = layout_option(args);
  const int64_t chunk = args.get_int_in("--chunk", 64, 1, 4096);
  in.out_dir = args.get("--out");
  in.costs = args.has("--costs") ? load_mamba2_costs(args.get("--costs")) : mamba2_cost_defaults();
  in.row = load_row(args.get("--tree"));
  const int64_t S = in.row.tokens();
  in.x = load_npy(args.get("--x"));
  in.dt = load_npy(args.get("--dt"));
  in.a = load_npy(args.get("--a"));
  in.b = load_npy(args.get("--b"));
  in.c = load_npy(args.get("--c"));
  in.has_d = args.has("--d");
  in.has_dout = args.has("--dout");
  if (in.has_d) in.d = load_npy(args.get("--d"));
  if (in.has_dout) in.dout = load_npy(args.get("--dout"));
  // One precision for every array: float64 computes in double, float32 in float.
  in.dtype = in.x.dtype;
  auto same_dtype = [&](const NpyArray& a, const char* name) {
    require(a.dtype == in.dtype, name, " is ", dtype_name(a.dtype), " but x is ", dtype_name(in.dtype),
            ": mixing dtypes is refused (give every array the same dtype)");
  };
  same_dtype(in.dt, "dt");
  same_dtype(in.a, "a");
  same_dtype(in.b, "b");
  same_dtype(in.c, "c");
  if (in.has_d) same_dtype(in.d, "d");
  if (in.has_dout) same_dtype(in.dout, "dout");

  require(in.x.shape.size() == 3 && in.x.shape[0] == S, "x: expected shape [S, H, P] with S = ", S,
          " tokens of the tree, got ", in.x.shape_string());
  require(in.b.shape.size() == 3 && in.b.shape[0] == S, "b: expected shape [S, G, N] with S = ", S, ", got ",
          in.b.shape_string());
  const int64_t H = in.x.shape[1], P = in.x.shape[2], G = in.b.shape[1], N = in.b.shape[2];
  require(H >= 1 && P >= 1 && G >= 1 && N >= 1, "x, b: H, P, G and N must be >= 1");
  require(H <= 65536 && P <= 65536 && N <= 65536, "x, b: H, P and N must be <= 65536");
  require(H % G == 0, "b: G = ", G, " groups must divide x's H = ", H, " heads");
  require_shape(in.dt, "dt", {S, H});
  require_shape(in.a, "a", {H});
  require_shape(in.c, "c", {S, G, N});
  if (in.has_d) require_shape(in.d, "d", {H});
  if (in.has_dout) require_shape(in.dout, "dout", {S, H, P});
  require_finite(in.x, "x");
  require_finite(in.b, "b");
  require_finite(in.c, "c");
  if (in.has_d) require_finite(in.d, "d");
  if (in.has_dout) require_finite(in.dout, "dout");
  require_each(in.dt, "dt", [](double v) { return std::isfinite(v) && v > 0; },
               "expected finite values > 0: apply softplus and the bias first");
  require_each(in.a, "a", [](double v) { return std::isfinite(v) && v < 0; }, "expected finite values < 0");
  in.shape = Mamba2Shape{static_cast<int>(H), static_cast<int>(P), static_cast<int>(G), static_cast<int>(N),
                         in.dtype == DType::F64 ? 8 : 4, static_cast<int>(chunk)};
  const int64_t inputs = in.x.numel() + in.dt.numel() + in.a.numel() + in.b.numel() + in.c.numel() + in.d.numel() +
                         in.dout.numel();
  const int64_t outputs = in.x.numel() + (in.has_dout ? inputs - in.dout.numel() : 0);
  require_memory(arrays_memory_bytes(in.ranks.count, inputs, outputs, in.dtype == DType::F64 ? 8 : 4),
                 count_of(in.ranks.count, "rank") + " of Mamba-2 on " + count_of(S, "token"));
  return in;
}

template <class T>
std::vector<T> values(const NpyArray& a) {
  return std::vector<T>(a.data.begin(), a.data.end());
}

template <class T>
std::string npy_of(const std::vector<int64_t>& shape, const std::vector<T>& data) {
  if constexpr (std::is_same_v<T, float>) return npy_bytes(shape, data.data());
  else return npy_bytes(shape, data.data(), DType::F64);
}

// Runs the layer on this rank and returns the files (on rank 0; none elsewhere).
template <class T>
std::vector<std::pair<std::string, std::string>> compute(const Inputs& in, Communicator& comm, const Mamba2Plan& plan) {
  const Mamba2Shape& s = in.shape;
  const int64_t S = in.row.tokens(), H = s.heads, P = s.head_dim, G = s.groups, N = s.state_dim;
  const auto& mine = plan.tokens[static_cast<size_t>(comm.rank())];
  const auto x = rows_of<T>(in.x.data, H * P, mine), dt = rows_of<T>(in.dt.data, H, mine),
             b = rows_of<T>(in.b.data, G * N, mine), c = rows_of<T>(in.c.data, G * N, mine);
  const auto a = values<T>(in.a), d = in.has_d ? values<T>(in.d) : std::vector<T>();
  Mamba2CP<T> cp(plan, in.row, s, comm);
  const int64_t rows = cp.owned_rows();
  std::vector<T> y(static_cast<size_t>(rows * H * P));
  cp.forward(Mamba2Inputs<T>{x.data(), dt.data(), b.data(), c.data(), a.data(), in.has_d ? d.data() : nullptr},
             y.data());
  std::vector<T> dx(x.size()), ddt(dt.size()), db(b.size()), dc(c.size()), da(static_cast<size_t>(H)),
      dd(static_cast<size_t>(H));
  if (in.has_dout) {
    cp.backward(rows_of<T>(in.dout.data, H * P, mine).data(),
                Mamba2Grads<T>{dx.data(), ddt.data(), da.data(), db.data(), dc.data(), dd.data()});
    // A and D are replicated over the ranks: their gradients are the sum of every rank's part.
    comm.all_reduce_sum(da.data(), H, CpuBackend<T>::comm_type);
    comm.all_reduce_sum(dd.data(), H, CpuBackend<T>::comm_type);
  }
  CpuBackend<T> be;
  auto gather = [&](const std::vector<T>& v, int64_t width) { return gather_to_root(comm, be, v, plan.tokens, width); };
  std::vector<std::pair<std::string, std::string>> files;
  const auto y0 = gather(y, H * P);
  files.emplace_back("y.npy", npy_of<T>({S, H, P}, y0));
  if (in.has_dout) {
    const auto dx0 = gather(dx, H * P), ddt0 = gather(ddt, H), db0 = gather(db, G * N), dc0 = gather(dc, G * N);
    files.emplace_back("dx.npy", npy_of<T>({S, H, P}, dx0));
    files.emplace_back("ddt.npy", npy_of<T>({S, H}, ddt0));
    files.emplace_back("da.npy", npy_of<T>({H}, da));
    files.emplace_back("db.npy", npy_of<T>({S, G, N}, db0));
    files.emplace_back("dc.npy", npy_of<T>({S, G, N}, dc0));
    if (in.has_d) files.emplace_back("dd.npy", npy_of<T>({H}, dd));
  }
  if (comm.rank() != 0) files.clear();
  return files;
}

int execute(Communicator& comm, const Inputs& in, OutputDir* out) {
  const Ownership tokens = plan_ownership(make_plan(in.row, comm.size(), AttentionShape{}, CostModel{}, in.attention));
  const Mamba2Plan plan = plan_mamba2(in.row, tokens, in.shape, in.costs, in.force);
  const OutputFiles files = in.dtype == DType::F64 ? compute<double>(in, comm, plan) : compute<float>(in, comm, plan);
  if (comm.rank() != 0) return 0;
  for (const auto& [name, bytes] : files) out->write(name, bytes);
  out->commit();
  char how[256];
  std::snprintf(how, sizeof how, "%s, %s (predicted %.3f ms; transpose %.3f ms, %lld bytes; summary %.3f ms, %lld bytes)",
                count_of(comm.size(), "rank").c_str(), strategy_name(plan.strategy), plan.price().ms,
                plan.transpose_price.ms, static_cast<long long>(plan.transpose_price.bytes), plan.summary_price.ms,
                static_cast<long long>(plan.summary_price.bytes));
  const Mamba2Shape& s = in.shape;
  std::printf("mamba2: %s, H %d, P %d, G %d, N %d, %s%s, %s: wrote %s to %s\n", count_of(in.row.tokens(), "token").c_str(),
              s.heads, s.head_dim, s.groups, s.state_dim, dtype_name(in.dtype), in.has_dout ? ", with backward" : "", how,
              count_of(static_cast<int64_t>(files.size()), "file").c_str(), in.out_dir.c_str());
  return 0;
}

int mamba2_cmd(const std::vector<std::string>& argv) {
  return run_file_command<Inputs>("mamba2", argv, declare_options, kOutputs, prepare, execute);
}

const Register kMamba2("mamba2",
                       "--tree T.json --x X.npy --dt DT.npy --a A.npy --b B.npy --c C.npy [--d D.npy] [--dout DO.npy] "
                       "[--ranks N] [--timeout S] [--strategy transpose|summary|auto] [--layout L] [--chunk C] "
                       "[--costs FILE] --out DIR",
                       "the Mamba-2 scan over the tree, in one process or as CP over N ranks; writes y (and dx, ddt, "
                       "da, db, dc, dd with --dout)",
                       mamba2_cmd);

}  // namespace
}  // namespace treecp::cli
