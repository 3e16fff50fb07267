// treecp gdn: Gated DeltaNet / KDA forward (and backward with --dout) over a packed tree, on one
// process or on N ranks (--ranks N re-launches under mpirun). Every rank reads the inputs, plans the
// same way, runs its part; rank 0 gathers and writes the outputs. --layout picks the GDN layout
// (searched by the cost model by default; --attention-layout names the attention layers' layout, whose
// token moves the search then prices). --device cuda runs each rank's part on
// its GPU (gpu.hpp: bf16 inputs, fp32 states and gradients; outputs written as float32).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include "arrays.hpp"
#include "checks.hpp"
#include "command.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "core/npy.hpp"
#include "gpu.hpp"
#include "launcher.hpp"
#include "output_dir.hpp"
#include "runtime/conv_cp.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/gdn_cp.hpp"
#include "runtime/redistribute.hpp"
#include "plan/gdn_plan.hpp"
#include "plan/planner.hpp"
#include "tree/row.hpp"

namespace treecp::cli {
namespace {

struct GdnInputs {
  RankOptions ranks;
  std::string out_dir;
  double scale = 1;
  int chunk = 64;
  Row row;
  NpyArray q, k, v, g, beta, dout;
  bool has_dout = false;
  int64_t S = 0;
  int H = 0, dk = 0, dv = 0;
  GdnGate gate = GdnGate::Scalar;
  bool f64 = false;
  bool gpu = false;  // --device cuda
  cuda::DType dtype = cuda::DType::kBf16;  // --dtype (GPU: the inputs rounded to it on upload)
  int reps = 1;      // --reps (GPU timing: the median after a warm-up)
  cuda::GdnPrecision precision = cuda::GdnPrecision::fp32;  // --precision (GPU: the chunk kernels' arithmetic)
  bool fla_split = false;  // --fla-split (GPU: the FLA-like split forward where the call qualifies)
  bool keep_forward = false;  // --keep-forward (GPU, with --fla-split: the backward reads the forward's arrays)
  GdnLayout layout = GdnLayout::Searched;  // --layout
  std::optional<Layout> attention;         // --attention-layout
};

// Every file the command may write; those a run does not write are removed from --out at commit.
const std::vector<std::string> kOutputs = {"o.npy", "dq.npy", "dk.npy", "dv.npy", "dg.npy", "dbeta.npy"};

void declare_options(Args& args) {
  declare_rank_options(args);
  args.value("--tree").value("--q").value("--k").value("--v").value("--g").value("--beta").value("--scale")
      .value("--dout").value("--out").value("--chunk").value("--device").value("--layout").value("--attention-layout")
      .value("--reps").value("--dtype").value("--precision").flag("--fla-split")
      .flag("--keep-forward");
}

// Every option and input checked, with the same dtype, finite and range rules as `treecp attention`:
// the launcher calls it before any rank starts, and every rank again on the same files.
GdnInputs prepare(const Args& args) {
  GdnInputs in;
  in.ranks = rank_options(args, 1);
  in.gpu = args.get_choice("--device", "cpu", {"cpu", "cuda"}) == "cuda";
  if (in.gpu) require(gpu_support(), "--device cuda: this treecp was built without CUDA and NCCL");
  require(in.gpu || !args.has("--reps"), "--reps goes with --device cuda");
  in.dtype = layer_gpu_dtype(args, in.gpu);
  in.reps = static_cast<int>(args.get_int_in("--reps", 1, 1, 1000));
  // --precision: the GPU chunk kernels' products (docs/kernels.md); the CPU ranks compute in the inputs' dtype.
  require(in.gpu || !args.has("--precision"), "--precision goes with --device cuda (on CPU ranks the inputs' npy "
          "dtype is the precision)");
  std::vector<std::string> names;
  for (const cuda::GdnPrecision p : cuda::kGdnPrecisions) names.push_back(cuda::gdn_precision_name(p));
  const std::string precision = args.get_choice("--precision", "fp32", names);
  for (const cuda::GdnPrecision p : cuda::kGdnPrecisions)
    if (precision == cuda::gdn_precision_name(p)) in.precision = p;
  require(in.dtype == cuda::DType::kBf16 || in.precision == cuda::GdnPrecision::fp32, "--precision ", precision,
          " needs --dtype bf16 (fp16 runs the fp32 products: the bf16 paths' intermediates could overflow fp16)");
  // --fla-split: the FLA-like split forward (CudaBackend::set_gdn_fla_split), all of whose products are bf16 tensor-core
  // ones; where a call does not qualify (KDA's per-channel gate, Dk or Dv not 64 or 128) the classic forward runs.
  in.fla_split = args.get_flag("--fla-split");
  require(in.gpu || !in.fla_split, "--fla-split goes with --device cuda");
  require(!in.fla_split || in.precision == cuda::GdnPrecision::bf16_tensor_scans,
          "--fla-split needs --precision bf16_tensor_scans (the split forward's products are all bf16 tensor-core "
          "ones), got --precision ", precision);
  // --keep-forward: the split forward keeps its arrays (3.5 GB a 40,960 tokens at H 32, Dk = Dv = 128) and the backward
  // reads them instead of running the split's prep and scan again (CudaBackend::set_gdn_keep_forward).
  in.keep_forward = args.get_flag("--keep-forward");
  require(!in.keep_forward || in.fla_split, "--keep-forward goes with --fla-split (it keeps the split forward's "
          "arrays for the backward)");
  in.chunk = static_cast<int>(args.get_int_in("--chunk", 64, 1, 4096));
  in.layout = parse_gdn_layout(args.get_choice("--layout", "searched", gdn_layout_names()));
  if (args.has("--attention-layout"))
    in.attention = parse_layout(args.get_choice("--attention-layout", "searched", layout_names()));
  in.scale = args.get_double_or("--scale", 1.0);
  require(std::isfinite(in.scale) && in.scale > 0, "option --scale must be a finite number > 0, got ", in.scale);
  in.out_dir = args.get("--out");
  in.row = load_row(args.get("--tree"));
  in.S = in.row.tokens();
  in.q = load_npy(args.get("--q"));
  require(in.q.shape.size() == 3 && in.q.shape[0] == in.S, "q: expected [S, H, Dk] with S = ", in.S,
          " tokens of the tree, got ", in.q.shape_string());
  const DType dtype = in.q.dtype;
  in.H = require_dim(in.q, "q", 1, "H", 1, 65536);
  in.dk = require_dim(in.q, "q", 2, "Dk", 1, 4096);
  in.k = load_npy(args.get("--k"));
  require_same_dtype(in.k, "k", in.q, "q");
  require_shape(in.k, "k", {in.S, in.H, in.dk});
  in.v = load_npy(args.get("--v"));
  require_same_dtype(in.v, "v", in.q, "q");
  require(in.v.shape.size() == 3 && in.v.shape[0] == in.S && in.v.shape[1] == in.H,
          "v: expected [", in.S, ", ", in.H, ", Dv], got ", in.v.shape_string());
  in.dv = require_dim(in.v, "v", 2, "Dv", 1, 4096);
  in.g = load_npy(args.get("--g"));
  require_same_dtype(in.g, "g", in.q, "q");
  if (in.g.shape == std::vector<int64_t>{in.S, in.H}) {
    in.gate = GdnGate::Scalar;
  } else if (in.g.shape == std::vector<int64_t>{in.S, in.H, in.dk}) {
    in.gate = GdnGate::PerChannel;
  } else {
    fail("g: expected [", in.S, ", ", in.H, "] (GDN) or [", in.S, ", ", in.H, ", ", in.dk, "] (KDA), got ",
         in.g.shape_string());
  }
  in.beta = load_npy(args.get("--beta"));
  require_same_dtype(in.beta, "beta", in.q, "q");
  require_shape(in.beta, "beta", {in.S, in.H});
  in.has_dout = args.has("--dout");
  if (in.has_dout) {
    in.dout = load_npy(args.get("--dout"));
    require_same_dtype(in.dout, "dout", in.q, "q");
    require_shape(in.dout, "dout", {in.S, in.H, in.dv});
  }
  require_finite(in.q, "q");
  require_finite(in.k, "k");
  require_finite(in.v, "v");
  require_finite_at_most(in.g, "g", 0.0, "g is the natural log of a decay in (0, 1]");
  require_finite(in.beta, "beta");
  if (in.has_dout) require_finite(in.dout, "dout");
  for (const auto& [a, name] : {std::pair{&in.q, "q"}, {&in.k, "k"}, {&in.v, "v"}, {&in.g, "g"}, {&in.beta, "beta"},
                                {&in.dout, "dout"}})
    require_fits(in.dtype, *a, name);
  in.f64 = dtype == DType::F64;
  const int64_t inputs = in.q.numel() + in.k.numel() + in.v.numel() + in.g.numel() + in.beta.numel() + in.dout.numel();
  const int64_t outputs = in.v.numel() + (in.has_dout ? inputs - in.dout.numel() : 0);
  // At least two dk x dv states per segment and head (the state a segment starts from, the one it ends
  // with) live somewhere in the job.
  const double states = 2.0 * in.row.num_segments() * in.H * double(in.dk) * in.dv * (in.f64 ? 8 : 4);
  require_memory(arrays_memory_bytes(in.ranks.count, inputs, outputs, in.f64 ? 8 : 4) + states,
                 count_of(in.ranks.count, "rank") + " of GDN on " + count_of(in.S, "token"));
  return in;
}

// The plan of --layout for N ranks (its prediction filled), with the attention layout's ownership when
// --attention-layout names one; every rank plans the same.
GdnPlan plan_layer(const GdnInputs& in, int N, const GdnShape& shape, int64_t state_bytes, int64_t activation_bytes) {
  GdnCostModel costs;
  costs.state_bytes_per_element = state_bytes;
  GdnPlanOptions options;
  options.layout = in.layout;
  options.activation_bytes_per_element = activation_bytes;
  if (in.attention) {
    PlanOptions attention;
    attention.layout = *in.attention;
    options.attention = plan_ownership(make_plan(in.row, N, AttentionShape{}, CostModel{}, attention));
  }
  return plan_gdn(in.row, N, shape, costs, options);
}

template <class T>
int run_typed(Communicator& comm, const GdnInputs& in, OutputDir* out) {
  const int N = comm.size(), me = comm.rank();
  const GdnShape shape{in.H, in.dk, in.dv, in.gate, in.scale, in.chunk};
  const GdnPlan plan = plan_layer(in, N, shape, sizeof(T), sizeof(T));
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
  outs.push_back({"o.npy", {in.S, in.H, in.dv}, gather(y, shape.v_width())});
  if (in.has_dout) {
    outs.push_back({"dq.npy", in.q.shape, gather(dq, shape.qk_width())});
    outs.push_back({"dk.npy", in.k.shape, gather(dk, shape.qk_width())});
    outs.push_back({"dv.npy", in.v.shape, gather(dv, shape.v_width())});
    outs.push_back({"dg.npy", in.g.shape, gather(dg, shape.g_width())});
    outs.push_back({"dbeta.npy", in.beta.shape, gather(dbeta, in.H)});
  }
  if (me != 0) return 0;
  const DType dtype = sizeof(T) == 8 ? DType::F64 : DType::F32;
  for (const Out& o : outs) out->write(o.name, npy_bytes(o.shape, o.data.data(), dtype));
  out->commit();
  const double fwd_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
  const double bwd_ms = std::chrono::duration<double, std::milli>(t2 - t1).count();
  std::printf("gdn %s %s: %s, %s, H %d, dk %d, dv %d, %s, layout %s, %s, %s, predicted %.3f ms forward+backward; "
              "forward %.3f ms%s",
              in.gate == GdnGate::Scalar ? "(GDN gates)" : "(KDA gates)", sizeof(T) == 8 ? "double" : "float",
              count_of(in.S, "token").c_str(), count_of(in.row.num_segments(), "segment").c_str(), in.H, in.dk, in.dv,
              count_of(N, "rank").c_str(), gdn_layout_name(plan.layout),
              count_of(plan.chained_segments(), "chained segment").c_str(),
              count_of(2 * plan.num_phases - 1, "DAG step").c_str(), plan.predicted_ms, fwd_ms, in.has_dout ? "" : "\n");
  if (in.has_dout) std::printf(", backward %.3f ms\n", bwd_ms);
  return 0;
}

// The GPU path: the same plan (fp32 states on the wire), the same outputs, written as float32.
int run_gpu(Communicator& comm, const GdnInputs& in, OutputDir* out) {
  const int N = comm.size();
  const GdnShape shape{in.H, in.dk, in.dv, in.gate, in.scale, in.chunk};
  const GdnPlan plan = plan_layer(in, N, shape, 4, 2);  // fp32 states, 16-bit activations
  const GdnArrays arrays{&in.q.data, &in.k.data, &in.v.data, &in.g.data, &in.beta.data,
                         in.has_dout ? &in.dout.data : nullptr};
  const GpuLayerResult r = gdn_on_gpus(comm, in.row, shape, plan, arrays, in.ranks.timeout_s, in.reps, in.dtype,
                                      in.precision, in.fla_split, in.keep_forward);
  if (comm.rank() != 0) return 0;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> files = {
      {"o.npy", {in.S, in.H, in.dv}}, {"dq.npy", in.q.shape}, {"dk.npy", in.k.shape},
      {"dv.npy", in.v.shape},          {"dg.npy", in.g.shape}, {"dbeta.npy", in.beta.shape}};
  for (size_t i = 0; i < r.outputs.size(); ++i)
    out->write(files[i].first, npy_bytes(files[i].second, r.outputs[i].data(), DType::F32));
  out->commit();
  std::printf("gdn %s %s (%s products%s%s) on %s: %s, %s, H %d, dk %d, dv %d, layout %s, %s, %s, forward %.3f ms",
              in.gate == GdnGate::Scalar ? "(GDN gates)" : "(KDA gates)", cuda::dtype_name(in.dtype),
              cuda::gdn_precision_name(in.precision), in.fla_split ? ", FLA-like split forward where it applies" : "",
              in.keep_forward ? ", kept for the backward" : "", count_of(N, "GPU").c_str(),
              count_of(in.S, "token").c_str(), count_of(in.row.num_segments(), "segment").c_str(), in.H, in.dk, in.dv,
              gdn_layout_name(plan.layout), count_of(plan.chained_segments(), "chained segment").c_str(),
              count_of(2 * plan.num_phases - 1, "DAG step").c_str(), r.forward_ms);
  if (in.has_dout) std::printf(", backward %.3f ms", r.backward_ms);
  if (in.reps > 1) std::printf(" (median of %d after a warm-up)", in.reps);
  std::printf("\n");
  return 0;
}

int execute(Communicator& comm, const GdnInputs& in, OutputDir* out) {
  if (in.gpu) return run_gpu(comm, in, out);
  return in.f64 ? run_typed<double>(comm, in, out) : run_typed<float>(comm, in, out);
}

int gdn_main(const std::vector<std::string>& argv) {
  return run_file_command<GdnInputs>("gdn", argv, declare_options, kOutputs, prepare, execute);
}

const Register kGdn("gdn",
                    "--tree T.json --q Q.npy --k K.npy --v V.npy --g G.npy --beta B.npy [--scale X] [--dout DO.npy] "
                    "[--ranks N] [--timeout S] [--chunk C] [--layout searched|contiguous|zigzag|doc-zigzag] "
                    "[--attention-layout L] [--device cpu|cuda] [--dtype bf16|fp16] "
                    "[--precision fp32|bf16_tensor|bf16_tensor_scans [--fla-split [--keep-forward]]] [--reps N] --out DIR",
                    "GDN (g [S,H]) / KDA (g [S,H,Dk]) over the tree; writes o.npy (and dq, dk, dv, dg, dbeta with "
                    "--dout); --device cuda: bf16 (or --dtype fp16) on one GPU per rank, fp32 products (or --precision "
                    "bf16_tensor[_scans]: bf16 tensor cores, faster, less exact; --fla-split with bf16_tensor_scans: the "
                    "FLA-like split forward for GDN at Dk, Dv 64 or 128; --keep-forward: its backward reads the forward's "
                    "arrays instead of computing them again) (--reps N: the median of N timed calls after "
                    "a warm-up)",
                    gdn_main);

}  // namespace
}  // namespace treecp::cli
