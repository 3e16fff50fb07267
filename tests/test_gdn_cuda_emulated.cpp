// The CUDA GDN/KDA kernels (src/kernels/cuda/gdn_device.cuh) run on the host: each block's 256 threads are
// std::threads, __syncthreads a std::barrier, shared memory a buffer filled with NaN before each block and the
// workspace all NaN before each call, so a missing barrier, a read of something never written or an indexing
// slip shows as a wrong or NaN result. The same checks run on the GPU in tests/cuda/test_gdn_cuda.cpp.
// The layer's small kernels (src/kernels/cuda/layer_ops_device.cuh: the summary algebra on interleaved maps, the
// L2 normalisation, the short convolution) run here too, against kernels/cpu and the CPU backend in double.
#include <gtest/gtest.h>

#include <barrier>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <tuple>

#include "common/gdn_cuda.hpp"
#include "kernels/cpu/conv1d.hpp"
#include "kernels/cuda/layer_ops_device.cuh"
#include "plan/ownership.hpp"
#include "runtime/conv_cp.hpp"
#include "runtime/cpu_backend.hpp"

namespace treecp::cuda {
namespace {

using namespace gdn_test;

// Threads per block: the bodies loop with the block's stride, so any count is valid; 96 (fewer than the 128
// columns, more than a short chunk's rows, not a power of two) keeps the suite fast; one test runs the GPU's 256.
struct EmulatedExec {
  int threads = 96;
  std::vector<std::string> launched;  // every launch's kernel name (K::kName), in order
  template <class K>
  void launch(int64_t blocks, const typename K::Args& a) {
    launched.push_back(K::kName);
    const int nthr = threads;
    std::vector<float> smem(K::smem_bytes(a) / sizeof(float) + 1);
    std::barrier<> bar(nthr);
    std::vector<std::thread> threads;
    for (int tid = 0; tid < nthr; ++tid)
      threads.emplace_back([&, tid] {
        detail::emulated_block_barrier = &bar;
        for (int64_t b = 0; b < blocks; ++b) {
          if (tid == 0) std::fill(smem.begin(), smem.end(), std::numeric_limits<float>::quiet_NaN());
          bar.arrive_and_wait();
          K::run(a, b, tid, nthr, smem.data());
          bar.arrive_and_wait();  // the block is done before the next one refills shared memory
        }
      });
    for (auto& t : threads) t.join();
  }
  void upload(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
};

// Host memory standing in for the device's; calls run the shared launch sequences on EmulatedExec.
struct EmulatedDev {
  std::vector<std::unique_ptr<unsigned char[]>> blocks;
  EmulatedExec x;

  void* raw(size_t bytes) {
    blocks.emplace_back(new unsigned char[bytes + 256]);
    const uintptr_t p = reinterpret_cast<uintptr_t>(blocks.back().get());
    return reinterpret_cast<void*>((p + 255) / 256 * 256);
  }
  template <class T>
  T* put(const std::vector<T>& host) {
    T* p = static_cast<T*>(raw(host.size() * sizeof(T)));
    std::memcpy(p, host.data(), host.size() * sizeof(T));
    return p;
  }
  template <class T>
  std::vector<T> get(const T* p, size_t n) {
    return std::vector<T>(p, p + n);
  }
  // Each workspace is followed by a guard of 0xff bytes that every call checks afterwards: the sizes are exact
  // (workspace_bytes), so a kernel writing past its call's carving shows here, and one reading past it reads NaN.
  static constexpr size_t kGuard = 4096;
  std::vector<const unsigned char*> guards;
  void* workspace(size_t bytes) {
    unsigned char* p = static_cast<unsigned char*>(raw(bytes + kGuard));
    std::memset(p, 0xff, bytes + kGuard);
    guards.push_back(p + bytes);
    return p;
  }
  void check_guards(const char* call) {
    for (const unsigned char* g : guards)
      for (size_t i = 0; i < kGuard; ++i)
        if (g[i] != 0xff) {
          ADD_FAILURE() << call << " wrote " << i << " bytes past the end of its workspace";
          return;
        }
  }
  size_t workspace_bytes(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, GdnCallKind kind) {
    detail::gdn_check(p, runs, false);
    return detail::GdnSchedule(p, runs, kind).bytes;
  }
  void forward(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs) {
    detail::gdn_forward_on(x, p, runs);
    check_guards("gdn_forward");
  }
  void summary(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, float* M, float* E) {
    detail::gdn_summary_on(x, p, runs, M, E);
    check_guards("gdn_summary");
  }
  void backward(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, const GdnCudaGrads& g) {
    detail::gdn_backward_on(x, p, runs, g);
    check_guards("gdn_backward");
  }
  void compose(int64_t n, int dk, int dv, const float* MB, const float* EB, const float* MA, const float* EA, float* M,
               float* E) {
    detail::gdn_compose_on(x, n, dk, dv, MB, EB, MA, EA, M, E);
  }
  void apply(int64_t n, int dk, int dv, const float* M, const float* E, const float* s, float* out) {
    detail::gdn_apply_on(x, n, dk, dv, M, E, s, out);
  }
  void apply_transposed(int64_t n, int dk, int dv, const float* M, const float* a, const float* ds, float* out) {
    detail::gdn_apply_transposed_on(x, n, dk, dv, M, a, ds, out);
  }
};

class GdnCudaEmulated : public ::testing::TestWithParam<Shape> {
 protected:
  Case make(uint64_t seed) const {
    const Shape s = GetParam();
    return Case(ragged_tokens(1), 2, s.dk, s.dv, s.gate, ragged_runs(1), 4, seed);
  }
};

TEST_P(GdnCudaEmulated, ForwardMatchesTheRecurrence) {
  EmulatedDev dev;
  const Case c = make(11);
  check_forward(dev, c, /*y_f32=*/false);
  check_forward(dev, c, /*y_f32=*/true);
}

TEST_P(GdnCudaEmulated, BackwardMatchesTheRecurrence) {
  EmulatedDev dev;
  check_backward(dev, make(12), /*dy_f32=*/false);
}

// Many chunks in one run from an initial state: the error must not grow beyond the float reference's (the GPU test
// runs the long case at every shape).
TEST(GdnCudaEmulatedLong, ManyChunks) {
  for (const Shape s : {Shape{GdnGate::Scalar, 64, 64}, Shape{GdnGate::PerChannel, 48, 80}}) {
    EmulatedDev dev;
    const Case c(1000, 1, s.dk, s.dv, s.gate, {{0, 1000, 0, 0}}, 1, 14);
    check_forward(dev, c, /*y_f32=*/true);
    check_backward(dev, c, /*dy_f32=*/false);
  }
}

TEST_P(GdnCudaEmulated, SummaryAppliedEqualsTheForward) {
  EmulatedDev dev;
  check_summary(dev, make(13));
}

INSTANTIATE_TEST_SUITE_P(Shapes, GdnCudaEmulated,
                         all_shapes(), shape_name);

TEST(GdnCudaEmulatedLaunch, TheGpuBlockSize) {
  EmulatedDev dev;
  dev.x.threads = detail::kGdnThreads;
  const Case c(ragged_tokens(1), 1, 64, 64, GdnGate::PerChannel, ragged_runs(1), 4, 31);
  check_forward(dev, c, /*y_f32=*/false);
  check_backward(dev, c, /*dy_f32=*/true);
}

// 16 state columns per scan block, with partial tiles (dv 72 = 4 x 16 + 8, the summary's dk 40 = 2 x 16 + 8).
TEST(GdnCudaEmulatedLaunch, SixteenScanColumns) {
  EmulatedDev dev;
  Case c(ragged_tokens(1), 2, 40, 72, GdnGate::PerChannel, ragged_runs(1), 4, 32);
  c.scan_columns = 16;
  check_forward(dev, c, /*y_f32=*/true);
  check_backward(dev, c, /*dy_f32=*/false);
  check_summary(dev, c);
}

// Shapes off the scans' vector paths: dk 37 and dv 21 (4-byte copies, dY read directly at odd dv, rows and inner
// sums not multiples of 4), and dk 256, where one chunk buffer of each scan holds two matrices in turn (as at dk 128
// and 16 columns, the last case).
TEST(GdnCudaEmulatedLaunch, OddAndWideShapes) {
  EXPECT_FALSE(detail::gdn_scan_alias(128, 32, false) || detail::gdn_scan_alias(128, 32, true));
  EXPECT_TRUE(detail::gdn_scan_alias(256, 32, false) && detail::gdn_scan_alias(256, 32, true));
  for (const bool backward : {false, true}) {  // two blocks an SM instead of one
    EXPECT_TRUE(detail::gdn_scan_alias(128, 16, backward));
    EXPECT_EQ(detail::gdn_blocks_per_sm(detail::gdn_scan_floats(128, 16, backward, true)), 2);
  }
  EXPECT_LE(detail::gdn_scan_floats(256, 32, true, true) * 4, detail::kGdnSmemMaxBytes);
  EXPECT_LE(detail::gdn_scan_floats(256, 32, false, true) * 4, detail::kGdnSmemMaxBytes);
  for (const Shape s : {Shape{GdnGate::PerChannel, 37, 21}, Shape{GdnGate::Scalar, 256, 40}}) {
    EmulatedDev dev;
    const Case c(ragged_tokens(1), 1, s.dk, s.dv, s.gate, ragged_runs(1), 4, 35);
    check_forward(dev, c, /*y_f32=*/false);
    check_backward(dev, c, /*dy_f32=*/false);
    check_summary(dev, c);
  }
  EmulatedDev dev;
  Case c(200, 1, 128, 64, GdnGate::PerChannel, {{0, 200, 0, 0}}, 1, 36);
  c.scan_columns = 16;
  check_forward(dev, c, /*y_f32=*/true);
  check_backward(dev, c, /*dy_f32=*/false);
}

// KDA's factored pair sums (prep's blocks below the diagonal, the gradients' gather) at dk 128 on each arithmetic are
// in the shape tests; here dk 160, where the gradients' staged rows would cost the second block an SM and the direct
// gather runs instead.
TEST(GdnCudaEmulatedLaunch, KdaDirectGatherAboveDk128) {
  using Grad = detail::GdnGradKernel<detail::kGdnFma>;
  EXPECT_TRUE(Grad::kda_ref(false, 128, 128));
  EXPECT_FALSE(Grad::kda_ref(false, 160, 24));
  EXPECT_FALSE(Grad::kda_ref(true, 64, 64));
  for (const GdnPrecision precision : {GdnPrecision::fp32, GdnPrecision::bf16_tensor}) {
    EmulatedDev dev;
    Case c(ragged_tokens(1), 1, 160, 24, GdnGate::PerChannel, ragged_runs(1), 4, 47);
    c.precision = precision;
    check_forward(dev, c, /*y_f32=*/true);
    check_backward(dev, c, /*dy_f32=*/false);
  }
}

// Every chunk product on tensor cores (3xTF32 fragments, the host path of gdn_mma_tf32x3: scans, prep, gradients)
// under the same fp32 tolerances: 32 columns at 64 / 64, and 16 columns with partial 16 x 8 tiles (dv 72, the
// summary's dk 40, chunks of 37 and 6 rows).
TEST(GdnCudaEmulatedLaunch, TensorCoreScans) {
  EmulatedDev dev;
  Case a(ragged_tokens(1), 1, 64, 64, GdnGate::Scalar, ragged_runs(1), 4, 33);
  a.tensor_cores = true;
  check_forward(dev, a, /*y_f32=*/true);
  check_backward(dev, a, /*dy_f32=*/false);
  Case b(ragged_tokens(1), 1, 40, 72, GdnGate::PerChannel, ragged_runs(1), 4, 34);
  b.tensor_cores = true;
  b.scan_columns = 16;
  check_forward(dev, b, /*y_f32=*/false);
  check_backward(dev, b, /*dy_f32=*/true);
  check_summary(dev, b);
}

// Prep's and the gradients' products on bf16 tensor cores (GdnPrecision::bf16_tensor: the host path of the bf16 mma,
// operands rounded as the device rounds them) against the double recurrence, within the bf16 model's error: both
// gates, the 64-row panels with partial 16 x 8 tiles (dv 72, dk 40, chunks of 37 and 6 rows), inner sizes past one
// panel (dk 128), fp32 and bf16 dy; and at the GPU's 256 threads.
TEST(GdnCudaEmulatedLaunch, Bf16TensorCorePrepAndGradients) {
  EmulatedDev dev;
  Case a(ragged_tokens(1), 1, 64, 64, GdnGate::Scalar, ragged_runs(1), 4, 37);
  a.precision = GdnPrecision::bf16_tensor;
  check_forward(dev, a, /*y_f32=*/true);
  check_backward(dev, a, /*dy_f32=*/false);
  Case b(ragged_tokens(1), 1, 40, 72, GdnGate::PerChannel, ragged_runs(1), 4, 38);
  b.precision = GdnPrecision::bf16_tensor;
  check_forward(dev, b, /*y_f32=*/false);
  check_backward(dev, b, /*dy_f32=*/true);
  check_summary(dev, b);
  Case d(200, 1, 128, 128, GdnGate::Scalar, {{0, 200, 0, 0}}, 1, 39);
  d.precision = GdnPrecision::bf16_tensor;
  dev.x.threads = 256;
  check_forward(dev, d, /*y_f32=*/true);
  check_backward(dev, d, /*dy_f32=*/false);
}

// The scans' products on bf16 mma too (GdnPrecision::bf16_tensor_scans), within the same model: 32 columns, and 16
// with partial 16 x 8 tiles (dv 72, the summary's dk 40, chunks of 37 and 6 rows); the split forward on it.
TEST(GdnCudaEmulatedLaunch, Bf16TensorCoreScans) {
  EmulatedDev dev;
  Case a(ragged_tokens(1), 1, 64, 64, GdnGate::Scalar, ragged_runs(1), 4, 42);
  a.precision = GdnPrecision::bf16_tensor_scans;
  check_forward(dev, a, /*y_f32=*/true);
  check_backward(dev, a, /*dy_f32=*/false);
  Case b(ragged_tokens(1), 1, 40, 72, GdnGate::PerChannel, ragged_runs(1), 4, 43);
  b.precision = GdnPrecision::bf16_tensor_scans;
  b.scan_columns = 16;
  check_forward(dev, b, /*y_f32=*/false);
  check_backward(dev, b, /*dy_f32=*/true);
  check_summary(dev, b);
  b.split_forward = true;
  check_forward(dev, b, /*y_f32=*/true);
}

// The split forward (GdnCudaParams::split_forward: the saving scan, then the chunk-parallel output kernel) on each
// arithmetic, partial chunks and tiles (dk 40, dv 72), y bf16 and fp32, and the summary (which it leaves as it was).
TEST(GdnCudaEmulatedLaunch, SplitForward) {
  EmulatedDev dev;
  for (const GdnPrecision precision : {GdnPrecision::fp32, GdnPrecision::bf16_tensor}) {
    Case a(ragged_tokens(1), 1, 40, 72, GdnGate::PerChannel, ragged_runs(1), 4, 40);
    a.precision = precision;
    a.split_forward = true;
    check_forward(dev, a, /*y_f32=*/false);
    check_forward(dev, a, /*y_f32=*/true);
    check_summary(dev, a);
  }
  Case b(200, 2, 128, 128, GdnGate::Scalar, {{0, 200, 0, 0}}, 1, 41);
  b.split_forward = true;
  b.tensor_cores = true;
  dev.x.threads = 256;
  check_forward(dev, b, /*y_f32=*/true);
}

// The FLA-like split forward (GdnCudaParams::fla_split: compact prep, the scan's state in mma fragments, the
// chunk-parallel output; every product bf16) against the double recurrence within the bf16 model's bounds, at the
// GPU's 256 threads (its bodies assume 8 warps): ragged runs from initial states (chunks of 37 and 6 rows, an empty
// run), dk and dv 64 and 128 in each pairing, 16, 32 and 64 state columns, y bf16 and fp32, the final states; a
// long run of 1,000 tokens; and the summary on the same parameters (which runs the classic kernels in the same
// workspace).
TEST(GdnCudaEmulatedLaunch, FlaSplitForward) {
  EmulatedDev dev;
  dev.x.threads = detail::kGdnThreads;
  uint64_t seed = 60;
  // The scan's (dk, columns) pairs each way its warps' tiles split: state and v_new tiles in pairs (64 / 32, 64 / 64,
  // 128 / 64: gdn_mma_b16_pair), the state's only (128 / 16), neither (64 / 16: gdn_mma_b16).
  for (const auto& [dk, dv, cols] : {std::tuple{64, 64, 0}, std::tuple{128, 128, 16}, std::tuple{64, 128, 64},
                                    std::tuple{128, 64, 32}, std::tuple{128, 128, 64}, std::tuple{64, 64, 16}}) {
    Case c(ragged_tokens(1), 2, dk, dv, GdnGate::Scalar, ragged_runs(1), 4, ++seed);
    c.fla(cols);
    check_forward(dev, c, /*y_f32=*/cols % 32 == 0);
    if (dk == 64 && dv == 64) check_summary(dev, c);
  }
  Case l(1000, 1, 128, 128, GdnGate::Scalar, {{0, 1000, 0, 0}}, 1, ++seed);
  l.fla();
  check_forward(dev, l, /*y_f32=*/false);
}

// The FLA-like split backward (gdn_fla_bwd_device.cuh: the split's prep and scan again, the local kernel, the reverse
// scan of the state gradient, the gradients per chunk; every product bf16) against the double recurrence within the
// bf16 model's bounds, at 256 threads: ragged runs from initial states with dL/d(final state) (chunks of 37 and 6
// rows, an empty run), every (dk, dv) pairing and column count the forward test takes, dy bf16 and fp32; then a long
// run of 300 tokens, its bf16 dy also 2 bytes off a 4-byte boundary and 4 bytes off a 16-byte one.
TEST(GdnCudaEmulatedLaunch, FlaSplitBackward) {
  EmulatedDev dev;
  dev.x.threads = detail::kGdnThreads;
  uint64_t seed = 80;
  for (const auto& [dk, dv, cols] : {std::tuple{64, 64, 0}, std::tuple{128, 128, 16}, std::tuple{64, 128, 64},
                                    std::tuple{128, 64, 32}, std::tuple{64, 64, 16}}) {
    Case c(ragged_tokens(1), 2, dk, dv, GdnGate::Scalar, ragged_runs(1), 4, ++seed);
    c.fla(cols);
    check_backward(dev, c, /*dy_f32=*/cols % 32 == 0);
  }
  Case l(300, 1, 128, 128, GdnGate::Scalar, {{0, 300, 0, 0}}, 1, ++seed);
  l.fla();
  check_backward(dev, l, /*dy_f32=*/false);
  check_backward(dev, l, /*dy_f32=*/false, /*dy_offset=*/1);  // element loads instead of cp.async
  check_backward(dev, l, /*dy_f32=*/false, /*dy_offset=*/2);  // cp.async in 4-byte units (not 16-byte aligned)
}

// A forward that keeps its arrays (GdnCudaParams::keep_forward) and the backward that reads them instead of computing
// them again: the same gradients against the double recurrence within the bf16 model's bounds (the workspace starts
// all NaN, so an array the kept forward did not write shows), on ragged runs from initial states with 16-, 32- and
// 64-column scans and on a long run; the kept backward launches neither the prep nor the scan (the plain one both);
// the forward's y is the plain forward's; and keep_forward without
// fla_split is refused by name.
TEST(GdnCudaEmulatedLaunch, FlaSplitKeptForward) {
  EmulatedDev dev;
  dev.x.threads = detail::kGdnThreads;
  uint64_t seed = 120;
  for (const auto& [dk, dv, cols] : {std::tuple{64, 64, 16}, std::tuple{128, 64, 32}, std::tuple{64, 128, 64}}) {
    Case c(ragged_tokens(1), 2, dk, dv, GdnGate::Scalar, ragged_runs(1), 4, ++seed);
    c.fla(cols);
    check_backward(dev, c, /*dy_f32=*/cols == 32, /*dy_offset=*/0, /*kept=*/true);
  }
  Case l(300, 1, 128, 128, GdnGate::Scalar, {{0, 300, 0, 0}}, 1, ++seed);
  l.fla();
  check_backward(dev, l, /*dy_f32=*/false, /*dy_offset=*/0, /*kept=*/true);
  // What each call launches: the kept forward the prep and the scan (and no output without y), its backward neither.
  GdnCudaParams pk = device_params(dev, l, GdnCallKind::backward);
  pk.keep_forward = true;
  pk.state_out = dev.put(std::vector<float>(l.state_in.size(), 0.f));
  dev.x.launched.clear();
  dev.forward(pk, l.runs);
  EXPECT_EQ(dev.x.launched, (std::vector<std::string>{"gdn fla prep", "gdn fla scan"}));
  GdnCudaGrads g;
  g.dy = dev.put(l.dy.bits);
  g.dq = dev.put(std::vector<float>(l.q.val.size(), 0.f));
  dev.x.launched.clear();
  dev.backward(pk, l.runs, g);
  EXPECT_EQ(dev.x.launched, (std::vector<std::string>{"gdn fla bwd local", "gdn fla bwd scan", "gdn fla bwd grads"}));
  pk.keep_forward = false;
  dev.x.launched.clear();
  dev.backward(pk, l.runs, g);
  EXPECT_EQ(dev.x.launched, (std::vector<std::string>{"gdn fla prep", "gdn fla scan", "gdn fla bwd local",
                                                      "gdn fla bwd scan", "gdn fla bwd grads"}));
  // The kept forward's y is the plain forward's, bit for bit (the same kernels; its prep also writes X).
  GdnCudaParams p = device_params(dev, l, GdnCallKind::forward);
  p.state_out = pk.state_out;
  pk.keep_forward = true;
  const size_t ny = l.v.val.size();
  uint16_t* y = dev.put(std::vector<uint16_t>(ny, 0));
  uint16_t* yk = dev.put(std::vector<uint16_t>(ny, 1));
  p.y = y;
  pk.y = yk;
  dev.forward(p, l.runs);
  dev.forward(pk, l.runs);
  EXPECT_EQ(dev.get(y, ny), dev.get(yk, ny));
  p.keep_forward = true;
  p.fla_split = false;
  try {
    dev.forward(p, l.runs);
    ADD_FAILURE() << "keep_forward without fla_split accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("keep_forward"), std::string::npos) << e.what();
  }
}

// The split's refusals, each naming what is wrong.
TEST(GdnCudaEmulatedChecks, FlaSplitRefusesWhatItDoesNotTake) {
  GdnCudaParams p;
  p.tokens = 10; p.heads = 1; p.dk = 128; p.dv = 128; p.fla_split = true;
  p.precision = GdnPrecision::bf16_tensor_scans;
  const std::vector<GdnCudaRun> runs = {{0, 10}};
  auto message = [&] {
    try {
      detail::gdn_check(p, runs, false);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(message(), "");
  p.scan_columns = 64;
  EXPECT_EQ(message(), "");
  p.gate = GdnGate::PerChannel;
  EXPECT_NE(message().find("scalar gate"), std::string::npos);
  p.gate = GdnGate::Scalar;
  p.dk = 96;
  EXPECT_NE(message().find("dk and dv of 64 or 128"), std::string::npos);
  p.dk = 128;
  p.precision = GdnPrecision::bf16_tensor;
  EXPECT_NE(message().find("bf16_tensor_scans"), std::string::npos);
  p.precision = GdnPrecision::bf16_tensor_scans;
  p.split_forward = true;
  EXPECT_NE(message().find("split_forward"), std::string::npos);
  p.split_forward = false;
  p.fla_split = false;
  EXPECT_NE(message().find("scan_columns"), std::string::npos);  // 64 columns only with the split
}

// gdn_fla_split_takes (which CudaBackend::set_gdn_fla_split asks, to fall back to the classic forward elsewhere) holds
// exactly where gdn_check takes the split: over every gate, head dims around the two taken, both dtypes, every
// precision, split_forward, the column counts and q / k alignment.
TEST(GdnCudaEmulatedChecks, FlaSplitTakesIsWhatTheCheckTakes) {
  const std::vector<GdnCudaRun> runs = {{0, 10}};
  alignas(4) static const uint16_t buf[4] = {};
  const void* aligned = buf;
  const void* odd = reinterpret_cast<const unsigned char*>(buf) + 1;
  int taken = 0, cases = 0;
  for (const GdnGate gate : {GdnGate::Scalar, GdnGate::PerChannel})
    for (const int dk : {32, 64, 96, 128, 256})
      for (const int dv : {64, 80, 128})
        for (const DType dt : {DType::kBf16, DType::kF16})
          for (const GdnPrecision pr : kGdnPrecisions)
            for (const bool split : {false, true})
              for (const int cols : {0, 16, 32, 64})
                for (const void* qk : {aligned, odd}) {
                  GdnCudaParams p;
                  p.tokens = 10; p.heads = 2; p.dk = dk; p.dv = dv; p.gate = gate; p.dtype = dt; p.precision = pr;
                  p.split_forward = split; p.scan_columns = cols; p.q = qk; p.k = qk; p.v = qk;
                  p.g = p.beta = aligned;
                  bool checked = true;
                  try {
                    p.fla_split = true;
                    detail::gdn_check(p, runs);
                  } catch (const Error&) {
                    checked = false;
                  }
                  p.fla_split = false;  // the question is asked before the split is chosen
                  EXPECT_EQ(gdn_fla_split_takes(p), checked)
                      << "gate " << static_cast<int>(gate) << " dk " << dk << " dv " << dv << " dtype "
                      << static_cast<int>(dt) << " precision " << gdn_precision_name(pr) << " split_forward " << split
                      << " columns " << cols << " q/k " << qk;
                  taken += checked;
                  ++cases;
                }
  EXPECT_GT(taken, 0);
  EXPECT_LT(taken, cases);
  GdnCudaParams shape;  // a size query has no pointers: they count as aligned
  shape.tokens = 10; shape.heads = 1; shape.dk = shape.dv = 128; shape.precision = GdnPrecision::bf16_tensor_scans;
  EXPECT_TRUE(gdn_fla_split_takes(shape));
}

// The workspace of each call is exactly its carving (GdnSchedule::carves: the descriptors, then one block a (chunk,
// head)), against sizes worked out here from the arrays' definitions (docs/kernels.md): 256-byte aligned carves in
// order, without overlap, the last ending at `bytes`; the forward with fla_split the split's compact blocks, the
// summary the classic prep's (without split_forward's S0 and D, which only the forward's output kernel reads). At
// T = 40,960, H = 32, dk = dv = 128 that is issue 29's 1.68 GB for the split against the classic 5.0 GB. That the
// kernels stay inside the sizes is the other tests' guard (EmulatedDev::check_guards, and NaN past the end).
TEST(GdnCudaEmulatedChecks, WorkspaceIsExactlyTheCallsCarving) {
  auto a256 = [](size_t x) { return (x + 255) / 256 * 256; };
  auto a64 = [](size_t x) { return (x + 63) / 64 * 64; };  // floats of a 256-byte aligned array
  struct Runs {
    int64_t tokens;
    std::vector<GdnCudaRun> runs;
  };
  const std::vector<Runs> run_sets = {{ragged_tokens(1), ragged_runs(1)}, {1000, {{0, 1000, 0, 0}}}, {10, {}},
                                      {40960, {{0, 40960}}}};
  int checked = 0;
  for (const auto& [dk, dv] : {std::pair{64, 64}, std::pair{128, 128}, std::pair{64, 128}, std::pair{48, 80}})
    for (const Runs& rs : run_sets)
      for (const GdnPrecision pr : kGdnPrecisions)
        for (const int mode : {0, 1, 2}) {  // classic, split_forward, fla_split
          GdnCudaParams p;
          p.tokens = rs.tokens; p.heads = rs.tokens == 40960 ? 32 : 3; p.dk = dk; p.dv = dv; p.precision = pr;
          p.split_forward = mode == 1;
          p.fla_split = mode == 2;
          if (p.fla_split && !gdn_fla_split_takes(p)) continue;
          size_t chunks = 0;
          for (const GdnCudaRun& r : rs.runs) chunks += static_cast<size_t>((r.t1 - r.t0 + 63) / 64);
          const size_t pairs = chunks * static_cast<size_t>(p.heads);
          const size_t descriptors = a256(chunks * 16) + a256(rs.runs.size() * 16);
          // G, Qst, Kst, R, W [64][dk]; U [64][dv]; P, C, L⁻¹ [64][64]; e^{G_last} [dk], floats.
          const size_t classic = 5 * a64(64 * size_t(dk)) + a64(64 * size_t(dv)) + 3 * 4096 + a64(dk);
          const size_t per = pr == GdnPrecision::fp32 ? 1 : 2;  // S0 and D elements a float holds
          const size_t states = a64((size_t(dk) * dv + per - 1) / per) + a64((64 * size_t(dv) + per - 1) / per);
          // W, U bf16; G fp32 [64]; hT bf16 [dv][dk]; v_new bf16 [64][dv], bytes.
          const size_t fla = a256(128 * size_t(dk)) + a256(128 * size_t(dv)) + 256 + a256(2 * size_t(dk) * dv) +
                             a256(128 * size_t(dv));
          for (const GdnCallKind kind : {GdnCallKind::forward, GdnCallKind::summary, GdnCallKind::backward}) {
            const detail::GdnSchedule s(p, rs.runs, kind);
            const auto carves = s.carves();
            size_t at = 0;
            for (const auto& c : carves) {
              EXPECT_EQ(c.begin % 256, 0u) << c.what;
              EXPECT_GE(c.begin, at) << c.what << " overlaps the carve before it";
              EXPECT_LE(c.begin, c.end) << c.what;
              at = c.end;
            }
            EXPECT_EQ(carves.back().end, s.bytes) << "bytes past the last carve";
            EXPECT_EQ(carves.front().begin, 0u);
            if (kind == GdnCallKind::forward && p.fla_split) {  // a kept forward carves the backward's blocks
              GdnCudaParams pk = p;
              pk.keep_forward = true;
              EXPECT_EQ(detail::GdnSchedule(pk, rs.runs, kind).bytes,
                        detail::GdnSchedule(p, rs.runs, GdnCallKind::backward).bytes);
              if (rs.tokens == 40960 && dk == 128 && dv == 128)
                EXPECT_NEAR(detail::GdnSchedule(pk, rs.runs, kind).bytes * 1e-9, 3.528, 0.001);  // 168.25 KiB blocks
            }
            if (kind == GdnCallKind::backward) continue;  // its sizes: the gradients' arrays (GdnBlock::make)
            const bool fwd = kind == GdnCallKind::forward;
            const size_t block = fwd && p.fla_split ? fla : 4 * (classic + (fwd && p.split_forward ? states : 0));
            EXPECT_EQ(s.bytes, descriptors + pairs * block)
                << "dk " << dk << " dv " << dv << " mode " << mode << " kind " << static_cast<int>(kind);
            ++checked;
            if (rs.tokens == 40960 && dk == 128 && dv == 128 && mode == 2) {
              if (fwd) EXPECT_NEAR(s.bytes * 1e-9, 1.683, 0.001);  // 20,480 blocks of 80.25 KiB
              else EXPECT_NEAR(s.bytes * 1e-9, 5.043, 0.001);     // the summary's classic 240.5 KiB blocks
            }
          }
        }
  EXPECT_GT(checked, 100);
}

// fp16 activations (check_fp16: both gates, ragged and odd shapes, forward, backward, summary, 3xTF32, the split
// forward, large values, the bf16 precisions refused); once at the GPU's 256 threads.
TEST(GdnCudaEmulatedFp16, MatchesTheRecurrence) {
  EmulatedDev dev;
  check_fp16(dev);
  dev.x.threads = detail::kGdnThreads;
  const Case c(ragged_tokens(1), 1, 64, 64, GdnGate::PerChannel, ragged_runs(1), 4, 77, DType::kF16);
  check_forward(dev, c, /*y_f32=*/false);
  check_backward(dev, c, /*dy_f32=*/false);
}

TEST(GdnCudaEmulatedAlgebra, ComposeIsAssociativeAndAppliesMatchTheCpu) {
  EmulatedDev dev;
  check_algebra(dev, 64, 64, 2, 21);
  check_algebra(dev, 48, 80, 1, 22);
}

TEST(GdnCudaEmulatedChecks, BadArgumentsAreNamed) {
  EmulatedDev dev;
  const Case c(ragged_tokens(1), 2, 64, 64, GdnGate::Scalar, ragged_runs(1), 4, 5);
  GdnCudaParams p = device_params(dev, c, GdnCallKind::forward);
  p.state_out = dev.put(std::vector<float>(c.state_in.size()));
  auto message = [&](std::vector<GdnCudaRun> runs) {
    try {
      dev.forward(p, runs);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message({{0, 10}, {5, 20}}).find("overlap"), std::string::npos);
  EXPECT_NE(message({{0, c.S + 1}}).find("outside"), std::string::npos);
  EXPECT_NE(message({{0, 5, -1, 1}, {5, 9, -1, 1}}).find("slot 1"), std::string::npos);
  p.workspace_bytes = 16;
  EXPECT_NE(message({{0, 5}}).find("workspace"), std::string::npos);
  p.dk = 300;
  EXPECT_NE(message({{0, 5}}).find("dk"), std::string::npos);
  p.dk = 64;
  p.scan_columns = 8;
  EXPECT_NE(message({{0, 5}}).find("scan_columns"), std::string::npos);
  p.scan_columns = 0;
  p.precision = static_cast<GdnPrecision>(7);
  EXPECT_NE(message({{0, 5}}).find("precision"), std::string::npos);
  p.precision = GdnPrecision::fp32;
  p.dtype = static_cast<DType>(9);
  EXPECT_NE(message({{0, 5}}).find("dtype"), std::string::npos);
}

// ---- the layer's small kernels

// A bf16 array for the kernels and its values; fp32 arrays are plain floats whose values the references take.
std::vector<float> floats(const std::vector<double>& x) { return std::vector<float>(x.begin(), x.end()); }
std::vector<double> doubles(const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); }
template <class T, class In>
std::vector<T> as(const std::vector<In>& x) {
  return std::vector<T>(x.begin(), x.end());
}
// got - base, for gradients added into a random base.
std::vector<double> added(const std::vector<float>& got, const std::vector<float>& base) {
  std::vector<double> out(got.size());
  for (size_t i = 0; i < got.size(); ++i) out[i] = static_cast<double>(got[i]) - base[i];
  return out;
}
void expect_close(const char* what, const std::vector<double>& got, const std::vector<double>& ref64,
                  const std::vector<double>& ref32, double extra = 0.0) {
  const double e32 = rel_err(ref32, ref64);
  expect_within(what, rel_err(got, ref64), e32, kErrFactor * e32 + kAtol + extra);
}

// Every affine op on interleaved maps against CpuBackend<double> (and <float> for the tolerance), on fp32 values;
// the pure moves (identity, transpose, state, seed without a state) exactly.
TEST(GdnCudaEmulatedAffine, OpsMatchTheCpuBackend) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(41);
  EmulatedExec x;
  for (const AffineShape sh : {AffineShape{3, 12, 20}, AffineShape{2, 33, 7}}) {
    const int64_t items = 2, item = sh.map_elements(), state = sh.state_elements();
    const double msd = 1.0 / std::sqrt(sh.rows);
    auto rand_maps = [&](int64_t n) {
      std::vector<double> m = testing::randn(static_cast<size_t>(n * item), rng);
      for (int64_t b = 0; b < n * sh.heads; ++b)
        for (int64_t i = 0; i < int64_t{sh.rows} * sh.rows; ++i) m[b * sh.map_block() + i] *= msd;
      return as<double>(floats(m));
    };
    const std::vector<double> later = rand_maps(items), earlier = rand_maps(items);
    const std::vector<double> s = as<double>(floats(testing::randn(static_cast<size_t>(state), rng)));
    const std::vector<double> g = as<double>(floats(testing::randn(static_cast<size_t>(state), rng)));
    std::vector<float> scratch(static_cast<size_t>(detail::affine_workspace_floats(sh, items)));
    auto poison = [&] { std::fill(scratch.begin(), scratch.end(), std::numeric_limits<float>::quiet_NaN()); };
    CpuBackend<double> c64;
    CpuBackend<float> c32;
    // compose
    {
      std::vector<double> r64 = later;
      c64.affine_compose(sh, items, r64, earlier);
      std::vector<float> r32 = floats(later);
      c32.affine_compose(sh, items, r32, floats(earlier));
      std::vector<float> dev = floats(later);
      const std::vector<float> e = floats(earlier);
      poison();
      detail::affine_compose_on(x, sh, items, dev.data(), e.data(), scratch.data());
      expect_close("affine compose", doubles(dev), r64, doubles(r32));
    }
    // seed, with and without a state (item 1 of two; item 0 untouched)
    for (const bool with_state : {true, false}) {
      std::vector<double> r64 = later;
      c64.affine_seed(sh, r64, 1, with_state ? &s : nullptr);
      std::vector<float> r32 = floats(later);
      const std::vector<float> s32 = floats(s);
      c32.affine_seed(sh, r32, 1, with_state ? &s32 : nullptr);
      std::vector<float> dev = floats(later);
      poison();
      detail::affine_seed_on(x, sh, dev.data() + item, with_state ? s32.data() : nullptr, scratch.data());
      if (with_state)
        expect_close("affine seed", doubles(dev), r64, doubles(r32));
      else
        EXPECT_EQ(doubles(dev), r64) << "affine seed without a state";
    }
    // adjoint, with and without g
    for (const bool with_g : {true, false}) {
      const std::vector<double> map(later.begin(), later.begin() + item);
      std::vector<double> r64 = earlier;
      c64.affine_adjoint(sh, map, s, with_g ? &g : nullptr, r64, 1);
      std::vector<float> r32 = floats(earlier);
      const std::vector<float> m32 = floats(map), s32 = floats(s), g32 = floats(g);
      c32.affine_adjoint(sh, m32, s32, with_g ? &g32 : nullptr, r32, 1);
      std::vector<float> dev = floats(earlier);
      poison();
      detail::affine_adjoint_on(x, sh, m32.data(), s32.data(), with_g ? g32.data() : nullptr, dev.data() + item,
                                scratch.data());
      if (with_g)
        expect_close("affine adjoint", doubles(dev), r64, doubles(r32));
      else
        EXPECT_EQ(doubles(dev), r64) << "affine adjoint without g (a transpose and a copy)";
    }
    // identity and state, exact
    {
      std::vector<double> r64 = later;
      c64.affine_identity(sh, r64, 1);
      std::vector<float> dev = floats(later);
      detail::affine_identity_on(x, sh, dev.data() + item);
      EXPECT_EQ(doubles(dev), r64) << "affine identity";
      std::vector<double> st(static_cast<size_t>(state), 0.0);
      c64.affine_state(sh, later, 1, st);
      std::vector<float> sd(static_cast<size_t>(state), std::numeric_limits<float>::quiet_NaN());
      const std::vector<float> l32 = floats(later);
      detail::affine_state_on(x, sh, l32.data() + item, sd.data());
      EXPECT_EQ(doubles(sd), st) << "affine state";
    }
    // interleave: gdn_summary's contiguous (M, E) into a map
    {
      const int64_t rr = int64_t{sh.rows} * sh.rows, rc = int64_t{sh.rows} * sh.cols;
      std::vector<float> M(static_cast<size_t>(sh.heads * rr)), E(static_cast<size_t>(sh.heads * rc));
      std::vector<double> want(static_cast<size_t>(item));
      for (int h = 0; h < sh.heads; ++h) {
        for (int64_t i = 0; i < rr; ++i) want[h * sh.map_block() + i] = M[h * rr + i] = static_cast<float>(rng() % 1000);
        for (int64_t i = 0; i < rc; ++i) want[h * sh.map_block() + rr + i] = E[h * rc + i] = static_cast<float>(rng() % 1000);
      }
      std::vector<float> map(static_cast<size_t>(item), std::numeric_limits<float>::quiet_NaN());
      detail::affine_interleave_on(x, sh, M.data(), E.data(), map.data());
      EXPECT_EQ(doubles(map), want) << "affine interleave";
    }
  }
}

// l2norm forward and backward against kernels/cpu in double on the 16-bit inputs (bf16 and fp16, y rounded to the
// type: its rounding on top); partial tiles (70 vectors of 64 in tiles of 32; 45 of 200 in tiles of 20); the backward
// adds into a random base. fp16 also with inputs of a few thousand (|x|² ~ 10^9: past fp16's range, not fp32's).
class GdnCudaEmulatedL2Norm : public ::testing::TestWithParam<DType> {};
class GdnCudaEmulatedConv : public ::testing::TestWithParam<DType> {};

TEST_P(GdnCudaEmulatedL2Norm, MatchesTheCpu) {
  TREECP_SEED_TRACE;
  const DType t = GetParam();
  testing::Rng rng = testing::test_rng(42);
  EmulatedExec x;
  for (const auto& [groups, dim, sd] : {std::tuple<int64_t, int, double>{70, 64, 1.0}, std::tuple<int64_t, int, double>{45, 200, 1.0},
                                        std::tuple<int64_t, int, double>{20, 128, t == DType::kF16 ? 4096.0 : 1.0}}) {
    const size_t n = static_cast<size_t>(groups * dim);
    const Bf16Array xb(testing::randn(n, rng, sd), t);
    const std::vector<float> dy = floats(testing::randn(n, rng));
    // dx scales as 1 / |x|: so does the base, so that its fp32 rounding stays below the tolerance
    const std::vector<float> base = floats(testing::randn(n, rng, 1e-2 / sd));
    std::vector<double> y64(n), dx64(n, 0.0);
    std::vector<float> y32(n), dx32(n, 0.f);
    l2norm_forward(xb.val.data(), groups, dim, y64.data());
    l2norm_forward(floats(xb.val).data(), groups, dim, y32.data());
    l2norm_backward(xb.val.data(), doubles(dy).data(), groups, dim, dx64.data());
    l2norm_backward(floats(xb.val).data(), dy.data(), groups, dim, dx32.data());
    std::vector<uint16_t> y(n, 0x7fc0);
    std::vector<float> dx = base;
    detail::l2norm_on(x, detail::l2norm_args(xb.bits.data(), nullptr, y.data(), nullptr, groups, dim), t);
    detail::l2norm_on(x, detail::l2norm_args(xb.bits.data(), dy.data(), nullptr, dx.data(), groups, dim), t);
    expect_close(t == DType::kF16 ? "l2norm y (fp16)" : "l2norm y (bf16)", values16(y, t), y64, doubles(y32), rounding(t));
    expect_close("l2norm dx", added(dx, base), dx64, doubles(dx32));
  }
}

// The short convolution on a rank's rows of a 2-rank split of a random tree (halo rows, children continuing their
// parent's tail), widths 4 and 3, with and without SiLU and bias, 300 channels (a partial channel tile) and more
// than one tile of rows: against kernels/cpu in double on the 16-bit inputs (bf16 and fp16; y with its type's
// rounding on top).
TEST_P(GdnCudaEmulatedConv, MatchesTheCpuWithHalos) {
  TREECP_SEED_TRACE;
  const DType t = GetParam();
  testing::Rng rng = testing::test_rng(43);
  EmulatedExec x;
  const Row row = testing::random_tree(rng, {.segments = 9, .max_len = 40});
  const Ownership layout = contiguous_ownership(row.tokens(), 2);
  for (const auto& [width, silu, bias] : {std::tuple{4, true, true}, std::tuple{3, false, false}}) {
    const int C = 300;
    const ConvHalo halo = make_conv_halo(row, layout, 1, width);
    const int64_t rows = static_cast<int64_t>(halo.prev.size()), out = halo.owned_rows;
    ASSERT_GT(rows, out) << "the case must have halo rows";
    const Bf16Array xb(testing::randn(static_cast<size_t>(rows * C), rng), t);
    const Bf16Array wb(testing::randn(static_cast<size_t>(C * width), rng, 0.5), t);
    const Bf16Array bb(testing::randn(static_cast<size_t>(C), rng), t);
    const std::vector<float> dy = floats(testing::randn(static_cast<size_t>(out * C), rng));
    auto run_cpu = [&](auto zero) {
      using T = decltype(zero);
      const std::vector<T> xv = as<T>(xb.val), wv = as<T>(wb.val), bv = as<T>(bb.val), dyv(dy.begin(), dy.end());
      Conv1dParams<T> p;
      p.x = xv.data(); p.prev = halo.prev.data(); p.weight = wv.data(); p.bias = bias ? bv.data() : nullptr;
      p.rows = rows; p.out_rows = out; p.shape = ConvShape{C, width, silu};
      std::vector<T> y(static_cast<size_t>(out * C)), dx(static_cast<size_t>(rows * C), T(0)), dw(wv.size(), T(0)),
          db(static_cast<size_t>(C), T(0));
      conv1d_forward(p, y.data());
      conv1d_backward(p, dyv.data(), dx.data(), dw.data(), db.data());
      auto d = [](const std::vector<T>& v) { return std::vector<double>(v.begin(), v.end()); };
      return std::vector<std::vector<double>>{d(y), d(dx), d(dw), d(db)};
    };
    const auto r64 = run_cpu(0.0), r32 = run_cpu(0.f);
    Conv1dDeviceParams p;
    p.x = xb.bits.data(); p.prev = halo.prev.data(); p.weight = wb.bits.data(); p.bias = bias ? bb.bits.data() : nullptr;
    p.out_rows = out; p.shape = ConvShape{C, width, silu}; p.dtype = t;
    std::vector<uint16_t> y(static_cast<size_t>(out * C), 0x7fc0);
    detail::conv1d_on(x, detail::conv_args(p, y.data(), nullptr, nullptr, nullptr, nullptr), t);
    const std::vector<float> bx = floats(testing::randn(static_cast<size_t>(rows * C), rng, 1e-2)),
                             bw = floats(testing::randn(static_cast<size_t>(C * width), rng, 1e-2)),
                             bbias = floats(testing::randn(static_cast<size_t>(C), rng, 1e-2));
    std::vector<float> dx = bx, dw = bw, db = bbias;
    detail::conv1d_on(x, detail::conv_args(p, nullptr, dy.data(), dx.data(), dw.data(), bias ? db.data() : nullptr), t);
    expect_close(t == DType::kF16 ? "conv1d y (fp16)" : "conv1d y (bf16)", values16(y, t), r64[0], r32[0], rounding(t));
    expect_close("conv1d dx (halo rows too)", added(dx, bx), r64[1], r32[1]);
    expect_close("conv1d dweight", added(dw, bw), r64[2], r32[2]);
    if (bias) expect_close("conv1d dbias", added(db, bbias), r64[3], r32[3]);
    else EXPECT_EQ(db, bbias) << "no bias: dbias untouched";
  }
}

std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info) { return dtype_label(info.param); }
INSTANTIATE_TEST_SUITE_P(DTypes, GdnCudaEmulatedL2Norm, ::testing::Values(DType::kBf16, DType::kF16), dtype_param_name);
INSTANTIATE_TEST_SUITE_P(DTypes, GdnCudaEmulatedConv, ::testing::Values(DType::kBf16, DType::kF16), dtype_param_name);

TEST(GdnCudaEmulatedConvChecks, BadArgumentsAreNamed) {
  EmulatedExec x;
  Conv1dDeviceParams p;
  p.out_rows = 3;
  p.shape = ConvShape{4, 65, false};
  std::vector<uint16_t> y(12);
  auto message = [&] {
    try {
      detail::conv1d_on(x, detail::conv_args(p, y.data(), nullptr, nullptr, nullptr, nullptr), p.dtype);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message().find("width"), std::string::npos);
  p.shape.width = 4;
  EXPECT_NE(message().find("x, prev and weight"), std::string::npos);
  try {
    detail::l2norm_on(x, detail::l2norm_args(nullptr, nullptr, nullptr, nullptr, 4, 0), DType::kBf16);
    ADD_FAILURE() << "dim 0 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dim"), std::string::npos);
  }
  p.x = p.weight = y.data();
  std::vector<int64_t> prev = {-1, 0, 1};
  p.prev = prev.data();
  p.dtype = static_cast<DType>(5);
  EXPECT_NE(message().find("dtype"), std::string::npos);
}

}  // namespace
}  // namespace treecp::cuda
