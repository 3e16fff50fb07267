// Packed rows, visibility and slices against brute force; accounting formulas; presets; input errors.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>

#include "core/error.hpp"
#include "core/json.hpp"
#include "tree/accounting.hpp"
#include "tree/presets.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

#include "common/common.hpp"

namespace treecp {
namespace {

// Oracle straight from the segment list, sharing no code with Row: token -> segment by walking
// lengths, ancestry by following parent pointers, logical position by summing ancestor lengths.
struct BruteRow {
  std::vector<Segment> segs;
  std::vector<int32_t> seg_of;
  std::vector<int64_t> logical;
  explicit BruteRow(const std::vector<Segment>& s) : segs(s) {
    for (int32_t i = 0; i < static_cast<int32_t>(segs.size()); ++i) {
      int64_t base = 0;
      for (int32_t a = segs[i].parent; a != -1; a = segs[a].parent) base += segs[a].length;
      for (int64_t t = 0; t < segs[i].length; ++t) {
        seg_of.push_back(i);
        logical.push_back(base + t);
      }
    }
  }
  bool ancestor_or_self(int32_t a, int32_t s) const {
    for (int32_t x = s; x != -1; x = segs[x].parent) {
      if (x == a) return true;
    }
    return false;
  }
  bool visible(int64_t i, int64_t j, int64_t window) const {
    if (!ancestor_or_self(seg_of[j], seg_of[i])) return false;
    if (seg_of[i] == seg_of[j] && j > i) return false;
    return window <= 0 || logical[i] - logical[j] < window;
  }
};

// A random row of 1..max_segments segments, lengths 1..max_len, paths up to 6 segments deep.
std::vector<Segment> random_segments(testing::Rng& rng, int max_segments, int max_len) {
  const int n = std::uniform_int_distribution<int>(1, max_segments)(rng);
  return testing::random_tree(rng, {.segments = n, .max_len = max_len, .max_depth = 6}).segments();
}

std::set<std::pair<int64_t, int64_t>> slice_pairs(const std::vector<Slice>& slices, int64_t* duplicates) {
  std::set<std::pair<int64_t, int64_t>> pairs;
  *duplicates = 0;
  for (const Slice& s : slices) {
    int64_t counted = 0;
    for (int64_t q = s.q_begin; q < s.q_end; ++q) {
      for (int64_t k = s.k_begin; k < s.k_end; ++k) {
        if (!s.contains(q, k)) continue;
        ++counted;
        if (!pairs.insert({q, k}).second) ++*duplicates;
      }
    }
    EXPECT_EQ(counted, s.area()) << to_string(s);
  }
  return pairs;
}

// Runs of ancestors contiguous in the packed row, counted from the segment list alone.
int64_t brute_ancestor_runs(const std::vector<Segment>& segs, int32_t s) {
  std::vector<int64_t> start(segs.size() + 1, 0);
  for (size_t i = 0; i < segs.size(); ++i) start[i + 1] = start[i] + segs[i].length;
  int64_t runs = 0;
  for (int32_t c = s, a = segs[s].parent; a != -1; c = a, a = segs[a].parent) {
    if (c == s || start[c] != start[a] + segs[a].length) ++runs;  // a does not continue into c's run
  }
  return runs;
}

TEST(Visibility, SlicesEqualBruteForcePairForPair) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(20261129);
  for (int trial = 0; trial < 300; ++trial) {
    const auto segs = random_segments(rng, 9, 7);
    const Row row(segs);
    const BruteRow brute(segs);
    for (int64_t window : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, int64_t{5}, int64_t{11}}) {
      const auto slices = row_slices(row, window);
      int64_t duplicates = 0;
      const auto pairs = slice_pairs(slices, &duplicates);
      EXPECT_EQ(duplicates, 0);
      int64_t expected = 0;
      for (int64_t i = 0; i < row.tokens(); ++i) {
        for (int64_t j = 0; j < row.tokens(); ++j) {
          const bool vis = brute.visible(i, j, window);
          expected += vis;
          ASSERT_EQ(vis, pairs.count({i, j}) == 1) << "trial " << trial << " window " << window << " q " << i << " k " << j;
          ASSERT_EQ(vis, row.visible(i, j, window));
        }
      }
      EXPECT_EQ(row_stats(row, window).visible_pairs, expected);
    }
    // Consecutive ancestors contiguous in the packed row share one slice: one per run, plus the segment's own.
    const auto slices = row_slices(row);
    int64_t runs = 0;
    for (int32_t s = 0; s < row.num_segments(); ++s) runs += brute_ancestor_runs(segs, s) + 1;
    EXPECT_EQ(static_cast<int64_t>(slices.size()), runs) << "trial " << trial;
    EXPECT_EQ(row.slice_count(), runs);
    for (size_t i = 1; i < slices.size(); ++i) {
      if (slices[i].q_begin == slices[i - 1].q_begin && slices[i].k_begin < slices[i].q_begin) {
        EXPECT_LT(slices[i - 1].k_end, slices[i].k_begin) << to_string(slices[i - 1]) << " " << to_string(slices[i]);
      }
    }
  }
}

TEST(Visibility, ChainOfOneTokenSegmentsIsTwoSlicesPerSegment) {
  const int32_t n = 200000;
  std::vector<Segment> segs;
  for (int32_t s = 0; s < n; ++s) segs.push_back({s - 1, 1});
  const Row row(segs);
  EXPECT_EQ(row.max_depth(), n);
  const auto slices = row_slices(row);
  ASSERT_EQ(static_cast<int64_t>(slices.size()), 2 * int64_t{n} - 1);
  int64_t pairs = 0;
  for (const Slice& s : slices) pairs += s.area();
  EXPECT_EQ(pairs, int64_t{n} * (n + 1) / 2);
  // segment s: one full slice against all of [0, s), then itself
  EXPECT_EQ(slices[2 * 1000 - 1], make_slice(1000, 1001, 0, 1000, 1, 1001));
  EXPECT_EQ(slices[2 * 1000], make_slice(1000, 1001, 1000, 1001, 0, 1));
  // with a window of 5, segment s sees [s - 4, s]: one band slice against the run and itself
  const auto windowed = row_slices(row, 5);
  pairs = 0;
  for (const Slice& s : windowed) pairs += s.area();
  EXPECT_EQ(pairs, 5 * int64_t{n} - 10);
  EXPECT_EQ(row_stats(row, 5).visible_pairs, pairs);
}

TEST(Input, RowNeedingTooManySlicesIsRefusedNamingTheLimit) {
  // A comb: every spine segment first has a leaf, so the spine never continues its parent and each
  // spine segment adds a slice to everything below it: about depth^2 / 2 slices.
  std::vector<Segment> segs = {{-1, 1}};
  int32_t spine = 0;
  while (static_cast<int64_t>(segs.size()) < 6000) {
    segs.push_back({spine, 1});  // leaf
    segs.push_back({spine, 1});  // next spine segment
    spine = static_cast<int32_t>(segs.size()) - 1;
  }
  std::string message;
  try {
    Row row(segs);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("more than 4194304 slices"), std::string::npos) << message;
  EXPECT_NE(message.find("Row::kMaxSlices"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos);
  segs.resize(2000);  // about a million slices: accepted, and exactly as many as counted
  const Row small(segs);
  EXPECT_EQ(static_cast<int64_t>(row_slices(small).size()), small.slice_count());
}

TEST(Visibility, SplitAtAnyChunkBoundaryKeepsEveryPair) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const Row row(random_segments(rng, 8, 9));
    const int64_t window = std::uniform_int_distribution<int64_t>(0, 6)(rng);
    const auto slices = row_slices(row, window);
    std::vector<int64_t> bounds = {0};
    while (bounds.back() < row.tokens()) {
      bounds.push_back(std::min(row.tokens(), bounds.back() + std::uniform_int_distribution<int64_t>(1, 5)(rng)));
    }
    const auto pieces = split_slices(slices, bounds);
    int64_t d1 = 0, d2 = 0;
    EXPECT_EQ(slice_pairs(slices, &d1), slice_pairs(pieces, &d2));
    EXPECT_EQ(d2, 0);
    for (const Slice& p : pieces) {
      // each piece lies inside one query chunk and one key chunk
      auto chunk = [&](int64_t pos) { return std::upper_bound(bounds.begin(), bounds.end(), pos) - bounds.begin(); };
      EXPECT_EQ(chunk(p.q_begin), chunk(p.q_end - 1));
      EXPECT_EQ(chunk(p.k_begin), chunk(p.k_end - 1));
    }
  }
}

TEST(Visibility, SliceAreaClosedFormMatchesCounting) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(3);
  std::uniform_int_distribution<int64_t> pos(0, 30), d(-40, 40);
  for (int trial = 0; trial < 2000; ++trial) {
    int64_t q0 = pos(rng), q1 = q0 + pos(rng), k0 = pos(rng), k1 = k0 + pos(rng), a = d(rng), b = d(rng);
    const Slice s = make_slice(q0, q1, k0, k1, std::min(a, b), std::max(a, b));
    int64_t count = 0;
    for (int64_t q = q0; q < q1; ++q) {
      for (int64_t k = k0; k < k1; ++k) count += (q - k >= std::min(a, b) && q - k < std::max(a, b));
    }
    ASSERT_EQ(s.area(), count);
    if (!s.empty()) {
      // tight: first and last rows and columns hold a visible pair
      bool qf = false, ql = false, kf = false, kl = false;
      for (int64_t k = s.k_begin; k < s.k_end; ++k) qf |= s.contains(s.q_begin, k), ql |= s.contains(s.q_end - 1, k);
      for (int64_t q = s.q_begin; q < s.q_end; ++q) kf |= s.contains(q, s.k_begin), kl |= s.contains(q, s.k_end - 1);
      EXPECT_TRUE(qf && ql && kf && kl) << to_string(s);
    }
  }
}

TEST(SmallExample, NineTokens) {
  // Root 0-3, completion A 4-6, completion B 7-8 (DESIGN.md, ART 03/06).
  const Row row({{-1, 4}, {0, 3}, {0, 2}});
  for (int64_t k = 0; k <= 6; ++k) EXPECT_TRUE(row.visible(6, k));
  for (int64_t k : {0, 1, 2, 3, 7, 8}) EXPECT_TRUE(row.visible(8, k));
  for (int64_t k : {4, 5, 6}) EXPECT_FALSE(row.visible(8, k));
  EXPECT_EQ(row.logical(7), 4);
  EXPECT_EQ(row.logical(8), 5);
  // window 3: query 8 (logical 5) sees logical 3, 4, 5 = physical 3, 7, 8 (never 6, a sibling)
  std::vector<int64_t> seen;
  for (int64_t k = 0; k < 9; ++k) {
    if (row.visible(8, k, 3)) seen.push_back(k);
  }
  EXPECT_EQ(seen, (std::vector<int64_t>{3, 7, 8}));
  int64_t dup = 0;
  const auto pairs = slice_pairs(row_slices(row, 3), &dup);
  for (int64_t k = 0; k < 9; ++k) EXPECT_EQ(pairs.count({8, k}) == 1, k == 3 || k == 7 || k == 8);
  const RowStats st = row_stats(row);
  EXPECT_EQ(st.physical_tokens, 9);
  EXPECT_EQ(st.flattened_tokens, 13);
  EXPECT_EQ(st.trajectories, 2);
  EXPECT_EQ(st.visible_pairs, 10 + 18 + 11);
  EXPECT_EQ(st.flattened_visible_pairs, 28 + 21);
  EXPECT_EQ(st.depth, 2);
  EXPECT_EQ(st.families, 1);
  EXPECT_EQ(row_stats(row, 3).visible_pairs, 9 + 9 + 6);
}

TEST(Accounting, SingleFamilyFormulas) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(11);
  for (int trial = 0; trial < 100; ++trial) {
    const int64_t P = std::uniform_int_distribution<int64_t>(1, 3000)(rng);
    const int m = std::uniform_int_distribution<int>(1, 20)(rng);
    std::vector<Segment> segs = {{-1, P}};
    int64_t sum_c = 0;
    for (int i = 0; i < m; ++i) {
      segs.push_back({0, std::uniform_int_distribution<int64_t>(1, 2000)(rng)});
      sum_c += segs.back().length;
    }
    const RowStats st = row_stats(Row(segs));
    EXPECT_EQ(st.physical_tokens, P + sum_c);
    EXPECT_EQ(st.flattened_tokens, m * P + sum_c);
    EXPECT_EQ(st.flattened_visible_pairs - st.visible_pairs, (m - 1) * P * (P + 1) / 2);
    EXPECT_EQ(st.trajectories, m);
  }
}

TEST(Row, PositionsSubtreesAncestorsTrajectories) {
  // 0 root(3) { 1(2) { 2(1) } 3(2) }  4 root(2) { 5(1) }
  const Row row({{-1, 3}, {0, 2}, {1, 1}, {0, 2}, {-1, 2}, {4, 1}});
  EXPECT_EQ(row.tokens(), 11);
  EXPECT_EQ(row.segment_of(0), 0);
  EXPECT_EQ(row.segment_of(5), 2);
  EXPECT_EQ(row.segment_of(10), 5);
  EXPECT_EQ(row.logical(5), 5);
  EXPECT_EQ(row.logical(6), 3);
  EXPECT_EQ(row.logical(10), 2);
  EXPECT_EQ(row.subtree_end(0), 4);
  EXPECT_EQ(row.subtree_token_end(0), 8);
  EXPECT_EQ(row.subtree_token_end(1), 6);
  EXPECT_EQ(row.ancestor_chain(2), (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(row.leaves(), (std::vector<int32_t>{2, 3, 5}));
  EXPECT_EQ(row.roots(), (std::vector<int32_t>{0, 4}));
  EXPECT_EQ(row.trajectory_length(2), 6);
  EXPECT_EQ(row.max_depth(), 3);
  EXPECT_THROW(row.segment_of(11), Error);
}

std::string error_of(const std::string& text) {
  try {
    row_from_json(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Input, EveryMalformedRowGetsItsOwnError) {
  EXPECT_NE(error_of(R"({"segments":[{"parent":-1,"length":2},{"parent":2,"length":1},{"parent":0,"length":1}]})")
                .find("segment 1: parent 2 is not an earlier segment"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"segments":[{"parent":-1,"length":2},{"parent":1,"length":1}]})")
                .find("segment 1: a segment cannot be its own parent"),
            std::string::npos);
  // 0 { 1 } 2 is a new root, so attaching 3 to 1 breaks DFS preorder
  EXPECT_NE(error_of(R"({"segments":[{"parent":-1,"length":2},{"parent":0,"length":1},{"parent":-1,"length":1},{"parent":1,"length":1}]})")
                .find("segment 3: not in DFS preorder"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"segments":[{"parent":-1,"length":2},{"parent":0,"length":0}]})")
                .find("segment 1: length must be positive, got 0"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"segments":[{"parent":-1,"length":-5}]})").find("segment 0: length must be positive, got -5"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"segments":[{"parent":-1,"length":2,"weight":1}]})").find("segment 0: unknown key \"weight\""),
            std::string::npos);
  EXPECT_NE(error_of(R"({"segments":[{"parent":-1,"length":2}],"rows":1})").find("row: unknown key \"rows\""),
            std::string::npos);
  EXPECT_NE(error_of(R"({"segments":[]})").find("empty row"), std::string::npos);
  EXPECT_NE(error_of(R"({"segments":[{"parent":-1,"length":2147483647},{"parent":0,"length":1}]})")
                .find("segment 1: row exceeds 2^31-1 tokens"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"segments":[{"parent":-1,"length":2},]})").find("malformed JSON at line 1, column"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"segments":[{"parent":-1,"length":2.5}]})").find("segment 0: \"length\" must be an integer"),
            std::string::npos);
  EXPECT_NE(error_of(R"({"segments":[{"length":2}]})").find("segment 0: missing key \"parent\""), std::string::npos);
  EXPECT_NE(error_of(R"({"segments":[{"parent":-2,"length":2}]})").find("segment 0: parent -2"), std::string::npos);
  EXPECT_NE(error_of("").find("malformed JSON"), std::string::npos);
  // a valid row round-trips through JSON
  const Row row({{-1, 4}, {0, 3}, {0, 2}, {-1, 1}});
  EXPECT_EQ(row_from_json(row_to_json(row)).segments().size(), 4u);
}

int64_t children_of(const Row& row, int32_t s) {
  int64_t n = 0;
  for (int32_t c = s + 1; c < row.subtree_end(s); ++c) n += row.parent(c) == s;
  return n;
}

TEST(Presets, ExactIntegers) {
  for (int cp : {1, 2, 3, 8}) {
    const Row fixed = make_preset("fixed5k", cp);
    EXPECT_EQ(fixed.tokens(), 40960 * cp);
    EXPECT_EQ(fixed.roots().size(), static_cast<size_t>(8 * cp));
    for (int32_t s = 0; s < fixed.num_segments(); ++s) {
      EXPECT_EQ(fixed.length(s), fixed.parent(s) == -1 ? 1024 : 512);
      if (fixed.parent(s) == -1) {
        EXPECT_EQ(children_of(fixed, s), 8);
      }
    }
    const Row dom = make_preset("dominant", cp);
    EXPECT_EQ(dom.tokens(), 40960 * cp);
    EXPECT_EQ(dom.roots().size(), static_cast<size_t>(cp));
    for (int32_t s = 0; s < dom.num_segments(); ++s) EXPECT_EQ(dom.length(s), dom.parent(s) == -1 ? 8192 : 2048);

    const Row varied = make_preset("varied5k", cp, 5);
    EXPECT_EQ(varied.tokens(), 40960 * cp);
    for (int32_t r : varied.roots()) {
      if (r + 1 < varied.num_segments()) {  // the last segment may be clipped
        EXPECT_EQ(varied.length(r), 1024);
      }
      EXPECT_LE(children_of(varied, r), 8);
    }
    for (int32_t s = 0; s < varied.num_segments() - 1; ++s) {  // the last segment may be clipped
      if (varied.parent(s) != -1) {
        EXPECT_GE(varied.length(s), 64);
        EXPECT_LE(varied.length(s), 1536);
      }
    }
    const Row chain = make_preset("longchain", cp);
    EXPECT_EQ(chain.tokens(), 98304 * cp);
    ASSERT_EQ(chain.num_segments(), 5);
    EXPECT_EQ(chain.length(0), 2048);
    for (int32_t s = 1; s < 5; ++s) EXPECT_EQ(chain.length(s), (98304 * cp - 2048) / 4);

    const Row deep = make_preset("deep", cp, 3);
    EXPECT_EQ(deep.tokens(), 40960 * cp);
    EXPECT_EQ(deep.max_depth(), 4);
    for (int32_t s = 0; s < deep.num_segments(); ++s) {
      if (deep.parent(s) == -1) {
        if (s + 1 < deep.num_segments()) {
          EXPECT_EQ(deep.length(s), 2048);
        }
      } else if (s + 1 < deep.num_segments()) {
        EXPECT_GE(deep.length(s), 16);
        EXPECT_LE(deep.length(s), 1024);
      }
      const int64_t kids = children_of(deep, s);
      if (deep.depth(s) < 4 && deep.subtree_end(s) < deep.num_segments()) {
        EXPECT_TRUE(kids == 2 || kids == 3) << "segment " << s;
      }
      if (deep.depth(s) == 4) {
        EXPECT_EQ(kids, 0);
      }
    }
    const Row art = make_preset("art-fixed5k", cp);
    EXPECT_EQ(art.tokens(), 40960 * cp);
    for (int32_t s = 0; s + 1 < art.num_segments(); ++s) EXPECT_EQ(art.length(s), art.parent(s) == -1 ? 5000 : 100);

    const Row artdom = make_preset("art-dominant", cp, 9);
    EXPECT_EQ(artdom.tokens(), 40960 * cp);
    for (int block = 0; block < cp; ++block) {  // each 40,960-token block starts with its dominant family
      const int32_t s = artdom.segment_of(40960LL * block);
      EXPECT_EQ(artdom.start(s), 40960LL * block);
      EXPECT_EQ(artdom.parent(s), -1);
      EXPECT_GE(artdom.length(s), 14745 - 2048);
      EXPECT_LE(artdom.length(s), 14745 + 2048);
    }
    for (const char* name : {"art-varied5k", "art-manysmall"}) EXPECT_EQ(make_preset(name, cp, 1).tokens(), 40960 * cp);
    EXPECT_EQ(make_preset("art-long8k", cp, 1).tokens(), 147456 * cp);
  }
  // seeded: the same seed gives the same row, another seed another row
  EXPECT_EQ(row_to_json(make_preset("varied5k", 2, 42)), row_to_json(make_preset("varied5k", 2, 42)));
  EXPECT_NE(row_to_json(make_preset("varied5k", 2, 42)), row_to_json(make_preset("varied5k", 2, 43)));
  EXPECT_THROW(make_preset("nope", 1), Error);
  EXPECT_THROW(make_preset("fixed5k", 0), Error);
}

TEST(Presets, DrawsFollowTheirDistribution) {
  PresetRng rng(1);
  double sum = 0, sq = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = rng.normal();
    sum += x;
    sq += x * x;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sq / n, 1.0, 0.02);
  for (int i = 0; i < 1000; ++i) {
    const int64_t v = rng.clipped_normal(512, 160, 64, 1536);
    EXPECT_GE(v, 64);
    EXPECT_LE(v, 1536);
  }
}

std::string run_cli(const std::string& args, int* rc) {
  const std::string out = (std::filesystem::temp_directory_path() / "treecp_cli_out.txt").string();
  *rc = std::system((std::string(TREECP_CLI_PATH) + " " + args + " > " + out + " 2>&1").c_str());
  std::ifstream in(out);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(Cli, GenerateAndStats) {
  const auto dir = std::filesystem::temp_directory_path() / "treecp_test_tree_cli";
  std::filesystem::create_directories(dir);
  const std::string row = (dir / "row.json").string();
  int rc = 0;
  run_cli("tree generate --preset fixed5k --cp 2 --out " + row, &rc);
  ASSERT_EQ(rc, 0);
  const std::string out = run_cli("tree stats --tree " + row + " --json", &rc);
  ASSERT_EQ(rc, 0) << out;
  const json::Value v = json::parse(out);
  const RowStats st = row_stats(make_preset("fixed5k", 2));
  EXPECT_EQ(v.at("physical_tokens").as_int(), 81920);
  EXPECT_EQ(v.at("flattened_tokens").as_int(), st.flattened_tokens);
  EXPECT_EQ(v.at("trajectories").as_int(), 128);
  EXPECT_EQ(v.at("visible_pairs").as_int(), st.visible_pairs);
  EXPECT_EQ(v.at("flattened_visible_pairs").as_int(), st.flattened_visible_pairs);
  EXPECT_EQ(v.at("depth").as_int(), 2);
  EXPECT_EQ(v.at("families").as_int(), 16);
  EXPECT_EQ(v.at("slices").as_int(), st.slices);

  // bad input: one line naming the rule, non-zero exit, nothing written
  const std::string bad = (dir / "bad.json").string();
  std::ofstream(bad) << R"({"segments":[{"parent":-1,"length":4},{"parent":1,"length":3}]})";
  const std::string err = run_cli("tree stats --tree " + bad, &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(err.find("segment 1: a segment cannot be its own parent"), std::string::npos) << err;
  const std::string target = (dir / "never.json").string();
  std::filesystem::remove(target);
  run_cli("tree generate --preset nosuch --cp 2 --out " + target, &rc);
  EXPECT_NE(rc, 0);
  EXPECT_FALSE(std::filesystem::exists(target));
  run_cli("tree generate --preset fixed5k --cp 0 --out " + target, &rc);
  EXPECT_NE(rc, 0);
  EXPECT_FALSE(std::filesystem::exists(target));
}

}  // namespace
}  // namespace treecp
