// treecp gdn: Gated DeltaNet / KDA forward (and backward with --dout) over a packed tree, on one
// process or on N ranks (--ranks N re-launches under mpirun). Every rank reads the inputs, plans the
// same way, runs its part; rank 0 gathers and writes the outputs.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "command.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "core/npy.hpp"
#include "launcher.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/gdn_cp.hpp"
#include "plan/gdn_plan.hpp"
#include "runtime/redistribute.hpp"
#include "tree/row.hpp"

namespace treecp::cli {
namespace {

struct GdnInputs {
  Row row;
  NpyArray q, k, v, g, beta, dout;
  bool has_dout = false;
  int64_t S = 0;
  int H = 0, dk = 0, dv = 0;
  GdnGate gate = GdnGate::Scalar;
  bool f64 = false;
};

// Loads and checks every input; the messages name the array and the expected shape.
GdnInputs load_inputs(const Args& args) {
  GdnInputs in;
  in.row = load_row(args.get("--tree"));
  in.S = in.row.tokens();
  in.q = load_npy(args.get("--q"));
  require(in.q.shape.size() == 3 && in.q.shape[0] == in.S, "q: expected [S, H, Dk] with S = ", in.S,
          " tokens of the tree, got ", in.q.shape_string());
  in.H = static_cast<int>(in.q.shape[1]);
  in.dk = static_cast<int>(in.q.shape[2]);
  require(in.H >= 1 && in.dk >= 1, "q: H and Dk must be >= 1, got ", in.q.shape_string());
  in.k = load_npy(args.get("--k"));
  require_shape(in.k, "k", {in.S, in.H, in.dk});
  in.v = load_npy(args.get("--v"));
  require(in.v.shape.size() == 3 && in.v.shape[0] == in.S && in.v.shape[1] == in.H && in.v.shape[2] >= 1,
          "v: expected [", in.S, ", ", in.H, ", Dv], got ", in.v.shape_string());
  in.dv = static_cast<int>(in.v.shape[2]);
  in.g = load_npy(args.get("--g"));
  if (in.g.shape == std::vector<int64_t>{in.S, in.H}) {
    in.gate = GdnGate::Scalar;
  } else if (in.g.shape == std::vector<int64_t>{in.S, in.H, in.dk}) {
    in.gate = GdnGate::PerChannel;
  } else {
    fail("g: expected [", in.S, ", ", in.H, "] (GDN) or [", in.S, ", ", in.H, ", ", in.dk, "] (KDA), got ",
         in.g.shape_string());
  }
  in.beta = load_npy(args.get("--beta"));
  require_shape(in.beta, "beta", {in.S, in.H});
  in.has_dout = args.has("--dout");
  if (in.has_dout) {
    in.dout = load_npy(args.get("--dout"));
    require_shape(in.dout, "dout", {in.S, in.H, in.dv});
  }
  in.f64 = in.q.dtype == DType::F64;
  return in;
}

template <class T>
int run_typed(Communicator& comm, const GdnInputs& in, double scale, int chunk, const std::string& out_dir) {
  const int N = comm.size(), me = comm.rank();
  const GdnShape shape{in.H, in.dk, in.dv, in.gate, scale, chunk};
  GdnCostModel costs;
  costs.state_bytes_per_element = sizeof(T);
  const GdnPlan plan = plan_gdn(in.row, N, shape, costs);  // fills the prediction
  const Ownership layout = gdn_ownership(in.row, plan);
  const auto& mine = layout[me];
  const std::vector<T> q = rows_of<T>(in.q.data, shape.qk_width(), mine), k = rows_of<T>(in.k.data, shape.qk_width(), mine),
                       v = rows_of<T>(in.v.data, shape.v_width(), mine), g = rows_of<T>(in.g.data, shape.g_width(), mine),
                       beta = rows_of<T>(in.beta.data, in.H, mine);
  CpuBackend<T> be;
  GdnCP<CpuBackend<T>> cp(plan, in.row, shape, comm, be);

  comm.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<T> y(v.size());
  cp.forward(q, k, v, g, beta, y);
  comm.barrier();
  const auto t1 = std::chrono::steady_clock::now();
  std::vector<T> dq(q.size()), dk(k.size()), dv(v.size()), dg(g.size()), dbeta(beta.size());
  if (in.has_dout) {
    cp.backward(rows_of<T>(in.dout.data, shape.v_width(), mine), dq, dk, dv, dg, dbeta);
    comm.barrier();
  }
  const auto t2 = std::chrono::steady_clock::now();

  // Gather everything first, write only when all of it is there.
  struct Out { std::string name; std::vector<int64_t> shape; std::vector<double> data; };
  std::vector<Out> outs;
  auto gather = [&](const std::vector<T>& a, int64_t width) {
    const std::vector<T> all = gather_to_root(comm, be, a, layout, width);
    return std::vector<double>(all.begin(), all.end());
  };
  outs.push_back({"o.npy", {in.S, in.H, in.dv}, gather(y, in.H * in.dv)});
  if (in.has_dout) {
    outs.push_back({"dq.npy", in.q.shape, gather(dq, in.H * in.dk)});
    outs.push_back({"dk.npy", in.k.shape, gather(dk, in.H * in.dk)});
    outs.push_back({"dv.npy", in.v.shape, gather(dv, in.H * in.dv)});
    outs.push_back({"dg.npy", in.g.shape, gather(dg, shape.g_width())});
    outs.push_back({"dbeta.npy", in.beta.shape, gather(dbeta, in.H)});
  }
  if (me != 0) return 0;
  std::filesystem::create_directories(out_dir);
  const DType dtype = sizeof(T) == 8 ? DType::F64 : DType::F32;
  for (const Out& o : outs) write_output((std::filesystem::path(out_dir) / o.name).string(), npy_bytes(o.shape, o.data.data(), dtype));
  const double fwd_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  const double bwd_ms = std::chrono::duration<double, std::milli>(t2 - t1).count();
  std::printf("gdn %s %s: %lld tokens, %d segments, H %d, dk %d, dv %d, %d rank%s, %d chained segment%s, "
              "%d DAG steps, predicted %.3f ms forward+backward; forward %.3f ms%s",
              in.gate == GdnGate::Scalar ? "(GDN gates)" : "(KDA gates)", sizeof(T) == 8 ? "double" : "float",
              static_cast<long long>(in.S), in.row.num_segments(), in.H, in.dk, in.dv, N, N == 1 ? "" : "s",
              plan.chained_segments(), plan.chained_segments() == 1 ? "" : "s", 2 * plan.num_phases - 1, plan.predicted_ms, fwd_ms,
              in.has_dout ? "" : "\n");
  if (in.has_dout) std::printf(", backward %.3f ms\n", bwd_ms);
  return 0;
}

int gdn_main(const std::vector<std::string>& argv) {
  Args args("gdn", argv);
  args.value("--tree").value("--q").value("--k").value("--v").value("--g").value("--beta").value("--scale")
      .value("--dout").value("--ranks").value("--out").value("--chunk");
  args.parse();
  const int64_t ranks = args.get_int_or("--ranks", 1);
  require(ranks >= 1 && ranks <= 256, "--ranks must be in [1, 256], got ", ranks);
  const int64_t chunk = args.get_int_or("--chunk", 64);
  require(chunk >= 1 && chunk <= 4096, "--chunk must be in [1, 4096], got ", chunk);
  const double scale = args.get_double_or("--scale", 1.0);
  const std::string out_dir = args.get("--out");
  // Refuse bad inputs here, in one line, rather than from every rank under mpirun.
  if (ranks > 1 && !started_under_mpi()) load_inputs(args);
  if (int rc = 0; relaunch_under_mpi("gdn", static_cast<int>(ranks), argv, &rc)) return rc;

  RankGroup group(ranks);
  return group.run([&](Communicator& world) {
    Communicator* comm = &world;
    const GdnInputs in = load_on_every_rank(*comm, [&] { return load_inputs(args); });
    return in.f64 ? run_typed<double>(*comm, in, scale, static_cast<int>(chunk), out_dir)
                  : run_typed<float>(*comm, in, scale, static_cast<int>(chunk), out_dir);
  });
}

const Register kGdn("gdn",
                    "--tree T.json --q Q.npy --k K.npy --v V.npy --g G.npy --beta B.npy [--scale X] [--dout DO.npy] "
                    "[--ranks N] [--chunk C] --out DIR: GDN (g [S,H]) / KDA (g [S,H,Dk]) over the tree; writes o.npy "
                    "and with --dout dq, dk, dv, dg, dbeta",
                    gdn_main);

}  // namespace
}  // namespace treecp::cli
