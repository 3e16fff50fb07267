// GDN/KDA CP on rows of packed documents in the three layouts attention uses (contiguous, zigzag,
// per-document zigzag with ragged ends), chains whose pieces visit the ranks out of order: outputs and
// every gradient against the per-document token recurrence in double on 1-4 thread ranks, the short
// convolution's halos in those layouts, the plans' shapes, JSON (new and old form), validation, and
// the searched choice against a brute-force minimum on small rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "common/gdn.hpp"
#include "common/threads.hpp"
#include "core/error.hpp"
#include "plan/gdn_plan.hpp"
#include "runtime/conv_cp.hpp"
#include "runtime/cpu_backend.hpp"

namespace treecp {
namespace {

using testing::GdnData;
using testing::max_abs;
using testing::max_error;

// Packed documents (roots without children) of the given lengths.
Row packed(const std::vector<int64_t>& lengths) {
  std::vector<Segment> segs;
  for (int64_t l : lengths) segs.push_back({-1, l});
  return Row(segs);
}

// Random packed rows with what the layouts must survive: documents shorter than a piece, one longer
// than the row over the ranks, lengths that do not divide (ragged pieces).
Row random_packed(testing::Rng& rng, int ranks, int docs) {
  std::vector<int64_t> lengths;
  for (int d = 0; d < docs; ++d) lengths.push_back(1 + static_cast<int64_t>(rng() % 9));
  lengths[rng() % lengths.size()] = 23 + static_cast<int64_t>(rng() % 17) + 4 * ranks;  // longer than row / R
  return packed(lengths);
}

std::vector<int> run_ranks(const GdnPlan& plan, int32_t s) {
  std::vector<int> out;
  for (const GdnPiece& p : gdn_chain_runs(plan, s)) out.push_back(p.rank);
  return out;
}

// Runs the plan on thread ranks (double) and checks every rank's outputs and gradients against the
// per-document recurrence.
void expect_equals_reference(const Row& row, const GdnPlan& plan, GdnGate gate, testing::Rng& rng,
                             const std::string& what) {
  validate_gdn_plan(row, plan);
  const GdnData d = testing::random_gdn_data(row.tokens(), 2, 4, 3, gate, rng);
  const double scale = 0.7;
  const auto ref = testing::gdn_tree_reference(row, d, scale);
  const GdnShape shape = d.shape(scale, 4);  // chunks of 4 cross every piece boundary
  testing::on_threads(plan.ranks, {}, [&](int r, Communicator& comm) {
    const auto ranges = gdn_rank_ranges(row, plan, r);
    const auto got = testing::run_gdn_cp(comm, row, plan, shape, testing::gdn_buffers<double>(d, ranges));
    auto check = [&](const std::vector<double>& g, const std::vector<double>& want, int64_t width, const char* name) {
      EXPECT_LE(max_error(g, rows_of<double>(want, width, ranges)), 1e-10 * (1 + max_abs(want)))
          << name << " " << what << " rank " << r << "/" << plan.ranks;
    };
    check(got.y, ref.y, d.H * d.dv, "y");
    check(got.dq, ref.dq, d.H * d.dk, "dq");
    check(got.dk, ref.dk, d.H * d.dk, "dk");
    check(got.dv, ref.dv, d.H * d.dv, "dv");
    check(got.dg, ref.dg, d.H * d.g_width(), "dg");
    check(got.dbeta, ref.dbeta, d.H, "dbeta");
  });
}

class GdnLayouts : public ::testing::TestWithParam<GdnGate> {};

TEST_P(GdnLayouts, EveryLayoutEqualsThePerDocumentRun) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(31);
  for (int ranks = 1; ranks <= 4; ++ranks) {
    const Row row = random_packed(rng, ranks, 3 + ranks);
    for (GdnLayout l : {GdnLayout::Contiguous, GdnLayout::Zigzag, GdnLayout::DocZigzag}) {
      const GdnPlan plan = gdn_layout_plan(row, ranks, l);
      expect_equals_reference(row, plan, GetParam(), rng, std::string(gdn_layout_name(l)) + " R " +
                                                              std::to_string(ranks));
    }
    // The searched plan when attention runs zigzag (it may adopt that ownership).
    GdnPlanOptions o;
    o.attention = gdn_ownership(row, gdn_layout_plan(row, ranks, GdnLayout::Zigzag));
    const GdnPlan searched = plan_gdn(row, ranks, GdnShape{}, GdnCostModel{}, o);
    expect_equals_reference(row, searched, GetParam(), rng, "searched R " + std::to_string(ranks));
  }
}

// One document over the whole row in zigzag: the chain visits ranks 0 .. R-1 and back to 0.
TEST_P(GdnLayouts, OneDocumentOutAndBack) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(32);
  for (int ranks = 2; ranks <= 4; ++ranks) {
    const Row row = packed({41 + 2 * ranks});
    for (GdnLayout l : {GdnLayout::Zigzag, GdnLayout::DocZigzag})
      expect_equals_reference(row, gdn_layout_plan(row, ranks, l), GetParam(), rng, gdn_layout_name(l));
  }
}

// A rank that owns nothing: more ranks than a contiguous cut fills, and hand-made chains that skip a
// rank, visit one rank three times and hold empty pieces.
TEST_P(GdnLayouts, RanksThatOwnNothingAndChainsInAnyOrder) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(33);
  const Row tiny = packed({2, 1});
  for (GdnLayout l : {GdnLayout::Contiguous, GdnLayout::Zigzag, GdnLayout::DocZigzag})
    expect_equals_reference(tiny, gdn_layout_plan(tiny, 4, l), GetParam(), rng, "tiny");
  // Segment 0 over ranks 2, 0, 2, 1, 2 (rank 3 holds nothing of anything); segment 1 local on 1;
  // segment 2 with an empty piece on rank 3 between two of rank 0.
  const Row row = packed({30, 6, 12});
  GdnPlan plan = make_gdn_plan(row, 4, {1, 0, 1});
  plan.owner[1] = 1;
  plan.pieces[0] = {{2, 0, 5}, {0, 5, 11}, {2, 11, 12}, {1, 12, 20}, {2, 20, 30}};
  plan.pieces[2] = {{0, 36, 40}, {3, 40, 40}, {0, 40, 44}, {1, 44, 48}};
  expect_equals_reference(row, plan, GetParam(), rng, "hand-made");
}

INSTANTIATE_TEST_SUITE_P(Gates, GdnLayouts, ::testing::Values(GdnGate::Scalar, GdnGate::PerChannel),
                         [](const auto& info) { return info.param == GdnGate::Scalar ? "Gdn" : "Kda"; });

// Float: within a small multiple of the float one-process run's own error.
TEST(GdnLayoutFloat, ZigzagWithinFloatReferenceError) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(34);
  const Row row = random_packed(rng, 3, 6);
  const GdnData d = testing::random_gdn_data(row.tokens(), 2, 4, 3, GdnGate::PerChannel, rng);
  const auto ref = testing::gdn_tree_reference(row, d, 0.7);
  const GdnShape shape = d.shape(0.7, 4);
  auto self = make_self_communicator();
  const GdnPlan one = make_gdn_plan(row, 1, std::vector<uint8_t>(static_cast<size_t>(row.num_segments()), 0));
  const auto f = testing::run_gdn_cp(*self, row, one, shape, testing::gdn_buffers<float>(d, {{0, row.tokens()}}));
  const GdnPlan plan = gdn_layout_plan(row, 3, GdnLayout::Zigzag);
  testing::on_threads(3, {}, [&](int r, Communicator& comm) {
    const auto ranges = gdn_rank_ranges(row, plan, r);
    const auto got = testing::run_gdn_cp(comm, row, plan, shape, testing::gdn_buffers<float>(d, ranges));
    auto check = [&](const std::vector<float>& g, const std::vector<float>& same, const std::vector<double>& want,
                     int64_t width, const char* name) {
      EXPECT_TRUE(testing::within_reference(g, rows_of<float>(same, width, ranges), rows_of<double>(want, width, ranges),
                                            4.0, 1e-6 * (1 + max_abs(want))))
          << name << " rank " << r;
    };
    check(got.y, f.y, ref.y, d.H * d.dv, "y");
    check(got.dq, f.dq, ref.dq, d.H * d.dk, "dq");
    check(got.dk, f.dk, ref.dk, d.H * d.dk, "dk");
    check(got.dv, f.dv, ref.dv, d.H * d.dv, "dv");
    check(got.dg, f.dg, ref.dg, d.H * d.dk, "dg");
    check(got.dbeta, f.dbeta, ref.dbeta, d.H, "dbeta");
  });
}

// The short convolution's halos where a piece's left neighbour lives on another rank.
TEST(GdnLayoutConv, HalosInEveryLayoutEqualExplicitPaths) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(35);
  for (int ranks = 2; ranks <= 4; ++ranks) {
    const Row row = random_packed(rng, ranks, 5);
    for (GdnLayout l : {GdnLayout::Contiguous, GdnLayout::Zigzag, GdnLayout::DocZigzag}) {
      const Ownership layout = gdn_ownership(row, gdn_layout_plan(row, ranks, l));
      const int C = 3, K = 4;
      const std::vector<double> x = testing::randn(static_cast<size_t>(row.tokens() * C), rng),
                                w = testing::randn(static_cast<size_t>(C * K), rng), b = testing::randn(C, rng),
                                dy = testing::randn(x.size(), rng);
      const auto ref = testing::conv_tree_reference(row, x, w, b, C, K, true, dy);
      testing::on_threads(ranks, {}, [&](int r, Communicator& comm) {
        const auto& mine = layout[static_cast<size_t>(r)];
        const auto xl = rows_of<double>(x, C, mine), dyl = rows_of<double>(dy, C, mine);
        std::vector<double> y(xl.size()), dx(xl.size()), dw(w.size()), db(b.size());
        CpuBackend<double> be;
        ConvCP<CpuBackend<double>> conv(layout, row, ConvShape{C, K, true}, comm, be);
        conv.forward(xl, w, &b, y);
        conv.backward(dyl, dx, dw, &db);
        EXPECT_LT(max_error(y, rows_of<double>(ref.y, C, mine)), 1e-12) << gdn_layout_name(l) << " rank " << r;
        EXPECT_LT(max_error(dx, rows_of<double>(ref.dx, C, mine)), 1e-12) << gdn_layout_name(l) << " rank " << r;
        EXPECT_LT(max_error(dw, ref.dw), 1e-11);
        EXPECT_LT(max_error(db, ref.db), 1e-11);
      });
    }
  }
}

TEST(GdnLayoutPlan, PiecesOfTheThreeLayouts) {
  // 4 ranks, 40 tokens: documents 3, 30, 7.
  const Row row = packed({3, 30, 7});
  const GdnPlan c = gdn_layout_plan(row, 4, GdnLayout::Contiguous);  // cuts 10, 20, 30
  EXPECT_FALSE(c.chained[0]);
  EXPECT_EQ(c.owner[0], 0);
  ASSERT_TRUE(c.chained[1]);
  EXPECT_EQ(c.pieces[1], (std::vector<GdnPiece>{{0, 3, 10}, {1, 10, 20}, {2, 20, 30}, {3, 30, 33}}));
  EXPECT_EQ(c.owner[2], 3);
  const GdnPlan z = gdn_layout_plan(row, 4, GdnLayout::Zigzag);  // 8 pieces of 5
  EXPECT_EQ(z.owner[0], 0);
  EXPECT_EQ(run_ranks(z, 1), (std::vector<int>{0, 1, 2, 3, 2, 1}));
  EXPECT_EQ(z.pieces[1].front(), (GdnPiece{0, 3, 5}));
  EXPECT_EQ(z.holder(1), 1);
  ASSERT_TRUE(z.chained[2]);  // [33, 40) over pieces 6 and 7: ranks 1, 0
  EXPECT_EQ(run_ranks(z, 2), (std::vector<int>{1, 0}));
  const GdnPlan dz = gdn_layout_plan(row, 4, GdnLayout::DocZigzag);  // long: >= max(8, 40 / 8) tokens
  EXPECT_EQ(gdn_doc_zigzag_min_tokens(row, 4), 8);
  EXPECT_FALSE(dz.chained[0]);
  EXPECT_FALSE(dz.chained[2]);
  ASSERT_TRUE(dz.chained[1]);
  EXPECT_EQ(run_ranks(dz, 1), (std::vector<int>{0, 1, 2, 3, 2, 1, 0}));
  // 30 tokens in 8 ragged pieces (cuts 30 j / 8: 0, 3, 7, 11, 15, 18, 22, 26, 30): 3, 4, 4, 4 | 3, 4, 4, 4,
  // rank 3's two adjacent pieces merged.
  std::vector<int64_t> sizes;
  for (const GdnPiece& p : dz.pieces[1]) sizes.push_back(p.size());
  EXPECT_EQ(sizes, (std::vector<int64_t>{3, 4, 4, 7, 4, 4, 4}));
  for (const GdnPlan* p : {&c, &z, &dz}) {
    validate_gdn_plan(row, *p);
    EXPECT_EQ(tokens_of(gdn_rank_ranges(row, *p, 0)) + tokens_of(gdn_rank_ranges(row, *p, 1)) +
                  tokens_of(gdn_rank_ranges(row, *p, 2)) + tokens_of(gdn_rank_ranges(row, *p, 3)),
              row.tokens());
  }
  // The zigzag chain's scan: 6 runs, 3 rounds each way (the even split's 4 runs need 2).
  EXPECT_EQ(affine_plan_scan_rounds(row, z), 3);
  EXPECT_EQ(affine_plan_scan_rounds(row, make_gdn_plan(row, 4, {0, 1, 0})), 2);
  // Layout names round-trip; bad ones are refused by name.
  for (GdnLayout l : kGdnLayouts) EXPECT_EQ(parse_gdn_layout(gdn_layout_name(l)), l);
  EXPECT_THROW(parse_gdn_layout("zig-zag"), Error);
}

// A plan that follows any ownership moves no token out of it.
TEST(GdnLayoutPlan, PlanForOwnershipKeepsEveryToken) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(36);
  const Row tree = testing::random_tree(rng, {.segments = 14, .max_len = 20, .max_depth = 4});
  for (int ranks = 1; ranks <= 5; ++ranks) {
    const Ownership own = contiguous_ownership(tree.tokens(), ranks);
    const GdnPlan plan = gdn_plan_for_ownership(tree, own);
    validate_gdn_plan(tree, plan);
    EXPECT_FALSE(tokens_move(own, gdn_ownership(tree, plan))) << ranks;
    EXPECT_EQ(gdn_move_price(tree, plan, own, GdnShape{}, GdnCostModel{}, 4).ms, 0.0);
  }
}

TEST(GdnLayoutPlan, JsonRoundTripAndTheOlderForm) {
  const Row row = packed({3, 30, 7});
  GdnPlan z = gdn_layout_plan(row, 4, GdnLayout::Zigzag);
  gdn_predict(row, z, GdnShape{}, GdnCostModel{});
  const GdnPlan q = GdnPlan::from_json(json::parse(json::dump(z.to_json())));
  validate_gdn_plan(row, q);
  EXPECT_EQ(q.layout, GdnLayout::Zigzag);
  EXPECT_EQ(q.chained, z.chained);
  EXPECT_EQ(q.owner, z.owner);
  EXPECT_EQ(q.pieces, z.pieces);
  EXPECT_EQ(q.phase, z.phase);
  EXPECT_DOUBLE_EQ(q.predicted_ms, z.predicted_ms);
  // A plan file of the older form (cuts per rank) reads as pieces in rank order and prices the same.
  const json::Value old = json::parse(R"({"ranks": 3, "num_phases": 2, "segments": [
      {"chained": false, "phase": 0, "owner": 2},
      {"chained": true, "phase": 1, "cuts": [3, 13, 23, 33]},
      {"chained": true, "phase": 1, "cuts": [33, 33, 35, 40]}]})");
  GdnPlan o = GdnPlan::from_json(old);
  validate_gdn_plan(row, o);
  EXPECT_EQ(o.pieces[2], (std::vector<GdnPiece>{{0, 33, 33}, {1, 33, 35}, {2, 35, 40}}));
  GdnPlan even = make_gdn_plan(row, 3, {0, 1, 1});
  EXPECT_EQ(o.pieces[1], even.pieces[1]);
}

// Existing plans (pieces in rank order over all ranks) price as before: per chain step, the busiest
// rank's work, then 2 directions x ceil(log2 R) rounds of (one message of every chain's summary + one
// composition of each).
TEST(GdnLayoutPlan, RankOrderPlansPriceAsBefore) {
  const GdnShape shape;
  const GdnCostModel m;
  const AffinePlanCosts c = gdn_plan_costs(shape, m);
  const Row row = packed({4000, 4001, 900});
  for (int ranks : {2, 3, 4, 5}) {
    GdnPlan p = make_gdn_plan(row, ranks, {1, 1, 0});
    const double got = gdn_predict(row, p, shape, m);
    const double summary_bytes = c.summary_elements * c.bytes_per_element;
    const double compose = c.summary_elements * c.compose_madds_per_element / m.madds_per_ms;
    const int rounds = ranks == 2 ? 1 : ranks <= 4 ? 2 : 3;
    double chain_work = 0;
    for (int r = 0; r < ranks; ++r) {
      double w = 0;
      for (int32_t s : {0, 1}) w += static_cast<double>(p.pieces[s][r].size()) * c.chain_ms_per_token;
      chain_work = std::max(chain_work, w);
    }
    const double chain_step = chain_work + 2 * rounds *
                                               (m.link.latency_ms + 2 * summary_bytes / m.link.bandwidth_bytes_per_ms +
                                                2 * compose) +
                              m.step_overhead_ms;
    // Local step: the one local document on one rank.
    const double local_step = 900 * c.local_ms_per_token + m.step_overhead_ms;
    EXPECT_NEAR(got, chain_step + local_step, 1e-9 * got) << ranks;
  }
}

TEST(GdnLayoutPlan, ValidationNamesSegmentAndPiece) {
  const Row row = packed({3, 30, 7});
  const GdnPlan good = gdn_layout_plan(row, 4, GdnLayout::Zigzag);
  auto refused = [&](GdnPlan bad, const std::string& expect) {
    try {
      validate_gdn_plan(row, bad);
      ADD_FAILURE() << "accepted; expected: " << expect;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(expect), std::string::npos) << e.what();
    }
  };
  GdnPlan b = good;
  b.pieces[1][2].rank = 4;
  refused(b, "segment 1: piece 2: rank 4 out of range");
  b = good;
  b.pieces[1][3].begin += 1;  // a gap
  refused(b, "segment 1: piece 3:");
  b = good;
  b.pieces[1][1].end = b.pieces[1][1].begin - 1;  // ends before it starts
  refused(b, "segment 1: piece 1:");
  b = good;
  b.pieces[1].back().end -= 1;
  refused(b, "segment 1: its pieces end at 32");
  b = good;
  b.pieces[1].clear();
  refused(b, "segment 1: a chained segment needs at least one piece");
  b = good;
  b.pieces[0] = {{0, 0, 3}};
  refused(b, "segment 0: a local segment has no pieces");
  // JSON pieces of the wrong arity are refused with their place.
  EXPECT_THROW(GdnPlan::from_json(json::parse(
                   R"({"ranks": 2, "num_phases": 2, "segments": [{"chained": true, "phase": 1, "pieces": [[0, 0]]}]})")),
               Error);
}

// The searched plan against brute force on small packed rows: every chained set (rank-order and
// zigzag pieces), the three layouts and the attention ownership, each priced with its token moves.
// The search must be at most the cheapest fixed layout, at least the brute-force minimum, and pick a
// fixed layout when that layout is the strict brute-force minimum.
TEST(GdnLayoutPlan, SearchedChoiceAgainstBruteForce) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(37);
  GdnShape shape;
  shape.heads = 4;
  shape.dk = shape.dv = 32;
  int fixed_wins = 0;
  for (int trial = 0; trial < 24; ++trial) {
    const int ranks = 2 + trial % 3;
    std::vector<int64_t> lengths;
    const int docs = 2 + static_cast<int>(rng() % 4);
    for (int d = 0; d < docs; ++d) lengths.push_back(64 + static_cast<int64_t>(rng() % 4000));
    const Row row = packed(lengths);
    GdnCostModel m;
    m.link.bandwidth_bytes_per_ms = trial % 2 ? 6.7e5 : 6.7e3;  // fast and slow links
    GdnPlanOptions o;
    const GdnLayout att = trial % 4 < 2 ? GdnLayout::Zigzag : GdnLayout::Contiguous;
    if (trial % 3 != 0) o.attention = gdn_ownership(row, gdn_layout_plan(row, ranks, att));
    auto price = [&](GdnPlan& p) {
      const double move = o.attention ? gdn_move_price(row, p, *o.attention, shape, m, 4).ms : 0.0;
      return gdn_predict(row, p, shape, m) + move;
    };
    double sets_min = 1e300, fixed_min = 1e300;
    GdnLayout fixed_best = GdnLayout::Contiguous;
    for (uint32_t mask = 0; mask < (1u << docs); ++mask) {
      std::vector<uint8_t> chained(static_cast<size_t>(docs));
      for (int d = 0; d < docs; ++d) chained[d] = (mask >> d) & 1;
      GdnPlan even = make_gdn_plan(row, ranks, chained);
      GdnPlan zig = even;
      for (int32_t s = 0; s < docs; ++s)
        if (chained[s]) zig.pieces[s] = gdn_zigzag_pieces(row, s, ranks);
      sets_min = std::min({sets_min, price(even), price(zig)});
    }
    std::vector<std::pair<GdnLayout, GdnPlan>> fixed;
    for (GdnLayout l : {GdnLayout::Contiguous, GdnLayout::Zigzag, GdnLayout::DocZigzag})
      fixed.emplace_back(l, gdn_layout_plan(row, ranks, l));
    if (o.attention) fixed.emplace_back(GdnLayout::Attention, gdn_plan_for_ownership(row, *o.attention));
    for (auto& [l, p] : fixed) {
      const double ms = price(p);
      if (ms < fixed_min) {
        fixed_min = ms;
        fixed_best = l;
      }
    }
    GdnPlan got = plan_gdn(row, ranks, shape, m, o);
    const double got_ms = price(got);
    const std::string what = "trial " + std::to_string(trial) + " ranks " + std::to_string(ranks);
    EXPECT_LE(got_ms, fixed_min * (1 + 1e-12)) << what;
    EXPECT_GE(got_ms, std::min(sets_min, fixed_min) * (1 - 1e-12)) << what;
    if (fixed_min < sets_min * (1 - 1e-9)) {
      ++fixed_wins;
      EXPECT_NEAR(got_ms, fixed_min, 1e-12 * fixed_min) << what << " expected " << gdn_layout_name(fixed_best);
    }
  }
  // The trials include rows where a fixed layout is the strict minimum (the property is exercised).
  EXPECT_GT(fixed_wins, 0);
}

// Attention in zigzag and a slow link: the searched plan runs where attention holds the tokens.
TEST(GdnLayoutPlan, SearchedRunsInTheAttentionLayoutWhenMovingCosts) {
  const Row row = packed({5000, 300, 2000, 700, 4100});
  GdnCostModel slow;
  slow.link.bandwidth_bytes_per_ms = 1e3;
  for (int ranks : {2, 4}) {
    for (GdnLayout att : {GdnLayout::Contiguous, GdnLayout::Zigzag, GdnLayout::DocZigzag}) {
      GdnPlanOptions o;
      o.attention = gdn_ownership(row, gdn_layout_plan(row, ranks, att));
      const GdnPlan p = plan_gdn(row, ranks, GdnShape{}, slow, o);
      EXPECT_EQ(gdn_move_price(row, p, *o.attention, GdnShape{}, slow, 4).ms, 0.0)
          << gdn_layout_name(att) << " ranks " << ranks << " chose " << gdn_layout_name(p.layout);
      // Without the attention layout to honour, the same row need not pay zigzag's longer scan.
      GdnPlan z = gdn_layout_plan(row, ranks, GdnLayout::Zigzag);
      EXPECT_LE(plan_gdn(row, ranks, GdnShape{}, slow).predicted_ms, gdn_predict(row, z, GdnShape{}, slow));
    }
  }
  // A fixed layout asked for is what comes back, with its prediction.
  GdnPlanOptions o;
  o.layout = GdnLayout::DocZigzag;
  const GdnPlan fixed = plan_gdn(row, 4, GdnShape{}, slow, o);
  EXPECT_EQ(fixed.layout, GdnLayout::DocZigzag);
  EXPECT_GT(fixed.predicted_ms, 0.0);
  o.layout = GdnLayout::Attention;
  EXPECT_THROW(plan_gdn(row, 4, GdnShape{}, slow, o), Error);
}

}  // namespace
}  // namespace treecp
