// Pictures and traces: the span recorder, the Chrome trace writer (one process per rank, nested or
// split threads), the SVG writer's parts, and the plan and weak-scaling pictures read back by an
// independent parser (tests/check_pictures.py: Python's XML and JSON) against the plan and row they
// were drawn from, then rendered with rsvg-convert.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/cli.hpp"
#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "core/json.hpp"
#include "core/trace.hpp"
#include "plan/planner.hpp"
#include "runtime/span_gather.hpp"
#include "tree/presets.hpp"
#include "tree/row.hpp"
#include "viz/axis.hpp"
#include "viz/plan_svg.hpp"
#include "viz/scaling_svg.hpp"
#include "viz/schedule.hpp"
#include "viz/svg.hpp"

namespace treecp {
namespace {

using testing::read_text;
using testing::run_treecp;
using testing::TempDir;
using testing::write_file;

// ---- spans and the Chrome trace

TEST(Trace, RecorderIsThreadSafeAndCountsFromItsOrigin) {
  SpanRecorder rec(3);
  rec.reset_origin();
  const double t0 = rec.now_ms();
  EXPECT_GE(t0, 0.0);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&rec, k] {
      for (int i = 0; i < 500; ++i) {
        const double b = rec.now_ms();
        rec.record(std::to_string(k), "test", b, rec.now_ms());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const std::vector<Span> spans = rec.spans();
  ASSERT_EQ(spans.size(), 2000u);
  std::vector<int> per_thread(4, 0);
  for (const Span& s : spans) {
    EXPECT_EQ(s.rank, 3);
    EXPECT_EQ(s.track, kMeasuredTrack);
    EXPECT_LE(s.begin_ms, s.end_ms);
    EXPECT_GE(s.begin_ms, t0);
    ++per_thread[static_cast<size_t>(std::stoi(s.name))];
  }
  EXPECT_EQ(per_thread, std::vector<int>(4, 500));
}

// Events of one (pid, tid), as (name, ts, dur).
struct Event {
  std::string name;
  int pid, tid;
  double ts, dur;
};

std::vector<Event> x_events(const json::Value& doc) {
  std::vector<Event> out;
  for (const json::Value& e : doc.at("traceEvents").as_array()) {
    if (e.at("ph").as_string() != "X") continue;
    out.push_back({e.at("name").as_string(), static_cast<int>(e.at("pid").as_int()),
                   static_cast<int>(e.at("tid").as_int()), e.at("ts").as_double(), e.at("dur").as_double()});
  }
  return out;
}

TEST(Trace, ChromeTraceHasAProcessPerRankAndNestsOrSplitsSpans) {
  const std::vector<Span> spans = {
      {"forward", "pass", 0, kMeasuredTrack, 0.0, 10.0},
      {"stage 0", "stage", 0, kMeasuredTrack, 1.0, 3.0},   // inside forward
      {"stage 1", "stage", 0, kMeasuredTrack, 3.0, 9.0},   // inside forward, after stage 0
      {"KV wave 1", "transfer", 0, kMeasuredTrack, 2.0, 5.0},  // a transfer: the transfers thread
      {"merge", "stage", 0, kMeasuredTrack, 2.5, 4.0},         // overlaps both stages: a second thread
      {"forward", "pass", 0, kPredictedTrack, 0.0, 8.0},
      {"forward", "pass", 2, kMeasuredTrack, 0.5, 7.0},  // rank 1 has no spans
  };
  const json::Value doc = json::parse(chrome_trace_json(spans));
  std::set<int> processes;
  std::map<std::pair<int, int>, std::string> thread_names;
  for (const json::Value& e : doc.at("traceEvents").as_array()) {
    if (e.at("ph").as_string() != "M") continue;
    if (e.at("name").as_string() == "process_name") {
      processes.insert(static_cast<int>(e.at("pid").as_int()));
      EXPECT_EQ(e.at("args").at("name").as_string(), "rank " + std::to_string(e.at("pid").as_int()));
    }
    if (e.at("name").as_string() == "thread_name") {
      thread_names[{static_cast<int>(e.at("pid").as_int()), static_cast<int>(e.at("tid").as_int())}] =
          e.at("args").at("name").as_string();
    }
  }
  EXPECT_EQ(processes, (std::set<int>{0, 2}));
  const std::vector<Event> ev = x_events(doc);
  ASSERT_EQ(ev.size(), spans.size());
  auto find = [&](const std::string& name, int pid, const std::string& thread_prefix) {
    for (const Event& e : ev) {
      if (e.name == name && e.pid == pid && thread_names[{e.pid, e.tid}].rfind(thread_prefix, 0) == 0) return e;
    }
    ADD_FAILURE() << "no " << name << " on rank " << pid << " " << thread_prefix;
    return Event{};
  };
  const Event fwd = find("forward", 0, "measured"), s0 = find("stage 0", 0, "measured"),
              s1 = find("stage 1", 0, "measured"), kv = find("KV wave 1", 0, "measured"),
              merge = find("merge", 0, "measured"), pred = find("forward", 0, "predicted");
  EXPECT_EQ(s0.tid, fwd.tid);
  EXPECT_EQ(s1.tid, fwd.tid);
  EXPECT_EQ(thread_names[std::make_pair(0, fwd.tid)], "measured");
  EXPECT_EQ(thread_names[std::make_pair(0, kv.tid)], "measured transfers");
  EXPECT_EQ(thread_names[std::make_pair(0, merge.tid)], "measured 2");
  EXPECT_NE(pred.tid, fwd.tid);
  EXPECT_EQ(thread_names[std::make_pair(0, pred.tid)], "predicted");
  // Microseconds.
  EXPECT_DOUBLE_EQ(kv.ts, 2000.0);
  EXPECT_DOUBLE_EQ(kv.dur, 3000.0);
  EXPECT_DOUBLE_EQ(find("forward", 2, "measured").ts, 500.0);
}

TEST(Trace, RefusesBadSpansAndWritesNothingThen) {
  EXPECT_THROW(chrome_trace_json({{"a", "c", 0, 0, 2.0, 1.0}}), Error);  // ends before it begins
  EXPECT_THROW(chrome_trace_json({{"a", "c", -1, 0, 0.0, 1.0}}), Error);
  EXPECT_THROW(chrome_trace_json({{"a", "c", 0, 2, 0.0, 1.0}}), Error);
  EXPECT_THROW(chrome_trace_json({{"a", "c", 0, 0, 0.0, NAN}}), Error);
  try {
    chrome_trace_json({{"ok", "c", 0, 0, 0.0, 1.0}, {"late", "c", 1, 1, 5.0, 4.0}});
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'late'"), std::string::npos) << e.what();
  }
  TempDir dir("treecp_trace");
  const std::string path = dir / "t.json";
  EXPECT_THROW(write_chrome_trace({{"a", "c", 0, 0, 2.0, 1.0}}, path), Error);
  EXPECT_FALSE(std::filesystem::exists(path));
  EXPECT_THROW(write_chrome_trace({}, dir / "missing/t.json"), Error);
  write_chrome_trace({{"a \"quoted\" \\ name", "c", 0, 1, 0.0, 1.0}}, path);
  EXPECT_EQ(x_events(json::parse(read_text(path)))[0].name, "a \"quoted\" \\ name");
}

TEST(Trace, GatherOnOneRankIsExact) {
  auto comm = make_self_communicator();
  const std::vector<Span> mine = {{"fwd \"x\"\n", "stage", 7, kMeasuredTrack, 0.1, 1.0 / 3.0},
                                  {"bwd", "pass", 7, kPredictedTrack, 1e-300, 12345.678901234567}};
  const std::vector<Span> got = gather_spans(*comm, mine, 0);
  ASSERT_EQ(got.size(), 2u);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].name, mine[i].name);
    EXPECT_EQ(got[i].category, mine[i].category);
    EXPECT_EQ(got[i].rank, 0);  // the sender's rank, whatever the span said
    EXPECT_EQ(got[i].track, mine[i].track);
    EXPECT_EQ(got[i].begin_ms, mine[i].begin_ms);
    EXPECT_EQ(got[i].end_ms, mine[i].end_ms);
  }
  EXPECT_THROW(gather_spans(*comm, mine, 1), Error);
}

// predicted_spans: every timeline span plus a forward and a backward per rank that enclose them.
TEST(Trace, PredictedSpansEncloseEachPass) {
  const Row row = scale_row(make_preset("longchain", 4, 0), 16);
  CostModel c;
  c.intra_node = {0.05, 1e6};  // slow links: waves wait for their KV
  c.rank_bandwidth_bytes_per_ms = 1e6;
  PlanOptions opt;
  opt.layout = Layout::Zigzag;
  const AttentionShape layer;
  const Plan plan = make_plan(row, 4, layer, c, opt);
  const Timeline t = simulate_plan_timeline(plan, layer, c);
  const std::vector<Span> spans = viz::predicted_spans(t);
  ASSERT_EQ(spans.size(), t.spans.size() + 8);
  for (const Span& s : spans) {
    EXPECT_EQ(s.track, kPredictedTrack);
    const double f = t.prediction.forward_ms[static_cast<size_t>(s.rank)];
    if (s.category == "pass") continue;
    const bool backward = s.name.find("bwd") != std::string::npos || s.name.rfind("dKV", 0) == 0 ||
                          s.name == "wait dKV";
    EXPECT_TRUE(backward ? s.begin_ms >= f : s.end_ms <= f) << s.name;
  }
  EXPECT_GT(plan.num_waves, 0);  // the case has transfers to name
  std::set<std::string> categories;
  for (const Span& s : spans) categories.insert(s.category);
  EXPECT_EQ(categories, (std::set<std::string>{"pass", "stage", "transfer", "token-local", "wait"}));
}

// ---- the SVG writer's parts

TEST(Svg, EscapesTextAndBalancesElements) {
  EXPECT_EQ(viz::xml_escape("a<b & \"c\" 'd'>"), "a&lt;b &amp; &quot;c&quot; &apos;d&apos;&gt;");
  EXPECT_EQ(viz::px(12.5), "12.5");
  EXPECT_EQ(viz::px(3.0), "3");
  EXPECT_EQ(viz::px(-0.001), "0");
  viz::Svg unbalanced(10, 10);
  unbalanced.open("g");
  EXPECT_THROW(unbalanced.finish(), Error);
  viz::Svg closing(10, 10);
  EXPECT_THROW(closing.close(), Error);
  viz::Svg ok(10, 10);
  ok.element("text", {{"x", "1"}}, "<&>", "tip");
  const std::string out = ok.finish();
  EXPECT_NE(out.find("<text x=\"1\"><title>tip</title>&lt;&amp;&gt;</text>"), std::string::npos) << out;
}

TEST(Svg, TicksAreRoundAndCoverTheRange) {
  for (double max : {0.0007, 0.9, 1.0, 8.943, 17.3, 99.0, 100.0, 327680.0, 1.9e9}) {
    for (int target : {3, 5, 10}) {
      const viz::Ticks t = viz::nice_ticks(max, target);
      const double mantissa = t.step / std::pow(10.0, std::floor(std::log10(t.step)));
      EXPECT_TRUE(std::abs(mantissa - 1) < 1e-9 || std::abs(mantissa - 2) < 1e-9 || std::abs(mantissa - 5) < 1e-9)
          << max << " " << t.step;
      EXPECT_LE(static_cast<int>(t.at.size()) - 1, target) << max;
      EXPECT_EQ(t.at.front(), 0.0);
      EXPECT_LE(t.at.back(), max * (1 + 1e-9));
      EXPECT_GT(t.at.back() + t.step, max);
    }
  }
  EXPECT_EQ(viz::tick_label(0.25, 0.05), "0.25");
  EXPECT_EQ(viz::tick_label(40000, 5000), "40000");
  EXPECT_THROW(viz::nice_ticks(0.0, 5), Error);
}

TEST(Svg, RankColoursAreDistinct) {
  std::set<std::string> colours;
  for (int r = 0; r < 64; ++r) colours.insert(viz::rank_colour(r));
  EXPECT_EQ(colours.size(), 64u);
  EXPECT_EQ(viz::lighten("#000000", 0.5), "#808080");
  EXPECT_EQ(viz::lighten("#4e79a7", 0.0), "#4e79a7");
}

// ---- the pictures, read back

std::string python() {
#ifdef TREECP_PYTHON
  return TREECP_PYTHON;
#else
  return "";
#endif
}

// Runs tests/check_pictures.py; returns its output, empty when every check held.
std::string check_pictures(const std::string& args, const TempDir& dir) {
  const std::string log = dir / "check.log";
  const int rc = std::system((python() + " " + TREECP_TESTS_DIR + "/check_pictures.py " + args + " > " + log + " 2>&1").c_str());
  const std::string out = read_text(log);
  return rc == 0 ? "" : (out.empty() ? "exit status " + std::to_string(rc) : out);
}

bool have_renderer() { return std::system("command -v rsvg-convert > /dev/null 2>&1") == 0; }

TEST(PlanSvg, RefusesAPlanOfAnotherRow) {
  const Row row = make_preset("fixed5k", 2, 0);
  const Plan plan = make_plan(row, 2, AttentionShape{}, CostModel{}, PlanOptions{});
  const Timeline t = simulate_plan_timeline(plan, AttentionShape{}, CostModel{});
  EXPECT_THROW(viz::plan_svg(make_preset("fixed5k", 3, 0), plan, t, {}), Error);
  Timeline short_t = t;
  short_t.prediction.forward_ms.pop_back();
  EXPECT_THROW(viz::plan_svg(row, plan, short_t, {}), Error);
  viz::PlanPicture narrow;
  narrow.width_px = 100;
  EXPECT_THROW(viz::plan_svg(row, plan, t, narrow), Error);
}

// `treecp plan --svg` at CP 2-8, on a deep tree, on the 23,108-slice art-manysmall row (aggregated), with
// a window, and with slow links (waits, several waves, overlapping returns): every picture reads back
// against its plan and row, and renders.
TEST(PlanSvg, PicturesReadBackAgainstTheirPlans) {
  if (python().empty()) GTEST_SKIP() << "no Python 3 interpreter was found at configure time";
  TempDir dir("treecp_plan_svg");
  write_file(dir / "slow.json",
             "{\"intra_node\": {\"latency_ms\": 0.05, \"bandwidth_bytes_per_ms\": 1.0e6}, "
             "\"rank_bandwidth_bytes_per_ms\": 1.0e6}");
  struct Case {
    std::string preset;
    int cp;
    std::string extra;
  };
  const std::vector<Case> cases = {{"varied5k", 2, ""},
                                   {"varied5k", 4, "--layout zigzag"},
                                   {"varied5k", 8, ""},
                                   {"deep", 3, "--layout contiguous --window 600"},
                                   {"art-manysmall", 8, ""},
                                   {"art-varied5k", 8, "--layout zigzag --costs " + (dir / "slow.json")},
                                   {"longchain", 5, "--costs " + (dir / "slow.json")}};
  const bool render = have_renderer();
  std::string checks, renders;
  for (const Case& c : cases) {
    const std::string tag = c.preset + "_" + std::to_string(c.cp);
    const std::string row = dir / (tag + ".row.json"), plan = dir / (tag + ".plan.json"), svg = dir / (tag + ".svg");
    const std::string cp = " --cp " + std::to_string(c.cp);
    ASSERT_EQ(run_treecp("tree generate --preset " + c.preset + cp + " --out " + row, dir / "log").status, 0);
    const testing::CliRun r =
        run_treecp("plan --tree " + row + cp + " " + c.extra + " --json --out " + plan + " --svg " + svg, dir / "log");
    ASSERT_EQ(r.status, 0) << r.log;
    checks += " " + svg + " " + plan + " " + row;
    renders += " " + svg;
  }
  EXPECT_EQ(check_pictures("plan" + checks, dir), "");
  if (render) {
    EXPECT_EQ(check_pictures("render" + renders, dir), "");
  }
  // The slow-link case draws what it is there for.
  const std::string slow = read_text(dir / "art-varied5k_8.svg");
  EXPECT_NE(slow.find("data-kind=\"wait\""), std::string::npos);
  EXPECT_NE(slow.find("data-lane=\"transfer\" data-row=\"2\""), std::string::npos);
  EXPECT_NE(read_text(dir / "art-manysmall_8.svg").find("class=\"bin\""), std::string::npos);
  if (!render) GTEST_SKIP() << "rsvg-convert not installed (scripts/setup.sh installs librsvg2-bin): not rendered";
}

TEST(PlanSvg, BadArgumentsWriteNothing) {
  TempDir dir("treecp_plan_svg_bad");
  const std::string svg = dir / "p.svg";
  for (const std::string& args : std::vector<std::string>{"plan --preset fixed5k --cp 2 --svg -",
                                                          "plan --preset fixed5k --cp 2 --svg",
                                                          "plan --preset fixed5k --cp 0 --svg " + svg,
                                                          "plan --preset fixed5k --cp 2 --svg " + (dir / "missing/p.svg")}) {
    const testing::CliRun r = run_treecp(args, dir / "log");
    EXPECT_NE(r.status, 0) << args;
    EXPECT_EQ(std::count(r.log.begin(), r.log.end(), '\n'), 1) << args << ": " << r.log;
    EXPECT_FALSE(std::filesystem::exists(svg)) << args;
  }
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{"log"});
}

TEST(RunTrace, BadPathsAreRefusedBeforeAnyRankStarts) {
  TempDir dir("treecp_run_trace_bad");
  for (const std::string& args : std::vector<std::string>{"run --ranks 2 --trace -", "run --ranks 2 --trace",
                                                          "run --ranks 2 --trace " + (dir / "missing/t.json")}) {
    const testing::CliRun r = run_treecp(args, dir / "log");
    EXPECT_NE(r.status, 0) << args;
    EXPECT_EQ(std::count(r.log.begin(), r.log.end(), '\n'), 1) << args << ": " << r.log;  // no mpirun output
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "missing"));
}

TEST(ScalingSvg, CurvesReadBack) {
  const std::vector<viz::ScalingSeries> series = {
      {"fixed5k", "treecp", {{1, 17.2}, {2, 19.4}, {4, 19.9}, {8, 20.3}}},
      {"fixed5k", "ring", {{2, 21.0}, {4, 24.5}, {8, 31.0}}},
      {"varied5k", "treecp", {{1, 17.4}, {2, 19.5}, {4, 20.5}, {8, 20.6}}},
      {"art-dominant", "treecp", {{2, 0.0}, {8, 3.5}}},
      {"one point", "ring", {{4, 5.0}}},
  };
  const std::string svg = viz::weak_scaling_svg(series, "weak scaling, one H200 per rank");
  json::Value expected = json::Value::array();
  for (const viz::ScalingSeries& s : series) {
    json::Value v = json::Value::object(), pts = json::Value::array();
    v.set("preset", s.preset);
    v.set("method", s.method);
    for (const viz::ScalingPoint& p : s.points) {
      json::Value pt = json::Value::array();
      pt.push_back(p.cp);
      pt.push_back(p.ms);
      pts.push_back(pt);
    }
    v.set("points", pts);
    expected.push_back(v);
  }
  if (python().empty()) GTEST_SKIP() << "no Python 3 interpreter was found at configure time";
  TempDir dir("treecp_scaling_svg");
  write_file(dir / "s.svg", svg);
  write_file(dir / "s.json", json::dump(expected));
  EXPECT_EQ(check_pictures("scaling " + (dir / "s.svg") + " " + (dir / "s.json"), dir), "");
  if (!have_renderer()) GTEST_SKIP() << "rsvg-convert not installed: not rendered";
  EXPECT_EQ(check_pictures("render " + (dir / "s.svg"), dir), "");
}

TEST(ScalingSvg, RefusesBadSeries) {
  using viz::ScalingSeries;
  EXPECT_THROW(viz::weak_scaling_svg({}, "t"), Error);
  EXPECT_THROW(viz::weak_scaling_svg({{"p", "m", {}}}, "t"), Error);
  EXPECT_THROW(viz::weak_scaling_svg({{"p", "m", {{2, 1.0}, {2, 2.0}}}}, "t"), Error);
  EXPECT_THROW(viz::weak_scaling_svg({{"p", "m", {{0, 1.0}}}}, "t"), Error);
  EXPECT_THROW(viz::weak_scaling_svg({{"p", "m", {{1, -1.0}}}}, "t"), Error);
  EXPECT_THROW(viz::weak_scaling_svg({{"p", "m", {{1, NAN}}}}, "t"), Error);
  try {
    viz::weak_scaling_svg({{"p", "m", {{1, 1.0}}}, {"p", "m", {{2, 1.0}}}}, "t");
    FAIL() << "a duplicate series was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'m' of 'p'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace treecp
