// The simulator's timeline (simulate_timeline): its totals are simulate()'s bit for bit; each span lasts
// what the one stage-cost and transfer-cost functions say; forward and backward lanes are gapless (every
// idle interval is an explicit wait) and ordered; waves start only once their KV has landed; returns
// start when their stage ends and finish before the backward does. Worked by hand on a small case, then
// checked on random loads and on real plans.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "plan/cost.hpp"
#include "plan/planner.hpp"
#include "common/schedule.hpp"
#include "tree/presets.hpp"
#include "tree/row.hpp"

namespace treecp {
namespace {

// The schedule of Costs.SimulatorFollowsTheScheduleModel (test_plan.cpp), with token-local work, span by span.
TEST(Timeline, HandWorkedSchedule) {
  testing::ScheduleCase s = testing::hand_worked_schedule();
  s.costs.token_local_forward_ms_per_token = 0.25;
  s.costs.token_local_backward_ms_per_token = 0.5;
  s.loads[0].owned_tokens = 4;  // token-local 1 ms forward, 2 ms backward
  const Links links(s.costs, 2);
  const Timeline t = simulate_timeline(s.costs, links, s.shape, s.loads, s.waves);
  // Forward (after 1 ms of token-local work): local 0-3 while wave 0 lands at 4; wave 0 runs 4-5 and
  // issues wave 1's fetch (4-6); wave 1 runs 6-8. Backward from 9: wave 1 (4 ms), its return (2 ms),
  // wave 0 (2 ms), its return (4 ms, to 10 + 9), local (6 ms), token-local 2 ms.
  struct Want {
    SpanKind kind;
    Pass pass;
    int wave;
    double begin, end;
  };
  const Pass F = Pass::Forward, B = Pass::Backward;
  const std::vector<Want> want = {
      {SpanKind::TokenLocal, F, -1, 0, 1},   {SpanKind::LocalStage, F, -1, 1, 4}, {SpanKind::Fetch, F, 0, 1, 5},
      {SpanKind::Wait, F, 0, 4, 5},          {SpanKind::Fetch, F, 1, 5, 7},       {SpanKind::RemoteStage, F, 0, 5, 6},
      {SpanKind::Wait, F, 1, 6, 7},          {SpanKind::RemoteStage, F, 1, 7, 9}, {SpanKind::RemoteStage, B, 1, 9, 13},
      {SpanKind::Return, B, 1, 13, 15},      {SpanKind::RemoteStage, B, 0, 13, 15}, {SpanKind::Return, B, 0, 15, 19},
      {SpanKind::LocalStage, B, -1, 15, 21}, {SpanKind::TokenLocal, B, -1, 21, 23},
  };
  ASSERT_EQ(t.spans.size(), want.size());  // rank 1 has nothing to do: no spans at all
  for (size_t i = 0; i < want.size(); ++i) {
    const ScheduleSpan& got = t.spans[i];
    EXPECT_EQ(got.rank, 0) << i;
    EXPECT_EQ(got.kind, want[i].kind) << i;
    EXPECT_EQ(got.pass, want[i].pass) << i;
    EXPECT_EQ(got.wave, want[i].wave) << i;
    EXPECT_DOUBLE_EQ(got.begin_ms, want[i].begin) << i;
    EXPECT_DOUBLE_EQ(got.end_ms, want[i].end) << i;
  }
  EXPECT_DOUBLE_EQ(t.prediction.forward_ms[0], 9.0);
  EXPECT_DOUBLE_EQ(t.prediction.backward_ms[0], 14.0);
  EXPECT_DOUBLE_EQ(t.prediction.makespan_ms, 23.0);
}

// A slow return makes the backward wait for it.
TEST(Timeline, BackwardWaitsForTheLastReturn) {
  CostModel c;
  c.stage_launch_ms = c.range_ms = c.merge_ms_per_query_token = 0.0;
  c.underfill_pairs = 0;
  c.token_local_forward_ms_per_token = c.token_local_backward_ms_per_token = 0.0;
  c.local_forward_pairs_per_ms = c.remote_forward_pairs_per_ms = 1.0;
  c.local_backward_pairs_per_ms = c.remote_backward_pairs_per_ms = 1.0;
  c.intra_node = {0.0, 1.0};
  c.rank_bandwidth_bytes_per_ms = 1e9;
  c.kv_bytes_per_element = 1;
  c.dkv_bytes_per_element = 4;
  const AttentionShape shape{1, 1, 1, 1};  // 2 B per KV token, 8 B per dK/dV token
  const Links links(c, 2);
  std::vector<RankLoad> loads(2);
  loads[0].local = {1, 0, 0};
  loads[0].waves = {{1, 0, 1}};
  loads[1].waves = {{0, 0, 0}};
  std::vector<WaveTraffic> waves(1, WaveTraffic(4, 0));
  waves[0][1 * 2 + 0] = 2;  // forward 4 ms; the return 16 ms
  const Timeline t = simulate_timeline(c, links, shape, loads, waves);
  // Forward: local 0-1, wait 1-4, wave 0 4-5. Backward from 5: wave 0 5-6, return 6-22, local 6-7, wait 7-22.
  ASSERT_EQ(t.spans.size(), 8u);
  EXPECT_EQ(t.spans.back().kind, SpanKind::Wait);
  EXPECT_EQ(t.spans.back().pass, Pass::Backward);
  EXPECT_DOUBLE_EQ(t.spans.back().begin_ms, 7.0);
  EXPECT_DOUBLE_EQ(t.spans.back().end_ms, 22.0);
  EXPECT_DOUBLE_EQ(t.prediction.makespan_ms, 22.0);
}

void expect_same(const Prediction& a, const Prediction& b) {
  ASSERT_EQ(a.forward_ms.size(), b.forward_ms.size());
  for (size_t r = 0; r < a.forward_ms.size(); ++r) {
    EXPECT_EQ(a.forward_ms[r], b.forward_ms[r]) << "rank " << r;  // bit-identical, not near
    EXPECT_EQ(a.backward_ms[r], b.backward_ms[r]) << "rank " << r;
  }
  EXPECT_EQ(a.makespan_ms, b.makespan_ms);
  EXPECT_EQ(a.slowest_rank, b.slowest_rank);
}

// The properties every timeline has, checked against the public cost functions.
void check_timeline(const CostModel& c, const Links& links, const AttentionShape& shape, const std::vector<RankLoad>& loads,
                    const std::vector<WaveTraffic>& waves, const Timeline& t) {
  const int cp = links.cp();
  const size_t W = waves.size();
  const double tol = 1e-9 * std::max(1.0, t.prediction.makespan_ms);
  double latest = 0.0;
  for (int r = 0; r < cp; ++r) {
    const double F = t.prediction.forward_ms[r], total = F + t.prediction.backward_ms[r];
    std::vector<ScheduleSpan> compute, fetches, returns;
    for (const ScheduleSpan& s : t.spans) {
      if (s.rank != r) continue;
      ASSERT_LT(s.begin_ms, s.end_ms) << "empty spans are left out";
      ASSERT_GE(s.begin_ms, 0.0);
      ASSERT_LE(s.end_ms, total);
      latest = std::max(latest, s.end_ms);
      (s.kind == SpanKind::Fetch ? fetches : s.kind == SpanKind::Return ? returns : compute).push_back(s);
      // Pass boundaries: forward spans end by F, backward spans begin at F or later.
      if (s.pass == Pass::Forward) {
        ASSERT_LE(s.end_ms, F);
      } else {
        ASSERT_GE(s.begin_ms, F);
      }
    }
    // The compute lane tiles [0, total] in order, with no gap and no overlap.
    double at = 0.0;
    for (const ScheduleSpan& s : compute) {
      ASSERT_EQ(s.begin_ms, at) << "rank " << r << " compute lane has a gap or an overlap";
      at = s.end_ms;
    }
    ASSERT_EQ(at, compute.empty() ? 0.0 : total);
    // Durations are the cost functions' own numbers.
    const RankLoad& l = loads[r];
    std::vector<double> fwd_stage_end(W, -1), fwd_stage_begin(W, -1), bwd_stage_end(W, -1);
    for (const ScheduleSpan& s : compute) {
      const double d = s.end_ms - s.begin_ms;
      const bool fwd = s.pass == Pass::Forward;
      if (s.kind == SpanKind::LocalStage) {
        EXPECT_NEAR(d, stage_ms(c, l.local, false, s.pass), tol);
      } else if (s.kind == SpanKind::RemoteStage) {
        ASSERT_GE(s.wave, 0);
        EXPECT_NEAR(d, stage_ms(c, l.waves[s.wave], true, s.pass), tol);
        (fwd ? fwd_stage_end : bwd_stage_end)[s.wave] = s.end_ms;
        if (fwd) fwd_stage_begin[s.wave] = s.begin_ms;
      } else if (s.kind == SpanKind::TokenLocal) {
        const double per_token = fwd ? c.token_local_forward_ms_per_token : c.token_local_backward_ms_per_token;
        EXPECT_NEAR(d, static_cast<double>(l.owned_tokens) * per_token, tol);
      }
    }
    // Forward fetches: one per wave with traffic into r, back to back in wave order, each as long as
    // exchange_ms says; wave w + 1's fetch is issued as wave w starts, and no wave starts before its KV.
    double fetch_free = 0.0;
    int last_wave = -1;
    for (const ScheduleSpan& s : fetches) {
      ASSERT_GT(s.wave, last_wave);
      last_wave = s.wave;
      ASSERT_GE(s.begin_ms, fetch_free - tol);
      fetch_free = s.end_ms;
      EXPECT_NEAR(s.end_ms - s.begin_ms, exchange_ms(c, links, waves[s.wave], r, c.kv_bytes_per_token(shape), true),
                  tol);
      if (fwd_stage_begin[s.wave] >= 0) {
        EXPECT_GE(fwd_stage_begin[s.wave], s.end_ms - tol);
      }
      if (s.wave > 0 && fwd_stage_begin[s.wave - 1] >= 0) {
        EXPECT_NEAR(s.begin_ms, fwd_stage_begin[s.wave - 1], tol);
      }
    }
    for (size_t w = 0; w < W; ++w) {
      const bool needs = exchange_ms(c, links, waves[w], r, c.kv_bytes_per_token(shape), true) > 0;
      EXPECT_EQ(needs, std::any_of(fetches.begin(), fetches.end(), [&](const ScheduleSpan& s) {
                  return s.wave == static_cast<int>(w);
                })) << "rank " << r << " wave " << w;
    }
    // Returns: from the end of their backward stage (its start when the stage is empty), as long as
    // the mirrored exchange, finished before the backward's token-local work.
    double attention_done = F;
    for (const ScheduleSpan& s : compute) {
      if (s.pass == Pass::Backward && s.kind != SpanKind::TokenLocal) attention_done = s.end_ms;
    }
    for (const ScheduleSpan& s : returns) {
      EXPECT_NEAR(s.end_ms - s.begin_ms, exchange_ms(c, links, waves[s.wave], r, c.dkv_bytes_per_token(shape), false),
                  tol);
      if (bwd_stage_end[s.wave] >= 0) {
        EXPECT_NEAR(s.begin_ms, bwd_stage_end[s.wave], tol);
      }
      EXPECT_LE(s.end_ms, attention_done + tol);
    }
  }
  EXPECT_EQ(latest, t.prediction.makespan_ms);
}

TEST(Timeline, RandomLoadsKeepEveryProperty) {
  std::mt19937_64 rng(2024);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  int forward_waits = 0, backward_waits = 0, overlapping_returns = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int cp = 1 + static_cast<int>(rng() % 6);
    const size_t W = cp == 1 ? 0 : rng() % 5;
    CostModel c;
    c.stage_launch_ms = 0.05 * u(rng);
    c.range_ms = 0.01 * u(rng);
    c.merge_ms_per_query_token = 1e-4 * u(rng);
    c.underfill_pairs = rng() % 2 ? 0 : 1000;
    c.underfill_ms = 0.2 * u(rng);
    c.token_local_forward_ms_per_token = 1e-3 * u(rng);
    c.token_local_backward_ms_per_token = 2e-3 * u(rng);
    c.local_forward_pairs_per_ms = 50 + 500 * u(rng);
    c.remote_forward_pairs_per_ms = 50 + 500 * u(rng);
    c.local_backward_pairs_per_ms = 20 + 200 * u(rng);
    c.remote_backward_pairs_per_ms = 20 + 200 * u(rng);
    c.ranks_per_node = 1 + static_cast<int>(rng() % 3);
    c.intra_node = {0.1 * u(rng), 100 + 2000 * u(rng)};
    c.inter_node = {0.3 * u(rng), 50 + 500 * u(rng)};
    c.rank_bandwidth_bytes_per_ms = 100 + 3000 * u(rng);
    c.kv_bytes_per_element = 1 + static_cast<int64_t>(rng() % 2);
    c.dkv_bytes_per_element = 1 + static_cast<int64_t>(rng() % 4);
    const AttentionShape shape{1, 1, 1, 1};
    const Links links(c, cp);
    std::vector<RankLoad> loads(cp);
    std::vector<WaveTraffic> waves(W, WaveTraffic(static_cast<size_t>(cp) * cp, 0));
    for (int r = 0; r < cp; ++r) {
      loads[r].owned_tokens = static_cast<int64_t>(rng() % 200);
      const int64_t lp = rng() % 3 == 0 ? 0 : static_cast<int64_t>(rng() % 5000);
      loads[r].local = {lp, static_cast<int64_t>(rng() % 100), static_cast<int64_t>(rng() % 4)};
      loads[r].waves.resize(W);
      for (size_t w = 0; w < W; ++w) {
        if (rng() % 3 == 0) continue;  // nothing from this wave
        loads[r].waves[w] = {1 + static_cast<int64_t>(rng() % 3000), static_cast<int64_t>(rng() % 100),
                             1 + static_cast<int64_t>(rng() % 3)};
        for (int src = 0; src < cp; ++src) {
          if (src != r && rng() % 2) waves[w][static_cast<size_t>(src) * cp + r] = 1 + static_cast<int64_t>(rng() % 300);
        }
      }
    }
    const Timeline t = simulate_timeline(c, links, shape, loads, waves);
    expect_same(t.prediction, simulate(c, links, shape, loads, waves));
    check_timeline(c, links, shape, loads, waves, t);
    if (HasFatalFailure() || HasFailure()) {
      ADD_FAILURE() << "trial " << trial << " (cp " << cp << ", " << W << " waves)";
      return;
    }
    for (size_t i = 0; i < t.spans.size(); ++i) {
      const ScheduleSpan& s = t.spans[i];
      if (s.kind == SpanKind::Wait) ++(s.pass == Pass::Forward ? forward_waits : backward_waits);
      for (size_t j = i + 1; s.kind == SpanKind::Return && j < t.spans.size(); ++j) {
        const ScheduleSpan& o = t.spans[j];
        overlapping_returns += o.rank == s.rank && o.kind == SpanKind::Return && o.begin_ms < s.end_ms;
      }
    }
  }
  // The random cases reach every branch of the schedule.
  EXPECT_GT(forward_waits, 0);
  EXPECT_GT(backward_waits, 0);
  EXPECT_GT(overlapping_returns, 0);
}

// On real plans: simulate_plan_timeline's totals are simulate_plan's, and agree with the planner's own
// prediction of the plan.
TEST(Timeline, PlansOfPresets) {
  for (const char* preset : {"varied5k", "deep", "longchain", "art-varied5k"}) {
    for (int cp : {2, 3, 4, 8}) {
      for (Layout layout : {Layout::Searched, Layout::Zigzag}) {
        const Row row = scale_row(make_preset(preset, cp, 1), 8);
        PlanOptions opt;
        opt.layout = layout;
        const CostModel c;
        const AttentionShape shape;
        const Plan plan = make_plan(row, cp, shape, c, opt);
        const Timeline t = simulate_plan_timeline(plan, shape, c);
        expect_same(t.prediction, simulate_plan(plan, shape, c));
        EXPECT_NEAR(t.prediction.makespan_ms, plan.predicted_makespan_ms, 1e-6 * plan.predicted_makespan_ms)
            << preset << " cp " << cp << " " << layout_name(layout);
        for (const ScheduleSpan& s : t.spans) ASSERT_LE(s.end_ms, t.prediction.makespan_ms);
      }
    }
  }
}

}  // namespace
}  // namespace treecp
