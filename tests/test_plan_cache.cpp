// The plan cache returns the very plan it made for identical inputs and a fresh one for any change of row,
// rank count, layer shape (window included), options or coefficients; it evicts the least recently used entry; lookahead's prepared plans
// equal direct planning, and its workers' errors reach the caller.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "plan/plan_cache.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/lookahead.hpp"
#include "tree/presets.hpp"

namespace treecp {
namespace {

const AttentionShape kLayer{4, 2, 8, 8};

Row small_row(int64_t extra) {
  return Row(std::vector<Segment>{{-1, 40 + extra}, {0, 17}, {0, 9}, {-1, 23}, {3, 5}});
}

TEST(PlanCache, HitsOnlyForIdenticalInputs) {
  PlanCache cache(8);
  const CostModel costs;
  PlanOptions opt;
  bool hit = true;
  const auto a = cache.get(small_row(0), 2, kLayer, costs, opt, &hit);
  EXPECT_FALSE(hit);
  const auto b = cache.get(small_row(0), 2, kLayer, costs, opt, &hit);
  EXPECT_TRUE(hit);
  EXPECT_EQ(a.get(), b.get());
  EXPECT_EQ(json::dump(plan_to_json(*a)), json::dump(plan_to_json(make_plan(small_row(0), 2, kLayer, costs, opt))));
  // every input of the plan is part of the key
  cache.get(small_row(1), 2, kLayer, costs, opt, &hit);
  EXPECT_FALSE(hit) << "another row";
  cache.get(small_row(0), 3, kLayer, costs, opt, &hit);
  EXPECT_FALSE(hit) << "another rank count";
  AttentionShape windowed = kLayer;
  windowed.window = 7;
  cache.get(small_row(0), 2, windowed, costs, opt, &hit);
  EXPECT_FALSE(hit) << "another window";
  AttentionShape wider = kLayer;
  wider.hkv = 4;
  cache.get(small_row(0), 2, wider, costs, opt, &hit);
  EXPECT_FALSE(hit) << "another shape";
  PlanOptions zigzag = opt;
  zigzag.layout = Layout::Zigzag;
  cache.get(small_row(0), 2, kLayer, costs, zigzag, &hit);
  EXPECT_FALSE(hit) << "another layout";
  PlanOptions refetch = opt;
  refetch.backward_kv = "refetch";
  cache.get(small_row(0), 2, kLayer, costs, refetch, &hit);
  EXPECT_FALSE(hit) << "another backward KV choice";
  CostModel slower = costs;
  slower.local_forward_pairs_per_ms /= 2;
  cache.get(small_row(0), 2, kLayer, slower, opt, &hit);
  EXPECT_FALSE(hit) << "other coefficients";
  EXPECT_EQ(cache.size(), 8u);
  EXPECT_EQ(cache.hits(), 1);
  EXPECT_EQ(cache.misses(), 8);
}

TEST(PlanCache, EvictsTheLeastRecentlyUsed) {
  PlanCache cache(2);
  const CostModel costs;
  bool hit = false;
  cache.get(small_row(0), 2, kLayer, costs, PlanOptions{});
  cache.get(small_row(1), 2, kLayer, costs, PlanOptions{});
  cache.get(small_row(0), 2, kLayer, costs, PlanOptions{}, &hit);  // row 0 is now the most recent
  EXPECT_TRUE(hit);
  cache.get(small_row(2), 2, kLayer, costs, PlanOptions{});  // evicts row 1
  EXPECT_EQ(cache.size(), 2u);
  cache.get(small_row(0), 2, kLayer, costs, PlanOptions{}, &hit);
  EXPECT_TRUE(hit);
  cache.get(small_row(1), 2, kLayer, costs, PlanOptions{}, &hit);
  EXPECT_FALSE(hit);
}

TEST(PlanCache, ConcurrentCallersGetOnePlanPerKey) {
  PlanCache cache(16);
  const CostModel costs;
  const Row row = make_preset("varied5k", 2, 3);
  std::vector<std::shared_ptr<const Plan>> got(4);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) threads.emplace_back([&, i] { got[i] = cache.get(row, 2, kLayer, costs, PlanOptions{}); });
  for (auto& t : threads) t.join();
  EXPECT_EQ(cache.size(), 1u);
  for (int i = 1; i < 4; ++i) EXPECT_EQ(json::dump(plan_to_json(*got[i])), json::dump(plan_to_json(*got[0])));
}

TEST(Lookahead, PreparesWhatDirectPlanningGives) {
  const CostModel costs;
  PlanCache cache(4);
  std::vector<Row> rows;
  for (uint64_t seed = 0; seed < 3; ++seed) rows.push_back(scale_row(make_preset("varied5k", 3, seed), 64));
  rows.push_back(rows[0]);  // a repeated tree comes from the cache
  for (int rank = 0; rank < 3; ++rank) {
    Lookahead<CpuBackend<float>> ahead(rank, 3, costs, PlanOptions{}, kLayer, &cache);
    for (size_t i = 0; i < 3; ++i) ahead.submit(rows[i]);
    for (size_t i = 0; i < rows.size(); ++i) {
      // The repeat is submitted once row 0's plan is cached (submitted together, both workers may miss).
      if (i == 1) ahead.submit(rows[3]);
      const auto got = ahead.next();
      const Plan direct = make_plan(rows[i], 3, kLayer, costs, PlanOptions{});
      EXPECT_EQ(json::dump(plan_to_json(*got.plan)), json::dump(plan_to_json(direct))) << "row " << i << " rank " << rank;
      const RankSchedule want = make_rank_schedule(direct, rank);
      EXPECT_EQ(got.prepared.schedule.owned.ranges(), want.owned.ranges());
      EXPECT_EQ(got.prepared.local, want.local_slices);
      ASSERT_EQ(got.prepared.waves.size(), want.waves.size());
      for (size_t w = 0; w < want.waves.size(); ++w) EXPECT_EQ(got.prepared.waves[w], want.waves[w].slices);
      EXPECT_GE(got.host_ms, 0.0);
      if (i == 3) {
        EXPECT_TRUE(got.cache_hit) << "rank " << rank;
      }
    }
    EXPECT_EQ(ahead.pending(), 0u);
  }
}

TEST(Lookahead, WorkerErrorsReachTheCaller) {
  // Ring is a baseline's layout, which make_plan refuses.
  Lookahead<CpuBackend<float>> ahead(0, 1, CostModel{}, PlanOptions{.layout = Layout::Ring}, AttentionShape{2, 1, 4, 4});
  ahead.submit(small_row(0));
  EXPECT_THROW(ahead.next(), Error);
  EXPECT_THROW(ahead.next(), Error) << "nothing submitted";
}

}  // namespace
}  // namespace treecp
