// Calibration recovers coefficients it is given measurements of: non-negative least squares against brute
// force, stage throughputs / launch / merge / range from noisy synthetic stages, token-local work from passes,
// link latency and bandwidth from all-to-all probes.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "plan/calibrate.hpp"

namespace treecp {
namespace {

TEST(Nnls, MatchesBruteForceOverActiveSets) {
  std::mt19937_64 rng(3);
  std::normal_distribution<double> g(0, 1);
  for (int trial = 0; trial < 40; ++trial) {
    const int rows = 12, cols = 3;
    std::vector<double> a(rows * cols), b(rows);
    for (double& x : a) x = g(rng);
    for (double& x : b) x = g(rng);
    const std::vector<double> x = nnls(a, b, rows, cols);
    auto cost = [&](const std::vector<double>& v) {
      double s = 0;
      for (int i = 0; i < rows; ++i) {
        double r = -b[i];
        for (int j = 0; j < cols; ++j) r += a[i * cols + j] * v[j];
        s += r * r;
      }
      return s;
    };
    for (double v : x) EXPECT_GE(v, 0.0);
    // Brute force: a fine grid around the answer never does better (convex problem, so local = global).
    double best = cost(x);
    for (int d0 = -2; d0 <= 2; ++d0)
      for (int d1 = -2; d1 <= 2; ++d1)
        for (int d2 = -2; d2 <= 2; ++d2) {
          std::vector<double> y = {std::max(0.0, x[0] + 0.01 * d0), std::max(0.0, x[1] + 0.01 * d1),
                                   std::max(0.0, x[2] + 0.01 * d2)};
          EXPECT_GE(cost(y), best - 1e-9) << "trial " << trial;
        }
  }
}

TEST(Calibrate, RecoversStageAndPassAndLinkCoefficients) {
  CostModel truth;
  truth.local_forward_pairs_per_ms = 4.0e8;
  truth.remote_forward_pairs_per_ms = 3.6e8;
  truth.local_backward_pairs_per_ms = 1.5e8;
  truth.remote_backward_pairs_per_ms = 1.3e8;
  truth.stage_launch_ms = 0.012;
  truth.merge_ms_per_query_token = 2.0e-6;
  truth.range_ms = 0.003;
  truth.underfill_ms = 0.0;
  truth.token_local_forward_ms_per_token = 3.0e-6;
  truth.token_local_backward_ms_per_token = 7.0e-6;
  truth.intra_node = {0.02, 2.5e8};
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> u(0, 1);
  for (double noise : {0.0, 0.02}) {
    std::vector<StageSample> stages;
    std::vector<PassSample> passes;
    std::vector<LinkSample> links;
    for (int i = 0; i < 400; ++i) {
      StageSample s;
      s.remote = i % 2 == 1;
      s.pass = (i / 2) % 2 ? Pass::Backward : Pass::Forward;
      s.load.pairs = static_cast<int64_t>(1e5 + u(rng) * 3e8);
      s.load.compute_pairs = static_cast<int64_t>(s.load.pairs * (1.0 + 0.1 * u(rng)));
      s.load.query_tokens = s.remote ? static_cast<int64_t>(u(rng) * 40000) : 0;
      s.load.ranges = 1 + static_cast<int64_t>(u(rng) * 20);
      s.measured_ms = stage_ms(truth, s.load, s.remote, s.pass) * (1.0 + noise * (2 * u(rng) - 1));
      stages.push_back(s);
    }
    for (int i = 0; i < 40; ++i) {
      const int64_t owned = 1000 + static_cast<int64_t>(u(rng) * 80000);
      const double stage_sum = 1 + 10 * u(rng);
      passes.push_back({Pass::Forward, owned, stage_sum + owned * truth.token_local_forward_ms_per_token, stage_sum});
      passes.push_back({Pass::Backward, owned, stage_sum + owned * truth.token_local_backward_ms_per_token, stage_sum});
    }
    for (int64_t bytes : {int64_t{1} << 20, int64_t{16} << 20, int64_t{256} << 20})
      links.push_back({2, bytes, truth.intra_node.latency_ms + bytes / truth.intra_node.bandwidth_bytes_per_ms});
    links.push_back({4, int64_t{64} << 20, truth.intra_node.latency_ms + 3.0 * (64 << 20) / 6.0e8});
    const Calibration c = calibrate(CostModel{}, stages, passes, links);
    const double tol = noise == 0.0 ? 1e-6 : 0.08;
    auto near = [&](double got, double want, const char* what) {
      EXPECT_NEAR(got / want, 1.0, tol) << what << " noise " << noise;
    };
    near(c.costs.local_forward_pairs_per_ms, truth.local_forward_pairs_per_ms, "local forward");
    near(c.costs.remote_forward_pairs_per_ms, truth.remote_forward_pairs_per_ms, "remote forward");
    near(c.costs.local_backward_pairs_per_ms, truth.local_backward_pairs_per_ms, "local backward");
    near(c.costs.remote_backward_pairs_per_ms, truth.remote_backward_pairs_per_ms, "remote backward");
    near(c.costs.token_local_forward_ms_per_token, truth.token_local_forward_ms_per_token, "token-local forward");
    near(c.costs.token_local_backward_ms_per_token, truth.token_local_backward_ms_per_token, "token-local backward");
    near(c.costs.intra_node.bandwidth_bytes_per_ms, truth.intra_node.bandwidth_bytes_per_ms, "link bandwidth");
    near(c.costs.rank_bandwidth_bytes_per_ms, 6.0e8, "rank bandwidth");
    // The small terms are weakly determined under noise; their effect is what counts.
    EXPECT_LE(c.stage_fit_error, noise == 0.0 ? 1e-6 : noise) << "noise " << noise;
    EXPECT_EQ(c.stage_samples, 400);
  }
}

TEST(Calibrate, UnmeasuredClassesKeepTheBaseValues) {
  CostModel base;
  std::vector<StageSample> stages;
  for (int i = 1; i <= 30; ++i) {  // enough samples (three per unknown) to fit every term
    StageSample s;
    s.load.pairs = i * 1000000;
    s.load.ranges = 1;
    s.measured_ms = 0.01 + s.load.pairs / 5.0e8 + 0.002;  // local forward only (launch and one range)
    stages.push_back(s);
  }
  const Calibration c = calibrate(base, stages, {}, {});
  EXPECT_NEAR(c.costs.local_forward_pairs_per_ms / 5.0e8, 1.0, 0.02);
  EXPECT_EQ(c.costs.remote_forward_pairs_per_ms, base.remote_forward_pairs_per_ms);
  EXPECT_EQ(c.costs.local_backward_pairs_per_ms, base.local_backward_pairs_per_ms);
  EXPECT_EQ(c.costs.intra_node.bandwidth_bytes_per_ms, base.intra_node.bandwidth_bytes_per_ms);
  EXPECT_DOUBLE_EQ(mean_abs_log_error({{2.0, 1.0}, {1.0, 2.0}, {-1.0, 3.0}}), std::log(2.0));
}

}  // namespace
}  // namespace treecp

namespace treecp {
namespace {

TEST(Calibrate, FewSamplesFitOnlyTheThroughputs) {
  CostModel base;
  base.local_forward_pairs_per_ms = 1.0e7;
  CostModel truth = base;
  truth.local_forward_pairs_per_ms = 4.0e7;
  std::vector<StageSample> stages;
  for (int i = 1; i <= 6; ++i) {
    StageSample s;
    s.load.pairs = i * 3000000;
    s.load.ranges = i;
    s.measured_ms = stage_ms(truth, s.load, false, Pass::Forward);  // base launch, range and underfill terms
    stages.push_back(s);
  }
  const Calibration c = calibrate(base, stages, {}, {});
  EXPECT_NEAR(c.costs.local_forward_pairs_per_ms / truth.local_forward_pairs_per_ms, 1.0, 1e-9);
  EXPECT_EQ(c.costs.stage_launch_ms, base.stage_launch_ms);
  EXPECT_EQ(c.costs.range_ms, base.range_ms);
  EXPECT_EQ(c.costs.underfill_ms, base.underfill_ms);
  EXPECT_LT(c.stage_fit_error, 1e-9);
}

}  // namespace
}  // namespace treecp
