// `treecp attention --ranks N` starts its own MPI ranks and writes the same files as the
// single-process run, in packed order: compared file by file on random trees, every layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/common.hpp"
#include "core/npy.hpp"
#include "plan/planner.hpp"
#include "tree/row.hpp"

namespace treecp {
namespace {

namespace fs = std::filesystem;

using testing::read_text;
using testing::write_file;

int run_cli(const std::string& args, const std::string& log) { return testing::run_treecp("attention " + args, log).status; }

// max |a - b| relative to b's largest entry (-inf LSE of rows with no key must match exactly).
double rel_diff(const NpyArray& a, const NpyArray& b) {
  EXPECT_EQ(a.shape, b.shape);
  return testing::max_error(a.data, b.data) / std::max(1e-300, testing::max_abs(b.data));
}

TEST(AttentionCpCli, RanksWriteTheSameFilesAsOneProcess) {
#ifndef TREECP_HAVE_MPI
  GTEST_SKIP() << "built without MPI";
#endif
  testing::TempDir dir("treecp_attention_cp_cli");
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(1);
  // One random family over the whole row, so that a layout that splits it must exchange KV.
  const Row row = testing::random_tree(rng, {.segments = std::uniform_int_distribution<int>(5, 9)(rng), .min_len = 100,
                                             .max_len = 400, .max_depth = 2, .min_children = 8, .max_children = 8,
                                             .root_min_len = 100, .root_max_len = 300});
  write_file(dir / "row.json", row_to_json(row));
  const int64_t S = row.tokens(), hq = 4, hkv = 2, d = 8, dv = 8;
  std::normal_distribution<double> nd(0.0, 1.0);
  auto array = [&](const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    std::vector<double> v(static_cast<size_t>(n));
    for (double& x : v) x = nd(rng);
    write_file(dir / name, npy_bytes(shape, v.data(), DType::F64));
  };
  array("q.npy", {S, hq, d});
  array("k.npy", {S, hkv, d});
  array("v.npy", {S, hkv, dv});
  array("dout.npy", {S, hq, dv});
  array("sink.npy", {hq});
  const std::string inputs = "--tree " + (dir / "row.json") + " --q " + (dir / "q.npy") + " --k " + (dir / "k.npy") +
                             " --v " + (dir / "v.npy") + " --dout " + (dir / "dout.npy") + " --sink " +
                             (dir / "sink.npy") + " --window 37";
  ASSERT_EQ(run_cli(inputs + " --out " + (dir / "one"), dir / "log1"), 0) << read_text(dir / "log1");
  for (const std::string& layout : {std::string("searched"), std::string("zigzag"), std::string("contiguous")}) {
    const std::string out = dir / ("cp_" + layout);
    ASSERT_EQ(run_cli(inputs + " --ranks 3 --chunk 128 --layout " + layout + " --out " + out, dir / "log3"), 0)
        << read_text(dir / "log3");
    // the run was really distributed; the fixed layouts split the family, so KV moved (the searched
    // plan may rightly keep a row this small on one rank under the default H200 costs)
    EXPECT_NE(read_text(dir / "log3").find("3 ranks, " + layout + " plan with "), std::string::npos) << read_text(dir / "log3");
    if (layout != "searched") {
      EXPECT_EQ(read_text(dir / "log3").find("with 0 waves"), std::string::npos) << read_text(dir / "log3");
    }
    for (const char* f : {"o.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy", "dsink.npy"}) {
      EXPECT_LE(rel_diff(load_npy(out + "/" + f), load_npy(dir / ("one/" + std::string(f)))), 1e-10) << layout << " " << f;
    }
  }
  // A bad shape is refused before any rank starts, and nothing is written.
  array("bad_k.npy", {S, hkv, d + 1});
  const std::string bad_out = dir / "never";
  const std::string bad = "--tree " + (dir / "row.json") + " --q " + (dir / "q.npy") + " --k " + (dir / "bad_k.npy") +
                          " --v " + (dir / "v.npy") + " --ranks 3 --out " + bad_out;
  EXPECT_NE(run_cli(bad, dir / "logbad"), 0);
  EXPECT_NE(read_text(dir / "logbad").find("k: expected shape"), std::string::npos) << read_text(dir / "logbad");
  EXPECT_FALSE(fs::exists(bad_out));
}

}  // namespace
}  // namespace treecp
