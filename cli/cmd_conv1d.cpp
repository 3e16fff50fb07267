// treecp conv1d: causal depthwise conv1d (optional SiLU) over a packed tree, forward and, with
// --dout, backward; on one process or N ranks (contiguous shards, halos along logical paths).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>

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
#include "runtime/redistribute.hpp"
#include "tree/row.hpp"

namespace treecp::cli {
namespace {

struct ConvInputs {
  RankOptions ranks;
  std::string out_dir;
  bool silu = false;
  Row row;
  NpyArray x, weight, bias, dout;
  bool has_bias = false, has_dout = false;
  int64_t S = 0;
  int C = 0, K = 0;
  bool gpu = false;  // --device cuda
  cuda::DType dtype = cuda::DType::kBf16;  // --dtype (GPU: the inputs rounded to it on upload)
};

// Every file the command may write; those a run does not write are removed from --out at commit.
const std::vector<std::string> kOutputs = {"y.npy", "dx.npy", "dweight.npy", "dbias.npy"};

void declare_options(Args& args) {
  declare_rank_options(args);
  args.value("--tree").value("--x").value("--weight").value("--bias").value("--dout").value("--out").value("--device").value("--dtype").flag("--silu");
}

// Every option and input checked, with the same dtype, finite and range rules as `treecp attention`:
// the launcher calls it before any rank starts, and every rank again on the same files.
ConvInputs prepare(const Args& args) {
  ConvInputs in;
  in.ranks = rank_options(args, 1);
  in.gpu = args.get_choice("--device", "cpu", {"cpu", "cuda"}) == "cuda";
  if (in.gpu) require(gpu_support(), "--device cuda: this treecp was built without CUDA and NCCL");
  in.dtype = layer_gpu_dtype(args, in.gpu);
  in.out_dir = args.get("--out");
  in.silu = args.get_flag("--silu");
  in.row = load_row(args.get("--tree"));
  in.S = in.row.tokens();
  in.x = load_npy(args.get("--x"));
  require(in.x.shape.size() == 2 && in.x.shape[0] == in.S, "x: expected [S, C] with S = ", in.S,
          " tokens of the tree, got ", in.x.shape_string());
  const DType dtype = in.x.dtype;
  in.C = require_dim(in.x, "x", 1, "C", 1, Row::kMaxTokens);
  in.weight = load_npy(args.get("--weight"));
  require_same_dtype(in.weight, "weight", in.x, "x");
  // [C, K], or PyTorch's depthwise [C, 1, K].
  const auto& ws = in.weight.shape;
  const bool ok = (ws.size() == 2 && ws[0] == in.C) || (ws.size() == 3 && ws[0] == in.C && ws[1] == 1);
  require(ok && ws.back() >= 1 && ws.back() <= 64, "weight: expected [", in.C, ", K] or [", in.C,
          ", 1, K] with 1 <= K <= 64, got ", in.weight.shape_string());
  in.K = static_cast<int>(ws.back());
  in.has_bias = args.has("--bias");
  if (in.has_bias) {
    in.bias = load_npy(args.get("--bias"));
    require_same_dtype(in.bias, "bias", in.x, "x");
    require_shape(in.bias, "bias", {in.C});
  }
  in.has_dout = args.has("--dout");
  if (in.has_dout) {
    in.dout = load_npy(args.get("--dout"));
    require_same_dtype(in.dout, "dout", in.x, "x");
    require_shape(in.dout, "dout", {in.S, in.C});
  }
  require_finite(in.x, "x");
  require_finite(in.weight, "weight");
  if (in.has_bias) require_finite(in.bias, "bias");
  if (in.has_dout) require_finite(in.dout, "dout");
  for (const auto& [a, name] : {std::pair{&in.x, "x"}, {&in.weight, "weight"}, {&in.bias, "bias"}})
    require_fits(in.dtype, *a, name);  // dout stays fp32 on the GPU
  const int64_t inputs = in.x.numel() + in.weight.numel() + in.bias.numel() + in.dout.numel();
  const int64_t outputs = in.x.numel() + (in.has_dout ? inputs - in.dout.numel() : 0);
  require_memory(arrays_memory_bytes(in.ranks.count, inputs, outputs, dtype == DType::F64 ? 8 : 4),
                 count_of(in.ranks.count, "rank") + " of conv1d on " + count_of(in.S, "token"));
  return in;
}

template <class T>
int run_typed(Communicator& comm, const ConvInputs& in, OutputDir* out) {
  const bool silu = in.silu;
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
  const DType dtype = sizeof(T) == 8 ? DType::F64 : DType::F32;
  for (const Out& o : outs) out->write(o.name, npy_bytes(o.shape, o.data.data(), dtype));
  out->commit();
  std::printf("conv1d %s: %s, %s, %s, width %d%s, %s; %s %.3f ms\n", sizeof(T) == 8 ? "double" : "float",
              count_of(in.S, "token").c_str(), count_of(in.row.num_segments(), "segment").c_str(),
              count_of(in.C, "channel").c_str(), in.K, silu ? ", SiLU" : "", count_of(N, "rank").c_str(),
              in.has_dout ? "forward+backward" : "forward", ms);
  return 0;
}

// The GPU path: the same ownership, the same outputs, written as float32.
int run_gpu(Communicator& comm, const ConvInputs& in, OutputDir* out) {
  const int N = comm.size();
  const Ownership layout = contiguous_ownership(in.S, N);
  const ConvArrays arrays{&in.x.data, &in.weight.data, in.has_bias ? &in.bias.data : nullptr,
                          in.has_dout ? &in.dout.data : nullptr};
  const GpuLayerResult r = conv1d_on_gpus(comm, in.row, ConvShape{in.C, in.K, in.silu}, layout, arrays,
                                          in.ranks.timeout_s, in.dtype);
  if (comm.rank() != 0) return 0;
  std::vector<std::pair<std::string, std::vector<int64_t>>> files = {
      {"y.npy", in.x.shape}, {"dx.npy", in.x.shape}, {"dweight.npy", in.weight.shape}, {"dbias.npy", in.bias.shape}};
  for (size_t i = 0; i < r.outputs.size(); ++i)
    out->write(files[i].first, npy_bytes(files[i].second, r.outputs[i].data(), DType::F32));
  out->commit();
  std::printf("conv1d %s on %s: %s, %s, %s, width %d%s; forward %.3f ms", cuda::dtype_name(in.dtype),
              count_of(N, "GPU").c_str(),
              count_of(in.S, "token").c_str(), count_of(in.row.num_segments(), "segment").c_str(),
              count_of(in.C, "channel").c_str(), in.K, in.silu ? ", SiLU" : "", r.forward_ms);
  if (in.has_dout) std::printf(", backward %.3f ms", r.backward_ms);
  std::printf("\n");
  return 0;
}

int execute(Communicator& comm, const ConvInputs& in, OutputDir* out) {
  if (in.gpu) return run_gpu(comm, in, out);
  return in.x.dtype == DType::F64 ? run_typed<double>(comm, in, out) : run_typed<float>(comm, in, out);
}

int conv1d_main(const std::vector<std::string>& argv) {
  return run_file_command<ConvInputs>("conv1d", argv, declare_options, kOutputs, prepare, execute);
}

const Register kConv1d("conv1d",
                       "--tree T.json --x X.npy --weight W.npy [--bias B.npy] [--silu] [--dout DO.npy] [--ranks N] "
                       "[--timeout S] [--device cpu|cuda] [--dtype bf16|fp16] --out DIR",
                       "causal depthwise conv1d over the tree (x [S,C], weight [C,K]); writes y.npy (and dx, dweight, "
                       "dbias with --dout); --device cuda: bf16 (or --dtype fp16) on one GPU per rank",
                       conv1d_main);

}  // namespace
}  // namespace treecp::cli
