// GDN/KDA over a tree in one process (self communicator): the CP runtime against the tree reference
// for local, chained and mixed plans; finite differences of the whole pipeline; the planner.
#include <gtest/gtest.h>

#include <filesystem>
#include <numeric>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "plan/gdn_plan.hpp"
#include "common/gdn.hpp"

namespace treecp {
namespace {

using testing::GdnData;

struct Result {
  std::vector<double> y, dq, dk, dv, dg, dbeta;
};

// Runs the CP runtime on one rank over the whole row with the given chained set.
Result run_cp(const Row& row, const GdnData& d, const std::vector<uint8_t>& chained, double scale, int chunk) {
  auto comm = make_self_communicator();
  const GdnPlan plan = make_gdn_plan(row, 1, chained);
  validate_gdn_plan(row, plan);
  const auto r = testing::run_gdn_cp(*comm, row, plan, d.shape(scale, chunk),
                                     testing::gdn_buffers<double>(d, gdn_rank_ranges(row, plan, 0)));
  return {r.y, r.dq, r.dk, r.dv, r.dg, r.dbeta};
}

using testing::max_abs;
using testing::max_error;

class GdnTree : public ::testing::TestWithParam<GdnGate> {};

TEST_P(GdnTree, OneRankEqualsReferenceForAnyChainedSet) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(1);
  for (int seed = 0; seed < 3; ++seed) {
    const Row row = testing::random_tree(rng, {.segments = 9, .max_len = 40});
    const GdnData d = testing::random_gdn_data(row.tokens(), 2, 5, 4, GetParam(), rng);
    const auto ref = testing::gdn_tree_reference(row, d, 0.8);
    const int32_t n = row.num_segments();
    for (int mode = 0; mode < 3; ++mode) {
      std::vector<uint8_t> chained(static_cast<size_t>(n), 0);
      for (int32_t s = 0; s < n; ++s) chained[s] = mode == 1 ? 1 : mode == 2 ? static_cast<uint8_t>(rng() % 2) : 0;
      const Result r = run_cp(row, d, chained, 0.8, 8);
      const double tol = 1e-11;
      EXPECT_LT(max_error(r.y, ref.y), tol * (1 + max_abs(ref.y))) << "seed " << seed << " mode " << mode;
      EXPECT_LT(max_error(r.dq, ref.dq), tol * (1 + max_abs(ref.dq)));
      EXPECT_LT(max_error(r.dk, ref.dk), tol * (1 + max_abs(ref.dk)));
      EXPECT_LT(max_error(r.dv, ref.dv), tol * (1 + max_abs(ref.dv)));
      EXPECT_LT(max_error(r.dg, ref.dg), tol * (1 + max_abs(ref.dg)));
      EXPECT_LT(max_error(r.dbeta, ref.dbeta), tol * (1 + max_abs(ref.dbeta)));
    }
  }
}

// J = Σ y·dy through the whole tree (parents' states feed several children).
TEST_P(GdnTree, TreeGradientsMatchFiniteDifferences) {
  const Row row(std::vector<Segment>{{-1, 6}, {0, 4}, {1, 3}, {0, 5}, {-1, 3}});
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(99);
  const GdnData d = testing::random_gdn_data(row.tokens(), 1, 3, 2, GetParam(), rng);
  std::vector<uint8_t> chained = {1, 0, 1, 0, 0};
  const Result r = run_cp(row, d, chained, 0.9, 4);
  auto loss = [&](const GdnData& x) {
    const Result f = run_cp(row, x, chained, 0.9, 4);
    double j = 0;
    for (size_t i = 0; i < f.y.size(); ++i) j += f.y[i] * x.dy[i];
    return j;
  };
  const double eps = 1e-6;
  auto check = [&](std::vector<double> GdnData::*field, const std::vector<double>& analytic, const char* name) {
    for (size_t i = 0; i < analytic.size(); ++i) {
      GdnData p = d, m = d;
      (p.*field)[i] += eps;
      (m.*field)[i] -= eps;
      const double fd = (loss(p) - loss(m)) / (2 * eps);
      ASSERT_NEAR(analytic[i], fd, 1e-7 * (1 + std::abs(fd))) << name << "[" << i << "]";
    }
  };
  check(&GdnData::q, r.dq, "dq");
  check(&GdnData::k, r.dk, "dk");
  check(&GdnData::v, r.dv, "dv");
  check(&GdnData::g, r.dg, "dg");
  check(&GdnData::beta, r.dbeta, "dbeta");
}

INSTANTIATE_TEST_SUITE_P(Gates, GdnTree, ::testing::Values(GdnGate::Scalar, GdnGate::PerChannel),
                         [](const auto& info) { return info.param == GdnGate::Scalar ? "GDN" : "KDA"; });

TEST(GdnPlan, RangesCoverTheRowOnce) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(5);
  const Row row = testing::random_tree(rng, {.segments = 30, .max_len = 100, .max_depth = 5});
  for (int ranks : {1, 2, 3, 4, 7}) {
    std::vector<uint8_t> chained(static_cast<size_t>(row.num_segments()));
    for (size_t s = 0; s < chained.size(); ++s) chained[s] = static_cast<uint8_t>(s % 3 == 0);
    const GdnPlan plan = make_gdn_plan(row, ranks, chained);
    validate_gdn_plan(row, plan);
    std::vector<int> seen(static_cast<size_t>(row.tokens()), 0);
    for (int r = 0; r < ranks; ++r)
      for (const TokenRange& t : gdn_rank_ranges(row, plan, r))
        for (int64_t i = t.begin; i < t.end; ++i) seen[i]++;
    for (int64_t i = 0; i < row.tokens(); ++i) ASSERT_EQ(seen[i], 1) << "token " << i << " ranks " << ranks;
  }
}

TEST(GdnPlan, PhasesFollowTheDag) {
  // root(chained) -> a(local) -> b(chained) -> c(local); root -> d(chained)
  const Row row(std::vector<Segment>{{-1, 10}, {0, 5}, {1, 5}, {2, 5}, {0, 5}});
  const GdnPlan plan = make_gdn_plan(row, 3, {1, 0, 1, 0, 1});
  EXPECT_EQ(plan.phase, (std::vector<int32_t>{1, 1, 2, 2, 2}));
  EXPECT_EQ(plan.num_phases, 3);
  GdnPlan bad = plan;
  bad.phase[3] = 1;
  EXPECT_THROW(validate_gdn_plan(row, bad), Error);
  bad = plan;
  bad.pieces[0][1].end = 100;
  EXPECT_THROW(validate_gdn_plan(row, bad), Error);
}

TEST(GdnPlan, CostModelDecidesWhatChains) {
  const GdnShape shape;  // DESIGN.md's GDN shape: H 32, Dk = Dv = 128, chunk 64
  const GdnCostModel model;
  // One dominant root: splitting it over 4 ranks beats running it on one.
  const Row dominant(std::vector<Segment>{{-1, 200000}, {0, 2000}, {0, 2000}, {-1, 3000}});
  GdnPlan p = plan_gdn(dominant, 4, shape, model);
  EXPECT_TRUE(p.chained[0]);
  GdnPlan none = make_gdn_plan(dominant, 4, std::vector<uint8_t>(4, 0));
  EXPECT_LT(p.predicted_ms, gdn_predict(dominant, none, shape, model));
  // Many equal small families balance without any summary.
  std::vector<Segment> many;
  for (int f = 0; f < 16; ++f) {
    const int32_t root = static_cast<int32_t>(many.size());
    many.push_back({-1, 512});
    for (int c = 0; c < 4; ++c) many.push_back({root, 128});
  }
  EXPECT_EQ(plan_gdn(Row(many), 4, shape, model).chained_segments(), 0);
  // One rank never chains.
  EXPECT_EQ(plan_gdn(dominant, 1, shape, model).chained_segments(), 0);
  // The choice depends on the state size, not on a length rule: with a very slow link the same
  // dominant row stays local, with a fast one it chains.
  GdnCostModel slow = model;
  slow.link.bandwidth_bytes_per_ms = 1.0;
  EXPECT_EQ(plan_gdn(dominant, 4, shape, slow).chained_segments(), 0);
}

TEST(GdnPlan, JsonRoundTrip) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(8);
  const Row row = testing::random_tree(rng, {.segments = 12, .max_len = 50});
  std::vector<uint8_t> chained(static_cast<size_t>(row.num_segments()));
  for (size_t s = 0; s < chained.size(); ++s) chained[s] = static_cast<uint8_t>(s % 2);
  GdnPlan p = make_gdn_plan(row, 3, chained);
  gdn_predict(row, p, GdnShape{}, GdnCostModel{});
  const json::Value v = json::parse(json::dump(p.to_json()));
  EXPECT_EQ(v.at("segments").size(), static_cast<size_t>(row.num_segments()));
  const GdnPlan q = GdnPlan::from_json(v);
  validate_gdn_plan(row, q);
  EXPECT_EQ(q.chained, p.chained);
  EXPECT_EQ(q.owner, p.owner);
  EXPECT_EQ(q.pieces, p.pieces);
  EXPECT_EQ(q.phase, p.phase);
  EXPECT_EQ(q.num_phases, p.num_phases);
  EXPECT_DOUBLE_EQ(q.predicted_ms, p.predicted_ms);
  const GdnCostModel m = gdn_costs_from_json(to_json(GdnCostModel{}));
  EXPECT_EQ(m.madds_per_ms, GdnCostModel{}.madds_per_ms);
}

// config/gdn_costs_cpu.json holds the built-in defaults; unknown keys and bad values are refused.
TEST(GdnPlan, CostFileMatchesBuiltInDefaults) {
  const auto path = std::filesystem::path(__FILE__).parent_path().parent_path() / "config" / "gdn_costs_cpu.json";
  EXPECT_EQ(json::dump(to_json(load_gdn_costs(path.string()))), json::dump(to_json(GdnCostModel{})));
  EXPECT_THROW(gdn_costs_from_json(json::parse(R"({"ns_per_madd": 0.5})")), Error);
  EXPECT_THROW(gdn_costs_from_json(json::parse(R"({"madds_per_ms": 0})")), Error);
  EXPECT_THROW(gdn_costs_from_json(json::parse(R"({"link": {"latency_ms": 0, "bandwidth_bytes_per_ms": -1}})")), Error);
}

}  // namespace
}  // namespace treecp
