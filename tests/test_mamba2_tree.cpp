// Mamba-2 over a whole tree in one process: the bucketed chunked executor against the recurrence
// reference and against the flattened per-trajectory run, finite differences through shared states,
// and float within the float reference's own error.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "runtime/mamba2_tree.hpp"
#include "common/mamba2.hpp"

namespace treecp {
namespace {

using testing::Mamba2Data;
using testing::Mamba2Result;
using testing::max_abs_diff;

template <class T>
Mamba2Result run_tree(const Row& row, const Mamba2Data& d, int chunk) {
  const auto b = testing::mamba2_buffers<T>(d, {{0, d.S}});
  const auto p = b.params(d, chunk);
  std::vector<T> y(d.x.size()), dx(d.x.size()), ddt(d.dt.size()), dA(d.A.size()), dB(d.B.size()), dC(d.C.size()),
      dD(static_cast<size_t>(d.H));
  const auto saved = mamba2_tree_forward(row, p, y.data());
  mamba2_tree_backward(
      row, p, saved, b.dy.data(),
      Mamba2Grads<T>{dx.data(), ddt.data(), dA.data(), dB.data(), dC.data(), d.with_d ? dD.data() : nullptr});
  using testing::widen;
  return {widen(y), widen(dx), widen(ddt), widen(dA), widen(dB), widen(dC), widen(dD)};
}

void expect_all_close(const Mamba2Result& got, const Mamba2Result& want, double rel, const std::string& what) {
  auto check = [&](const std::vector<double>& a, const std::vector<double>& b, const char* name) {
    ASSERT_EQ(a.size(), b.size()) << name;
    EXPECT_LT(max_abs_diff(a, b), rel * (1 + testing::max_abs(b))) << name << " " << what;
  };
  check(got.y, want.y, "y");
  check(got.dx, want.dx, "dx");
  check(got.ddt, want.ddt, "ddt");
  check(got.dA, want.dA, "dA");
  check(got.dB, want.dB, "dB");
  check(got.dC, want.dC, "dC");
  check(got.dD, want.dD, "dD");
}

TEST(Mamba2Tree, BucketsAreDepthLevels) {
  const Row row(std::vector<Segment>{{-1, 3}, {0, 2}, {1, 1}, {0, 4}, {-1, 2}, {4, 1}});
  const auto b = mamba2_scan_buckets(row);
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(b[1], (std::vector<int32_t>{1, 3, 5}));
  EXPECT_EQ(b[2], (std::vector<int32_t>{2}));
}

TEST(Mamba2Tree, ChunkedTreeEqualsRecurrenceReference) {
  for (uint64_t seed : {1, 2, 3, 4}) {
    const Row row = testing::random_tree(testing::test_rng(seed), {.segments = 10, .min_len = 1, .max_len = 40, .max_depth = 4});
    const Mamba2Data d = testing::random_mamba2_data(row.tokens(), 4, 3, 2, 5, seed % 2 == 0, seed * 31);
    const Mamba2Result ref = testing::mamba2_tree_reference(row, d);
    for (int chunk : {1, 6, 64})
      expect_all_close(run_tree<double>(row, d, chunk), ref, 1e-12, "seed " + std::to_string(seed));
  }
}

// Packing shares the prompt's work; the result is what each trajectory computes alone.
TEST(Mamba2Tree, PackedEqualsFlattenedTrajectories) {
  for (uint64_t seed : {5, 6, 7}) {
    const Row row = testing::random_tree(testing::test_rng(seed), {.segments = 12, .min_len = 1, .max_len = 30, .max_depth = 5});
    ASSERT_GT(row.leaves().size(), 1u);
    const Mamba2Data d = testing::random_mamba2_data(row.tokens(), 2, 4, 1, 3, true, seed);
    const Mamba2Result flat = testing::mamba2_flattened_reference(row, d);
    expect_all_close(testing::mamba2_tree_reference(row, d), flat, 1e-12, "reference, seed " + std::to_string(seed));
    expect_all_close(run_tree<double>(row, d, 8), flat, 1e-12, "chunked tree, seed " + std::to_string(seed));
  }
}

// J = Σ y·dy through a tree whose parents feed several children; every input against central
// differences of the chunked executor itself.
TEST(Mamba2Tree, GradientsThroughSharedStatesMatchFiniteDifferences) {
  const Row row(std::vector<Segment>{{-1, 6}, {0, 4}, {1, 3}, {1, 2}, {0, 5}, {-1, 3}});
  const Mamba2Data base = testing::random_mamba2_data(row.tokens(), 2, 2, 1, 3, true, 99);
  const Mamba2Result r = run_tree<double>(row, base, 4);
  auto loss = [&](const Mamba2Data& x) {
    const Mamba2Result f = run_tree<double>(row, x, 4);
    double j = 0;
    for (size_t i = 0; i < f.y.size(); ++i) j += f.y[i] * x.dy[i];
    return j;
  };
  auto fd_check = [&](std::vector<double> Mamba2Data::*field, const std::vector<double>& analytic, const char* name) {
    testing::expect_finite_differences(base, field, analytic, loss, name);
  };
  fd_check(&Mamba2Data::x, r.dx, "dx");
  fd_check(&Mamba2Data::dt, r.ddt, "ddt");
  fd_check(&Mamba2Data::A, r.dA, "dA");
  fd_check(&Mamba2Data::B, r.dB, "dB");
  fd_check(&Mamba2Data::C, r.dC, "dC");
  fd_check(&Mamba2Data::D, r.dD, "dD");
}

TEST(Mamba2Tree, FloatWithinFloatReferenceError) {
  const Row row = testing::random_tree(testing::test_rng(11), {.segments = 9, .min_len = 20, .max_len = 120, .max_depth = 3});
  const Mamba2Data d = testing::random_mamba2_data(row.tokens(), 4, 8, 2, 16, true, 12);
  const Mamba2Result exact = testing::mamba2_tree_reference(row, d);
  const Mamba2Result f1 = testing::mamba2_tree_reference<float>(row, d);
  const Mamba2Result f64 = run_tree<float>(row, d, 64);
  auto check = [&](const std::vector<double>& got, const std::vector<double>& ref, const std::vector<double>& want,
                   const char* name) {
    EXPECT_LE(max_abs_diff(got, want), testing::tolerance(max_abs_diff(ref, want), want)) << name;
  };
  check(f64.y, f1.y, exact.y, "y");
  check(f64.dx, f1.dx, exact.dx, "dx");
  check(f64.ddt, f1.ddt, exact.ddt, "ddt");
  // dA is one sum over every token per head (4 values): the float reference's largest error over 4 numbers is an
  // unstable scale (150 seeds: chunked / reference error ratio median 2.3, up to 23; relative error at most 1.2e-5,
  // i.e. ~200 float roundings), so its bound also admits the rounding of a T-term float sum whose terms pass
  // through a chunk's cumulative log-decay (up to 64 terms): 64 eps sqrt(T) max|dA|. The double test above holds
  // the chunked form to 1e-12; this one is about float rounding only.
  const double eps = std::numeric_limits<float>::epsilon();
  const double sum_scale = 64 * eps * std::sqrt(static_cast<double>(row.tokens())) * testing::max_abs(exact.dA);
  EXPECT_LE(max_abs_diff(f64.dA, exact.dA), testing::tolerance(max_abs_diff(f1.dA, exact.dA), exact.dA) + sum_scale)
      << "dA";
  check(f64.dB, f1.dB, exact.dB, "dB");
  check(f64.dC, f1.dC, exact.dC, "dC");
  check(f64.dD, f1.dD, exact.dD, "dD");
}

TEST(Mamba2Tree, RefusesAMismatchedRow) {
  const Row row(std::vector<Segment>{{-1, 4}});
  const Mamba2Data d = testing::random_mamba2_data(5, 1, 2, 1, 2, false, 1);
  const auto b = testing::mamba2_buffers<double>(d, {{0, 5}});
  std::vector<double> y(d.x.size());
  EXPECT_THROW(mamba2_tree_forward(row, b.params(d, 4), y.data()), Error);
}

}  // namespace
}  // namespace treecp
