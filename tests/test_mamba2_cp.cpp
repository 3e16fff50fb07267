// Mamba-2 CP in one process (self communicator) and its planner: both strategies against the tree
// reference, the pricing terms (head cuts, groups, bytes, which strategy wins where), and the
// refusals.
#include <gtest/gtest.h>

#include <filesystem>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "core/json.hpp"
#include "plan/planner.hpp"
#include "runtime/mamba2_cp.hpp"
#include "plan/mamba2_plan.hpp"
#include "common/mamba2.hpp"

namespace treecp {
namespace {

using testing::Mamba2Data;
using testing::Mamba2Result;
using testing::max_abs_diff;

Mamba2Shape shape_of(const Mamba2Data& d, int chunk, int element_bytes = 8) {
  return Mamba2Shape{d.H, d.P, d.G, d.N, element_bytes, chunk};
}

template <class T>
Mamba2Result run_one_rank(const Row& row, const Mamba2Data& d, Mamba2Strategy strategy, int chunk) {
  auto comm = make_self_communicator();
  const Mamba2Shape shape = shape_of(d, chunk, sizeof(T));
  const Mamba2Plan plan = plan_mamba2(row, {{{0, row.tokens()}}}, shape, mamba2_cost_defaults(), strategy);
  Mamba2CP<T> cp(plan, row, shape, *comm);
  const auto b = testing::mamba2_buffers<T>(d, {{0, row.tokens()}});
  std::vector<T> y(d.x.size()), dx(d.x.size()), ddt(d.dt.size()), dA(d.A.size()), dB(d.B.size()), dC(d.C.size()),
      dD(static_cast<size_t>(d.H));
  cp.forward(
      Mamba2Inputs<T>{b.x.data(), b.dt.data(), b.B.data(), b.C.data(), b.A.data(), d.with_d ? b.D.data() : nullptr},
      y.data());
  cp.backward(b.dy.data(), Mamba2Grads<T>{dx.data(), ddt.data(), dA.data(), dB.data(), dC.data(), dD.data()});
  using testing::widen;
  return {widen(y), widen(dx), widen(ddt), widen(dA), widen(dB), widen(dC), widen(dD)};
}

TEST(Mamba2Cp, OneRankEqualsReferenceBothStrategies) {
  for (uint64_t seed : {1, 2, 3}) {
    const Row row = testing::random_tree(testing::test_rng(seed), {.segments = 8, .min_len = 1, .max_len = 40, .max_depth = 4});
    const Mamba2Data d = testing::random_mamba2_data(row.tokens(), 4, 3, 2, 5, seed != 2, seed * 13);
    const Mamba2Result ref = testing::mamba2_tree_reference(row, d);
    const Mamba2Result fref = testing::mamba2_tree_reference<float>(row, d);
    for (Mamba2Strategy s : {Mamba2Strategy::Transpose, Mamba2Strategy::Summary}) {
      const Mamba2Result r = run_one_rank<double>(row, d, s, 8);
      const Mamba2Result f = run_one_rank<float>(row, d, s, 8);
      const std::vector<double>* fields[][3] = {{&r.y, &f.y, &ref.y},       {&r.dx, &f.dx, &ref.dx},
                                                {&r.ddt, &f.ddt, &ref.ddt}, {&r.dA, &f.dA, &ref.dA},
                                                {&r.dB, &f.dB, &ref.dB},    {&r.dC, &f.dC, &ref.dC},
                                                {&r.dD, &f.dD, &ref.dD}};
      const std::vector<double>* frefs[] = {&fref.y, &fref.dx, &fref.ddt, &fref.dA, &fref.dB, &fref.dC, &fref.dD};
      for (int i = 0; i < 7; ++i) {
        const auto& [dbl, flt, want] = fields[i];
        EXPECT_LT(max_abs_diff(*dbl, *want), 1e-11 * (1 + testing::max_abs(*want)))
            << strategy_name(s) << " field " << i << " seed " << seed;
        EXPECT_LE(max_abs_diff(*flt, *want), testing::tolerance(max_abs_diff(*frefs[i], *want), *want))
            << strategy_name(s) << " float field " << i << " seed " << seed;
      }
    }
  }
}

TEST(Mamba2Plan, HeadCutsAndGroups) {
  EXPECT_EQ(mamba2_head_cuts(8, 3), (std::vector<int32_t>{0, 2, 5, 8}));
  EXPECT_EQ(mamba2_head_cuts(2, 5), (std::vector<int32_t>{0, 0, 0, 1, 1, 2}));  // three ranks hold no head
  const Mamba2Shape s{8, 4, 2, 3, 4, 16};                                      // 4 heads per group
  EXPECT_EQ(mamba2_groups_of(s, 2, 5).begin, 0);
  EXPECT_EQ(mamba2_groups_of(s, 2, 5).end, 2);
  EXPECT_EQ(mamba2_groups_of(s, 4, 8).begin, 1);
  EXPECT_EQ(mamba2_groups_of(s, 4, 8).size(), 1);
  EXPECT_EQ(mamba2_groups_of(s, 3, 3).size(), 0);
  EXPECT_EQ(s.input_elements(2, 5), 3 * (4 + 1) + 2 * 2 * 3);
}

// The transpose's bytes: every token's x, dt, B, C of the heads a rank does not hold go out and its
// gradients come back; y and dy the same without dt, B and C.
TEST(Mamba2Plan, TransposeBytesByHand) {
  const Row row(std::vector<Segment>{{-1, 10}, {0, 6}});
  const Ownership tokens = {{{0, 7}}, {{7, 16}}};
  const Mamba2Shape s{4, 3, 2, 5, 4, 16};  // heads 0-1 (group 0) on rank 0, 2-3 (group 1) on rank 1
  const Mamba2Price p = price_mamba2_transpose(row, tokens, mamba2_head_cuts(4, 2), s, mamba2_cost_defaults());
  const int64_t in = 2 * (3 + 1) + 2 * 5, out = 2 * 3;  // per token, the other rank's two heads
  EXPECT_EQ(p.bytes, 4 * (7 + 9) * (2 * in + 2 * out));
  EXPECT_EQ(p.rounds, 4);
  EXPECT_EQ(p.steps, 2);
}

// Heads fewer than ranks: the transpose leaves ranks idle and the busiest one runs the whole row;
// summaries split the long segment over every rank. Many heads and short families: the transpose.
TEST(Mamba2Plan, ChoiceFollowsTheShape) {
  const Row chain(std::vector<Segment>{{-1, 20000}});
  const Ownership six = contiguous_ownership(chain.tokens(), 6);
  const Mamba2Plan few = plan_mamba2(chain, six, Mamba2Shape{2, 64, 1, 128, 4, 64}, mamba2_cost_defaults());
  EXPECT_EQ(few.strategy, Mamba2Strategy::Summary);
  EXPECT_LT(few.summary_price.work_ms * 2, few.transpose_price.work_ms);
  EXPECT_EQ(few.chains.chained_segments(), 1);
  EXPECT_EQ(gdn_ownership(chain, few.chains), six);  // its pieces are the owners' shards: nothing moves
  std::vector<Segment> segs;
  for (int f = 0; f < 16; ++f) {
    segs.push_back({-1, 1024});
    const int32_t root = static_cast<int32_t>(segs.size()) - 1;
    for (int c = 0; c < 8; ++c) segs.push_back({root, 512});
  }
  const Row families(segs);
  const Plan attn = make_plan(families, 2, AttentionShape{}, CostModel{}, PlanOptions{});
  const Mamba2Plan many = plan_mamba2(families, plan_ownership(attn), Mamba2Shape{}, mamba2_cost_defaults());
  EXPECT_GT(many.transpose_price.bytes, 0);
  EXPECT_EQ(many.price().ms, std::min(many.transpose_price.ms, many.summary_price.ms));
}

// Aligned with contiguous owners, every chained piece and local unit is where its tokens already
// are; make_gdn_plan's balanced placement moves some.
TEST(Mamba2Plan, OwnerAlignedPlanMovesNothingOnContiguousOwners) {
  const Row row = testing::random_tree(testing::test_rng(4), {.segments = 12, .min_len = 5, .max_len = 60, .max_depth = 4});
  for (int n : {2, 3, 5}) {
    const Ownership tokens = contiguous_ownership(row.tokens(), n);
    for (int mode = 0; mode < 3; ++mode) {
      std::vector<uint8_t> chained(static_cast<size_t>(row.num_segments()));
      for (size_t s = 0; s < chained.size(); ++s) chained[s] = mode == 0 ? 0 : mode == 1 ? 1 : s % 2;
      const GdnPlan aligned = mamba2_owner_aligned_plan(row, tokens, chained);
      validate_gdn_plan(row, aligned);
      if (mode != 1) continue;
      EXPECT_FALSE(tokens_move(tokens, gdn_ownership(row, aligned))) << n;
      EXPECT_TRUE(tokens_move(tokens, gdn_ownership(row, make_gdn_plan(row, n, chained)))) << n;
    }
  }
}

TEST(Mamba2Plan, ForcedStrategyAndRefusals) {
  const Row row(std::vector<Segment>{{-1, 12}, {0, 4}});
  const Ownership two = contiguous_ownership(row.tokens(), 2);
  const Mamba2Shape s{4, 2, 2, 3, 8, 8};
  EXPECT_EQ(plan_mamba2(row, two, s, mamba2_cost_defaults(), Mamba2Strategy::Summary).strategy,
            Mamba2Strategy::Summary);
  EXPECT_THROW(plan_mamba2(row, two, Mamba2Shape{6, 2, 4, 3, 8, 8}, mamba2_cost_defaults()), Error);  // 6 % 4
  EXPECT_THROW(plan_mamba2(row, {{{0, 10}}, {{11, 16}}}, s, mamba2_cost_defaults()), Error);         // token 10 lost
  EXPECT_FALSE(parse_mamba2_strategy("auto").has_value());
  EXPECT_EQ(parse_mamba2_strategy("summary"), Mamba2Strategy::Summary);
  EXPECT_THROW(parse_mamba2_strategy("heads"), Error);
  // A plan for two ranks on one.
  auto comm = make_self_communicator();
  const Mamba2Plan plan = plan_mamba2(row, two, s, mamba2_cost_defaults());
  EXPECT_THROW(Mamba2CP<double>(plan, row, s, *comm), Error);
}

TEST(Mamba2Plan, CostFileMatchesBuiltInDefaults) {
  const auto path = std::filesystem::path(__FILE__).parent_path().parent_path() / "config" / "mamba2_costs_cpu.json";
  EXPECT_EQ(json::dump(to_json(load_mamba2_costs(path.string()))), json::dump(to_json(mamba2_cost_defaults())));
}

}  // namespace
}  // namespace treecp
