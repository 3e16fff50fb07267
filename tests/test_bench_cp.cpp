// The ring baseline is a valid plan that moves every KV row to every other rank, and `treecp bench cp` on CPU
// ranks produces the weak-scaling records it promises (the GPU form runs the same code over NCCL).
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "common/cli.hpp"
#include "core/json.hpp"
#include "plan/baselines.hpp"
#include "plan/cost.hpp"
#include "plan/planner.hpp"
#include "tree/presets.hpp"
#include "tree/slice.hpp"

namespace treecp {
namespace {

TEST(RingPlan, ValidAndMovesEveryRowToEveryRank) {
  for (const char* preset : {"fixed5k", "varied5k", "deep", "longchain"}) {
    for (int cp = 1; cp <= 6; ++cp) {
      const Row row = scale_row(make_preset(preset, cp, 1), 64);
      for (int64_t window : {int64_t{0}, int64_t{37}}) {
        AttentionShape shape;
        shape.window = window;
        const Plan p = ring_plan(row, cp, shape, CostModel{});  // validate_plan inside: exact cover, mirror
        EXPECT_EQ(p.num_waves, cp - 1);
        EXPECT_EQ(p.layout, Layout::Ring);
        int64_t pairs = 0;
        for (int r = 0; r < cp; ++r) {
          int64_t received = 0;
          for (const Stage& st : p.ranks[r].stages) {
            pairs += st.pairs;
            for (const auto& ranges : st.recv)
              for (const TokenRange& t : ranges) received += t.size();
          }
          EXPECT_EQ(received, row.tokens() - p.ranks[r].owned_tokens()) << preset << " cp " << cp << " rank " << r;
        }
        int64_t visible = 0;
        for (const Slice& s : row_slices(row, window)) visible += s.area();
        EXPECT_EQ(pairs, visible) << preset << " cp " << cp;
      }
    }
  }
}

TEST(BenchCp, CpuRanksWriteTheWeakScalingRecords) {
  testing::TempDir dir("treecp_bench_cp");
  const auto run = testing::run_treecp("bench cp --device cpu --ranks 2 --cp 1,2 --presets fixed5k,varied5k,longchain "
                                       "--trees 3 --reps 2 --scale 128 --json " + dir / "b.json" + " --svg " +
                                       dir / "b.svg",
                                       dir / "log");
  ASSERT_EQ(run.status, 0) << run.log;
  const json::Value doc = json::parse(testing::read_text(dir / "b.json"));
  const json::Value& v = doc.at("records");
  EXPECT_GT(doc.at("links").size(), 0u) << "the all-to-all probe at 2 ranks";
  std::set<std::string> seen;
  for (size_t i = 0; i < v.size(); ++i) {
    const json::Value& r = v[i];
    const std::string what = r.at("preset").as_string() + " cp " + std::to_string(r.at("cp").as_int()) + " " +
                             r.at("method").as_string();
    seen.insert(what);
    EXPECT_GT(r.at("forward_ms").as_double(), 0.0) << what;
    EXPECT_GT(r.at("backward_ms").as_double(), 0.0) << what;
    EXPECT_GE(r.at("forward_backward_ms").as_double(), r.at("forward_ms").as_double()) << what;
    if (r.at("method").as_string() == "ring") {
      EXPECT_GT(r.at("bytes_per_step").as_double(), 0.0) << what << ": ring moves every KV row";
      EXPECT_EQ(r.at("waves").as_int(), 1) << what;
    }
    if (r.at("preset").as_string() == "varied5k" && r.at("method").as_string() == "treecp") {
      EXPECT_EQ(r.at("per_step_ms").size(), 3u) << what << ": one step per tree";
      EXPECT_TRUE(r.contains("planning_exposed_ms")) << what;
    }
  }
  for (const char* want : {"fixed5k cp 1 treecp", "fixed5k cp 2 treecp", "fixed5k cp 2 ring", "varied5k cp 2 treecp",
                           "longchain cp 2 ring"})
    EXPECT_EQ(seen.count(want), 1u) << want << " missing; log:\n" << run.log;
  EXPECT_NE(testing::read_text(dir / "b.svg").find("<svg"), std::string::npos);
  // Every record carries its plan and per-stage measurements: calibration fits them and judges held-out plans.
  const json::Value& first = v[0];
  EXPECT_TRUE(first.contains("plan") && first.contains("stages") && first.contains("ranks"));
  const auto cal = testing::run_treecp("calibrate --bench " + dir / "b.json" + " --out " + dir / "c.json", dir / "log2");
  ASSERT_EQ(cal.status, 0) << cal.log;
  EXPECT_NE(cal.log.find("plans held out"), std::string::npos) << cal.log;
  const CostModel fitted = load_costs(dir / "c.json");  // a valid coefficient file
  EXPECT_GT(fitted.local_forward_pairs_per_ms, 0.0);
}

// --dv apart from --d (V, O, dO and dV buffers Dv wide): the steps run and the JSON names the layer planned for.
TEST(BenchCp, CpuRanksTakeAValueHeadDimUnlikeTheKeyHeadDim) {
  testing::TempDir dir("treecp_bench_cp_dv");
  const auto run = testing::run_treecp("bench cp --device cpu --cp 1 --presets fixed5k --trees 1 --reps 1 --scale 256 "
                                       "--d 16 --dv 40 --no-links --json " + dir / "b.json",
                                       dir / "log");
  ASSERT_EQ(run.status, 0) << run.log;
  const json::Value doc = json::parse(testing::read_text(dir / "b.json"));
  EXPECT_EQ(doc.at("shape").at("d").as_int(), 16);
  EXPECT_EQ(doc.at("shape").at("dv").as_int(), 40);
  ASSERT_GT(doc.at("records").size(), 0u);
  EXPECT_GT(doc.at("records")[0].at("forward_backward_ms").as_double(), 0.0);
}

TEST(BenchCp, RefusesBadOptionsInOneLine) {
  testing::TempDir dir("treecp_bench_cp_bad");
  for (const char* args : {"--device cpu --ranks 2 --cp 3", "--device cpu --cp 2,1 --ranks 2", "--device tpu",
                           "--device cpu --presets nope", "--device cpu --reps 0", "--device cpu --dv 0"}) {
    const auto run = testing::run_treecp(std::string("bench cp ") + args, dir / "log");
    EXPECT_NE(run.status, 0) << args;
    EXPECT_EQ(std::count(run.log.begin(), run.log.end(), '\n'), 1) << args << ":\n" << run.log;
  }
}

}  // namespace
}  // namespace treecp
