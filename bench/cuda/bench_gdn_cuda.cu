// Benchmark of the CUDA GDN / KDA chunk kernels (not a test): T tokens (default 40,960) in `docs` equal runs
// (default 1) from zero states, H = 32, dk = dv = 128, bf16 inputs. For each gate: a check of the forward's first
// 128 tokens of two heads against the CPU double recurrence, then forward and forward+backward timed with CUDA
// events (3 warm-up calls, median of --reps) at 32 and at 16 state columns per scan block, with the scans' products
// as register-blocked fp32 FMA and on tensor cores (GdnCudaParams::tensor_cores), and with prep's and the gradients'
// products on bf16 tensor cores (GdnPrecision::bf16_tensor; bf16_tensor_scans: the scans too), with the split forward
// (GdnCudaParams::split_forward), the effective TFLOP/s, and the time of each kernel in one forward and one backward
// (default columns, each path). Forward+backward includes zeroing the fp32 gradients (the contract adds into them).
// FLOPs (gdn_chunk_flops): the chunked form's useful multiply-adds x 2 per (chunk of c tokens, head):
//   P and C (lower triangles) 2 c^2 dk, the triangular solve for U and W c^2 (dk + dv), D = U - W S, Qst S and
//   Rᵀ D 6 c dk dv, C D c^2 dv; the backward counted as twice the forward (forward+backward = 3x).
// --fla 1 adds the FLA-like split forward (GdnCudaParams::fla_split, scalar gate only: bf16 products throughout, the
// scan's state in mma fragments) at 32, 64 and 16 columns; --fla only runs that path alone (the GDN rows only). Its
// per-kernel rows are "gdn fla prep", "gdn fla scan" and "gdn fla output"; its backward is the split backward
// (gdn_fla_bwd_device.cuh: the prep and scan again, then "gdn fla bwd local", "gdn fla bwd scan", "gdn fla bwd grads").
// The path "kept for bwd" (32 columns) runs the forward with keep_forward, whose backward skips the prep and the scan.
// Usage: bench_gdn_cuda [--tokens T] [--docs N] [--heads H] [--dim D] [--reps R] [--fla 0|1|only]
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/gdn.hpp"
#include "kernels/cuda/gdn.hpp"
#include "kernels/cuda/gdn_device.cuh"
#include "kernels/cuda/memory.hpp"
#include "timing.hpp"

using namespace treecp;
using namespace treecp::cuda;
using namespace treecp::cuda::bench;

namespace {

double gdn_chunk_flops(const std::vector<GdnCudaRun>& runs, int heads, int dk, int dv) {
  double f = 0;
  for (const GdnCudaRun& r : runs)
    for (int64_t t = r.t0; t < r.t1; t += cuda::detail::kGdnChunk) {
      const double c = static_cast<double>(std::min<int64_t>(cuda::detail::kGdnChunk, r.t1 - t));
      f += 2 * c * c * dk + c * c * (dk + dv) + 6 * c * dk * dv + c * c * dv;
    }
  return f * heads;
}

// x = a x + b, bf16 in place (fill_uniform gives [-1, 1)).
__global__ void affine_bf16(uint16_t* x, int64_t n, float a, float b) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = cuda::detail::float_to_bf16(a * cuda::detail::bf16_to_float(x[i]) + b);
}

void* alloc(size_t bytes) {
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
}

void fill(void* p, int64_t n, uint64_t seed, float a, float b) {
  fill_uniform(static_cast<uint16_t*>(p), n, seed, 0, nullptr);
  affine_bf16<<<1024, 256>>>(static_cast<uint16_t*>(p), n, a, b);
  check_cuda(cudaGetLastError(), "affine_bf16");
}

template <class T>
std::vector<T> download(const void* p, size_t n) {
  std::vector<T> h(n);
  check_cuda(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return h;
}

// Each launch between two events, summed by kernel (the per-kernel table).
struct TimedExec {
  cuda::detail::GdnDeviceExec x{nullptr};
  std::vector<std::pair<std::string, std::pair<cudaEvent_t, cudaEvent_t>>> spans;
  template <class K>
  void launch(int64_t blocks, const typename K::Args& a) {
    cudaEvent_t b, e;
    check_cuda(cudaEventCreate(&b), "event");
    check_cuda(cudaEventCreate(&e), "event");
    check_cuda(cudaEventRecord(b), "record");
    x.template launch<K>(blocks, a);
    check_cuda(cudaEventRecord(e), "record");
    spans.push_back({K::kName, {b, e}});
  }
  void upload(void* dst, const void* src, size_t bytes) { x.upload(dst, src, bytes); }
  std::map<std::string, double> collect() {
    check_cuda(cudaDeviceSynchronize(), "sync");
    std::map<std::string, double> ms;
    for (auto& [name, ev] : spans) {
      float t = 0;
      check_cuda(cudaEventElapsedTime(&t, ev.first, ev.second), "elapsed");
      ms[name] += t;
      cudaEventDestroy(ev.first);
      cudaEventDestroy(ev.second);
    }
    spans.clear();
    return ms;
  }
};

}  // namespace

int main(int argc, char** argv) {
  int64_t T = 40960;
  int docs = 1, H = 32, D = 128, reps = 10;
  std::string fla = "0";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--tokens") T = std::stoll(argv[i + 1]);
    else if (a == "--docs") docs = std::stoi(argv[i + 1]);
    else if (a == "--heads") H = std::stoi(argv[i + 1]);
    else if (a == "--dim") D = std::stoi(argv[i + 1]);
    else if (a == "--reps") reps = std::stoi(argv[i + 1]);
    else if (a == "--fla") fla = argv[i + 1];
    else {
      std::fprintf(stderr, "bench_gdn_cuda: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  try {
    require(T >= 128 && docs >= 1 && docs <= T && H >= 2 && reps >= 1, "bench_gdn_cuda: bad sizes");
    require(fla == "0" || fla == "1" || fla == "only", "bench_gdn_cuda: --fla takes 0, 1 or only, got ", fla);
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, 0), "device properties");
    std::vector<GdnCudaRun> runs;
    for (int d = 0; d < docs; ++d) runs.push_back({T * d / docs, T * (d + 1) / docs, -1, -1});
    const double fwd_flops = gdn_chunk_flops(runs, H, D, D);
    std::printf("GDN / KDA chunk kernels on %s: T = %lld in %d run(s), H = %d, dk = dv = %d, bf16 in, fp32 states\n",
                prop.name, static_cast<long long>(T), docs, H, D);
    std::printf("| gate | scan columns | products | check y (first 128 tokens, 2 heads) | forward ms | TFLOP/s | fwd+bwd ms | TFLOP/s |\n");
    std::printf("|---|---|---|---|---|---|---|---|\n");
    std::vector<std::pair<std::string, std::map<std::string, double>>> breakdowns;
    for (const GdnGate gate : {GdnGate::Scalar, GdnGate::PerChannel}) {
      if (fla == "only" && gate != GdnGate::Scalar) continue;
      const int64_t nqk = T * H * D, ng = gate == GdnGate::Scalar ? T * H : T * H * D;
      GdnCudaParams p;
      p.tokens = T; p.heads = H; p.dk = D; p.dv = D; p.gate = gate;
      p.scale = static_cast<float>(1.0 / std::sqrt(D));
      p.q = alloc(nqk * 2); p.k = alloc(nqk * 2); p.v = alloc(nqk * 2); p.g = alloc(ng * 2); p.beta = alloc(T * H * 2);
      const float unit = static_cast<float>(std::sqrt(3.0 / D));  // |q|^2, |k|^2 about 1
      fill(const_cast<void*>(p.q), nqk, 1, unit, 0.f);
      fill(const_cast<void*>(p.k), nqk, 2, unit, 0.f);
      fill(const_cast<void*>(p.v), nqk, 3, 1.f, 0.f);
      fill(const_cast<void*>(p.g), ng, 4, 0.25f, -0.25f);         // log-decay in [-0.5, 0)
      fill(const_cast<void*>(p.beta), T * H, 5, 0.45f, 0.5f);     // beta in [0.05, 0.95)
      p.y = alloc(nqk * 2);
      p.state_out = nullptr;
      p.workspace_bytes = gdn_workspace_bytes(p, runs, true);
      p.workspace = alloc(p.workspace_bytes);
      GdnCudaGrads g;
      void* dy = alloc(nqk * 2);
      fill(dy, nqk, 6, 1.f, 0.f);
      g.dy = dy;
      float* grads[5] = {static_cast<float*>(alloc(nqk * 4)), static_cast<float*>(alloc(nqk * 4)),
                         static_cast<float*>(alloc(nqk * 4)), static_cast<float*>(alloc(ng * 4)),
                         static_cast<float*>(alloc(T * H * 4))};
      g.dq = grads[0]; g.dk = grads[1]; g.dv = grads[2]; g.dg = grads[3]; g.dbeta = grads[4];
      const int64_t sizes[5] = {nqk, nqk, nqk, ng, T * H};
      auto forward = [&] { gdn_forward(p, runs); };
      auto fwd_bwd = [&] {
        gdn_forward(p, runs);
        for (int i = 0; i < 5; ++i) check_cuda(cudaMemsetAsync(grads[i], 0, sizes[i] * 4), "memset");
        gdn_backward(p, runs, g);
      };
      const int64_t n = 128;
      auto wide = [](const std::vector<uint16_t>& b) {
        std::vector<double> o(b.size());
        for (size_t i = 0; i < b.size(); ++i) o[i] = cuda::detail::bf16_to_float(b[i]);
        return o;
      };
      const auto q = wide(download<uint16_t>(p.q, n * H * D)), k = wide(download<uint16_t>(p.k, n * H * D)),
                 v = wide(download<uint16_t>(p.v, n * H * D)), gg = wide(download<uint16_t>(p.g, ng / T * n)),
                 beta = wide(download<uint16_t>(p.beta, n * H));
      GdnParams<double> cp;
      cp.q = q.data(); cp.k = k.data(); cp.v = v.data(); cp.g = gg.data(); cp.beta = beta.data();
      cp.tokens = n; cp.shape = GdnShape{H, D, D, gate, p.scale, 64};
      std::vector<double> yr(n * H * D, 0.0);
      const int64_t checked = std::min<int64_t>(n, runs[0].t1);
      for (int h = 0; h < 2; ++h) {
        std::vector<double> s(static_cast<size_t>(D) * D, 0.0);
        gdn_recurrent_forward(cp, h, 0, checked, s.data(), yr.data());
      }
      // Check: the first 128 tokens of heads 0 and 1 (the first run's) against the double recurrence.
      auto check_y = [&] {
        forward();
        check_cuda(cudaDeviceSynchronize(), "forward");
        const auto y = wide(download<uint16_t>(p.y, n * H * D));
        double num = 0, den = 0;
        for (int h = 0; h < 2; ++h)
          for (int64_t t = 0; t < checked; ++t)
            for (int e = 0; e < D; ++e) {
              const int64_t i = (t * H + h) * D + e;
              num += (y[i] - yr[i]) * (y[i] - yr[i]);
              den += yr[i] * yr[i];
            }
        return std::sqrt(num / den);
      };
      const char* name = gate == GdnGate::Scalar ? "GDN (scalar)" : "KDA (per channel)";
      // The paths: 3xTF32 everywhere, bf16 products (prep and gradients, or everywhere), the split forward.
      struct Path {
        bool tensor;
        GdnPrecision precision;
        bool split;
        const char* label;
        bool fla = false;
        bool keep = false;  // keep_forward: the backward reads the forward's arrays instead of recomputing them
      };
      constexpr GdnPrecision f32 = GdnPrecision::fp32, b16 = GdnPrecision::bf16_tensor,
                             b16s = GdnPrecision::bf16_tensor_scans;
      std::vector<Path> paths;
      if (fla != "only")
        paths = {{false, f32, false, "fp32 FMA"},
                 {true, f32, false, "3xTF32 mma"},
                 {false, b16, false, "bf16 mma prep+grads"},
                 {false, f32, true, "fp32 FMA, split forward"},
                 {false, b16, true, "bf16 mma prep+grads, split fwd"},
                 {false, b16s, true, "bf16 mma all, split fwd"}};
      if (fla != "0" && gate == GdnGate::Scalar) {
        paths.push_back({false, b16s, false, "bf16 mma all, FLA split fwd", true});
        paths.push_back({false, b16s, false, "FLA split fwd, kept for bwd", true, true});
      }
      auto set_path = [&](const Path& x) {
        p.tensor_cores = x.tensor;
        p.precision = x.precision;
        p.split_forward = x.split;
        p.fla_split = x.fla;
        p.keep_forward = x.keep;
      };
      for (const Path& path : paths)
        for (const int cols : path.keep  ? std::vector<int>{32}
                              : path.fla ? std::vector<int>{32, 64, 16}
                                         : std::vector<int>{32, 16}) {
          p.scan_columns = cols;
          set_path(path);
          const double err = check_y();
          const double t_fwd = time_ms(reps, forward), t_fb = time_ms(reps, fwd_bwd);
          // the gradients are finite
          for (int i = 0; i < 5; ++i) {
            const auto h = download<float>(grads[i], std::min<int64_t>(sizes[i], 1 << 20));
            for (float x : h) require(std::isfinite(x), "bench_gdn_cuda: a non-finite gradient");
          }
          std::printf("| %s | %d | %s | %.2e | %.3f | %.1f | %.3f | %.1f |\n", name, cols,
                      path.label, err, t_fwd, fwd_flops / t_fwd * 1e-9, t_fb,
                      3 * fwd_flops / t_fb * 1e-9);
        }
      p.scan_columns = 0;
      for (const Path& path : paths) {
        set_path(path);
        TimedExec tx;
        cuda::detail::gdn_forward_on(tx, p, runs);
        auto fwd_parts = tx.collect();
        cuda::detail::gdn_backward_on(tx, p, runs, g);
        auto bwd_parts = tx.collect();
        std::map<std::string, double> parts;
        for (auto& [k2, ms] : fwd_parts) parts["forward: " + k2] = ms;
        for (auto& [k2, ms] : bwd_parts) parts["backward: " + k2] = ms;
        char ws[64];  // the forward's workspace on this path (the split forward keeps S0 and D)
        std::snprintf(ws, sizeof(ws), " (fwd workspace %.2f GB)", gdn_workspace_bytes(p, runs, GdnCallKind::forward) * 1e-9);
        breakdowns.push_back({std::string(name) + ", " + path.label + ws, parts});
      }
      for (const void* ptr : {p.q, p.k, p.v, p.g, p.beta, static_cast<const void*>(p.y), static_cast<const void*>(p.workspace),
                              static_cast<const void*>(dy)})
        check_cuda(cudaFree(const_cast<void*>(ptr)), "cudaFree");
      for (float* ptr : grads) check_cuda(cudaFree(ptr), "cudaFree");
    }
    std::printf("\nper kernel, one call each (ms):\n");
    for (auto& [name, parts] : breakdowns)
      for (auto& [k2, ms] : parts) std::printf("  %-62s %-30s %8.3f\n", name.c_str(), k2.c_str(), ms);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gdn_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
