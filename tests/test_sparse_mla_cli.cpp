// `treecp sparse-mla` end to end: the files of one process equal the library's, --ranks N writes the same
// files (the same ids exactly) for several layouts and both ways of fetching KV, --ids reuses a selection,
// float32 runs forward only, and every bad input is refused in one line with nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/common.hpp"
#include "core/npy.hpp"
#include "kernels/cpu/sparse_mla.hpp"
#include "tree/row.hpp"

namespace treecp {
namespace {

namespace fs = std::filesystem;
using testing::read_text;
using testing::TempDir;
using testing::write_file;

testing::CliRun run_cli(const TempDir& dir, const std::string& args) {
  return testing::run_treecp("sparse-mla " + args, dir / "log.txt");
}

double rel_diff(const NpyArray& a, const NpyArray& b) {
  EXPECT_EQ(a.shape, b.shape);
  double scale = 1e-300, err = 0;
  for (size_t i = 0; i < a.data.size() && i < b.data.size(); ++i) {
    if (std::isinf(a.data[i]) && a.data[i] == b.data[i]) continue;
    scale = std::max(scale, std::abs(b.data[i]));
    err = std::max(err, std::abs(a.data[i] - b.data[i]));
  }
  return err / scale;
}

// A row (one family long enough to be split, plus a small one) and float64 inputs in `dir`.
struct Problem {
  Row row;
  int64_t S = 0;
  int h = 4, dqk = 12, dv = 8, hi = 3, di = 6;
  std::vector<double> q, kv, qi, ki, w, dout;
  std::string inputs;  // the command-line arguments naming the files
};

// With `row`, another layer's inputs on that row (files named with `prefix`).
Problem write_problem(const TempDir& dir, std::mt19937_64& rng, const std::string& prefix = "", const Row* row = nullptr) {
  Problem p;
  std::vector<Segment> segs = {{-1, std::uniform_int_distribution<int64_t>(60, 120)(rng)}};
  for (int c = 0; c < 5; ++c) segs.push_back({0, std::uniform_int_distribution<int64_t>(20, 60)(rng)});
  segs.push_back({-1, 17});
  segs.push_back({6, 9});
  p.row = row ? *row : Row(segs);
  p.S = p.row.tokens();
  std::normal_distribution<double> nd(0.0, 1.0);
  auto array = [&](const std::string& name, std::vector<int64_t> shape, std::vector<double>& v) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    v.resize(static_cast<size_t>(n));
    for (double& x : v) x = nd(rng);
    write_file(dir / (prefix + name), npy_bytes(shape, v.data(), DType::F64));
  };
  write_file(dir / "row.json", row_to_json(p.row));
  array("q.npy", {p.S, p.h, p.dqk}, p.q);
  array("kv.npy", {p.S, p.dqk}, p.kv);
  array("qi.npy", {p.S, p.hi, p.di}, p.qi);
  array("ki.npy", {p.S, p.di}, p.ki);
  array("w.npy", {p.S, p.hi}, p.w);
  array("dout.npy", {p.S, p.h, p.dv}, p.dout);
  p.inputs = "--tree " + (dir / "row.json") + " --q " + (dir / (prefix + "q.npy")) + " --kv " + (dir / (prefix + "kv.npy")) +
             " --dv 8 --dout " + (dir / (prefix + "dout.npy"));
  return p;
}

std::string indexer_args(const TempDir& dir, const std::string& prefix = "") {
  return " --qi " + (dir / (prefix + "qi.npy")) + " --ki " + (dir / (prefix + "ki.npy")) + " --w " + (dir / (prefix + "w.npy"));
}

TEST(SparseMlaCli, OneProcessWritesTheLibrarysResults) {
  TempDir dir("treecp_smla_cli");
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(1);
  const Problem p = write_problem(dir, rng);
  const testing::CliRun r = run_cli(dir, p.inputs + indexer_args(dir) + " --topk 6 --window 40 --scale 0.3 --out " + (dir / "out"));
  ASSERT_EQ(r.status, 0) << r.log;
  EXPECT_NE(r.log.find("one process"), std::string::npos) << r.log;
  cpu::SparseMlaProblem<double> lp;
  lp.hi = p.hi, lp.di = p.di, lp.h = p.h, lp.dqk = p.dqk, lp.dv = p.dv, lp.topk = 6, lp.window = 40, lp.scale = 0.3;
  lp.qi = p.qi.data(), lp.ki = p.ki.data(), lp.w = p.w.data(), lp.q = p.q.data(), lp.kv = p.kv.data(), lp.dout = p.dout.data();
  const cpu::SparseMlaResult<double> ref = cpu::sparse_mla_reference(p.row, lp);
  const NpyInt64Array ids = load_npy_int64(dir / "out/ids.npy");
  EXPECT_EQ(ids.shape, (std::vector<int64_t>{p.S, 6}));
  EXPECT_EQ(ids.data, ref.ids);
  EXPECT_EQ(load_npy(dir / "out/o.npy").data, ref.o);
  EXPECT_EQ(load_npy(dir / "out/lse.npy").data, ref.lse);
  EXPECT_EQ(load_npy(dir / "out/dq.npy").data, ref.dq);
  EXPECT_EQ(load_npy(dir / "out/dkv.npy").data, ref.dkv);
  EXPECT_EQ(load_npy(dir / "out/dkv.npy").shape, (std::vector<int64_t>{p.S, p.dqk}));
}

TEST(SparseMlaCli, RanksWriteTheSameFilesAsOneProcess) {
#ifndef TREECP_HAVE_MPI
  GTEST_SKIP() << "built without MPI";
#endif
  TempDir dir("treecp_smla_cp_cli");
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(2);
  const Problem p = write_problem(dir, rng);
  const std::string args = p.inputs + indexer_args(dir) + " --topk 5 --window 50";
  ASSERT_EQ(run_cli(dir, args + " --out " + (dir / "one")).status, 0) << read_text(dir / "log.txt");
  struct Run {
    const char* layout;
    const char* fetch;
  };
  for (const Run& run : {Run{"zigzag", "waves"}, Run{"contiguous", "selected"}, Run{"searched", "auto"}}) {
    const std::string out = dir / (std::string("cp_") + run.layout);
    const testing::CliRun r =
        run_cli(dir, args + " --ranks 3 --layout " + run.layout + " --fetch " + run.fetch + " --out " + out);
    ASSERT_EQ(r.status, 0) << r.log;
    EXPECT_NE(r.log.find(std::string("3 ranks, ") + run.layout), std::string::npos) << r.log;
    if (std::string(run.fetch) != "auto") {
      EXPECT_NE(r.log.find(std::string(run.fetch) == "waves" ? "KV in the waves" : "selected rows only"), std::string::npos) << r.log;
    }
    if (std::string(run.layout) != "searched") {
      EXPECT_EQ(r.log.find("with 0 waves"), std::string::npos) << r.log;
    }
    EXPECT_EQ(load_npy_int64(out + "/ids.npy").data, load_npy_int64(dir / "one/ids.npy").data) << run.layout;
    for (const char* f : {"o.npy", "lse.npy", "dq.npy", "dkv.npy"}) {
      EXPECT_LE(rel_diff(load_npy(out + "/" + f), load_npy(dir / ("one/" + std::string(f)))), 1e-10) << run.layout << " " << f;
    }
  }
}

TEST(SparseMlaCli, IdsReuseASelection) {
  // Layer 2 reuses layer 1's ids.npy: ids.npy repeats them and the outputs equal the library's on them.
  TempDir dir("treecp_smla_ids");
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(3);
  const Problem first = write_problem(dir, rng);
  const Problem second = write_problem(dir, rng, "l2_", &first.row);
  ASSERT_EQ(run_cli(dir, first.inputs + indexer_args(dir) + " --topk 4 --out " + (dir / "l1")).status, 0)
      << read_text(dir / "log.txt");
  const std::vector<int64_t> ids = load_npy_int64(dir / "l1/ids.npy").data;
  cpu::SparseMlaProblem<double> lp;
  lp.h = second.h, lp.dqk = second.dqk, lp.dv = second.dv, lp.topk = 4;
  lp.ids = ids.data(), lp.q = second.q.data(), lp.kv = second.kv.data(), lp.dout = second.dout.data();
  const cpu::SparseMlaResult<double> ref = cpu::sparse_mla_reference(second.row, lp);
  for (const std::string ranks : {"1", "2"}) {
#ifndef TREECP_HAVE_MPI
    if (ranks != "1") continue;
#endif
    const std::string out = dir / ("l2_" + ranks);
    const testing::CliRun r = run_cli(dir, second.inputs + " --ids " + (dir / "l1/ids.npy") + " --topk 4 --ranks " + ranks + " --out " + out);
    ASSERT_EQ(r.status, 0) << r.log;
    EXPECT_NE(r.log.find("ids reused (indexer skipped)"), std::string::npos) << r.log;
    EXPECT_EQ(load_npy_int64(out + "/ids.npy").data, ids);
    for (auto [f, want] : {std::pair{"o.npy", &ref.o}, std::pair{"lse.npy", &ref.lse}, std::pair{"dq.npy", &ref.dq}, std::pair{"dkv.npy", &ref.dkv}}) {
      NpyArray expect;
      expect.shape = load_npy(out + "/" + f).shape;
      expect.data = *want;
      EXPECT_LE(rel_diff(load_npy(out + "/" + f), expect), 1e-10) << f << " ranks " << ranks;
    }
  }
}

TEST(SparseMlaCli, Float32ForwardOnlyRemovesStaleGradients) {
  TempDir dir("treecp_smla_f32");
  const Row row({{-1, 10}, {0, 5}});
  write_file(dir / "row.json", row_to_json(row));
  std::vector<float> q(15 * 2 * 8, 0.25f), kv(15 * 8, -0.5f), qi(15 * 2 * 4, 1.0f), ki(15 * 4, 0.5f), w(15 * 2, 1.0f);
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i)));
  write_file(dir / "q.npy", npy_bytes({15, 2, 8}, q.data()));
  write_file(dir / "kv.npy", npy_bytes({15, 8}, kv.data()));
  write_file(dir / "qi.npy", npy_bytes({15, 2, 4}, qi.data()));
  write_file(dir / "ki.npy", npy_bytes({15, 4}, ki.data()));
  write_file(dir / "w.npy", npy_bytes({15, 2}, w.data()));
  fs::create_directories(dir / "out");
  write_file(dir / "out/dq.npy", "stale");
  write_file(dir / "out/dkv.npy", "stale");
  const testing::CliRun r = run_cli(dir, "--tree " + (dir / "row.json") + " --q " + (dir / "q.npy") + " --kv " + (dir / "kv.npy") +
                                             " --dv 6" + indexer_args(dir) + " --topk 3 --out " + (dir / "out"));
  ASSERT_EQ(r.status, 0) << r.log;
  EXPECT_NE(r.log.find("float32"), std::string::npos);
  EXPECT_EQ(load_npy(dir / "out/o.npy").dtype, DType::F32);
  EXPECT_EQ(load_npy(dir / "out/o.npy").shape, (std::vector<int64_t>{15, 2, 6}));
  // all keys score alike: ties go to the smaller ids, so query 12 (in the child) keeps 0, 1, 2
  const NpyInt64Array ids = load_npy_int64(dir / "out/ids.npy");
  EXPECT_EQ(std::vector<int64_t>(ids.data.begin() + 12 * 3, ids.data.begin() + 13 * 3), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(std::vector<int64_t>(ids.data.begin(), ids.data.begin() + 3), (std::vector<int64_t>{0, -1, -1}));
  EXPECT_FALSE(fs::exists(dir / "out/dq.npy"));
  EXPECT_FALSE(fs::exists(dir / "out/dkv.npy"));
}

TEST(SparseMlaCli, BadInputsAreRefusedInOneLineAndWriteNothing) {
  TempDir dir("treecp_smla_bad");
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(4);
  const Problem p = write_problem(dir, rng);
  // ids: query 0 reads token 1, which comes after it
  std::vector<int64_t> bad_ids(static_cast<size_t>(p.S * 2), -1);
  bad_ids[0] = 1;
  write_file(dir / "bad_ids.npy", npy_bytes({p.S, 2}, bad_ids.data()));
  std::vector<int64_t> short_ids(static_cast<size_t>(p.S), -1);
  write_file(dir / "short_ids.npy", npy_bytes({p.S, 1}, short_ids.data()));
  std::vector<float> f(static_cast<size_t>(p.S * p.dqk), 0.5f);
  write_file(dir / "kv32.npy", npy_bytes({p.S, p.dqk}, f.data()));
  std::vector<double> nan_w = p.w;
  nan_w[5] = std::nan("");
  write_file(dir / "nan_w.npy", npy_bytes({p.S, p.hi}, nan_w.data(), DType::F64));
  std::vector<double> kv_short(static_cast<size_t>((p.S - 1) * p.dqk), 0.1);
  write_file(dir / "kv_short.npy", npy_bytes({p.S - 1, p.dqk}, kv_short.data(), DType::F64));
  // The arguments of a good run; each case changes (value), adds or drops (empty value) some.
  const std::vector<std::pair<std::string, std::string>> good = {
      {"--tree", dir / "row.json"}, {"--q", dir / "q.npy"},   {"--kv", dir / "kv.npy"}, {"--dv", "8"},
      {"--qi", dir / "qi.npy"},     {"--ki", dir / "ki.npy"}, {"--w", dir / "w.npy"},   {"--topk", "2"}};
  auto args = [&](const std::vector<std::pair<std::string, std::string>>& change) {
    std::vector<std::pair<std::string, std::string>> all = good;
    for (const auto& [flag, value] : change) {
      auto it = std::find_if(all.begin(), all.end(), [&](const auto& a) { return a.first == flag; });
      if (it == all.end()) {
        all.push_back({flag, value});
      } else {
        it->second = value;
      }
    }
    std::string out;
    for (const auto& [flag, value] : all) {
      if (!value.empty()) out += " " + flag + " " + value;
    }
    return out;
  };
  const std::vector<std::pair<std::string, std::string>> reuse = {{"--qi", ""}, {"--ki", ""}, {"--w", ""}};
  auto with = [](std::vector<std::pair<std::string, std::string>> a, std::pair<std::string, std::string> b) {
    a.push_back(b);
    return a;
  };
  struct Bad {
    std::string args, message;
  };
  const std::vector<Bad> cases = {
      {args({{"--topk", ""}}), "--topk K is required"},
      {args({{"--topk", "0"}}), "--topk K is required, in [1, 1048576], got 0"},
      {args({{"--w", ""}}), "--w is required (or --ids"},
      {args({{"--dv", "13"}}), "in [1, Dqk = 12]"},
      {args({{"--window", "-1"}}), "option --window must be in [0, "},
      {args({{"--fetch", "some"}}), "option --fetch must be one of auto, waves, selected"},
      {args({{"--kv", dir / "kv32.npy"}}), "kv is float32 but q is float64"},
      {args({{"--kv", dir / "kv_short.npy"}}), "kv: expected shape"},
      {args({{"--w", dir / "nan_w.npy"}}), "w: element 5 is nan"},
      {args(with(reuse, {"--ids", dir / "bad_ids.npy"})), "ids: query 0, entry 0: key 1 is not visible to the query (tree)"},
      {args(with(reuse, {"--ids", dir / "short_ids.npy"})), "ids: expected shape"},
      {args({{"--ids", dir / "bad_ids.npy"}}), "--qi is not used with --ids"},
      {args(with(with(reuse, {"--ids", dir / "bad_ids.npy"}), {"--fetch", "waves"})), "--fetch waves needs the indexer's waves"},
      {args(with(reuse, {"--ids", dir / "qi.npy"})), "expected little-endian int64"},
  };
  EXPECT_EQ(run_cli(dir, args({}) + " --out " + (dir / "good")).status, 0) << read_text(dir / "log.txt");
  for (const Bad& b : cases) {
    const testing::CliRun r = run_cli(dir, b.args + " --out " + (dir / "never"));
    EXPECT_NE(r.status, 0) << b.args;
    EXPECT_NE(r.log.find(b.message), std::string::npos) << "expected '" << b.message << "', got: " << r.log;
    EXPECT_EQ(std::count(r.log.begin(), r.log.end(), '\n'), 1) << r.log;
    EXPECT_FALSE(fs::exists(dir / "never")) << b.args;
  }
}

}  // namespace
}  // namespace treecp
