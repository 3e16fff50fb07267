// The sparse MLA planner: per-query sparse work against brute force, the two kinds of work priced
// separately through the one stage cost, the selected-row bound against brute force, the fetch mode
// following the bytes, layouts that balance the sparse work where balancing pairs would not, and the
// cost files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/json.hpp"
#include "plan/cost.hpp"
#include "plan/planner.hpp"
#include "plan/sparse_mla_plan.hpp"
#include "plan/work.hpp"
#include "tree/row.hpp"

#include "common/common.hpp"

namespace treecp {
namespace {

using testing::base_seed;  // tests/common: TREECP_TEST_SEED=N replays a run, failures print the seed

// A random row of `segments` segments, lengths 1..max_len, paths up to 6 segments deep.
Row random_tree(std::mt19937_64& rng, int segments, int max_len) {
  return testing::random_tree(rng, {.segments = segments, .max_len = max_len, .max_depth = 6});
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::filesystem::path config_file(const char* name) {
  return std::filesystem::path(__FILE__).parent_path().parent_path() / "config" / name;
}

TEST(SparseMlaPlan, SparsePairsPerQueryMatchBruteForce) {
  TREECP_SEED_TRACE;
  std::mt19937_64 rng(base_seed() + 1);
  for (int trial = 0; trial < 10; ++trial) {
    const Row row = random_tree(rng, 8, 25);
    const int64_t window = trial % 3 ? 7 : 0, topk = 1 + trial * 4;
    const std::vector<int64_t> got = sparse_pairs_per_query(row, window, topk);
    for (int64_t q = 0; q < row.tokens(); ++q) {
      int64_t n = 0;
      for (int64_t j = 0; j < row.tokens(); ++j) n += row.visible(q, j, window) ? 1 : 0;
      ASSERT_EQ(got[static_cast<size_t>(q)], std::min(n, topk)) << "query " << q << " trial " << trial;
    }
  }
}

// Under any plan: indexer pairs are the visible pairs, sparse pairs the per-query min(k, visible); the
// selected-row bound never exceeds the rows the waves bring or the brute-force bound.
TEST(SparseMlaPlan, WorkAndBoundAgainstBruteForce) {
  TREECP_SEED_TRACE;
  std::mt19937_64 rng(base_seed() + 2);
  for (int trial = 0; trial < 8; ++trial) {
    const Row row = random_tree(rng, 9, 40);
    const int cp = 2 + trial % 4;
    SparseMlaPlanOptions o;
    o.plan.layout = kLayouts[static_cast<size_t>(trial) % std::size(kLayouts)];
    o.window = trial % 2 ? 11 : 0;
    o.plan.chunk_tokens = 7;
    o.topk = 1 + trial * 3;
    const SparseMlaPlan p = make_sparse_mla_plan(row, cp, SparseMlaCosts{}, o);
    const std::vector<int64_t> per_query = sparse_pairs_per_query(row, o.window, o.topk);
    int64_t indexer = 0;
    for (int r = 0; r < cp; ++r) {
      const SparseMlaRankCost& rc = p.prediction.ranks[static_cast<size_t>(r)];
      indexer += rc.indexer_pairs;
      int64_t sparse = 0, rows_bound = 0;
      for (const TokenRange& t : p.plan.ranks[static_cast<size_t>(r)].owned) {
        for (int64_t q = t.begin; q < t.end; ++q) sparse += per_query[static_cast<size_t>(q)];
      }
      EXPECT_EQ(rc.sparse_pairs, sparse) << "rank " << r << " trial " << trial;
      // brute force: per owner, min(its tokens some owned query sees, sum_q min(k, keys of that owner q sees))
      for (int src = 0; src < cp; ++src) {
        if (src == r) continue;
        int64_t seen = 0, capped = 0;
        std::vector<bool> any(static_cast<size_t>(row.tokens()), false);
        for (const TokenRange& t : p.plan.ranks[static_cast<size_t>(r)].owned) {
          for (int64_t q = t.begin; q < t.end; ++q) {
            int64_t n = 0;
            for (int64_t j = 0; j < row.tokens(); ++j) {
              if (p.plan.chunk_owner[static_cast<size_t>(chunk_of(p.plan.chunk_bounds, j))] != src || !row.visible(q, j, o.window)) continue;
              ++n;
              any[static_cast<size_t>(j)] = true;
            }
            capped += std::min(n, o.topk);
          }
        }
        // the waves fetch whole chunks: count the tokens of every chunk holding a seen key
        for (size_t c = 0; c + 1 < p.plan.chunk_bounds.size(); ++c) {
          bool hit = false;
          for (int64_t j = p.plan.chunk_bounds[c]; j < p.plan.chunk_bounds[c + 1]; ++j) hit = hit || any[static_cast<size_t>(j)];
          if (hit) seen += p.plan.chunk_bounds[c + 1] - p.plan.chunk_bounds[c];
        }
        rows_bound += std::min(seen, capped);
      }
      EXPECT_EQ(rc.selected_rows, rows_bound) << "rank " << r << " trial " << trial;
      EXPECT_LE(rc.selected_rows, rc.wave_rows);
    }
    EXPECT_EQ(indexer, p.plan.visible_pairs);
  }
}

TEST(SparseMlaPlan, IndexerAndSparseWorkArePricedSeparately) {
  // One rank: no exchange; the indexer is one local stage of the visible pairs at the indexer rate, the
  // sparse call one stage of the selected pairs at the sparse rates, each through stage_ms.
  const Row row({{-1, 300}, {0, 100}, {0, 50}});
  SparseMlaCosts c;
  c.indexer.local_forward_pairs_per_ms = 1000.0;
  c.indexer.stage_launch_ms = 0.5;
  c.indexer.range_ms = 0.25;
  c.indexer.underfill_pairs = 0;
  c.sparse.local_forward_pairs_per_ms = 100.0;
  c.sparse.local_backward_pairs_per_ms = 40.0;
  c.sparse.stage_launch_ms = 1.0;
  c.sparse.range_ms = 0.0;
  c.sparse.token_local_forward_ms_per_token = 0.001;
  c.sparse.token_local_backward_ms_per_token = 0.002;
  for (int64_t topk : {8, 64, 100000}) {
    SparseMlaPlanOptions o;
    o.topk = topk;
    const SparseMlaPlan p = make_sparse_mla_plan(row, 1, c, o);
    const SparseMlaRankCost& rc = p.prediction.ranks[0];
    const std::vector<int64_t> per_query = sparse_pairs_per_query(row, 0, topk);
    int64_t sparse = 0;
    for (int64_t x : per_query) sparse += x;
    const int64_t pairs = 300 * 301 / 2 + 2 * 300 * 100 / 2 + 100 * 101 / 2 + 300 * 50 + 50 * 51 / 2;
    ASSERT_EQ(rc.indexer_pairs, pairs);
    EXPECT_EQ(rc.sparse_pairs, sparse);
    EXPECT_DOUBLE_EQ(rc.indexer_ms, 0.5 + static_cast<double>(pairs) / 1000.0 + 0.25);
    EXPECT_DOUBLE_EQ(rc.sparse_forward_ms, 1.0 + static_cast<double>(sparse) / 100.0 + 450 * 0.001);
    EXPECT_DOUBLE_EQ(rc.sparse_backward_ms, 1.0 + static_cast<double>(sparse) / 40.0 + 450 * 0.002);
    EXPECT_DOUBLE_EQ(p.prediction.makespan_ms, rc.indexer_ms + rc.sparse_forward_ms + rc.sparse_backward_ms);
    EXPECT_EQ(p.prediction.bytes_moved, 0);
    if (topk == 100000) {
      EXPECT_EQ(sparse, pairs);  // k above every visible count: the sparse call sees every pair
    }
  }
}

TEST(SparseMlaPlan, FetchFollowsTheBytes) {
  // Rank 1 owns a 10-token completion of rank 0's 300-token root (and a family of its own): with k = 4
  // its lists read at most 40 root rows, so fetching the selected rows moves fewer bytes than taking
  // the 300 rows with the waves; with k = 100 the bound is the 300 rows and the waves win.
  const Row row({{-1, 300}, {0, 10}, {-1, 290}});
  SparseMlaPlanOptions o;
  o.plan.layout = Layout::Contiguous;
  o.plan.chunk_tokens = 10;
  for (int64_t topk : {4, 100}) {
    o.topk = topk;
    const SparseMlaPlan p = make_sparse_mla_plan(row, 2, SparseMlaCosts{}, o);
    ASSERT_EQ(p.plan.ranks[1].owned, (std::vector<TokenRange>{{300, 600}}));
    const SparseMlaRankCost& r1 = p.prediction.ranks[1];
    EXPECT_EQ(r1.selected_rows, std::min<int64_t>(300, 10 * topk));
    EXPECT_EQ(p.fetch, topk == 4 ? KvFetch::Selected : KvFetch::Waves) << "k " << topk;
    EXPECT_LE(p.prediction.bytes_moved, p.other.bytes_moved);
    EXPECT_NE(p.other.fetch, p.fetch);
    // forced modes are kept
    SparseMlaPlanOptions forced = o;
    forced.fetch = topk == 4 ? "waves" : "selected";
    EXPECT_NE(make_sparse_mla_plan(row, 2, SparseMlaCosts{}, forced).fetch, p.fetch);
  }
  // Bytes of the selected mode, by hand for k = 4 (40 rows, bf16 kv of 576, fp32 dKV, int64 ids, and one
  // id count each way): rank 1 gets 300 ki rows in the waves.
  o.topk = 4;
  const SparseMlaPlan p = make_sparse_mla_plan(row, 2, SparseMlaCosts{}, o);
  const SparseMlaShape sh;
  EXPECT_EQ(p.prediction.ranks[1].bytes_received, 300 * sh.di * 2 + 8 + 40 * sh.dqk * 2);
  EXPECT_EQ(p.prediction.ranks[1].bytes_sent, 8 + 40 * (8 + sh.dqk * 4));
}

TEST(SparseMlaPlan, SparseDominatedCostsBalanceQueriesNotPairs) {
  // A 1,000-token root (500 K pairs, 1,000 queries) beside 300 families of 10 (16.5 K pairs, 3,000
  // queries), k = 4: pairs and queries disagree. Balancing pairs (the dense planner) leaves the sparse
  // work unbalanced; with the sparse call dominant, the sparse planner balances it.
  std::vector<Segment> segs{{-1, 1000}};
  for (int f = 0; f < 300; ++f) segs.push_back({-1, 10});
  const Row row(segs);
  const int64_t topk = 4;
  const std::vector<int64_t> per_query = sparse_pairs_per_query(row, 0, topk);
  int64_t total = 0;
  for (int64_t x : per_query) total += x;
  auto max_sparse = [&](const Plan& plan) {
    int64_t worst = 0;
    for (const RankPlan& rp : plan.ranks) {
      int64_t s = 0;
      for (const TokenRange& t : rp.owned) {
        for (int64_t q = t.begin; q < t.end; ++q) s += per_query[static_cast<size_t>(q)];
      }
      worst = std::max(worst, s);
    }
    return static_cast<double>(worst) / (static_cast<double>(total) / 2);
  };
  PlanOptions dense_options;
  dense_options.layout = Layout::Searched;
  const Plan dense = make_plan(row, 2, AttentionShape{}, CostModel{}, dense_options);
  EXPECT_GT(max_sparse(dense), 1.3) << "the row must make the two balances disagree";
  SparseMlaCosts sparse_heavy;
  sparse_heavy.sparse.local_forward_pairs_per_ms = 1.0e3;
  sparse_heavy.sparse.local_backward_pairs_per_ms = 1.0e3;
  SparseMlaPlanOptions o;
  o.topk = topk;
  const SparseMlaPlan p = make_sparse_mla_plan(row, 2, sparse_heavy, o);
  EXPECT_LT(max_sparse(p.plan), 1.1);
  // and the searched plan is the fastest of every layout's
  for (Layout layout : kLayouts) {
    SparseMlaPlanOptions one = o;
    one.plan.layout = layout;
    EXPECT_LE(p.prediction.makespan_ms, make_sparse_mla_plan(row, 2, sparse_heavy, one).prediction.makespan_ms + 1e-12) << layout_name(layout);
  }
}

TEST(SparseMlaPlan, SharedIndexLayerHasNoIndexerWork) {
  const Row row({{-1, 300}, {0, 10}, {-1, 290}});
  SparseMlaPlanOptions o;
  o.topk = 4;
  o.full_index = false;
  const SparseMlaPlan p = make_sparse_mla_plan(row, 2, SparseMlaCosts{}, o);
  EXPECT_EQ(p.fetch, KvFetch::Selected);
  for (const SparseMlaRankCost& rc : p.prediction.ranks) {
    EXPECT_EQ(rc.indexer_ms, 0.0);
    EXPECT_EQ(rc.wave_rows, 0);
  }
  o.fetch = "waves";
  EXPECT_NE(message_of([&] { make_sparse_mla_plan(row, 2, SparseMlaCosts{}, o); }).find("reuses ids"), std::string::npos);
}

TEST(SparseMlaCosts, FilesMatchBuiltInDefaultsAndRoundTrip) {
  const SparseMlaCosts file = load_sparse_mla_costs(config_file("costs_sparse_mla_default.json").string());
  EXPECT_EQ(json::dump(to_json(file)), json::dump(to_json(SparseMlaCosts{})));
  EXPECT_EQ(json::dump(to_json(sparse_mla_costs_from_json(to_json(file)))), json::dump(to_json(file)));
  const SparseMlaCosts cpu = load_sparse_mla_costs(config_file("costs_sparse_mla_cpu.json").string());
  EXPECT_EQ(cpu.shape.bytes_per_element, 4);
  EXPECT_LT(cpu.sparse.local_forward_pairs_per_ms, SparseMlaCosts{}.sparse.local_forward_pairs_per_ms);
  // a partial file keeps the sparse MLA defaults for the rest, not the dense ones
  const SparseMlaCosts part = sparse_mla_costs_from_json(json::parse(R"({"sparse": {"local_forward_pairs_per_ms": 5}})"));
  EXPECT_EQ(part.sparse.local_forward_pairs_per_ms, 5.0);
  EXPECT_EQ(part.sparse.remote_forward_pairs_per_ms, 5.0);
  EXPECT_EQ(part.sparse.token_local_forward_ms_per_token, SparseMlaCosts{}.sparse.token_local_forward_ms_per_token);
}

TEST(SparseMlaCosts, RejectsUnknownAndUnusedKeys) {
  auto msg = [](const char* text) { return message_of([&] { sparse_mla_costs_from_json(json::parse(text)); }); };
  EXPECT_NE(msg(R"({"sparce": {}})").find("unknown key 'sparce'"), std::string::npos);
  EXPECT_NE(msg(R"({"sparse": {"links": []}})").find("sparse.links is not used"), std::string::npos);
  EXPECT_NE(msg(R"({"indexer": {"local_backward_pairs_per_ms": 1}})").find("indexer.local_backward_pairs_per_ms"), std::string::npos);
  EXPECT_NE(msg(R"({"indexer": {"shape": {}}})").find("give the shape at the top level"), std::string::npos);
  EXPECT_NE(msg(R"({"shape": {"dv": 600}})").find("dv (600) must be <= dqk"), std::string::npos);
  EXPECT_NE(msg(R"({"shape": {"hi": 0}})").find("shape.hi must be > 0"), std::string::npos);
  EXPECT_NE(msg(R"({"sparse": {"local_forward_pairs_per_ms": 0}})").find("> 0"), std::string::npos);
}

}  // namespace
}  // namespace treecp
