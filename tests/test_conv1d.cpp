// Causal depthwise conv1d on a packed tree in one process: against explicit root-to-token paths,
// finite differences for every gradient, and the halo geometry (a child's halo is its parent's tail).
#include <gtest/gtest.h>

#include <random>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "runtime/conv_cp.hpp"
#include "runtime/cpu_backend.hpp"
#include "common/gdn.hpp"

namespace treecp {
namespace {

using testing::max_error;
using testing::randn;

struct ConvRun {
  std::vector<double> y, dx, dw, db;
};

ConvRun run_one_rank(const Row& row, int C, int K, bool silu, const std::vector<double>& x, const std::vector<double>& w,
                 const std::vector<double>& b, const std::vector<double>& dy) {
  auto comm = make_self_communicator();
  CpuBackend<double> be;
  ConvCP<CpuBackend<double>> conv(contiguous_ownership(row.tokens(), 1), row, ConvShape{C, K, silu}, *comm, be);
  ConvRun r{std::vector<double>(x.size()), std::vector<double>(x.size()), std::vector<double>(w.size()),
            std::vector<double>(static_cast<size_t>(C))};
  conv.forward(x, w, b.empty() ? nullptr : &b, r.y);
  conv.backward(dy, r.dx, r.dw, b.empty() ? nullptr : &r.db);
  return r;
}

TEST(Conv1d, EqualsExplicitPathsOnTrees) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(1);
  for (int seed = 0; seed < 4; ++seed) {
    const Row row = testing::random_tree(rng, {.segments = 12, .max_len = 7, .max_depth = 5});
    for (int K : {1, 2, 4, 6}) {
      for (bool silu : {false, true}) {
        const int C = 3;
        const auto x = randn(static_cast<size_t>(row.tokens() * C), rng), w = randn(static_cast<size_t>(C * K), rng),
                   b = randn(C, rng), dy = randn(x.size(), rng);
        const auto ref = testing::conv_tree_reference(row, x, w, b, C, K, silu, dy);
        const ConvRun r = run_one_rank(row, C, K, silu, x, w, b, dy);
        EXPECT_LT(max_error(r.y, ref.y), 1e-12) << "tree " << seed << " K " << K;
        EXPECT_LT(max_error(r.dx, ref.dx), 1e-12);
        EXPECT_LT(max_error(r.dw, ref.dw), 1e-11);
        EXPECT_LT(max_error(r.db, ref.db), 1e-11);
      }
    }
  }
}

TEST(Conv1d, GradientsMatchFiniteDifferences) {
  const Row row(std::vector<Segment>{{-1, 2}, {0, 3}, {1, 1}, {0, 2}});
  const int C = 2, K = 4;
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(7);
  for (bool silu : {false, true}) {
    const auto x = randn(static_cast<size_t>(row.tokens() * C), rng), w = randn(C * K, rng), b = randn(C, rng),
               dy = randn(x.size(), rng);
    const ConvRun r = run_one_rank(row, C, K, silu, x, w, b, dy);
    auto loss = [&](const std::vector<double>& xx, const std::vector<double>& ww, const std::vector<double>& bb) {
      const ConvRun f = run_one_rank(row, C, K, silu, xx, ww, bb, dy);
      double j = 0;
      for (size_t i = 0; i < f.y.size(); ++i) j += f.y[i] * dy[i];
      return j;
    };
    const double eps = 1e-6;
    auto check = [&](int which, const std::vector<double>& analytic) {
      for (size_t i = 0; i < analytic.size(); ++i) {
        std::vector<double> xp = x, xm = x, wp = w, wm = w, bp = b, bm = b;
        auto& vp = which == 0 ? xp : which == 1 ? wp : bp;
        auto& vm = which == 0 ? xm : which == 1 ? wm : bm;
        vp[i] += eps;
        vm[i] -= eps;
        const double fd = (loss(xp, wp, bp) - loss(xm, wm, bm)) / (2 * eps);
        ASSERT_NEAR(analytic[i], fd, 1e-7 * (1 + std::abs(fd))) << "input " << which << " [" << i << "] silu " << silu;
      }
    };
    check(0, r.dx);
    check(1, r.dw);
    check(2, r.db);
  }
}

TEST(Conv1d, ChildHaloIsParentTailAcrossShortShards) {
  // root 0-3 | A 4-6 (child of root) | B 7-8 (child of root); four ranks of 2-3 tokens.
  const Row row(std::vector<Segment>{{-1, 4}, {0, 3}, {0, 2}});
  const Ownership layout = {{{0, 2}}, {{2, 4}}, {{4, 7}}, {{7, 9}}};
  validate_ownership(layout, row.tokens());
  // B's first token (7) reads 3, 2, 1 with K = 4; never A's tail 4-6.
  const ConvHalo h = make_conv_halo(row, layout, 3, 4);
  EXPECT_EQ(h.halo_tokens, (std::vector<int64_t>{1, 2, 3}));
  // The halo spans ranks 0 and 1.
  EXPECT_EQ(h.recv_rows[0].size(), 1u);
  EXPECT_EQ(h.recv_rows[1].size(), 2u);
  EXPECT_TRUE(h.recv_rows[2].empty());
  const ConvHalo h0 = make_conv_halo(row, layout, 0, 4);
  EXPECT_EQ(h0.send_rows[3], (std::vector<int64_t>{1}));  // token 1 is rank 0's row 1
}

TEST(Conv1d, RefusesBadLayouts) {
  const Row row(std::vector<Segment>{{-1, 4}, {0, 3}});
  EXPECT_THROW(validate_ownership({{{0, 3}}, {{4, 7}}}, row.tokens()), Error);  // token 3 missing
  EXPECT_THROW(validate_ownership({{{0, 4}}, {{3, 7}}}, row.tokens()), Error);  // token 3 twice
  EXPECT_THROW(validate_ownership({{{4, 7}, {0, 4}}}, row.tokens()), Error);    // unsorted
  auto comm = make_self_communicator();
  CpuBackend<double> be;
  EXPECT_THROW((ConvCP<CpuBackend<double>>({{{0, 7}}}, row, ConvShape{1, 0, false}, *comm, be)), Error);  // width 0
  EXPECT_THROW((ConvCP<CpuBackend<double>>({{{0, 6}}}, row, ConvShape{1, 2, false}, *comm, be)), Error);  // token 6
}

}  // namespace
}  // namespace treecp
