// The CUDA GDN/KDA kernels on the GPU: the checks of tests/common/gdn_cuda.hpp (the same ones the CPU suite runs
// on the host emulation of these kernels) against the double token recurrence, on larger cases: several runs of
// ragged lengths with and without initial states, both gates, dk = dv = 64 and 128, a long run of many chunks.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include "common/gdn_cuda.hpp"
#include "kernels/cuda/attention.hpp"  // check_cuda
#include "kernels/cuda/gdn.hpp"

namespace treecp::cuda {
namespace {

using namespace gdn_test;

bool gpu_present() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Device memory for the checks; every call is followed by a synchronisation and a check of its errors.
struct GpuDev {
  std::vector<void*> blocks;
  GpuDev() = default;
  GpuDev(const GpuDev&) = delete;
  GpuDev& operator=(const GpuDev&) = delete;
  ~GpuDev() {
    for (void* p : blocks) cudaFree(p);
  }
  void* raw(size_t bytes) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, std::max<size_t>(bytes, 256)), "test cudaMalloc");
    blocks.push_back(p);
    return p;
  }
  template <class T>
  T* put(const std::vector<T>& host) {
    T* p = static_cast<T*>(raw(host.size() * sizeof(T)));
    check_cuda(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "test upload");
    return p;
  }
  template <class T>
  std::vector<T> get(const T* p, size_t n) {
    std::vector<T> host(n);
    check_cuda(cudaMemcpy(host.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), "test download");
    return host;
  }
  void* workspace(size_t bytes) {
    void* p = raw(bytes);
    check_cuda(cudaMemset(p, 0xff, std::max<size_t>(bytes, 256)), "test memset");
    return p;
  }
  static void done(const char* what) {
    check_cuda(cudaGetLastError(), what);
    check_cuda(cudaDeviceSynchronize(), what);
  }
  size_t workspace_bytes(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, GdnCallKind kind) {
    return gdn_workspace_bytes(p, runs, kind);
  }
  void forward(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs) {
    gdn_forward(p, runs);
    done("gdn_forward");
  }
  void summary(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, float* M, float* E) {
    gdn_summary(p, runs, M, E);
    done("gdn_summary");
  }
  void backward(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, const GdnCudaGrads& g) {
    gdn_backward(p, runs, g);
    done("gdn_backward");
  }
  void compose(int64_t n, int dk, int dv, const float* MB, const float* EB, const float* MA, const float* EA, float* M,
               float* E) {
    gdn_compose(n, dk, dv, MB, EB, MA, EA, M, E);
    done("gdn_compose");
  }
  void apply(int64_t n, int dk, int dv, const float* M, const float* E, const float* s, float* out) {
    gdn_apply(n, dk, dv, M, E, s, out);
    done("gdn_apply");
  }
  void apply_transposed(int64_t n, int dk, int dv, const float* M, const float* a, const float* ds, float* out) {
    gdn_apply_transposed(n, dk, dv, M, a, ds, out);
    done("gdn_apply_transposed");
  }
};

class GdnCuda : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    if (!gpu_present()) GTEST_SKIP() << "no CUDA device";
  }
  // ~900 tokens in six runs (1, 37, 64, 524, 0 and 280 tokens) over 4 heads.
  Case ragged(uint64_t seed) const {
    const Shape s = GetParam();
    return Case(ragged_tokens(4), 4, s.dk, s.dv, s.gate, ragged_runs(4), 4, seed);
  }
  // One run of 4,000 tokens (63 chunks, the last of 32) from an initial state, 2 heads.
  Case long_run(uint64_t seed) const {
    const Shape s = GetParam();
    return Case(4000, 2, s.dk, s.dv, s.gate, {{0, 4000, 0, 0}}, 1, seed);
  }
  // Every call on one path (`path` sets it on a case): ragged runs at 32 columns (forward, backward, summary) and at
  // 16 (y bf16, dy fp32), and a long run.
  template <class F>
  void check_path(uint64_t seed, F&& path) const {
    GpuDev dev;
    Case c = ragged(seed);
    path(c);
    check_forward(dev, c, /*y_f32=*/true);
    check_backward(dev, c, /*dy_f32=*/false);
    check_summary(dev, c);
    c.scan_columns = 16;
    check_forward(dev, c, /*y_f32=*/false);
    check_backward(dev, c, /*dy_f32=*/true);
    Case l = long_run(seed + 1);
    path(l);
    check_forward(dev, l, /*y_f32=*/true);
    check_backward(dev, l, /*dy_f32=*/false);
  }
};

TEST_P(GdnCuda, ForwardMatchesTheRecurrence) {
  GpuDev dev;
  const Case c = ragged(101);
  check_forward(dev, c, /*y_f32=*/false);
  check_forward(dev, c, /*y_f32=*/true);
}

TEST_P(GdnCuda, BackwardMatchesTheRecurrence) {
  GpuDev dev;
  const Case c = ragged(102);
  check_backward(dev, c, /*dy_f32=*/false);
  check_backward(dev, c, /*dy_f32=*/true);
}

TEST_P(GdnCuda, LongRunForwardAndBackward) {
  GpuDev dev;
  const Case c = long_run(103);
  check_forward(dev, c, /*y_f32=*/false);
  check_backward(dev, c, /*dy_f32=*/false);
}

TEST_P(GdnCuda, SixteenScanColumns) {
  GpuDev dev;
  Case c = ragged(105);
  c.scan_columns = 16;
  check_forward(dev, c, /*y_f32=*/false);
  check_backward(dev, c, /*dy_f32=*/false);
  check_summary(dev, c);
}

// The chunk products on tensor cores (GdnCudaParams::tensor_cores: 3xTF32 mma.sync in prep, the scans and the
// gradients) under the same fp32 tolerances, at 32 and 16 columns, ragged runs and a long run: the GPU is where the
// operand fragments' positions are checked.
TEST_P(GdnCuda, TensorCoreScans) {
  check_path(106, [](Case& c) { c.tensor_cores = true; });
}

// Prep's and the gradients' products on bf16 tensor cores (GdnPrecision::bf16_tensor) against the double recurrence
// within the bf16 model's error (tests/common/gdn_cuda.hpp): the fragments' positions and the staged panels' layout
// are checked here.
TEST_P(GdnCuda, Bf16TensorCorePrepAndGradients) {
  check_path(108, [](Case& c) { c.precision = GdnPrecision::bf16_tensor; });
}

// The scans' products on bf16 mma too (GdnPrecision::bf16_tensor_scans).
TEST_P(GdnCuda, Bf16TensorCoreScans) {
  check_path(112, [](Case& c) { c.precision = GdnPrecision::bf16_tensor_scans; });
}

// The split forward (GdnCudaParams::split_forward: the saving scan, then the chunk-parallel output kernel) on each
// precision over ragged runs, and a long run on bf16 (its states stored as bf16; one long run: the CPU references
// of 4,000 tokens take seconds a case).
TEST_P(GdnCuda, SplitForward) {
  GpuDev dev;
  for (const GdnPrecision precision :
       {GdnPrecision::fp32, GdnPrecision::bf16_tensor, GdnPrecision::bf16_tensor_scans}) {
    Case c = ragged(110);
    c.precision = precision;
    c.split_forward = true;
    check_forward(dev, c, /*y_f32=*/false);
    check_forward(dev, c, /*y_f32=*/true);
  }
  Case l = long_run(111);
  l.precision = GdnPrecision::bf16_tensor;
  l.split_forward = true;
  check_forward(dev, l, /*y_f32=*/true);
}

TEST_P(GdnCuda, SummaryAppliedEqualsTheForward) {
  GpuDev dev;
  check_summary(dev, ragged(104));
}

INSTANTIATE_TEST_SUITE_P(Shapes, GdnCuda,
                         all_shapes(), shape_name);

// f(c, columns) for the split's ragged cases on the GPU: runs over 4 heads at each pairing of dk, dv in {64, 128}
// and 16, 32 and 64 state columns, seeds from `seed` on.
template <class F>
void for_each_fla_case(uint64_t& seed, F&& f) {
  for (const int dk : {64, 128})
    for (const int dv : {64, 128})
      for (const int cols : {16, 32, 64}) {
        Case c(ragged_tokens(4), 4, dk, dv, GdnGate::Scalar, ragged_runs(4), 4, ++seed);
        c.fla(cols);
        std::printf("  dk %d dv %d, %d columns\n", dk, dv, cols);
        f(c, cols);
      }
}

// The FLA-like split forward (GdnCudaParams::fla_split: compact prep, the scan's state in mma.sync fragments, the
// chunk-parallel output, every product bf16) against the double recurrence within the bf16 model's bounds: ragged
// runs over 4 heads at each pairing of dk, dv in {64, 128}, 16, 32 and 64 state columns, y bf16 and fp32, the final
// states; a long run (4,000 tokens from an initial state, 2 heads) at 128 / 128 and 32 and 64 columns; the summary on
// the same parameters. The GPU is where the fragments' register positions (the loads feeding mma.sync) are checked.
TEST(GdnCudaFla, SplitForwardMatchesTheRecurrence) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device";
  GpuDev dev;
  uint64_t seed = 160;
  for_each_fla_case(seed, [&](const Case& c, int cols) {
    check_forward(dev, c, /*y_f32=*/true);
    check_forward(dev, c, /*y_f32=*/false);
    if (cols == 32) check_summary(dev, c);
  });
  for (const int cols : {32, 64}) {
    Case l(4000, 2, 128, 128, GdnGate::Scalar, {{0, 4000, 0, 0}}, 1, ++seed);
    l.fla(cols);
    std::printf("  long run, %d columns\n", cols);
    check_forward(dev, l, /*y_f32=*/true);
  }
}

// The FLA-like split backward (fla_split on gdn_backward) on the GPU: the emulated suite's checks at larger sizes
// (ragged runs from initial states, dL/d(final state), every (dk, dv) pairing and column count, dy fp32 and bf16),
// then a long run (its bf16 dy also 2 bytes off a 4-byte boundary, and 4 bytes off a 16-byte one), against the double
// recurrence within the bf16 model's bounds; then backwards that read a kept forward's arrays (keep_forward).
TEST(GdnCudaFla, SplitBackwardMatchesTheRecurrence) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device";
  GpuDev dev;
  uint64_t seed = 190;
  for_each_fla_case(seed, [&](const Case& c, int cols) { check_backward(dev, c, /*dy_f32=*/cols != 32); });
  Case l(4000, 2, 128, 128, GdnGate::Scalar, {{0, 4000, 0, 0}}, 1, ++seed);
  l.fla();
  std::printf("  long run\n");
  check_backward(dev, l, /*dy_f32=*/false);
  check_backward(dev, l, /*dy_f32=*/false, /*dy_offset=*/1);  // dY by element loads, not cp.async
  check_backward(dev, l, /*dy_f32=*/false, /*dy_offset=*/2);  // cp.async in 4-byte units (not 16-byte aligned)
  std::printf("  kept forward (keep_forward: the backward reads the forward's arrays)\n");
  check_backward(dev, l, /*dy_f32=*/false, /*dy_offset=*/0, /*kept=*/true);
  for_each_fla_case(seed, [&](const Case& c, int cols) {
    if (cols != 16) check_backward(dev, c, /*dy_f32=*/cols == 64, /*dy_offset=*/0, /*kept=*/true);
  });
}

// fp16 activations (tests/common/gdn_cuda.hpp's check_fp16, which the CPU suite's emulation runs too).
TEST(GdnCudaFp16, MatchesTheRecurrence) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device";
  GpuDev dev;
  check_fp16(dev);
}

TEST(GdnCudaAlgebra, ComposeIsAssociativeAndAppliesMatchTheCpu) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA device";
  GpuDev dev;
  check_algebra(dev, 64, 64, 8, 201);
  check_algebra(dev, 128, 128, 8, 202);
}

TEST(GdnCudaChecks, BadArgumentsThrowBeforeAnyLaunch) {
  // Host-side checks only: runs without a GPU too.
  GdnCudaParams p;
  p.tokens = 10;
  p.heads = 2;
  p.dk = p.dv = 64;
  EXPECT_THROW(gdn_workspace_bytes(p, {{0, 11}}, false), Error);
  EXPECT_THROW(gdn_workspace_bytes(p, {{0, 6}, {5, 9}}, false), Error);
  EXPECT_THROW(gdn_forward(p, {{0, 5}}), Error);  // no inputs
  p.dk = 0;
  EXPECT_THROW(gdn_workspace_bytes(p, {{0, 5}}, true), Error);
  // The bool query covers both calls that take backward = false: with fla_split those differ (the forward's compact
  // blocks, the summary's classic ones), and the larger is the summary's.
  p.dk = p.dv = 128;
  p.precision = GdnPrecision::bf16_tensor_scans;
  p.fla_split = true;
  const std::vector<GdnCudaRun> runs = {{0, 10}};
  const size_t fwd = gdn_workspace_bytes(p, runs, GdnCallKind::forward),
               sum = gdn_workspace_bytes(p, runs, GdnCallKind::summary);
  EXPECT_LT(fwd, sum);
  EXPECT_EQ(gdn_workspace_bytes(p, runs, false), sum);
  EXPECT_EQ(gdn_workspace_bytes(p, runs, true), gdn_workspace_bytes(p, runs, GdnCallKind::backward));
}

}  // namespace
}  // namespace treecp::cuda
