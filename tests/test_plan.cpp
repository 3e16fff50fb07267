// The planner: work matrix, layouts, exact-once coverage against brute force, one fetch per range per
// wave, JSON round trips, the cost model's one function, the search against fixed layouts and an
// exhaustive search, and validate_plan's refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>

#include "core/error.hpp"
#include "core/json.hpp"
#include "kernels/cpu/tiles.hpp"
#include "kernels/cuda/tiles.hpp"
#include "plan/cost.hpp"
#include "plan/plan.hpp"
#include "plan/planner.hpp"
#include "plan/work.hpp"
#include "common/schedule.hpp"
#include "tree/presets.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

#include "common/common.hpp"

namespace treecp {

// gtest prints a Layout by its name.
void PrintTo(Layout layout, std::ostream* os) { *os << layout_name(layout); }

namespace {

// The layer planned for: DESIGN.md's benchmark shape, with a window.
AttentionShape layer(int64_t window = 0) {
  AttentionShape shape;
  shape.window = window;
  return shape;
}

// A random forest of up to 25 segments, lengths 1..max_len, depth <= 4, 0-3 children per segment.
Row random_row(testing::Rng& rng, int64_t max_len = 40) {
  return testing::random_tree(rng, {.segments = std::uniform_int_distribution<int>(1, 25)(rng), .max_len = max_len});
}

// Every (q, k) of every slice of every stage, counted densely: only for small rows.
void expect_exact_once(const Plan& plan, const Row& row, int64_t window, const std::string& what) {
  const int64_t S = row.tokens();
  std::vector<int> count(static_cast<size_t>(S * S), 0);
  for (const RankPlan& rp : plan.ranks) {
    for (const Stage& st : rp.stages) {
      for (const Slice& s : st.slices) {
        for (int64_t q = s.q_begin; q < s.q_end; ++q) {
          for (int64_t k = s.k_begin; k < s.k_end; ++k) {
            if (s.contains(q, k)) count[q * S + k]++;
          }
        }
      }
    }
  }
  int64_t bad = 0;
  for (int64_t q = 0; q < S; ++q) {
    for (int64_t k = 0; k < S; ++k) bad += count[q * S + k] != (row.visible(q, k, window) ? 1 : 0);
  }
  EXPECT_EQ(bad, 0) << what;
}

// A KV chunk is fetched by a rank at most once over all waves, never from itself, and every
// received token range is read by some slice of that stage.
void expect_one_fetch(const Plan& plan, const std::string& what) {
  for (int r = 0; r < plan.cp; ++r) {
    std::vector<TokenRange> all;
    for (int w = 1; w <= plan.num_waves; ++w) {
      const Stage& st = plan.ranks[r].stages[w];
      ASSERT_EQ(static_cast<int>(st.recv.size()), plan.cp) << what;
      EXPECT_TRUE(st.recv[r].empty()) << what;
      for (const auto& peer : st.recv) {
        for (const TokenRange& t : peer) {
          all.push_back(t);
          const bool used = std::any_of(st.slices.begin(), st.slices.end(),
                                        [&](const Slice& s) { return s.k_begin < t.end && s.k_end > t.begin; });
          EXPECT_TRUE(used) << what << ": rank " << r << " wave " << w << " fetches [" << t.begin << ", " << t.end
                            << ") and never reads it";
        }
      }
    }
    std::sort(all.begin(), all.end(), [](const TokenRange& a, const TokenRange& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < all.size(); ++i) {
      EXPECT_LE(all[i - 1].end, all[i].begin) << what << ": rank " << r << " fetches a range twice";
    }
  }
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Pairs per chunk pair against brute-force visibility; the tiled kernel's computed pairs against cutting
// every slice at every chunk pair and tiling each piece on its own (tile_padded_area is checked against
// counting tiles below).
TEST(Plan, WorkMatrixMatchesBruteForce) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(7);
  for (int iter = 0; iter < 60; ++iter) {
    const Row row = random_row(rng);
    const int64_t window = iter % 3 == 0 ? std::uniform_int_distribution<int64_t>(1, 30)(rng) : 0;
    const int64_t chunk = std::uniform_int_distribution<int64_t>(1, 25)(rng);
    const int64_t tq = std::uniform_int_distribution<int64_t>(0, 6)(rng), tk = std::uniform_int_distribution<int64_t>(1, 6)(rng);
    const auto slices = row_slices(row, window);
    const WorkMatrix w = build_work_matrix(slices, make_chunk_bounds(row, chunk), tq, tk);
    const int32_t n = w.num_chunks();
    std::vector<int64_t> dense(static_cast<size_t>(n) * n, 0), tiled(dense.size(), 0);
    for (int64_t q = 0; q < row.tokens(); ++q) {
      for (int64_t k = 0; k < row.tokens(); ++k) {
        if (row.visible(q, k, window)) dense[chunk_of(w.bounds, q) * n + chunk_of(w.bounds, k)]++;
      }
    }
    for (const Slice& s : slices) {
      for (int32_t i = 0; i < n; ++i) {
        for (int32_t j = 0; j < n; ++j) {
          tiled[i * n + j] += tile_padded_area(cut_slice(s, w.bounds[i], w.bounds[i + 1], w.bounds[j], w.bounds[j + 1]), tq, tk);
        }
      }
    }
    std::vector<int64_t> sparse(dense.size(), 0), compute(dense.size(), 0);
    for (int32_t i = 0; i < n; ++i) {
      for (int64_t e = w.row_start[i]; e < w.row_start[i + 1]; ++e) {
        EXPECT_GT(w.pairs[e], 0);
        if (e > w.row_start[i]) {
          EXPECT_LT(w.col[e - 1], w.col[e]);
        }
        sparse[i * n + w.col[e]] += w.pairs[e];
        compute[i * n + w.col[e]] += w.compute[e];
      }
    }
    EXPECT_EQ(sparse, dense) << "iteration " << iter;
    EXPECT_EQ(compute, tiled) << "iteration " << iter << " tiles " << tq << "x" << tk;
  }
}

TEST(Plan, ChunkSizeFollowsTheBudget) {
  EXPECT_EQ(default_chunk_tokens(327680, 8), 1280);  // 256 chunks = 128 + 16 x 8
  EXPECT_EQ(default_chunk_tokens(40960, 1), 512);
  EXPECT_EQ(default_chunk_tokens(1000, 4), 250);  // fewer 512-token chunks than ranks
  const Row row = make_preset("varied5k", 8, 0);
  const std::vector<int64_t> b = make_chunk_bounds(row, default_chunk_tokens(row.tokens(), 8));
  EXPECT_LE(static_cast<int64_t>(b.size()) - 1, chunk_budget(8) + 8);
}

// ART §05: eight causal tokens, two ranks, four chunks of two tokens.
TEST(Plan, SectionFiveExample) {
  const Row row({{-1, 8}});
  PlanOptions o;
  o.chunk_tokens = 2;
  o.layout = Layout::Contiguous;
  const Plan contiguous = make_plan(row, 2, layer(), CostModel{}, o);
  EXPECT_EQ(contiguous.ranks[0].pairs(), 10);
  EXPECT_EQ(contiguous.ranks[1].pairs(), 26);
  o.layout = Layout::Zigzag;
  const Plan folded = make_plan(row, 2, layer(), CostModel{}, o);
  EXPECT_EQ(folded.ranks[0].pairs(), 18);
  EXPECT_EQ(folded.ranks[1].pairs(), 18);
  EXPECT_EQ(folded.chunk_owner, (std::vector<int32_t>{0, 1, 1, 0}));
  validate_plan(contiguous, row, 0, 2);
  validate_plan(folded, row, 0, 2);
}

TEST(Plan, EveryLayoutCoversEveryPairOnceOnRandomTrees) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(11);
  int plans = 0;
  for (int iter = 0; iter < 24; ++iter) {
    const Row row = random_row(rng);
    const int64_t window = iter % 2 == 0 ? std::uniform_int_distribution<int64_t>(1, 40)(rng) : 0;
    for (int cp = 1; cp <= 8; ++cp) {
      PlanOptions o;
      o.chunk_tokens = std::uniform_int_distribution<int64_t>(1, 16)(rng);
      o.perdoc_min_piece = std::uniform_int_distribution<int64_t>(1, 4)(rng);
      o.max_waves = std::uniform_int_distribution<int>(1, 4)(rng);
      for (Layout layout : kLayouts) {
        o.layout = layout;
        const std::string what = std::string(layout_name(layout)) + " cp " + std::to_string(cp) + " iteration " + std::to_string(iter) +
                                 " window " + std::to_string(window);
        const Plan plan = make_plan(row, cp, layer(window), CostModel{}, o);
        ASSERT_NO_THROW(validate_plan(plan, row, window, cp)) << what;
        expect_exact_once(plan, row, window, what);
        expect_one_fetch(plan, what);
        EXPECT_EQ(plan.layout, layout);
        ++plans;
      }
    }
  }
  EXPECT_EQ(plans, 24 * 8 * 5);
}

// Attention layers with different windows share one ownership: the plan for another window keeps the
// base plan's chunks and owners and still computes every visible pair of its window once, each remote
// chunk fetched once.
TEST(Plan, AnotherWindowKeepsTheOwnershipAndCoversEveryPairOnce) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(23);
  for (int iter = 0; iter < 12; ++iter) {
    const Row row = random_row(rng);
    for (int cp = 1; cp <= 5; ++cp) {
      PlanOptions o;
      o.chunk_tokens = std::uniform_int_distribution<int64_t>(1, 16)(rng);
      o.layout = kLayouts[static_cast<size_t>(iter + cp) % 5];
      const Plan base = make_plan(row, cp, layer(), CostModel{}, o);
      for (int64_t window : {int64_t{0}, std::uniform_int_distribution<int64_t>(1, 30)(rng)}) {
        const std::string what = "cp " + std::to_string(cp) + " iteration " + std::to_string(iter) + " window " +
                                 std::to_string(window);
        const Plan plan = plan_for_ownership(row, base, layer(window), CostModel{}, o);
        ASSERT_NO_THROW(validate_plan(plan, row, window, cp)) << what;
        EXPECT_EQ(plan.window, window) << what;
        expect_exact_once(plan, row, window, what);
        expect_one_fetch(plan, what);
        EXPECT_EQ(plan.chunk_bounds, base.chunk_bounds) << what;
        EXPECT_EQ(plan.chunk_owner, base.chunk_owner) << what;
        EXPECT_EQ(plan_ownership(plan), plan_ownership(base)) << what;
      }
    }
  }
  EXPECT_THROW(plan_for_ownership(make_preset("fixed5k", 2, 0), make_plan(make_preset("fixed5k", 1, 0), 1, layer(),
                                                                          CostModel{}, PlanOptions{}),
                                  layer(), CostModel{}),
               Error);
}

TEST(Plan, PresetPlansValidateAtOddRankCounts) {
  for (int cp : {3, 5, 6}) {
    for (const char* preset : {"varied5k", "deep", "art-varied5k"}) {
      const Row row = make_preset(preset, cp, 1);
      for (int64_t window : {int64_t{0}, int64_t{4096}}) {
        PlanOptions o;
        PlanReport report;
        const Plan plan = make_plan(row, cp, layer(window), CostModel{}, o, &report);
        ASSERT_NO_THROW(validate_plan(plan, row, window, cp)) << preset << " cp " << cp;
        expect_one_fetch(plan, preset);
        int64_t pairs = 0;
        for (const RankPlan& rp : plan.ranks) pairs += rp.pairs();
        EXPECT_EQ(pairs, plan.visible_pairs);
      }
    }
  }
}

// The search starts from the best fixed layout and keeps only what improves it, so "never slower"
// holds by construction; what can fail is that it finds nothing (on rows whose families do not
// divide evenly it must beat every fixed layout somewhere) or that a prediction undercuts the lower
// bound of all work spread evenly at the local rates (an evaluation that drops work).
TEST(Plan, SearchedIsNeverPredictedSlowerThanAFixedLayout) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(5);
  int cases = 0, improved = 0;
  const CostModel costs;
  ASSERT_LE(costs.remote_forward_pairs_per_ms, costs.local_forward_pairs_per_ms);  // else not a bound
  ASSERT_LE(costs.remote_backward_pairs_per_ms, costs.local_backward_pairs_per_ms);
  auto check = [&](const Row& row, int cp, const PlanOptions& o, const std::string& what) {
    PlanReport report;
    const Plan plan = make_plan(row, cp, layer(), costs, o, &report);
    ASSERT_EQ(report.layouts.size(), 5u);
    const double bound =
        own_work_ms(costs, static_cast<double>(plan.visible_pairs), static_cast<double>(row.tokens())) / cp;
    for (const LayoutResult& l : report.layouts)
      EXPECT_GE(l.makespan_ms, bound * (1 - 1e-12)) << what << " " << layout_name(l.layout);
    ASSERT_EQ(report.layouts[4].layout, Layout::Searched);
    double best_fixed = 1e300;
    for (int l = 0; l < 4; ++l) {
      EXPECT_LE(report.layouts[4].makespan_ms, report.layouts[l].makespan_ms + 1e-12)
          << what << " vs " << layout_name(report.layouts[l].layout);
      best_fixed = std::min(best_fixed, report.layouts[l].makespan_ms);
    }
    EXPECT_DOUBLE_EQ(plan.predicted_makespan_ms, report.layouts[4].makespan_ms) << what;
    ++cases;
    improved += report.layouts[4].makespan_ms < best_fixed * (1 - 1e-3);
  };
  for (int cp : {2, 3, 4, 5, 6, 7, 8}) {
    for (const char* preset : {"fixed5k", "varied5k", "dominant", "deep", "art-manysmall"}) {
      check(make_preset(preset, cp, 3), cp, PlanOptions{}, std::string(preset) + " cp " + std::to_string(cp));
    }
  }
  const int preset_cases = cases, preset_improved = improved;
  for (int iter = 0; iter < 40; ++iter) {
    const Row row = random_row(rng, 400);
    PlanOptions o;
    o.chunk_tokens = std::uniform_int_distribution<int64_t>(16, 200)(rng);
    check(row, 2 + iter % 7, o, "random " + std::to_string(iter));
  }
  std::printf("the search beat every fixed layout by more than 0.1%% on %d of %d presets, %d of %d random rows\n",
              preset_improved, preset_cases, improved - preset_improved, cases - preset_cases);
  EXPECT_GT(preset_improved, 0) << "the search never improved on the best fixed layout of a preset";
  EXPECT_GT(improved - preset_improved, 0) << "the search never improved on the best fixed layout of a random row";
}

// One long causal sequence: equal tokens are not equal work, folding balances it (ART §05).
TEST(Plan, CausalSequencePrefersFoldingOverContiguous) {
  const Row row({{-1, 262144}});
  PlanReport report;
  (void)make_plan(row, 4, layer(), CostModel{}, PlanOptions{}, &report);
  EXPECT_LT(report.layouts[1].makespan_ms, report.layouts[0].makespan_ms);  // zigzag beats contiguous
  EXPECT_LT(report.layouts[4].makespan_ms, report.layouts[0].makespan_ms);
}

// Small inputs: the bounded search against every ownership and wave count, on the grid the search
// used (the perdoc grid of a row whose perdoc layout won has too many chunks for the exhaustive
// search: such rows are drawn again, and the test insists on 24 compared rows). A bound on a
// heuristic, so the seed is pinned.
TEST(Plan, SearchIsCloseToExhaustiveOnSmallInputs) {
  std::mt19937_64 rng(23);
  double worst = 1.0;
  int compared = 0;
  for (int iter = 0; iter < 200 && compared < 24; ++iter) {
    const Row row = random_row(rng, 600);
    const int cp = 2 + compared % 2;
    const int32_t chunks = cp == 2 ? 9 : 7;
    PlanOptions o;
    o.max_waves = 2;
    o.chunk_tokens = (row.tokens() + chunks - 1) / chunks;
    const CostModel costs;
    PlanReport report;
    const Plan plan = make_plan(row, cp, layer(), costs, o, &report);
    const WorkMatrix w = build_work_matrix(row_slices(row), plan.chunk_bounds);
    const int32_t n = w.num_chunks();
    if (n > chunks) continue;
    ++compared;
    Evaluator ev(w, costs, layer(), cp);
    std::vector<int32_t> owner(n, 0);
    double best = 1e300;
    for (int64_t code = 0;; ++code) {
      int64_t x = code;
      for (int32_t i = 0; i < n; ++i, x /= cp) owner[i] = static_cast<int32_t>(x % cp);
      if (x > 0) break;
      for (int waves = 0; waves <= o.max_waves; ++waves) {
        const Evaluator::Result r = ev.evaluate(owner, waves);
        if (r.valid && r.fits_memory) best = std::min(best, r.prediction.makespan_ms);
      }
    }
    const double got = report.layouts[4].makespan_ms;
    EXPECT_GE(got, best - 1e-9) << "the search beat the exhaustive optimum: an evaluation differs";
    worst = std::max(worst, got / best);
    EXPECT_LE(got, best * 1.10) << "iteration " << iter << ": searched " << got << " ms, optimum " << best << " ms";
  }
  ASSERT_EQ(compared, 24) << "too few rows could be searched exhaustively";
  std::printf("worst searched / optimum on small inputs: %.4f\n", worst);
}

TEST(Plan, SimulatingThePlanGivesItsPredictions) {
  for (int cp : {1, 2, 3, 8}) {
    const Row row = make_preset("varied5k", cp, 2);
    for (Layout layout : kLayouts) {
      PlanOptions o;
      o.layout = layout;
      const Plan plan = make_plan(row, cp, layer(), CostModel{}, o);
      const Prediction p = simulate_plan(plan, layer(), CostModel{});
      double makespan = 0.0;
      for (int r = 0; r < cp; ++r) {
        EXPECT_NEAR(p.forward_ms[r], plan.ranks[r].predicted_forward_ms, 1e-9) << layout_name(layout) << " rank " << r;
        EXPECT_NEAR(p.backward_ms[r], plan.ranks[r].predicted_backward_ms, 1e-9) << layout_name(layout) << " rank " << r;
        makespan = std::max(makespan, p.forward_ms[r] + p.backward_ms[r]);
      }
      EXPECT_NEAR(p.makespan_ms, plan.predicted_makespan_ms, 1e-9);
      EXPECT_NEAR(makespan, plan.predicted_makespan_ms, 1e-9);
    }
  }
}

TEST(Plan, JsonRoundTrip) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(3);
  for (int iter = 0; iter < 10; ++iter) {
    const Row row = iter == 0 ? make_preset("deep", 4, 0) : random_row(rng, 100);
    const int cp = 1 + iter % 6;
    PlanOptions o;
    const int64_t window = iter % 3 == 0 ? 50 : 0;
    const Plan plan = make_plan(row, cp, layer(window), CostModel{}, o);
    const json::Value v = plan_to_json(plan);
    for (const char* key : {"predicted_makespan_ms", "visible_pairs", "ranks"}) EXPECT_TRUE(v.contains(key)) << key;
    ASSERT_EQ(v.at("ranks").size(), static_cast<size_t>(cp));
    for (size_t r = 0; r < v.at("ranks").size(); ++r) {
      const json::Value& jr = v.at("ranks")[r];
      EXPECT_TRUE(jr.contains("owned_ranges"));
      for (const json::Value& st : jr.at("stages").as_array()) {
        EXPECT_TRUE(st.contains("pairs"));
        EXPECT_TRUE(st.contains("remote_ranges"));
      }
    }
    const Plan back = plan_from_json_text(json::dump(v));
    EXPECT_EQ(back.layout, plan.layout);
    EXPECT_EQ(back.cp, plan.cp);
    EXPECT_EQ(back.tokens, plan.tokens);
    EXPECT_EQ(back.window, plan.window);
    EXPECT_EQ(back.chunk_bounds, plan.chunk_bounds);
    EXPECT_EQ(back.chunk_owner, plan.chunk_owner);
    EXPECT_EQ(back.num_waves, plan.num_waves);
    EXPECT_EQ(back.visible_pairs, plan.visible_pairs);
    EXPECT_EQ(back.predicted_makespan_ms, plan.predicted_makespan_ms);
    ASSERT_EQ(back.ranks.size(), plan.ranks.size());
    for (size_t r = 0; r < plan.ranks.size(); ++r) {
      const RankPlan &a = plan.ranks[r], &b = back.ranks[r];
      EXPECT_EQ(a.owned, b.owned);
      EXPECT_EQ(a.predicted_forward_ms, b.predicted_forward_ms);
      EXPECT_EQ(a.predicted_backward_ms, b.predicted_backward_ms);
      ASSERT_EQ(a.stages.size(), b.stages.size());
      for (size_t w = 0; w < a.stages.size(); ++w) {
        EXPECT_EQ(a.stages[w].slices, b.stages[w].slices);
        EXPECT_EQ(a.stages[w].recv, b.stages[w].recv);
        EXPECT_EQ(a.stages[w].send, b.stages[w].send);
        EXPECT_EQ(a.stages[w].pairs, b.stages[w].pairs);
      }
    }
    validate_plan(back, row, window, cp);
    EXPECT_EQ(json::dump(plan_to_json(back)), json::dump(v));
  }
}

TEST(Plan, ValidateRejectsCorruptedPlans) {
  const Row row = make_preset("deep", 3, 0);
  PlanOptions o;
  o.layout = Layout::Zigzag;
  const Plan good = make_plan(row, 3, layer(), CostModel{}, o);
  validate_plan(good, row, 0, 3);
  // A stage with at least two slices.
  int r0 = -1;
  size_t w0 = 0;
  for (int r = 0; r < 3 && r0 < 0; ++r) {
    for (size_t w = 0; w < good.ranks[r].stages.size() && r0 < 0; ++w) {
      if (good.ranks[r].stages[w].slices.size() >= 2) r0 = r, w0 = w;
    }
  }
  ASSERT_GE(r0, 0);

  Plan missing = good;
  {
    Stage& st = missing.ranks[r0].stages[w0];
    st.pairs -= st.slices.back().area();
    st.slices.pop_back();
  }
  Plan duplicated = good;
  {
    Stage& st = duplicated.ranks[r0].stages[w0];
    st.slices.push_back(st.slices.front());
    st.pairs += st.slices.front().area();
  }
  Plan fewer_ranks = good;
  fewer_ranks.ranks.pop_back();
  const Row longer({{-1, row.tokens() + 5}});
  Plan bad_recv = good;
  bool corrupted_recv = false;
  for (int r = 0; r < 3 && !corrupted_recv; ++r) {
    for (size_t w = 1; w < bad_recv.ranks[r].stages.size() && !corrupted_recv; ++w) {
      for (auto& peer : bad_recv.ranks[r].stages[w].recv) {
        if (!peer.empty()) {
          peer.back().end -= 1;
          corrupted_recv = true;
          break;
        }
      }
    }
  }

  const std::string m_missing = message_of([&] { validate_plan(missing, row, 0); });
  const std::string m_dup = message_of([&] { validate_plan(duplicated, row, 0); });
  const std::string m_ranks = message_of([&] { validate_plan(fewer_ranks, row, 0); });
  const std::string m_cp = message_of([&] { validate_plan(good, row, 0, 4); });
  const std::string m_len = message_of([&] { validate_plan(good, longer, 0); });
  const std::string m_window = message_of([&] { validate_plan(good, row, 64); });
  EXPECT_NE(m_missing.find("missing"), std::string::npos) << m_missing;
  EXPECT_NE(m_dup.find("more than once"), std::string::npos) << m_dup;
  EXPECT_NE(m_ranks.find("rank count"), std::string::npos) << m_ranks;
  EXPECT_NE(m_cp.find("rank count"), std::string::npos) << m_cp;
  EXPECT_NE(m_len.find("row length"), std::string::npos) << m_len;
  EXPECT_NE(m_window.find("window"), std::string::npos) << m_window;
  const std::set<std::string> distinct{m_missing, m_dup, m_ranks, m_len, m_window};
  EXPECT_EQ(distinct.size(), 5u);
  // A remote slice moved into the local stage reads keys the rank does not own.
  Plan wrong_stage = good;
  bool moved = false;
  for (int r = 0; r < 3 && !moved; ++r) {
    for (size_t w = 1; w < wrong_stage.ranks[r].stages.size() && !moved; ++w) {
      Stage& st = wrong_stage.ranks[r].stages[w];
      if (st.slices.empty()) continue;
      const Slice s = st.slices.back();
      st.slices.pop_back();
      st.pairs -= s.area();
      wrong_stage.ranks[r].stages[0].slices.push_back(s);
      wrong_stage.ranks[r].stages[0].pairs += s.area();
      moved = true;
    }
  }
  ASSERT_TRUE(moved);
  const std::string m_stage = message_of([&] { validate_plan(wrong_stage, row, 0); });
  EXPECT_NE(m_stage.find("keys the rank does not own"), std::string::npos) << m_stage;
  if (corrupted_recv) {
    const std::string m = message_of([&] { validate_plan(bad_recv, row, 0); });
    EXPECT_NE(m.find("recv"), std::string::npos) << m;
  }
}

TEST(Plan, MemoryBoundTradesWavesForBuffers) {
  // The bound counts what the runtime holds (plan/memory.hpp): with the received KV kept for the backward,
  // every wave's buffer at once; fetched again, the wave in use and the next one. A bound just below the kept
  // choice's peak makes the planner fetch again; fetching again, a bound below that makes it pick another wave
  // count whose buffers fit.
  const Row row = make_preset("longchain", 4, 0);
  CostModel costs;
  PlanOptions o;
  o.layout = Layout::Zigzag;
  PlanReport free_report;
  (void)make_plan(row, 4, layer(), costs, o, &free_report);
  const LayoutResult unbounded = free_report.layouts[1];
  ASSERT_GE(unbounded.num_waves, 1);
  ASSERT_FALSE(unbounded.refetch_backward) << "keeping fits without a bound";
  costs.memory_limit_bytes_per_rank = unbounded.peak_memory_bytes - 1;
  PlanReport report;
  const Plan plan = make_plan(row, 4, layer(), costs, o, &report);
  validate_plan(plan, row, 0, 4);
  for (const LayoutResult& l : report.layouts) {
    if (l.fits_memory) {
      EXPECT_LE(l.peak_memory_bytes, costs.memory_limit_bytes_per_rank) << layout_name(l.layout);
    }
  }
  EXPECT_TRUE(report.layouts[1].fits_memory);
  EXPECT_TRUE(report.layouts[1].refetch_backward);
  EXPECT_TRUE(plan.refetch_backward);
  EXPECT_TRUE(report.layouts[4].fits_memory);

  o.backward_kv = "refetch";
  costs.memory_limit_bytes_per_rank = 0;
  PlanReport refetch_report;
  (void)make_plan(row, 4, layer(), costs, o, &refetch_report);
  const LayoutResult refetch = refetch_report.layouts[1];
  costs.memory_limit_bytes_per_rank = refetch.peak_memory_bytes - 1;
  PlanReport tight;
  (void)make_plan(row, 4, layer(), costs, o, &tight);
  EXPECT_TRUE(tight.layouts[1].fits_memory);
  EXPECT_LE(tight.layouts[1].peak_memory_bytes, costs.memory_limit_bytes_per_rank);
  EXPECT_NE(tight.layouts[1].num_waves, refetch.num_waves) << "other receive buffers";
}

TEST(Costs, SlowerCrossNodeLinksRaiseThePrediction) {
  const Row row = make_preset("varied5k", 4, 0);
  PlanOptions o;
  o.layout = Layout::Zigzag;
  CostModel one_node;
  CostModel two_nodes;
  two_nodes.ranks_per_node = 2;
  two_nodes.inter_node = {0.5, 1.0e6};  // 1 GB/s
  const Plan a = make_plan(row, 4, layer(), one_node, o);
  const Plan b = make_plan(row, 4, layer(), two_nodes, o);
  EXPECT_EQ(a.chunk_owner, b.chunk_owner);
  EXPECT_GT(b.predicted_makespan_ms, a.predicted_makespan_ms + 0.5);
  // A per-pair override wins over the node rule.
  two_nodes.links.push_back({0, 3, {0.0, 5.0e9}});
  EXPECT_EQ(two_nodes.link(0, 3).bandwidth_bytes_per_ms, 5.0e9);
  EXPECT_EQ(two_nodes.link(3, 0).bandwidth_bytes_per_ms, 1.0e6);
  EXPECT_EQ(two_nodes.link(0, 1).bandwidth_bytes_per_ms, one_node.intra_node.bandwidth_bytes_per_ms);
}

TEST(Costs, DefaultFileMatchesBuiltInDefaults) {
  const auto path = std::filesystem::path(__FILE__).parent_path().parent_path() / "config" / "costs_default.json";
  const CostModel file = load_costs(path.string());
  EXPECT_EQ(json::dump(to_json(file)), json::dump(to_json(CostModel{})));
  // And the JSON form round-trips.
  EXPECT_EQ(json::dump(to_json(costs_from_json(to_json(file)))), json::dump(to_json(file)));
}

// Every shipped coefficient file loads (a binary whose default file it is refuses to start otherwise):
// the H200 file keeps its fitted local-stage throughputs and round-trips.
TEST(Costs, CalibratedH200FileLoads) {
  const auto path = std::filesystem::path(__FILE__).parent_path().parent_path() / "config" / "costs_h200.json";
  const CostModel h200 = load_costs(path.string());
  EXPECT_NE(h200.local_forward_pairs_per_ms, CostModel{}.local_forward_pairs_per_ms);
  EXPECT_NE(h200.local_backward_pairs_per_ms, CostModel{}.local_backward_pairs_per_ms);
  EXPECT_EQ(json::dump(to_json(costs_from_json(to_json(h200)))), json::dump(to_json(h200)));
}

// The tiles priced are the kernels' own: the CPU kernel's 128 rows over the GQA group x 64 keys.
TEST(Costs, KernelTilesComeFromTheKernels) {
  EXPECT_EQ(tile_tokens(KernelTiles::Cpu, 4).query, cpu::kTileRows / 4);
  EXPECT_EQ(tile_tokens(KernelTiles::Cpu, 4).key, cpu::kKeyBlock);
  EXPECT_EQ(tile_tokens(KernelTiles::Cpu, 512).query, 1);
  EXPECT_EQ(tile_tokens(KernelTiles::Cuda, 8).query, cuda::kFwdBlockRows / 8);
  EXPECT_EQ(tile_tokens(KernelTiles::Cuda, 8).key, cuda::kFwdBlockKeys);
  EXPECT_EQ(tile_tokens(KernelTiles::Exact, 8).query, 0);
  const CostModel cpu_file = load_costs(
      (std::filesystem::path(__FILE__).parent_path().parent_path() / "config" / "costs_cpu.json").string());
  EXPECT_EQ(cpu_file.kernel_tiles, KernelTiles::Cpu);
  EXPECT_NE(message_of([] { costs_from_json(json::parse(R"({"kernel_tiles": "tpu"})")); }).find("kernel_tiles"),
            std::string::npos);
}

TEST(Costs, RejectsUnknownKeysAndBadValues) {
  EXPECT_NE(message_of([] { costs_from_json(json::parse(R"({"local_forward_pairs_per_m": 1})")); }).find("unknown key"),
            std::string::npos);
  EXPECT_NE(message_of([] { costs_from_json(json::parse(R"({"local_forward_pairs_per_ms": 0})")); }).find("> 0"),
            std::string::npos);
  EXPECT_NE(message_of([] { costs_from_json(json::parse(R"({"kv_bytes_per_element": 0})")); }).find("kv_bytes_per_element"),
            std::string::npos);
  // The layer's shape is not a coefficient: make_plan takes it.
  EXPECT_NE(message_of([] { costs_from_json(json::parse(R"({"shape": {"hkv": 4}})")); }).find("unknown key"),
            std::string::npos);
}

TEST(Costs, StageAndTransferTerms) {
  CostModel c;
  c.underfill_pairs = 1000;
  c.underfill_ms = 1.0;
  c.stage_launch_ms = 0.5;
  c.local_forward_pairs_per_ms = 100.0;
  c.range_ms = 0.25;
  c.merge_ms_per_query_token = 0.125;
  EXPECT_EQ(stage_ms(c, StageLoad{0, 10, 3}, false, Pass::Forward), 0.0);
  // launch + pairs / throughput + ranges + underfill x (1 - pairs / underfill_pairs)
  EXPECT_DOUBLE_EQ(stage_ms(c, StageLoad{500, 10, 2}, false, Pass::Forward), 0.5 + 5.0 + 0.5 + 0.5);
  c.remote_forward_pairs_per_ms = 50.0;
  EXPECT_DOUBLE_EQ(stage_ms(c, StageLoad{2000, 8, 1}, true, Pass::Forward), 0.5 + 40.0 + 0.25 + 1.0);
  // Transfer: latency + max(link, sender total, receiver total).
  c.ranks_per_node = 2;
  c.intra_node = {0.1, 1000.0};
  c.inter_node = {1.0, 100.0};
  c.rank_bandwidth_bytes_per_ms = 500.0;
  c.kv_bytes_per_element = c.dkv_bytes_per_element = 1;
  const AttentionShape tiny{1, 1, 1, 1};  // 2 bytes per token
  EXPECT_EQ(c.kv_bytes_per_token(tiny), 2);
  const Links links(c, 4);
  WaveTraffic t(16, 0);
  t[1 * 4 + 0] = 100;  // rank 1 -> rank 0, same node: 200 B
  t[2 * 4 + 0] = 50;   // rank 2 -> rank 0, across nodes: 100 B
  // intra: 0.1 + max(0.2, 0.4, 0.6) = 0.7; inter: 1.0 + max(1.0, 0.2, 0.6) = 2.0
  EXPECT_DOUBLE_EQ(exchange_ms(c, links, t, 0, 2, true), 2.0);
  // Rank 2 returns dK/dV to rank 0 over the reverse link: 1.0 + max(1.0, 0.2, 0.6).
  EXPECT_DOUBLE_EQ(exchange_ms(c, links, t, 2, 2, false), 0.0);  // rank 2 received nothing
  EXPECT_DOUBLE_EQ(exchange_ms(c, links, t, 0, 2, false), 2.0);
}

TEST(Costs, SimulatorFollowsTheScheduleModel) {
  const testing::ScheduleCase s = testing::hand_worked_schedule();
  const Links links(s.costs, 2);
  const Prediction p = simulate(s.costs, links, s.shape, s.loads, s.waves);
  // forward: compute 3, fetch0 ready 4 -> start 4, fetch1 ready 4 + 2 = 6, done 5; start 6, done 8.
  EXPECT_DOUBLE_EQ(p.forward_ms[0], 8.0);
  // backward: wave 1 2 x 2 = 4 ms, return 2 ms -> 6; wave 0 +2 ms = 6, return 4 ms -> 10; local +6 = 12.
  EXPECT_DOUBLE_EQ(p.backward_ms[0], 12.0);
  EXPECT_DOUBLE_EQ(p.makespan_ms, 20.0);
  EXPECT_EQ(p.slowest_rank, 0);
}

TEST(PlanCli, PrintsEveryLayoutAndJson) {
  const std::string cmd = std::string(TREECP_CLI_PATH) + " plan --preset varied5k --cp 3 --json 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.c_str(), "r"), pclose);
  ASSERT_TRUE(pipe);
  std::string out;
  char buf[65536];
  size_t got;
  while ((got = fread(buf, 1, sizeof buf, pipe.get())) > 0) out.append(buf, got);
  const json::Value v = json::parse(out);
  EXPECT_EQ(v.at("ranks").size(), 3u);
  EXPECT_EQ(v.at("layouts").size(), 5u);
  EXPECT_TRUE(v.at("planning_ms").is_number());
  const Plan plan = plan_from_json(v);
  validate_plan(plan, make_preset("varied5k", 3, 0), 0, 3);

  const std::string text_cmd = std::string(TREECP_CLI_PATH) + " plan --preset fixed5k --ranks 2 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> text(popen(text_cmd.c_str(), "r"), pclose);
  out.clear();
  while ((got = fread(buf, 1, sizeof buf, text.get())) > 0) out.append(buf, got);
  for (const char* word : {"contiguous", "zigzag", "perdoc", "family", "searched", "planned in", "kv_bytes_in"}) {
    EXPECT_NE(out.find(word), std::string::npos) << word << "\n" << out;
  }
  const std::string bad_cmd = std::string(TREECP_CLI_PATH) + " plan --preset fixed5k --cp 2 --layout spiral 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> bad(popen(bad_cmd.c_str(), "r"), pclose);
  out.clear();
  while ((got = fread(buf, 1, sizeof buf, bad.get())) > 0) out.append(buf, got);
  EXPECT_NE(out.find("option --layout must be one of contiguous, zigzag, perdoc, family, searched; got 'spiral'"),
            std::string::npos)
      << out;
  EXPECT_NE(pclose(bad.release()), 0);
}

}  // namespace
}  // namespace treecp

namespace treecp {
namespace {

// tile_padded_area against counting the touched tiles one by one.
TEST(Cost, TilePaddedAreaCountsEveryTouchedTile) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(17);
  std::uniform_int_distribution<int64_t> pos(0, 40), d(-50, 50), tile(1, 9);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t a = d(rng), b = d(rng);
    const Slice s = make_slice(pos(rng), pos(rng) + 1 + pos(rng), pos(rng), pos(rng) + 1 + pos(rng), std::min(a, b),
                               std::max(a, b) + 1);
    const int64_t tq = tile(rng), tk = tile(rng);
    int64_t expected = 0;
    for (int64_t q0 = s.q_begin; q0 < s.q_end; q0 += tq) {
      for (int64_t k0 = s.k_begin; k0 < s.k_end; k0 += tk) {
        bool touched = false;
        for (int64_t q = q0; q < std::min(q0 + tq, s.q_end); ++q) {
          for (int64_t k = k0; k < std::min(k0 + tk, s.k_end); ++k) touched |= s.contains(q, k);
        }
        expected += touched ? tq * tk : 0;
      }
    }
    ASSERT_EQ(tile_padded_area(s, tq, tk), expected) << to_string(s) << " tiles " << tq << "x" << tk;
    EXPECT_GE(tile_padded_area(s, tq, tk), s.area());
    EXPECT_EQ(tile_padded_area(s, 0, 0), s.area());
  }
}

// The planner's prediction and simulate_plan's (from the Plan's own slices) price tiles the same way,
// and small-segment rows cost more than their pairs once a tile is set.
TEST(Cost, TiledPredictionMatchesSimulationOfThePlan) {
  CostModel c;
  c.kernel_tiles = KernelTiles::Cpu;
  for (int cp : {1, 2, 3}) {
    const Row row = scale_row(make_preset("varied5k", cp, 4), 16);
    PlanOptions opt;
    opt.layout = Layout::Contiguous;
    const Plan tiled = make_plan(row, cp, layer(), c, opt);
    const Plan exact = make_plan(row, cp, layer(), CostModel{}, opt);
    EXPECT_NEAR(simulate_plan(tiled, layer(), c).makespan_ms, tiled.predicted_makespan_ms, 1e-6 * tiled.predicted_makespan_ms);
    EXPECT_GT(tiled.predicted_makespan_ms, exact.predicted_makespan_ms);
  }
}

}  // namespace
}  // namespace treecp
