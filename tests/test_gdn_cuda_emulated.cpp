// The CUDA GDN/KDA kernels (src/kernels/cuda/gdn_device.cuh) run on the host: each block's 256 threads are
// std::threads, __syncthreads a std::barrier, shared memory a buffer filled with NaN before each block and the
// workspace all NaN before each call, so a missing barrier, a read of something never written or an indexing
// slip shows as a wrong or NaN result. The same checks run on the GPU in tests/cuda/test_gdn_cuda.cpp.
#include <gtest/gtest.h>

#include <barrier>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>

#include "common/gdn_cuda.hpp"

namespace treecp::cuda {
namespace {

using namespace gdn_test;

// Threads per block: the bodies loop with the block's stride, so any count is valid; 96 (fewer than the 128
// columns, more than a short chunk's rows, not a power of two) keeps the suite fast; one test runs the GPU's 256.
struct EmulatedExec {
  int threads = 96;
  template <class K>
  void launch(int64_t blocks, const typename K::Args& a) {
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
  void* workspace(size_t bytes) {
    void* p = raw(bytes);
    std::memset(p, 0xff, bytes);
    return p;
  }
  size_t workspace_bytes(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, bool backward) {
    detail::gdn_check(p, runs, false);
    return detail::GdnSchedule(p, runs, backward).bytes;
  }
  void forward(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs) { detail::gdn_forward_on(x, p, runs); }
  void summary(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, float* M, float* E) {
    detail::gdn_summary_on(x, p, runs, M, E);
  }
  void backward(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, const GdnCudaGrads& g) {
    detail::gdn_backward_on(x, p, runs, g);
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

TEST(GdnCudaEmulatedAlgebra, ComposeIsAssociativeAndAppliesMatchTheCpu) {
  EmulatedDev dev;
  check_algebra(dev, 64, 64, 2, 21);
  check_algebra(dev, 48, 80, 1, 22);
}

TEST(GdnCudaEmulatedChecks, BadArgumentsAreNamed) {
  EmulatedDev dev;
  const Case c(ragged_tokens(1), 2, 64, 64, GdnGate::Scalar, ragged_runs(1), 4, 5);
  GdnCudaParams p = device_params(dev, c, false);
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
}

}  // namespace
}  // namespace treecp::cuda
