// Benchmark of the CUDA slice attention on the DESIGN.md presets (not a test).
// For each preset at CP1 (S = 40,960), Hq = 32, Hkv = 4, D = 128, bf16: per-new-tree setup (tile
// lists built on the host and uploaded), a check of sampled rows against a double CPU reference,
// then forward and forward+backward timed with CUDA events (median of the repetitions, each after half a second of
// back-to-back calls: sustained clocks, as scripts/bench_flex.py times the peers); the default paths again on the same
// values rounded to fp16 (their own table, with the sampled check against the fp16 inputs' double reference).
// FLOPs count visible pairs only: forward 4 A D Hq, backward 2.5x, forward+backward 3.5x that.
// Backward and forward+backward include zeroing the fp32 gradients (the contract accumulates).
// Usage: bench_attention [--out DIR] [--reps N] [--presets a,b,c] [--experiments 0|1] [--dims DQKxDV,...]
//   --experiments 0 skips the timings of the earlier experiments (decided ones; they print as nan), not their checks.
//   --dims 192x128,256x256,64x64 (pairs of attention_dims.hpp's kAttentionDims) runs the head-dim table instead of the
//   D = 128 tables: per preset and pair, every forward main loop the pair has (kDefault, kWgmma, kMmaSync at 16 and
//   32 rows per warp) and every backward one (kDefault, kMmaSync, kWgmma where it exists), sustained, with the
//   sampled O check of each forward. Without --dims nothing changes.
//   DIR receives <preset>.json (the row, for scripts/bench_flex.py) and treecp_results.json, and the forward's phase
//   stamps (launch.hpp, FwdWsConfig::trace): <preset>_fwdtrace.bin per block of the one-block-per-item kernel after the
//   A/B loops (sustained clocks), <preset>_fwdtrace_cold.bin the same after a second of idle GPU (kFwdTraceWords
//   uint64 per block).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/error.hpp"
#include "kernels/cuda/attention.hpp"
#include "kernels/cuda/attention_bwd_wgmma.cuh"  // the timing-only backward without dQ adds, the variants
#include "kernels/cuda/attention_fwd_wgmma.cuh"  // the forward's barrier and load variants
#include "kernels/cuda/attention_fwd_ws.cuh"     // the warp-specialised forward's bench-only configs
#include "tree/presets.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"
#include "timing.hpp"

using namespace treecp;
using namespace treecp::cuda;
using namespace treecp::cuda::bench;

namespace {

constexpr int kHq = 32, kHkv = 4, kD = 128;

using treecp::cuda::detail::BwdWsConfig;
using treecp::cuda::detail::BwdWsWalk;
using treecp::cuda::detail::FwdWsConfig;
using treecp::cuda::detail::FwdWsSoftmax;
// The warp-specialised forward's measured-and-rejected configs, compiled into this benchmark only so that it can still
// time them beside the library's two (docs/kernels.md, docs/benchmarks-gpu.md)
constexpr FwdWsConfig kFwdWsPlain{.q_in_registers = false, .overlap = false, .o_by_tma = false};  // change P, first
constexpr FwdWsConfig kFwdWsQReg{.overlap = false, .o_by_tma = false};                           // Q in registers
constexpr FwdWsConfig kFwdWsStores{.o_by_tma = false};  // with the overlap, O by direct stores (before change AC)
constexpr FwdWsConfig kFwdWsTrace{.trace = true};       // kDefault with the phase stamps
// change AH: the item read at the boundary; change AI: published one item ahead; change AM's first form
constexpr FwdWsConfig kFwdWsItemAtBoundary{.persistent = true, .prefetch = false};
constexpr FwdWsConfig kFwdWsOnline{.persistent = true};
constexpr FwdWsConfig kFwdWsHeldLatePack{.persistent = true, .softmax = FwdWsSoftmax::kHeld};

// Config C of the warp-specialised forward: the library's two through libtreecp_cuda (the code attention_forward
// runs), the others instantiated here from attention_fwd_ws.cuh. `counter`: the persistent forms' workspace.
template <FwdWsConfig C>
void fwd_ws(const treecp::cuda::detail::FwdArgs& a, int* counter = nullptr, unsigned long long* trace = nullptr) {
  if constexpr (C == FwdWsConfig::kDefault || C == FwdWsConfig::kPersistent)
    treecp::cuda::detail::launch_fwd_ws_d128(a, nullptr, C, counter);
  else
    treecp::cuda::detail::launch_fwd_ws<C>(a, nullptr, trace, counter);
}

// Deterministic pseudo-normal bf16 or fp16 fill (sum of 4 uniforms from a hash, scaled to unit variance): the same
// values for a seed, rounded to T.
template <class T>
__global__ void fill_random(T* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t h = (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    float s = 0.f;
    for (int r = 0; r < 4; ++r) {
      h ^= h >> 31;
      h *= 0xBF58476D1CE4E5B9ull;
      h ^= h >> 29;
      s += static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    }
    const float val = (s - 2.f) * 1.7320508f;  // var of a sum of 4 U(0,1) = 1/3
    if constexpr (std::is_same_v<T, __half>) x[i] = __float2half_rn(val);
    else x[i] = __float2bfloat16(val);
  }
}

void fill(void* p, int64_t n, uint64_t seed, DType dtype = DType::kBf16) {
  if (dtype == DType::kF16) fill_random<<<1024, 256>>>(static_cast<__half*>(p), n, seed);
  else fill_random<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed);
  check_cuda(cudaGetLastError(), "fill_random");
}

float bf(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// --experiments 0: the earlier experiments' timings (the blocks below this table's, decided in docs/benchmarks-gpu.md)
// are skipped and print as nan; their correctness checks still run. Saves about half of a call's GPU time.
bool g_experiments = true;
template <class Fn>
double time_exp(int reps, Fn&& fn) {
  return g_experiments ? time_ms(reps, fn) : std::nan("");
}

// A and B launched alternately, `pairs` times, each timed alone: the median time of each, and the median of the ratios
// B / A of adjacent launches (the GPU's clock drifts with its load; alternation cancels most of it).
struct AbTimes {
  double a_ms, b_ms, ratio;
};
template <class FnA, class FnB>
AbTimes time_ab(int pairs, FnA&& fa, FnB&& fb) {
  EventTimer timer;
  for (int i = 0; i < 3; ++i) {
    fa();
    fb();
  }
  std::vector<double> ta, tb, ratio;
  for (int i = 0; i < pairs; ++i) {
    const double x = i % 2 == 0 ? timer.ms(fa) : timer.ms(fb);
    const double y = i % 2 == 0 ? timer.ms(fb) : timer.ms(fa);
    ta.push_back(i % 2 == 0 ? x : y);
    tb.push_back(i % 2 == 0 ? y : x);
    ratio.push_back(tb.back() / ta.back());
  }
  return {median(ta), median(tb), median(ratio)};
}

// Runs fn back to back for about `ms` milliseconds of GPU time (clocks settle under sustained load).
template <class Fn>
void sustain(double ms, Fn&& fn) {
  const double one = EventTimer().ms(fn);
  const int n = static_cast<int>(ms / std::max(one, 0.01));
  for (int i = 0; i < n; ++i) fn();
  check_cuda(cudaDeviceSynchronize(), "sustain");
}

// ---- --dims: the head-dim table (Hq = 32, Hkv = 4, bf16, contiguous [S, H, D] buffers)
struct DimsPair {
  int qk, v;
};

// Sampled query rows of a forward just run against a double reference over Row::visible: O's relative error.
double sampled_o_error(const Row& row, const AttentionForwardParams& p, int64_t S, int dqk, int dv) {
  const int64_t nk = S * kHkv * dqk, nv = S * kHkv * dv;
  std::vector<uint16_t> kh(nk), vh(nv);
  check_cuda(cudaMemcpy(kh.data(), p.k, nk * 2, cudaMemcpyDeviceToHost), "copy");
  check_cuda(cudaMemcpy(vh.data(), p.v, nv * 2, cudaMemcpyDeviceToHost), "copy");
  std::mt19937_64 rng(11);
  double num = 0, den = 0;
  for (int sample = 0; sample < 16; ++sample) {
    const int64_t i = static_cast<int64_t>(rng() % S);
    const int h = static_cast<int>(rng() % kHq), kvh = h / (kHq / kHkv);
    std::vector<uint16_t> qh(dqk), oh(dv);
    check_cuda(cudaMemcpy(qh.data(), static_cast<const uint16_t*>(p.q) + (i * kHq + h) * dqk, dqk * 2,
                          cudaMemcpyDeviceToHost), "copy");
    check_cuda(cudaMemcpy(oh.data(), static_cast<const uint16_t*>(p.o) + (i * kHq + h) * dv, dv * 2,
                          cudaMemcpyDeviceToHost), "copy");
    std::vector<double> sc;
    std::vector<int64_t> js;
    double mx = -INFINITY;
    for (int64_t j = 0; j < S; ++j) {
      if (!row.visible(i, j)) continue;
      double dot = 0;
      for (int d = 0; d < dqk; ++d) dot += static_cast<double>(bf(qh[d])) * bf(kh[(j * kHkv + kvh) * dqk + d]);
      sc.push_back(dot * p.scale);
      js.push_back(j);
      mx = std::max(mx, sc.back());
    }
    double l = 0;
    for (double x : sc) l += std::exp(x - mx);
    std::vector<double> ref(dv, 0.0);
    for (size_t t = 0; t < sc.size(); ++t)
      for (int d = 0; d < dv; ++d) ref[d] += std::exp(sc[t] - mx) / l * bf(vh[(js[t] * kHkv + kvh) * dv + d]);
    for (int d = 0; d < dv; ++d) {
      num += (bf(oh[d]) - ref[d]) * (bf(oh[d]) - ref[d]);
      den += ref[d] * ref[d];
    }
  }
  return std::sqrt(num / den);
}

// One preset at one (Dqk, Dv): a line per main loop, forward and backward (backward with Dsum and the gradients'
// zeroing, as the D = 128 tables count it). FLOPs: forward 2 A (Dqk + Dv) Hq, backward 2.5x that (the 5 GEMMs'
// share at Dqk = Dv; reported the same way at Dqk != Dv for comparability).
void run_dims(const std::string& name, const Row& row, const DimsPair& dims, int reps) {
  const int64_t S = row.tokens();
  const int dqk = dims.qk, dvv = dims.v;
  const TilePlan plan = build_tile_plan(row_slices(row), S, S, kHq / kHkv);
  const DeviceTilePlan dplan(plan);
  const int64_t nq = S * kHq * dqk, nk = S * kHkv * dqk, nv = S * kHkv * dvv, no = S * kHq * dvv;
  void *q, *k, *v, *o, *d_o, *workspace;
  float *lse, *dsum, *dq, *dk, *dv;
  check_cuda(cudaMalloc(&q, nq * 2), "alloc");
  check_cuda(cudaMalloc(&k, nk * 2), "alloc");
  check_cuda(cudaMalloc(&v, nv * 2), "alloc");
  check_cuda(cudaMalloc(&o, no * 2), "alloc");
  check_cuda(cudaMalloc(&d_o, no * 2), "alloc");
  check_cuda(cudaMalloc(&lse, S * kHq * 4), "alloc");
  check_cuda(cudaMalloc(&dsum, S * kHq * 4), "alloc");
  check_cuda(cudaMalloc(&dq, nq * 4), "alloc");
  check_cuda(cudaMalloc(&dk, nk * 4), "alloc");
  check_cuda(cudaMalloc(&dv, nv * 4), "alloc");
  check_cuda(cudaMalloc(&workspace, attention_forward_workspace_bytes()), "workspace");
  fill(q, nq, 1);
  fill(k, nk, 2);
  fill(v, nv, 3);
  fill(d_o, no, 4);
  AttentionForwardParams fp;
  fp.q = q;
  fp.k = k;
  fp.v = v;
  fp.o = o;
  fp.lse = lse;
  fp.q_row_stride = kHq * dqk;
  fp.k_row_stride = kHkv * dqk;
  fp.v_row_stride = kHkv * dvv;
  fp.o_row_stride = kHq * dvv;
  fp.q_head_stride = fp.k_head_stride = dqk;
  fp.v_head_stride = fp.o_head_stride = dvv;
  fp.lse_row_stride = kHq;
  fp.lse_head_stride = 1;
  fp.hq = kHq;
  fp.hkv = kHkv;
  fp.head_dim = dqk;
  fp.value_dim = static_cast<int16_t>(dvv);
  fp.scale = 1.f / std::sqrt(static_cast<float>(dqk));
  fp.workspace = workspace;
  fp.workspace_bytes = attention_forward_workspace_bytes();
  AttentionBackwardParams bp;
  bp.q = q;
  bp.k = k;
  bp.v = v;
  bp.o = o;
  bp.d_o = d_o;
  bp.lse = lse;
  bp.dsum = dsum;
  bp.dq = dq;
  bp.dk = dk;
  bp.dv = dv;
  bp.q_row_stride = bp.dq_row_stride = kHq * dqk;
  bp.k_row_stride = bp.dk_row_stride = kHkv * dqk;
  bp.v_row_stride = kHkv * dvv;
  bp.o_row_stride = kHq * dvv;
  bp.q_head_stride = bp.k_head_stride = bp.dq_head_stride = bp.dk_head_stride = dqk;
  bp.v_head_stride = bp.o_head_stride = dvv;
  if (dvv != dqk) {
    bp.dv_row_stride = kHkv * dvv;
    bp.dv_head_stride = dvv;
  }
  bp.lse_row_stride = kHq;
  bp.lse_head_stride = 1;
  bp.hq = kHq;
  bp.hkv = kHkv;
  bp.head_dim = dqk;
  bp.value_dim = static_cast<int16_t>(dvv);
  bp.scale = fp.scale;
  const double fwd_flop = 2.0 * static_cast<double>(plan.visible_pairs) * (dqk + dvv) * kHq;
  auto line = [&](const char* dir, const char* path, double ms, double flop, double err) {
    std::printf("| %s | %dx%d | %s | %s | %.3f | %.0f | %s |\n", name.c_str(), dqk, dvv, dir, path, ms,
                flop / (ms * 1e-3) / 1e12, std::isnan(err) ? "" : std::to_string(err).c_str());
  };
  struct FwdPath {
    const char* name;
    Mainloop mainloop;
    int rows;
  };
  const FwdPath fwd_paths[] = {{"kDefault", Mainloop::kDefault, 0},
                               {"kWgmma", Mainloop::kWgmma, 0},
                               {"kMmaSync 16", Mainloop::kMmaSync, 16},
                               {"kMmaSync 32", Mainloop::kMmaSync, 32}};
  for (const FwdPath& f : fwd_paths) {
    if (dvv == 256 && f.rows == 32) continue;  // not instantiated (attention.cpp refuses it)
    AttentionForwardParams x = fp;
    x.mainloop = f.mainloop;
    x.rows_per_warp = static_cast<int8_t>(f.rows);
    auto call = [&] { attention_forward(x, dplan); };
    call();
    check_cuda(cudaDeviceSynchronize(), "forward");
    const double err = sampled_o_error(row, x, S, dqk, dvv);
    sustain(500, call);
    line("fwd", f.name, time_ms(reps, call), fwd_flop, err);
  }
  attention_forward(fp, dplan);  // O and LSE for the backward: the default path
  std::vector<std::pair<const char*, Mainloop>> bwd_paths{{"kDefault", Mainloop::kDefault}, {"kMmaSync", Mainloop::kMmaSync}};
  if (dqk == 64 || dqk == 128) bwd_paths.push_back({"kWgmma", Mainloop::kWgmma});
  for (const auto& [path, mainloop] : bwd_paths) {
    AttentionBackwardParams x = bp;
    x.mainloop = mainloop;
    auto call = [&] {
      check_cuda(cudaMemsetAsync(dq, 0, nq * 4), "zero");
      check_cuda(cudaMemsetAsync(dk, 0, nk * 4), "zero");
      check_cuda(cudaMemsetAsync(dv, 0, nv * 4), "zero");
      attention_backward(x, dplan);
    };
    call();
    check_cuda(cudaDeviceSynchronize(), "backward");
    sustain(500, call);
    line("bwd", path, time_ms(reps, call), 2.5 * fwd_flop, std::nan(""));
  }
  for (void* ptr : {q, k, v, o, d_o, workspace}) cudaFree(ptr);
  for (float* ptr : {lse, dsum, dq, dk, dv}) cudaFree(ptr);
}

struct Result {
  std::string preset;
  int64_t tokens, pairs;
  bool seg_rule;
  double setup_ms, build_ms, fwd_ms, fwdwg_ms, fwd16_ms, fwd32_ms, bwd_ms, bwd_mma_ms, bwd_kernel_ms, bwd_nodq_ms, bwd_none_ms, bwd_dkv_ms, bwd_none2_ms, bwd_wg_ms, bwd_ws_ms, bwd_wsr_ms, bwd_wg2_ms, bwd_ws2_ms, bwd_wsr2_ms, fwd_two_ms, fwd_one_ms, fwd_two2_ms, fwd_one2_ms, fwd_lean_ms, fwd_lean2_ms, fwd_ws_ms, fwd_ws2_ms, fwd_lean3_ms, fwd_wsq_ms, fwd_wsq2_ms, fwd_wso_ms, fwd_wso2_ms, walk_fwd_ms, walk_rev_ms, walk_fwd2_ms, walk_rev2_ms, seg_def_ms, seg_seg_ms, seg_def2_ms, seg_seg2_ms, seg_check, idle_on_ms, idle_off_ms, idle_on2_ms, idle_off2_ms, tmao_fwd[4], persist_fwd[3], prefetch_fwd[3], held_fwd[2], early_fwd, held_check, persist_check, cold_fwd_ms, warm_fwd_ms, fwd_idle_ms, dkdv_bwd[4], dkdv_check, memset_dq_ms, dsum_ms, fwdbwd_ms, err_o, err_lse, f16_fwd_ms, f16_bwd_ms, f16_fwdbwd_ms, f16_err_o, f16_err_lse;
  int64_t fwd_full, fwd_partial, bwd_full, bwd_partial;
};

}  // namespace

int main(int argc, char** argv) {
  std::string out_dir = ".", presets_arg = "fixed5k,varied5k,dominant,art-fixed5k", dims_arg;
  int reps = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--out") out_dir = argv[i + 1];
    else if (a == "--reps") reps = std::stoi(argv[i + 1]);
    else if (a == "--presets") presets_arg = argv[i + 1];
    else if (a == "--experiments") g_experiments = std::stoi(argv[i + 1]) != 0;
    else if (a == "--dims") dims_arg = argv[i + 1];
    else {
      std::fprintf(stderr, "bench_attention: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach a pipe as they are printed, even if the run is cut short
  std::vector<std::string> names;
  for (std::stringstream ss(presets_arg); ss.good();) {
    std::string n;
    std::getline(ss, n, ',');
    if (!n.empty()) names.push_back(n);
  }
  std::vector<DimsPair> dims;
  for (std::stringstream ss(dims_arg); ss.good();) {
    std::string n;
    std::getline(ss, n, ',');
    if (n.empty()) continue;
    const size_t x = n.find('x');
    int qk = 0, v = 0;
    try {
      qk = std::stoi(n.substr(0, x));
      v = x == std::string::npos ? qk : std::stoi(n.substr(x + 1));
    } catch (const std::exception&) {
    }
    if (!attention_dims_supported(qk, v)) {
      std::fprintf(stderr, "bench_attention: --dims %s is not one of %s (DQKxDV)\n", n.c_str(),
                   attention_dims_list().c_str());
      return 2;
    }
    dims.push_back({qk, v});
  }
  try {
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, 0), "device properties");
    std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    if (!dims.empty()) {
      std::printf("\ntreecp CUDA slice attention by head dims, Hq=%d Hkv=%d bf16, %s (sustained, median of %d)\n", kHq,
                  kHkv, prop.name, reps);
      std::printf("| preset | DqkxDv | dir | main loop | ms | TFLOP/s | sampled O rel err |\n");
      std::printf("|---|---|---|---|---|---|---|\n");
      for (const std::string& name : names) {
        const Row row = make_preset(name, 1, 0);
        for (const DimsPair& d : dims) run_dims(name, row, d, reps);
      }
      return 0;
    }
    std::vector<Result> results;
    for (const std::string& name : names) {
      const Row row = make_preset(name, 1, 0);
      const int64_t S = row.tokens();
      {
        std::ofstream f(out_dir + "/" + name + ".json");
        f << row_to_json(row);
      }
      Result r{};
      r.preset = name;
      r.tokens = S;
      // per-new-tree setup: slices -> tile lists -> device copy into the plan's reused allocation
      // (median of 7 fresh builds; the first one also allocates)
      std::vector<double> setup, build;
      TilePlan plan;
      DeviceTilePlan dplan;
      for (int i = 0; i < 7; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        plan = build_tile_plan(row_slices(row), S, S, kHq / kHkv);
        const auto t1 = std::chrono::steady_clock::now();
        dplan.upload(plan);
        check_cuda(cudaDeviceSynchronize(), "upload");  // the copy has landed
        const auto t2 = std::chrono::steady_clock::now();
        build.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        setup.push_back(std::chrono::duration<double, std::milli>(t2 - t0).count());
      }
      r.setup_ms = median(setup);
      r.build_ms = median(build);
      r.pairs = plan.visible_pairs;
      r.fwd_full = plan.fwd.full_tiles;
      r.fwd_partial = plan.fwd.partial_tiles;
      r.bwd_full = plan.bwd.full_tiles;
      r.bwd_partial = plan.bwd.partial_tiles;

      const int64_t nq = S * kHq * kD, nkv = S * kHkv * kD;
      void *q, *k, *v, *o, *d_o;
      float *lse, *dsum, *dq, *dk, *dv;
      check_cuda(cudaMalloc(&q, nq * 2), "alloc");
      check_cuda(cudaMalloc(&k, nkv * 2), "alloc");
      check_cuda(cudaMalloc(&v, nkv * 2), "alloc");
      check_cuda(cudaMalloc(&o, nq * 2), "alloc");
      check_cuda(cudaMalloc(&d_o, nq * 2), "alloc");
      check_cuda(cudaMalloc(&lse, S * kHq * 4), "alloc");
      check_cuda(cudaMalloc(&dsum, S * kHq * 4), "alloc");
      check_cuda(cudaMalloc(&dq, nq * 4), "alloc");
      check_cuda(cudaMalloc(&dk, nkv * 4), "alloc");
      check_cuda(cudaMalloc(&dv, nkv * 4), "alloc");
      fill(q, nq, 1);
      fill(k, nkv, 2);
      fill(v, nkv, 3);
      fill(d_o, nq, 4);
      const float scale = 1.f / std::sqrt(static_cast<float>(kD));
      AttentionForwardParams fp;
      fp.q = q;
      fp.k = k;
      fp.v = v;
      fp.o = o;
      fp.lse = lse;
      fp.q_row_stride = fp.o_row_stride = kHq * kD;
      fp.k_row_stride = fp.v_row_stride = kHkv * kD;
      fp.q_head_stride = fp.k_head_stride = fp.v_head_stride = fp.o_head_stride = kD;
      fp.lse_row_stride = kHq;
      fp.lse_head_stride = 1;
      fp.hq = kHq;
      fp.hkv = kHkv;
      fp.head_dim = kD;
      fp.scale = scale;
      AttentionBackwardParams bp;
      bp.q = q;
      bp.k = k;
      bp.v = v;
      bp.o = o;
      bp.d_o = d_o;
      bp.lse = lse;
      bp.dsum = dsum;
      bp.dq = dq;
      bp.dk = dk;
      bp.dv = dv;
      bp.q_row_stride = bp.o_row_stride = bp.dq_row_stride = kHq * kD;
      bp.k_row_stride = bp.v_row_stride = bp.dk_row_stride = kHkv * kD;
      bp.q_head_stride = bp.k_head_stride = bp.v_head_stride = bp.o_head_stride = bp.dq_head_stride =
          bp.dk_head_stride = kD;
      bp.lse_row_stride = kHq;
      bp.lse_head_stride = 1;
      bp.hq = kHq;
      bp.hkv = kHkv;
      bp.head_dim = kD;
      bp.scale = scale;

      // the default forward runs persistent with a workspace (AttentionForwardParams::workspace)
      void* workspace = nullptr;
      check_cuda(cudaMalloc(&workspace, attention_forward_workspace_bytes()), "workspace");
      fp.workspace = workspace;
      fp.workspace_bytes = attention_forward_workspace_bytes();

      // check: sampled query rows of the forward of `p` (just run) against a double reference over Row::visible;
      // returns the O and LSE relative errors (norm-wise over the samples)
      auto sampled_errors = [&](const AttentionForwardParams& p) {
        auto val = [&](uint16_t b) { return p.dtype == DType::kF16 ? bits_to_f32(b, DType::kF16) : bf(b); };
        const void *q = p.q, *k = p.k, *v = p.v, *o = p.o;
        std::vector<uint16_t> kh(nkv), vh(nkv);
        check_cuda(cudaMemcpy(kh.data(), k, nkv * 2, cudaMemcpyDeviceToHost), "copy");
        check_cuda(cudaMemcpy(vh.data(), v, nkv * 2, cudaMemcpyDeviceToHost), "copy");
        std::mt19937_64 rng(7);
        double num = 0, den = 0, lnum = 0, lden = 0;
        for (int sample = 0; sample < 24; ++sample) {
          const int64_t i = static_cast<int64_t>(rng() % S);
          const int h = static_cast<int>(rng() % kHq), kvh = h / (kHq / kHkv);
          std::vector<uint16_t> qh(kD), oh(kD);
          float lg;
          check_cuda(cudaMemcpy(qh.data(), static_cast<const uint16_t*>(q) + (i * kHq + h) * kD, kD * 2, cudaMemcpyDeviceToHost), "copy");
          check_cuda(cudaMemcpy(oh.data(), static_cast<const uint16_t*>(o) + (i * kHq + h) * kD, kD * 2, cudaMemcpyDeviceToHost), "copy");
          check_cuda(cudaMemcpy(&lg, lse + i * kHq + h, 4, cudaMemcpyDeviceToHost), "copy");
          std::vector<double> s;
          std::vector<int64_t> js;
          double mx = -INFINITY;
          for (int64_t j = 0; j <= i; ++j) {
            if (!row.visible(i, j)) continue;
            double dot = 0;
            for (int d = 0; d < kD; ++d) dot += static_cast<double>(val(qh[d])) * val(kh[(j * kHkv + kvh) * kD + d]);
            s.push_back(dot * scale);
            js.push_back(j);
            mx = std::max(mx, s.back());
          }
          double sum = 0;
          for (double x : s) sum += std::exp(x - mx);
          const double l = mx + std::log(sum);
          std::vector<double> ref(kD, 0.0);
          for (size_t t = 0; t < s.size(); ++t)
            for (int d = 0; d < kD; ++d) ref[d] += std::exp(s[t] - l) * val(vh[(js[t] * kHkv + kvh) * kD + d]);
          for (int d = 0; d < kD; ++d) {
            num += (val(oh[d]) - ref[d]) * (val(oh[d]) - ref[d]);
            den += ref[d] * ref[d];
          }
          lnum += (lg - l) * (lg - l);
          lden += l * l;
        }
        return std::make_pair(std::sqrt(num / den), std::sqrt(lnum / lden));
      };
      attention_forward(fp, dplan);
      check_cuda(cudaDeviceSynchronize(), "forward");
      std::tie(r.err_o, r.err_lse) = sampled_errors(fp);

      using Mainloop = AttentionForwardParams::Mainloop;
      fp.mainloop = Mainloop::kWgmma;
      r.fwdwg_ms = time_exp(reps, [&] { attention_forward(fp, dplan); });
      fp.mainloop = Mainloop::kMmaSync;
      fp.rows_per_warp = 16;
      r.fwd16_ms = time_exp(reps, [&] { attention_forward(fp, dplan); });
      fp.rows_per_warp = 32;
      r.fwd32_ms = time_exp(reps, [&] { attention_forward(fp, dplan); });
      {
        // the wgmma forward's variants (attention_fwd_wgmma.cuh), each timed twice for the spread:
        // barriers kTwo / kOne with the generic loads, then kOne with per-thread loads
        using treecp::cuda::detail::FwdBarriers;
        using treecp::cuda::detail::FwdLoads;
        const treecp::cuda::detail::FwdArgs fargs{fp, dplan.fwd, dplan.slices, static_cast<int32_t>(S),
                                                  static_cast<int32_t>(S), kHq / kHkv};
        auto time_fwd = [&](auto b, auto l) {
          return time_exp(reps, [&] {
            treecp::cuda::detail::launch_fwd_wgmma<kD, decltype(b)::value, decltype(l)::value>(fargs, nullptr);
          });
        };
        using Two = std::integral_constant<FwdBarriers, FwdBarriers::kTwo>;
        using One = std::integral_constant<FwdBarriers, FwdBarriers::kOne>;
        using Generic = std::integral_constant<FwdLoads, FwdLoads::kGeneric>;
        using PerThread = std::integral_constant<FwdLoads, FwdLoads::kPerThread>;
        r.fwd_two_ms = time_fwd(Two{}, Generic{});
        r.fwd_one_ms = time_fwd(One{}, Generic{});
        r.fwd_lean_ms = time_fwd(One{}, PerThread{});
        r.fwd_two2_ms = time_fwd(Two{}, Generic{});
        r.fwd_one2_ms = time_fwd(One{}, Generic{});
        r.fwd_lean2_ms = time_fwd(One{}, PerThread{});
        // the warp-specialised TMA forward's first forms (attention_fwd_ws.cuh), alternating with the default
        auto ws_plain = [&] { fwd_ws<kFwdWsPlain>(fargs); };
        auto ws_qreg = [&] { fwd_ws<kFwdWsQReg>(fargs); };
        auto ws_stores = [&] { fwd_ws<kFwdWsStores>(fargs); };
        auto ws_default = [&] { fwd_ws<FwdWsConfig::kDefault>(fargs); };
        r.fwd_ws_ms = time_exp(reps, ws_plain);
        r.fwd_wsq_ms = time_exp(reps, ws_qreg);
        r.fwd_wso_ms = time_exp(reps, ws_stores);
        r.fwd_lean3_ms = time_fwd(One{}, PerThread{});
        r.fwd_wso2_ms = time_exp(reps, ws_stores);
        r.fwd_wsq2_ms = time_exp(reps, ws_qreg);
        r.fwd_ws2_ms = time_exp(reps, ws_plain);
        // O stored by TMA from shared memory (kDefault) against direct stores (kFwdWsStores), A B B A
        r.tmao_fwd[0] = time_exp(reps, ws_stores);
        r.tmao_fwd[1] = time_exp(reps, ws_default);
        r.tmao_fwd[2] = time_exp(reps, ws_default);
        r.tmao_fwd[3] = time_exp(reps, ws_stores);
        {
          // the persistent forward, item read at the boundary, against one block per item (kDefault), A B B A, after
          // half a second of load
          int* counter = nullptr;
          check_cuda(cudaMalloc(&counter, treecp::cuda::detail::fwd_ws_workspace_bytes()), "counter");
          auto at_boundary = [&] { fwd_ws<kFwdWsItemAtBoundary>(fargs, counter); };
          auto online = [&] { fwd_ws<kFwdWsOnline>(fargs, counter); };
          auto held_late = [&] { fwd_ws<kFwdWsHeldLatePack>(fargs, counter); };
          auto persistent = [&] { fwd_ws<FwdWsConfig::kPersistent>(fargs, counter); };
          // the same kernel after a second of idle GPU, then after half a second of back-to-back launches
          std::this_thread::sleep_for(std::chrono::seconds(1));
          r.cold_fwd_ms = time_ms(reps, ws_default);
          sustain(500.0, ws_default);
          r.warm_fwd_ms = time_ms(reps, ws_default);
          const AbTimes ab = time_ab(4 * reps, ws_default, at_boundary);
          r.persist_fwd[0] = ab.a_ms;
          r.persist_fwd[1] = ab.b_ms;
          r.persist_fwd[2] = ab.ratio;
          // the item published one item ahead against it at the boundary and against one block per item
          const AbTimes ab65 = time_ab(4 * reps, at_boundary, online);
          const AbTimes ab63 = time_ab(4 * reps, ws_default, online);
          r.prefetch_fwd[0] = ab65.b_ms;
          r.prefetch_fwd[1] = ab65.ratio;
          r.prefetch_fwd[2] = ab63.ratio;
          // the persistent forward's output against the default's (bitwise: same arithmetic per item)
          std::vector<uint16_t> o3(static_cast<size_t>(S) * kHq * kD), o5(o3.size());
          ws_default();
          check_cuda(cudaMemcpy(o3.data(), fp.o, o3.size() * 2, cudaMemcpyDeviceToHost), "copy O");
          check_cuda(cudaMemset(fp.o, 0xff, o3.size() * 2), "poison O");
          at_boundary();
          check_cuda(cudaMemcpy(o5.data(), fp.o, o5.size() * 2, cudaMemcpyDeviceToHost), "copy O");
          r.persist_check = o3 == o5 ? 0.0 : 1.0;
          check_cuda(cudaMemset(fp.o, 0xff, o3.size() * 2), "poison O");
          online();
          check_cuda(cudaMemcpy(o5.data(), fp.o, o5.size() * 2, cudaMemcpyDeviceToHost), "copy O");
          if (o3 != o5) r.persist_check += 2.0;
          // the held-offset softmax (its first form, P packed after the vote) against the online one: time, alternated,
          // and O's relative L2 difference
          const AbTimes ab67 = time_ab(4 * reps, online, held_late);
          r.held_fwd[0] = ab67.b_ms;
          r.held_fwd[1] = ab67.ratio;
          r.early_fwd = time_ab(4 * reps, held_late, persistent).ratio;  // P packed before the vote (kPersistent)
          check_cuda(cudaMemset(fp.o, 0xff, o3.size() * 2), "poison O");
          held_late();
          check_cuda(cudaMemcpy(o5.data(), fp.o, o5.size() * 2, cudaMemcpyDeviceToHost), "copy O");
          {
            double num = 0, den = 0;
            for (size_t i = 0; i < o3.size(); ++i) {
              const double a = bf(o3[i]), b = bf(o5[i]);
              num += (a - b) * (a - b);
              den += a * a;
            }
            r.held_check = std::sqrt(num / den);  // NaN in either (a poisoned row left unwritten) fails the check
          }
          // kPersistent computes what kFwdWsHeldLatePack does (only the order of the pack and the vote differs):
          // bitwise equal
          std::vector<uint16_t> o8(o3.size());
          check_cuda(cudaMemset(fp.o, 0xff, o3.size() * 2), "poison O");
          persistent();
          check_cuda(cudaMemcpy(o8.data(), fp.o, o8.size() * 2, cudaMemcpyDeviceToHost), "copy O");
          if (o8 != o5) r.persist_check += 4.0;
          check_cuda(cudaFree(counter), "counter");
        }
        {
          // per-block phase stamps of the default (kFwdWsTrace: kDefault + clock64 stamps), raw, for offline study:
          // <preset>_fwdtrace.bin, blocks x kFwdTraceWords uint64 (launch.hpp names the words)
          using treecp::cuda::detail::kFwdTraceWords;
          const size_t words = static_cast<size_t>(dplan.fwd.num_major) * kHkv * kFwdTraceWords;
          unsigned long long* dtrace = nullptr;
          check_cuda(cudaMalloc(&dtrace, words * 8), "trace buffer");
          check_cuda(cudaMemset(dtrace, 0, words * 8), "trace buffer");
          // the same stamps twice: right after the A/B loops above (sustained clocks, <preset>_fwdtrace.bin), then
          // after a second of idle GPU (<preset>_fwdtrace_cold.bin): cycles per step in both states
          for (int pass = 0; pass < 2; ++pass) {
            if (pass == 1) std::this_thread::sleep_for(std::chrono::seconds(1));
            check_cuda(cudaMemset(dtrace, 0, words * 8), "trace buffer");
            fwd_ws<kFwdWsTrace>(fargs, nullptr, dtrace);
            std::vector<unsigned long long> h(words);
            check_cuda(cudaMemcpy(h.data(), dtrace, words * 8, cudaMemcpyDeviceToHost), "trace copy");
            std::ofstream tf(out_dir + "/" + name + (pass == 0 ? "_fwdtrace.bin" : "_fwdtrace_cold.bin"), std::ios::binary);
            tf.write(reinterpret_cast<const char*>(h.data()), static_cast<std::streamsize>(words * 8));
          }
          check_cuda(cudaFree(dtrace), "trace buffer");
        }
      }
      fp.mainloop = Mainloop::kDefault;  // the default, used below
      fp.rows_per_warp = 0;
      // The main table: each after half a second of back-to-back calls (sustained clocks; an idle H200 runs the first
      // milliseconds 3-11% faster), as scripts/bench_flex.py times the peers.
      auto fwd = [&] { attention_forward(fp, dplan); };
      auto fwdbwd = [&] {
        // the contract accumulates into zeroed fp32 gradients: the zeroing is part of the cost
        check_cuda(cudaMemsetAsync(dq, 0, nq * 4), "memset");
        check_cuda(cudaMemsetAsync(dk, 0, nkv * 4), "memset");
        check_cuda(cudaMemsetAsync(dv, 0, nkv * 4), "memset");
        attention_forward(fp, dplan);
        attention_backward(bp, dplan);
      };
      auto bwd = [&] {
        check_cuda(cudaMemsetAsync(dq, 0, nq * 4), "memset");
        check_cuda(cudaMemsetAsync(dk, 0, nkv * 4), "memset");
        check_cuda(cudaMemsetAsync(dv, 0, nkv * 4), "memset");
        attention_backward(bp, dplan);
      };
      std::this_thread::sleep_for(std::chrono::seconds(1));
      r.fwd_idle_ms = time_ms(reps, fwd);  // the same after a second of idle GPU, for comparison
      sustain(500.0, fwd);
      r.fwd_ms = time_ms(reps, fwd);
      sustain(500.0, fwdbwd);
      r.fwdbwd_ms = time_ms(reps, fwdbwd);
      sustain(500.0, bwd);
      r.bwd_ms = time_ms(reps, bwd);
      {
        // fp16: the same values rounded to fp16 in buffers of their own, the default paths, timed as the table's
        void *q16, *k16, *v16, *o16, *do16;
        check_cuda(cudaMalloc(&q16, nq * 2), "alloc");
        check_cuda(cudaMalloc(&k16, nkv * 2), "alloc");
        check_cuda(cudaMalloc(&v16, nkv * 2), "alloc");
        check_cuda(cudaMalloc(&o16, nq * 2), "alloc");
        check_cuda(cudaMalloc(&do16, nq * 2), "alloc");
        fill(q16, nq, 1, DType::kF16);
        fill(k16, nkv, 2, DType::kF16);
        fill(v16, nkv, 3, DType::kF16);
        fill(do16, nq, 4, DType::kF16);
        AttentionForwardParams f16 = fp;
        f16.dtype = DType::kF16;
        f16.q = q16;
        f16.k = k16;
        f16.v = v16;
        f16.o = o16;
        AttentionBackwardParams b16 = bp;
        b16.dtype = DType::kF16;
        b16.q = q16;
        b16.k = k16;
        b16.v = v16;
        b16.o = o16;
        b16.d_o = do16;
        attention_forward(f16, dplan);
        check_cuda(cudaDeviceSynchronize(), "fp16 forward");
        std::tie(r.f16_err_o, r.f16_err_lse) = sampled_errors(f16);
        auto fwd16 = [&] { attention_forward(f16, dplan); };
        auto zero_grads = [&] {
          check_cuda(cudaMemsetAsync(dq, 0, nq * 4), "memset");
          check_cuda(cudaMemsetAsync(dk, 0, nkv * 4), "memset");
          check_cuda(cudaMemsetAsync(dv, 0, nkv * 4), "memset");
        };
        auto fwdbwd16 = [&] {
          zero_grads();
          attention_forward(f16, dplan);
          attention_backward(b16, dplan);
        };
        auto bwd16 = [&] {
          zero_grads();
          attention_backward(b16, dplan);
        };
        sustain(500.0, fwd16);
        r.f16_fwd_ms = time_ms(reps, fwd16);
        sustain(500.0, fwdbwd16);
        r.f16_fwdbwd_ms = time_ms(reps, fwdbwd16);
        sustain(500.0, bwd16);
        r.f16_bwd_ms = time_ms(reps, bwd16);
        check_cuda(cudaDeviceSynchronize(), "fp16 timing");
        for (void* p : {q16, k16, v16, o16, do16}) cudaFree(p);
      }
      bp.mainloop = Mainloop::kMmaSync;  // the earlier backward, for comparison in the same run
      r.bwd_mma_ms = time_exp(reps, [&] {
        check_cuda(cudaMemsetAsync(dq, 0, nq * 4), "memset");
        check_cuda(cudaMemsetAsync(dk, 0, nkv * 4), "memset");
        check_cuda(cudaMemsetAsync(dv, 0, nkv * 4), "memset");
        attention_backward(bp, dplan);
      });
      bp.mainloop = Mainloop::kDefault;
      {
        // attribution: the same backward without its dQ reduction (dsum is ready from the runs above)
        AttentionBackwardParams nodq = bp;
        nodq.dsum_ready = true;
        const treecp::cuda::detail::BwdArgs args{nodq, dplan.bwd, dplan.slices, static_cast<int32_t>(S), static_cast<int32_t>(S),
                                   kHq / kHkv};
        r.bwd_kernel_ms = time_exp(reps, [&] {
          check_cuda(cudaMemsetAsync(dk, 0, nkv * 4), "memset");
          check_cuda(cudaMemsetAsync(dv, 0, nkv * 4), "memset");
          treecp::cuda::detail::launch_bwd_wgmma<kD, true>(args, nullptr);
        });
        // the rest of the backward's total: zeroing dQ (the caller's, in this contract) and the Dsum kernel
        r.memset_dq_ms = time_exp(reps, [&] { check_cuda(cudaMemsetAsync(dq, 0, nq * 4), "memset"); });
        r.dsum_ms = time_exp(reps, [&] { treecp::cuda::detail::launch_bwd_dsum(args, nullptr); });
        r.bwd_nodq_ms = time_exp(reps, [&] {
          check_cuda(cudaMemsetAsync(dk, 0, nkv * 4), "memset");
          check_cuda(cudaMemsetAsync(dv, 0, nkv * 4), "memset");
          treecp::cuda::detail::launch_bwd_wgmma<kD, false>(args, nullptr);
        });
        // the overlap variants of the same kernel (attention_bwd_wgmma.cuh), kNone twice for the spread
        using treecp::cuda::detail::BwdOverlap;
        auto time_variant = [&](auto variant) {
          return time_exp(reps, [&] {
            check_cuda(cudaMemsetAsync(dk, 0, nkv * 4), "memset");
            check_cuda(cudaMemsetAsync(dv, 0, nkv * 4), "memset");
            treecp::cuda::detail::launch_bwd_wgmma<kD, true, decltype(variant)::value>(args, nullptr);
          });
        };
        r.bwd_none_ms = time_variant(std::integral_constant<BwdOverlap, BwdOverlap::kNone>{});
        r.bwd_dkv_ms = time_variant(std::integral_constant<BwdOverlap, BwdOverlap::kDkv>{});
        r.bwd_none2_ms = time_variant(std::integral_constant<BwdOverlap, BwdOverlap::kNone>{});
        // the wgmma kernel (kDkvDq, the default before change Q) against the warp-specialised one
        // (attention_bwd_ws.cu) with dQ by red.global.add (ws) and by TMA bulk reductions (wsr), alternating
        auto time_wg = [&] {
          return time_exp(reps, [&] {
            check_cuda(cudaMemsetAsync(dk, 0, nkv * 4), "memset");
            check_cuda(cudaMemsetAsync(dv, 0, nkv * 4), "memset");
            treecp::cuda::detail::launch_bwd_wgmma<kD, true, BwdOverlap::kDkvDq>(args, nullptr);
          });
        };
        auto time_ws = [&](const BwdWsConfig& config) {
          return time_exp(reps, [&] {
            check_cuda(cudaMemsetAsync(dk, 0, nkv * 4), "memset");
            check_cuda(cudaMemsetAsync(dv, 0, nkv * 4), "memset");
            treecp::cuda::detail::launch_bwd_ws_d128(args, nullptr, config);
          });
        };
        // dQ by red.global.add (ws) and by TMA (wsr), dK / dV by the consumers in both
        constexpr BwdWsConfig kRedDq{.dq_by_tma = false}, kTmaDq{.dkdv_by_tma = false};
        r.bwd_wg_ms = time_wg();
        r.bwd_ws_ms = time_ws(kRedDq);
        r.bwd_wsr_ms = time_ws(kTmaDq);
        r.bwd_wg2_ms = time_wg();
        r.bwd_ws2_ms = time_ws(kRedDq);
        r.bwd_wsr2_ms = time_ws(kTmaDq);

        // walk orders of the warp-specialised backward: every walk forward (the default before change X) against the
        // first wave reversed (the default), alternating, twice
        constexpr BwdWsConfig kWalkForward{.walk = BwdWsWalk::kForward, .dkdv_by_tma = false};
        r.walk_fwd_ms = time_ws(kWalkForward);
        r.walk_rev_ms = time_ws(kTmaDq);
        r.walk_fwd2_ms = time_ws(kWalkForward);
        r.walk_rev2_ms = time_ws(kTmaDq);

        // block orders of the warp-specialised backward: the default order with the first wave reversed (kDefault)
        // against the segment order with every walk reversed (kSegmentOrder), alternating, twice; the rule
        // (DeviceTilePlan::bwd_segment_order) picks one of them for attention_backward
        {
          r.seg_rule = dplan.bwd_segment_order(kHkv, prop.multiProcessorCount);
          // both orders give the same dK and dV (each (tile, head) once): their sums of |dK| + |dV|
          auto dkdv_sum = [&](const BwdWsConfig& config) {
            check_cuda(cudaMemset(dk, 0, nkv * 4), "memset");
            check_cuda(cudaMemset(dv, 0, nkv * 4), "memset");
            treecp::cuda::detail::launch_bwd_ws_d128(args, nullptr, config);
            std::vector<float> h(nkv);
            double sum = 0;
            for (float* g : {dk, dv}) {
              check_cuda(cudaMemcpy(h.data(), g, nkv * 4, cudaMemcpyDeviceToHost), "copy");
              for (float x : h) sum += std::fabs(static_cast<double>(x));
            }
            return sum;
          };
          r.seg_check = std::fabs(dkdv_sum(BwdWsConfig::kSegmentOrder) / dkdv_sum(BwdWsConfig::kDefault) - 1.0);
          r.seg_def_ms = time_ws(BwdWsConfig::kDefault);
          r.seg_seg_ms = time_ws(BwdWsConfig::kSegmentOrder);
          r.seg_seg2_ms = time_ws(BwdWsConfig::kSegmentOrder);
          r.seg_def2_ms = time_ws(BwdWsConfig::kDefault);
          // warpgroup 1 skipping the steps its keys see no query of (the default) against not skipping, both in the
          // order the rule picks, alternating, twice
          const BwdWsConfig base = r.seg_rule ? BwdWsConfig::kSegmentOrder : BwdWsConfig::kDefault;  // the default's
          BwdWsConfig no_skip = base, dkdv_by_consumers = base;
          no_skip.skip_idle = false;
          dkdv_by_consumers.dkdv_by_tma = false;
          r.idle_off_ms = time_ws(no_skip);
          r.idle_on_ms = time_ws(base);
          r.idle_on2_ms = time_ws(base);
          r.idle_off2_ms = time_ws(no_skip);
          // dK / dV added by TMA bulk reductions against read-add-write by the consumers, A B B A; both must give the
          // same dK and dV
          r.dkdv_check = std::fabs(dkdv_sum(base) / dkdv_sum(dkdv_by_consumers) - 1.0);
          r.dkdv_bwd[0] = time_ws(dkdv_by_consumers);
          r.dkdv_bwd[1] = time_ws(base);
          r.dkdv_bwd[2] = time_ws(base);
          r.dkdv_bwd[3] = time_ws(dkdv_by_consumers);
        }
      }
      check_cuda(cudaDeviceSynchronize(), "timing");
      for (void* p : {q, k, v, o, d_o, workspace}) cudaFree(p);
      for (float* p : {lse, dsum, dq, dk, dv}) cudaFree(p);
      results.push_back(r);
      std::fprintf(stderr, "%s done\n", name.c_str());
    }

    std::ofstream js(out_dir + "/treecp_results.json");
    js << "[\n";
    std::printf("\ntreecp CUDA slice attention, Hq=%d Hkv=%d D=%d bf16, %s\n", kHq, kHkv, kD, prop.name);
    std::printf("| preset | tokens | visible pairs | setup ms (build) | fwd ms | fwd TFLOP/s | fwd ms wgmma / mma.sync 16 / 32 rows per warp | "
                "bwd ms (TFLOP/s) | bwd ms mma.sync | fwd+bwd ms | fwd+bwd TFLOP/s | check O / LSE rel err | fwd tile pairs full/partial | "
                "bwd tile pairs full/partial |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      const double flop = 4.0 * static_cast<double>(r.pairs) * kD * kHq;
      std::printf("| %s | %lld | %lld | %.3f (%.3f) | %.3f | %.1f | %.3f / %.3f / %.3f | %.3f (%.1f) | %.3f | %.3f | %.1f | %.1e / %.1e | %lld/%lld | %lld/%lld |\n",
                  r.preset.c_str(), static_cast<long long>(r.tokens), static_cast<long long>(r.pairs), r.setup_ms,
                  r.build_ms, r.fwd_ms, flop / r.fwd_ms / 1e9, r.fwdwg_ms, r.fwd16_ms, r.fwd32_ms, r.bwd_ms,
                  2.5 * flop / r.bwd_ms / 1e9, r.bwd_mma_ms, r.fwdbwd_ms, 3.5 * flop / r.fwdbwd_ms / 1e9, r.err_o,
                  r.err_lse, static_cast<long long>(r.fwd_full), static_cast<long long>(r.fwd_partial),
                  static_cast<long long>(r.bwd_full), static_cast<long long>(r.bwd_partial));
      js << "  {\"preset\": \"" << r.preset << "\", \"tokens\": " << r.tokens << ", \"pairs\": " << r.pairs
         << ", \"setup_ms\": " << r.setup_ms << ", \"fwd_ms\": " << r.fwd_ms << ", \"fwdbwd_ms\": " << r.fwdbwd_ms
         << ", \"err_o\": " << r.err_o << ", \"fp16_fwd_ms\": " << r.f16_fwd_ms << ", \"fp16_fwdbwd_ms\": " << r.f16_fwdbwd_ms
         << ", \"fp16_err_o\": " << r.f16_err_o << "}" << (i + 1 < results.size() ? "," : "") << "\n";
    }
    js << "]\n";
    std::printf("\nfp16 (the same values rounded to fp16), the default paths timed as the table's, ms (fp16 / bf16 - 1); "
                "check: sampled O / LSE rel err against the double reference of the fp16 inputs\n");
    std::printf("| preset | fwd ms | bwd ms | fwd+bwd ms | check O / LSE rel err |\n|---|---|---|---|---|\n");
    for (const Result& r : results)
      std::printf("| %s | %.3f (%+.1f%%) | %.3f (%+.1f%%) | %.3f (%+.1f%%) | %.1e / %.1e |\n", r.preset.c_str(), r.f16_fwd_ms,
                  100 * (r.f16_fwd_ms / r.fwd_ms - 1), r.f16_bwd_ms, 100 * (r.f16_bwd_ms / r.bwd_ms - 1), r.f16_fwdbwd_ms,
                  100 * (r.f16_fwdbwd_ms / r.fwdbwd_ms - 1), r.f16_err_o, r.f16_err_lse);
    std::printf("\nbackward attribution (timing only): wgmma bwd kernel without its dQ reduction, ms\n");
    for (const Result& r : results)
      std::printf("  %-12s default bwd %.3f ms (incl. dsum + zeroing); wgmma kernel (+ dK/dV zeroing) %.3f ms, the same without dQ adds %.3f ms; "
                  "dQ zeroing %.3f ms, Dsum kernel %.3f ms\n",
                  r.preset.c_str(), r.bwd_ms, r.bwd_kernel_ms, r.bwd_nodq_ms, r.memset_dq_ms, r.dsum_ms);
    std::printf("\nwgmma forward kernel by variant, ms, in timing order: kTwo / kOne / kOne+kPerThread loads / kTwo again / "
                "kOne again / kOne+kPerThread again (kTwo and kOne with the generic loads); then warp-specialised TMA (ws) / ws with Q in "
                "registers (wsq) / wsq with intra-warpgroup overlap (wso) / kOne+kPerThread / wso / wsq / ws\n");
    for (const Result& r : results)
      std::printf("  %-12s %.3f / %.3f / %.3f / %.3f / %.3f / %.3f;  %.3f / %.3f / %.3f / %.3f / %.3f / %.3f / %.3f\n",
                  r.preset.c_str(), r.fwd_two_ms, r.fwd_one_ms, r.fwd_lean_ms, r.fwd_two2_ms, r.fwd_one2_ms, r.fwd_lean2_ms,
                  r.fwd_ws_ms, r.fwd_wsq_ms, r.fwd_wso_ms, r.fwd_lean3_ms, r.fwd_wso2_ms, r.fwd_wsq2_ms, r.fwd_ws2_ms);
    std::printf("\nwgmma backward kernel (+ dK/dV zeroing) by overlap variant, ms: kNone / kDkv / kDkvDq / kNone again\n");
    for (const Result& r : results)
      std::printf("  %-12s %.3f / %.3f / %.3f / %.3f\n", r.preset.c_str(), r.bwd_none_ms, r.bwd_dkv_ms, r.bwd_kernel_ms,
                  r.bwd_none2_ms);
    std::printf("\nbackward kernel (+ dK/dV zeroing), ms, in timing order: wgmma kDkvDq / warp-specialised (ws) / "
                "ws with dQ by TMA bulk reductions (wsr, the default) / wgmma / ws / wsr (change: mean of each pair against wgmma)\n");
    for (const Result& r : results)
      std::printf("  %-12s %.3f / %.3f / %.3f / %.3f / %.3f / %.3f  (ws %+.1f%%, wsr %+.1f%%)\n", r.preset.c_str(), r.bwd_wg_ms,
                  r.bwd_ws_ms, r.bwd_wsr_ms, r.bwd_wg2_ms, r.bwd_ws2_ms, r.bwd_wsr2_ms,
                  100.0 * ((r.bwd_ws_ms + r.bwd_ws2_ms) / (r.bwd_wg_ms + r.bwd_wg2_ms) - 1.0),
                  100.0 * ((r.bwd_wsr_ms + r.bwd_wsr2_ms) / (r.bwd_wg_ms + r.bwd_wg2_ms) - 1.0));
    std::printf("\nwarp-specialised backward kernel (+ dK/dV zeroing) by walk order, ms, in timing order: every walk forward / "
                "first wave reversed (the default) / forward / first wave reversed\n");
    for (const Result& r : results)
      std::printf("  %-12s %.3f / %.3f / %.3f / %.3f  (first wave reversed %+.1f%%)\n", r.preset.c_str(), r.walk_fwd_ms,
                  r.walk_rev_ms, r.walk_fwd2_ms, r.walk_rev2_ms,
                  100.0 * ((r.walk_rev_ms + r.walk_rev2_ms) / (r.walk_fwd_ms + r.walk_fwd2_ms) - 1.0));
    std::printf("\nwarp-specialised backward kernel (+ dK/dV zeroing) by block order, ms: default order, first wave reversed / "
                "segment order, every walk reversed / default / segment, timed A B B A (the rule's pick; relative change of "
                "sum |dK| + |dV| between the orders)\n");
    for (const Result& r : results)
      std::printf("  %-12s %.3f / %.3f / %.3f / %.3f  (segment order %+.1f%%; rule: %s; check %.1e)\n", r.preset.c_str(),
                  r.seg_def_ms, r.seg_seg_ms, r.seg_def2_ms, r.seg_seg2_ms,
                  100.0 * ((r.seg_seg_ms + r.seg_seg2_ms) / (r.seg_def_ms + r.seg_def2_ms) - 1.0),
                  r.seg_rule ? "segment" : "default", r.seg_check);
    std::printf("\nwarp-specialised backward kernel (+ dK/dV zeroing) by idle-step skip, ms: warpgroup 1 computes every step / "
                "skips the steps its keys see no query of (the default) / computes / skips, timed A B B A\n");
    for (const Result& r : results)
      std::printf("  %-12s %.3f / %.3f / %.3f / %.3f  (skip %+.1f%%)\n", r.preset.c_str(), r.idle_off_ms, r.idle_on_ms,
                  r.idle_off2_ms, r.idle_on2_ms,
                  100.0 * ((r.idle_on_ms + r.idle_on2_ms) / (r.idle_off_ms + r.idle_off2_ms) - 1.0));
    std::printf("\nwarp-specialised forward kernel by O epilogue, ms: direct stores / TMA store from shared memory / TMA / "
                "direct, timed A B B A\n");
    for (const Result& r : results)
      std::printf("  %-12s %.3f / %.3f / %.3f / %.3f  (TMA %+.1f%%)\n", r.preset.c_str(), r.tmao_fwd[0], r.tmao_fwd[1],
                  r.tmao_fwd[2], r.tmao_fwd[3],
                  100.0 * ((r.tmao_fwd[1] + r.tmao_fwd[2]) / (r.tmao_fwd[0] + r.tmao_fwd[3]) - 1.0));
    std::printf("\ndefault forward (persistent, with a workspace), ms: after 1 s idle / the table's (after 0.5 s of back-to-back calls)\n");
    for (const Result& r : results)
      std::printf("  %-12s %.3f / %.3f  (%+.1f%%)\n", r.preset.c_str(), r.fwd_idle_ms, r.fwd_ms,
                  100.0 * (r.fwd_ms / r.fwd_idle_ms - 1.0));
    std::printf("\nwarp-specialised forward kernel (one block per item), ms: after 1 s idle / after 0.5 s of back-to-back launches\n");
    for (const Result& r : results)
      std::printf("  %-12s %.3f / %.3f  (%+.1f%%)\n", r.preset.c_str(), r.cold_fwd_ms, r.warm_fwd_ms,
                  100.0 * (r.warm_fwd_ms / r.cold_fwd_ms - 1.0));
    std::printf("\nwarp-specialised forward kernel, ms: one block per item (A) / persistent (B: one block per SM, items from a "
                "counter), launched alternately (median of each, median of B / A of adjacent launches; O bitwise equal: 0; "
                "+1: the item read at the boundary differs, +2: the item published ahead differs, +4: kPersistent differs from the "
                "held offset packed after its vote)\n");
    for (const Result& r : results)
      std::printf("  %-12s %.3f / %.3f  (persistent %+.1f%%; check %.0f)\n", r.preset.c_str(), r.persist_fwd[0],
                  r.persist_fwd[1], 100.0 * (r.persist_fwd[2] - 1.0), r.persist_check);
    std::printf("\npersistent forward with the item published one item ahead, alternated: ms, against the item read at the "
                "boundary (AH), against one block per item (kDefault)\n");
    for (const Result& r : results)
      std::printf("  %-12s %.3f  (%+.1f%% vs AH, %+.1f%% vs kDefault)\n", r.preset.c_str(), r.prefetch_fwd[0],
                  100.0 * (r.prefetch_fwd[1] - 1.0), 100.0 * (r.prefetch_fwd[2] - 1.0));
    std::printf("\npersistent forward with the held-offset softmax, P packed after the vote, against the online softmax, "
                "alternated: ms, change, relative L2 difference of O\n");
    for (const Result& r : results)
      std::printf("  %-12s %.3f  (%+.1f%% vs online; O differs by %.1e; P packed before the vote, kPersistent: %+.1f%%)\n",
                  r.preset.c_str(), r.held_fwd[0], 100.0 * (r.held_fwd[1] - 1.0), r.held_check,
                  100.0 * (r.early_fwd - 1.0));
    std::printf("\nwarp-specialised backward kernel (+ dK/dV zeroing) by dK/dV epilogue, ms: read-add-write / TMA bulk "
                "reductions / TMA / read-add-write, timed A B B A in the rule's order (relative change of sum |dK| + |dV|)\n");
    for (const Result& r : results)
      std::printf("  %-12s %.3f / %.3f / %.3f / %.3f  (TMA %+.1f%%; check %.1e)\n", r.preset.c_str(), r.dkdv_bwd[0],
                  r.dkdv_bwd[1], r.dkdv_bwd[2], r.dkdv_bwd[3],
                  100.0 * ((r.dkdv_bwd[1] + r.dkdv_bwd[2]) / (r.dkdv_bwd[0] + r.dkdv_bwd[3]) - 1.0), r.dkdv_check);
    for (const Result& r : results)
      if (!(r.err_o < 1e-2) || !(r.err_lse < 1e-3) || !(r.seg_check < 1e-3) || !(r.dkdv_check < 1e-3) || r.persist_check != 0.0 ||
          !(r.held_check < 1e-2)) {
        std::fprintf(stderr, "bench_attention: %s check failed (O %.2e, LSE %.2e, block orders %.2e, dK/dV epilogues %.2e, persistent forward %.0f, held offset %.2e)\n",
                     r.preset.c_str(), r.err_o, r.err_lse, r.seg_check, r.dkdv_check, r.persist_check, r.held_check);
        return 1;
      }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_attention: %s\n", e.what());
    return 1;
  }
  return 0;
}
