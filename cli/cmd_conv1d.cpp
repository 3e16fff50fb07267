// treecp conv1d: causal depthwise conv1d (optional SiLU) over a packed tree, forward and, with
// --dout, backward; on one process or N ranks (contiguous shards, halos along logical paths).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "command.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "core/npy.hpp"
#include "launcher.hpp"
#include "runtime/conv_cp.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/redistribute.hpp"
#include "tree/row.hpp"

namespace treecp::cli {
namespace {

struct ConvInputs {
  Row row;
  NpyArray x, weight, bias, dout;
  bool has_bias = false, has_dout = false;
  int64_t S = 0;
  int C = 0, K = 0;
};

ConvInputs load_inputs(const Args& args) {
  ConvInputs in;
  in.row = load_row(args.get("--tree"));
  in.S = in.row.tokens();
  in.x = load_npy(args.get("--x"));
  require(in.x.shape.size() == 2 && in.x.shape[0] == in.S && in.x.shape[1] >= 1, "x: expected [S, C] with S = ",
          in.S, " tokens of the tree, got ", in.x.shape_string());
  in.C = static_cast<int>(in.x.shape[1]);
  in.weight = load_npy(args.get("--weight"));
  // [C, K], or PyTorch's depthwise [C, 1, K].
  const auto& ws = in.weight.shape;
  const bool ok = (ws.size() == 2 && ws[0] == in.C) || (ws.size() == 3 && ws[0] == in.C && ws[1] == 1);
  require(ok && ws.back() >= 1 && ws.back() <= 64, "weight: expected [", in.C, ", K] or [", in.C,
          ", 1, K] with 1 <= K <= 64, got ", in.weight.shape_string());
  in.K = static_cast<int>(ws.back());
  in.has_bias = args.has("--bias");
  if (in.has_bias) {
    in.bias = load_npy(args.get("--bias"));
    require_shape(in.bias, "bias", {in.C});
  }
  in.has_dout = args.has("--dout");
  if (in.has_dout) {
    in.dout = load_npy(args.get("--dout"));
    require_shape(in.dout, "dout", {in.S, in.C});
  }
  return in;
}

template <class T>
int run_typed(Communicator& comm, const ConvInputs& in, bool silu, const std::string& out_dir) {
  const int N = comm.size();
  const Ownership layout = contiguous_ownership(in.S, N);
  const auto& mine = layout[comm.rank()];
  const std::vector<T> x = rows_of<T>(in.x.data, in.C, mine);
  const std::vector<T> w(in.weight.data.begin(), in.weight.data.end());
  const std::vector<T> b(in.bias.data.begin(), in.bias.data.end());
  const std::vector<T>* bias = in.has_bias ? &b : nullptr;
  CpuBackend<T> be;
  ConvCP<CpuBackend<T>> conv(layout, in.row, ConvShape{in.C, in.K, silu}, comm, be);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<T> y(x.size());
  conv.forward(x, w, bias, y);
  struct Out { std::string name; std::vector<int64_t> shape; std::vector<double> data; };
  std::vector<Out> outs;
  auto gather = [&](const std::vector<T>& a) {
    const std::vector<T> all = gather_to_root(comm, be, a, layout, in.C);
    return std::vector<double>(all.begin(), all.end());
  };
  outs.push_back({"y.npy", in.x.shape, gather(y)});
  if (in.has_dout) {
    std::vector<T> dx(x.size()), dw(w.size()), db(b.size());
    conv.backward(rows_of<T>(in.dout.data, in.C, mine), dx, dw, in.has_bias ? &db : nullptr);
    outs.push_back({"dx.npy", in.x.shape, gather(dx)});
    outs.push_back({"dweight.npy", in.weight.shape, std::vector<double>(dw.begin(), dw.end())});
    if (in.has_bias) outs.push_back({"dbias.npy", in.bias.shape, std::vector<double>(db.begin(), db.end())});
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (comm.rank() != 0) return 0;
  std::filesystem::create_directories(out_dir);
  const DType dtype = sizeof(T) == 8 ? DType::F64 : DType::F32;
  for (const Out& o : outs) write_output((std::filesystem::path(out_dir) / o.name).string(), npy_bytes(o.shape, o.data.data(), dtype));
  std::printf("conv1d %s: %lld tokens, %d segments, %d channels, width %d%s, %d rank%s; %s %.3f ms\n",
              sizeof(T) == 8 ? "double" : "float", static_cast<long long>(in.S), in.row.num_segments(), in.C, in.K,
              silu ? ", SiLU" : "", N, N == 1 ? "" : "s", in.has_dout ? "forward+backward" : "forward", ms);
  return 0;
}

int conv1d_main(const std::vector<std::string>& argv) {
  Args args("conv1d", argv);
  args.value("--tree").value("--x").value("--weight").value("--bias").value("--dout").value("--ranks").value("--out")
      .flag("--silu");
  args.parse();
  const int64_t ranks = args.get_int_or("--ranks", 1);
  require(ranks >= 1 && ranks <= 256, "--ranks must be in [1, 256], got ", ranks);
  const std::string out_dir = args.get("--out");
  // Refuse bad inputs here, in one line, rather than from every rank under mpirun.
  if (ranks > 1 && !started_under_mpi()) load_inputs(args);
  if (int rc = 0; relaunch_under_mpi("conv1d", static_cast<int>(ranks), argv, &rc)) return rc;

  RankGroup group(ranks);
  return group.run([&](Communicator& world) {
    Communicator* comm = &world;
    const ConvInputs in = load_on_every_rank(*comm, [&] { return load_inputs(args); });
    return in.x.dtype == DType::F64 ? run_typed<double>(*comm, in, args.get_flag("--silu"), out_dir)
                                    : run_typed<float>(*comm, in, args.get_flag("--silu"), out_dir);
  });
}

const Register kConv1d("conv1d",
                       "--tree T.json --x X.npy --weight W.npy [--bias B.npy] [--silu] [--dout DO.npy] [--ranks N] "
                       "--out DIR: causal depthwise conv1d over the tree (x [S,C], weight [C,K]); writes y.npy and "
                       "with --dout dx, dweight, dbias",
                       conv1d_main);

}  // namespace
}  // namespace treecp::cli
