// `treecp gdn` and `treecp conv1d` end to end: files in, files out, on one process and (re-launched
// under mpirun) on several; outputs equal the tree references; shape errors refused with nothing
// written.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/npy.hpp"
#include "common/cli.hpp"
#include "common/gdn.hpp"

namespace treecp {
namespace {

namespace fs = std::filesystem;

// Several ranks need mpirun; without MPI the command refuses --ranks > 1 (checked below).
#ifdef TREECP_HAVE_MPI
const std::vector<int> kGdnRanks = {1, 3}, kConvRanks = {1, 4};
#else
const std::vector<int> kGdnRanks = {1}, kConvRanks = {1};
#endif

using testing::max_abs;
using testing::max_error;

struct Cli {
  int rc = 0;
  std::string output;
};

Cli run_cli(const std::string& args) {
  const testing::TempDir logs("treecp_gdn_cli_log");
  const testing::CliRun r = testing::run_treecp(args, logs / "log");
  return {WIFEXITED(r.status) ? WEXITSTATUS(r.status) : -1, r.log};
}

void save(const fs::path& p, const std::vector<int64_t>& shape, const std::vector<double>& data, DType dt = DType::F64) {
  std::ofstream(p, std::ios::binary) << npy_bytes(shape, data.data(), dt);
}

class GdnCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() / ("treecp_gdn_cli_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    std::ofstream(dir / "t.json") << R"({"segments":[{"parent":-1,"length":30},{"parent":0,"length":7},)"
                                  << R"({"parent":1,"length":2},{"parent":0,"length":12},{"parent":-1,"length":4}]})";
    row = load_row((dir / "t.json").string());
  }
  void TearDown() override { fs::remove_all(dir); }
  std::string p(const std::string& name) const { return (dir / name).string(); }
  fs::path dir;
  Row row;
};

TEST_F(GdnCli, GdnAndKdaMatchTheReferenceOnOneAndThreeRanks) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(5);
  for (GdnGate gate : {GdnGate::Scalar, GdnGate::PerChannel}) {
    const testing::GdnData d = testing::random_gdn_data(row.tokens(), 2, 6, 3, gate, rng);
    const int64_t S = d.S;
    save(dir / "q.npy", {S, 2, 6}, d.q);
    save(dir / "k.npy", {S, 2, 6}, d.k);
    save(dir / "v.npy", {S, 2, 3}, d.v);
    save(dir / "g.npy", gate == GdnGate::Scalar ? std::vector<int64_t>{S, 2} : std::vector<int64_t>{S, 2, 6}, d.g);
    save(dir / "b.npy", {S, 2}, d.beta);
    save(dir / "do.npy", {S, 2, 3}, d.dy);
    const auto ref = testing::gdn_tree_reference(row, d, 0.5);
    for (int ranks : kGdnRanks) {
      const std::string out = p("out" + std::to_string(ranks));
      const Cli c = run_cli("gdn --tree " + p("t.json") + " --q " + p("q.npy") + " --k " + p("k.npy") + " --v " +
                            p("v.npy") + " --g " + p("g.npy") + " --beta " + p("b.npy") + " --dout " + p("do.npy") +
                            " --scale 0.5 --chunk 8 --ranks " + std::to_string(ranks) + " --out " + out);
      ASSERT_EQ(c.rc, 0) << c.output;
      EXPECT_NE(c.output.find(gate == GdnGate::Scalar ? "GDN" : "KDA"), std::string::npos) << c.output;
      const std::pair<const char*, const std::vector<double>*> files[] = {
          {"o.npy", &ref.y}, {"dq.npy", &ref.dq}, {"dk.npy", &ref.dk}, {"dv.npy", &ref.dv}, {"dg.npy", &ref.dg},
          {"dbeta.npy", &ref.dbeta}};
      for (const auto& [name, want] : files) {
        const NpyArray a = load_npy(out + "/" + name);
        EXPECT_EQ(a.dtype, DType::F64);
        EXPECT_LT(max_error(a.data, *want), 1e-10 * (1 + max_abs(*want))) << name << " ranks " << ranks;
      }
    }
  }
}

// --layout: each of the four gives the reference's outputs and names itself; --attention-layout is
// priced by the searched choice; bad values are refused in one line and write nothing.
TEST_F(GdnCli, EveryLayoutMatchesTheReference) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(9);
  const testing::GdnData d = testing::random_gdn_data(row.tokens(), 2, 4, 3, GdnGate::PerChannel, rng);
  const int64_t S = d.S;
  save(dir / "q.npy", {S, 2, 4}, d.q);
  save(dir / "k.npy", {S, 2, 4}, d.k);
  save(dir / "v.npy", {S, 2, 3}, d.v);
  save(dir / "g.npy", {S, 2, 4}, d.g);
  save(dir / "b.npy", {S, 2}, d.beta);
  save(dir / "do.npy", {S, 2, 3}, d.dy);
  const auto ref = testing::gdn_tree_reference(row, d, 0.5);
  const std::string base = "gdn --tree " + p("t.json") + " --q " + p("q.npy") + " --k " + p("k.npy") + " --v " +
                           p("v.npy") + " --g " + p("g.npy") + " --beta " + p("b.npy") + " --dout " + p("do.npy") +
                           " --scale 0.5 --chunk 8";
  for (const std::string layout : {"contiguous", "zigzag", "doc-zigzag", "searched"}) {
    const int ranks = kGdnRanks.back();
    const std::string out = p("out_" + layout);
    const Cli c = run_cli(base + " --layout " + layout + (layout == "searched" ? " --attention-layout zigzag" : "") +
                          " --ranks " + std::to_string(ranks) + " --out " + out);
    ASSERT_EQ(c.rc, 0) << c.output;
    if (layout != "searched") EXPECT_NE(c.output.find("layout " + layout), std::string::npos) << c.output;
    for (const auto& [name, want] : {std::pair{"o.npy", &ref.y}, {"dq.npy", &ref.dq}, {"dg.npy", &ref.dg},
                                     {"dbeta.npy", &ref.dbeta}}) {
      const NpyArray a = load_npy(out + "/" + name);
      EXPECT_LT(max_error(a.data, *want), 1e-10 * (1 + max_abs(*want))) << name << " " << layout;
    }
  }
  for (const std::string bad : {"--layout zig-zag", "--layout perdoc", "--attention-layout diagonal"}) {
    const Cli c = run_cli(base + " " + bad + " --out " + p("bad"));
    EXPECT_NE(c.rc, 0) << bad;
    EXPECT_NE(c.output.find(bad.substr(0, bad.find(' '))), std::string::npos) << c.output;
    EXPECT_EQ(std::count(c.output.begin(), c.output.end(), '\n'), 1) << c.output;
    EXPECT_FALSE(fs::exists(p("bad")));
  }
}

TEST_F(GdnCli, FloatInputsGiveFloatOutputs) {
  testing::Rng rng = testing::test_rng(6);
  const testing::GdnData d = testing::random_gdn_data(row.tokens(), 1, 4, 2, GdnGate::Scalar, rng);
  const int64_t S = d.S;
  save(dir / "q.npy", {S, 1, 4}, d.q, DType::F32);
  save(dir / "k.npy", {S, 1, 4}, d.k, DType::F32);
  save(dir / "v.npy", {S, 1, 2}, d.v, DType::F32);
  save(dir / "g.npy", {S, 1}, d.g, DType::F32);
  save(dir / "b.npy", {S, 1}, d.beta, DType::F32);
  const Cli c = run_cli("gdn --tree " + p("t.json") + " --q " + p("q.npy") + " --k " + p("k.npy") + " --v " +
                        p("v.npy") + " --g " + p("g.npy") + " --beta " + p("b.npy") + " --out " + p("o"));
  ASSERT_EQ(c.rc, 0) << c.output;
  const NpyArray o = load_npy(p("o/o.npy"));
  EXPECT_EQ(o.dtype, DType::F32);
  EXPECT_EQ(o.shape, (std::vector<int64_t>{S, 1, 2}));
  EXPECT_FALSE(fs::exists(p("o/dq.npy")));
}

TEST_F(GdnCli, ShapeErrorsAreRefusedAndNothingIsWritten) {
  const int64_t S = row.tokens();
  testing::Rng rng = testing::test_rng(7);
  const testing::GdnData d = testing::random_gdn_data(S, 2, 4, 3, GdnGate::Scalar, rng);
  save(dir / "q.npy", {S, 2, 4}, d.q);
  save(dir / "k.npy", {S, 2, 4}, d.k);
  save(dir / "v.npy", {S, 2, 3}, d.v);
  save(dir / "b.npy", {S, 2}, d.beta);
  save(dir / "gbad.npy", {S, 3}, std::vector<double>(static_cast<size_t>(S * 3), -0.1));
  save(dir / "short.npy", {S - 1, 2, 4}, std::vector<double>(static_cast<size_t>((S - 1) * 8), 0.1));
  const std::string base = "gdn --tree " + p("t.json") + " --v " + p("v.npy") + " --beta " + p("b.npy");
  Cli c = run_cli(base + " --q " + p("q.npy") + " --k " + p("k.npy") + " --g " + p("gbad.npy") + " --out " + p("x"));
  EXPECT_NE(c.rc, 0);
  EXPECT_NE(c.output.find("g: expected"), std::string::npos) << c.output;
  c = run_cli(base + " --q " + p("short.npy") + " --k " + p("k.npy") + " --g " + p("b.npy") + " --out " + p("x") +
              " --ranks 2");
  EXPECT_NE(c.rc, 0);
  EXPECT_NE(c.output.find("q: expected [S, H, Dk]"), std::string::npos) << c.output;
  c = run_cli(base + " --q " + p("q.npy") + " --k " + p("k.npy") + " --g " + p("b.npy") + " --dout " + p("q.npy") +
              " --out " + p("x"));
  EXPECT_NE(c.rc, 0);
  EXPECT_NE(c.output.find("dout"), std::string::npos) << c.output;
  EXPECT_FALSE(fs::exists(p("x")));
}

// --device: cpu or cuda; cuda runs (a CUDA build on a GPU machine) or is refused in one line naming why, and
// either way a refusal writes nothing.
TEST_F(GdnCli, DeviceIsCheckedAndARefusalWritesNothing) {
  const int64_t S = row.tokens();
  testing::Rng rng = testing::test_rng(8);
  const testing::GdnData d = testing::random_gdn_data(S, 1, 4, 4, GdnGate::Scalar, rng);
  save(dir / "q.npy", {S, 1, 4}, d.q);
  save(dir / "k.npy", {S, 1, 4}, d.k);
  save(dir / "v.npy", {S, 1, 4}, d.v);
  save(dir / "g.npy", {S, 1}, d.g);
  save(dir / "b.npy", {S, 1}, d.beta);
  save(dir / "x.npy", {S, 4}, d.v);
  save(dir / "w.npy", {4, 3}, std::vector<double>(12, 0.25));
  const std::string gdn = "gdn --tree " + p("t.json") + " --q " + p("q.npy") + " --k " + p("k.npy") + " --v " +
                          p("v.npy") + " --g " + p("g.npy") + " --beta " + p("b.npy");
  const std::string conv = "conv1d --tree " + p("t.json") + " --x " + p("x.npy") + " --weight " + p("w.npy");
  for (const std::string& base : {gdn, conv}) {
    Cli c = run_cli(base + " --device tpu --out " + p("dev"));
    EXPECT_NE(c.rc, 0);
    EXPECT_NE(c.output.find("--device"), std::string::npos) << c.output;
    EXPECT_FALSE(fs::exists(p("dev")));
    c = run_cli(base + " --device cuda --out " + p("dev"));
    if (c.rc == 0) {
      EXPECT_TRUE(fs::exists(p("dev"))) << c.output;
      fs::remove_all(p("dev"));
    } else {
      EXPECT_NE(c.output.find("--device cuda"), std::string::npos) << c.output;
      EXPECT_FALSE(fs::exists(p("dev")));
    }
  }
  // --dtype picks the GPU's 16-bit type: refused on the CPU (the npy dtype is the precision there), refused unless
  // bf16 or fp16, and fp16 refuses inputs past its largest finite value 65504 by name (a build without CUDA refuses
  // --device cuda first).
  save(dir / "big.npy", {S, 4}, std::vector<double>(static_cast<size_t>(S * 4), 7e4));
  for (const std::string& base : {gdn, conv}) {
    Cli c = run_cli(base + " --dtype fp16 --out " + p("dev"));
    EXPECT_NE(c.rc, 0);
    EXPECT_NE(c.output.find("--dtype goes with --device cuda"), std::string::npos) << c.output;
    c = run_cli(base + " --device cuda --dtype fp32 --out " + p("dev"));
    EXPECT_NE(c.rc, 0);
    EXPECT_TRUE(c.output.find("--dtype") != std::string::npos || c.output.find("--device cuda") != std::string::npos)
        << c.output;
    EXPECT_FALSE(fs::exists(p("dev")));
  }
  Cli c = run_cli("conv1d --tree " + p("t.json") + " --x " + p("big.npy") + " --weight " + p("w.npy") +
                  " --device cuda --dtype fp16 --out " + p("dev"));
  EXPECT_NE(c.rc, 0);
  EXPECT_TRUE(c.output.find("x: element 0 is 70000 (expected |values| <= 65504: fp16's largest finite value") !=
                  std::string::npos ||
              c.output.find("--device cuda") != std::string::npos)
      << c.output;
  EXPECT_FALSE(fs::exists(p("dev")));
  // --reps times the GPU path only: on the CPU it is refused by name, and so is a count out of range.
  c = run_cli(gdn + " --reps 3 --out " + p("dev"));
  EXPECT_NE(c.rc, 0);
  EXPECT_NE(c.output.find("--reps goes with --device cuda"), std::string::npos) << c.output;
  EXPECT_FALSE(fs::exists(p("dev")));
  c = run_cli(gdn + " --device cuda --reps 0 --out " + p("dev"));
  EXPECT_NE(c.rc, 0);
  // a CUDA build names --reps; a build without CUDA refuses --device cuda first
  EXPECT_TRUE(c.output.find("--reps") != std::string::npos || c.output.find("--device cuda") != std::string::npos)
      << c.output;
  EXPECT_FALSE(fs::exists(p("dev")));
  // --precision picks the GPU chunk kernels' products: refused on the CPU, refused unless one of the three names,
  // and the bf16 paths refused with --dtype fp16 (all before any rank starts: nothing written).
  c = run_cli(gdn + " --precision bf16_tensor --out " + p("dev"));
  EXPECT_NE(c.rc, 0);
  EXPECT_NE(c.output.find("--precision goes with --device cuda"), std::string::npos) << c.output;
  EXPECT_FALSE(fs::exists(p("dev")));
  for (const std::string& bad : {std::string(" --precision bf16"), std::string(" --precision bf16_tensor --dtype fp16"),
                                 std::string(" --precision bf16_tensor_scans --dtype fp16")}) {
    c = run_cli(gdn + " --device cuda" + bad + " --out " + p("dev"));
    EXPECT_NE(c.rc, 0) << bad;
    EXPECT_TRUE(c.output.find("--precision") != std::string::npos || c.output.find("--device cuda") != std::string::npos)
        << bad << ": " << c.output;
    EXPECT_FALSE(fs::exists(p("dev"))) << bad;
  }
  // a CUDA build names the pair; a build without CUDA refuses --device cuda first
  c = run_cli(gdn + " --device cuda --precision bf16_tensor --dtype fp16 --out " + p("dev"));
  EXPECT_TRUE(c.output.find("--precision bf16_tensor needs --dtype bf16") != std::string::npos ||
              c.output.find("built without CUDA") != std::string::npos)
      << c.output;
  // --fla-split: refused on the CPU and, on a CUDA build, unless the precision is bf16_tensor_scans
  c = run_cli(gdn + " --fla-split --out " + p("dev"));
  EXPECT_NE(c.rc, 0);
  EXPECT_NE(c.output.find("--fla-split goes with --device cuda"), std::string::npos) << c.output;
  EXPECT_FALSE(fs::exists(p("dev")));
  for (const std::string& precision : {std::string(""), std::string(" --precision bf16_tensor")}) {
    c = run_cli(gdn + " --device cuda --fla-split" + precision + " --out " + p("dev"));
    EXPECT_NE(c.rc, 0) << precision;
    EXPECT_TRUE(c.output.find("--fla-split needs --precision bf16_tensor_scans") != std::string::npos ||
                c.output.find("built without CUDA") != std::string::npos)
        << precision << ": " << c.output;
    EXPECT_FALSE(fs::exists(p("dev"))) << precision;
  }
  // --keep-forward keeps the split forward's arrays: refused without --fla-split
  c = run_cli(gdn + " --device cuda --precision bf16_tensor_scans --keep-forward --out " + p("dev"));
  EXPECT_NE(c.rc, 0);
  EXPECT_TRUE(c.output.find("--keep-forward goes with --fla-split") != std::string::npos ||
              c.output.find("built without CUDA") != std::string::npos)
      << c.output;
  EXPECT_FALSE(fs::exists(p("dev")));
}

TEST_F(GdnCli, Conv1dMatchesTheReference) {
  const int64_t S = row.tokens();
  const int C = 3, K = 4;
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(3);
  const std::vector<double> x = testing::randn(static_cast<size_t>(S * C), rng), w = testing::randn(C * K, rng),
                            b = testing::randn(C, rng), dy = testing::randn(x.size(), rng);
  save(dir / "x.npy", {S, C}, x);
  save(dir / "w.npy", {C, K}, w);
  save(dir / "b.npy", {C}, b);
  save(dir / "dy.npy", {S, C}, dy);
  const auto ref = testing::conv_tree_reference(row, x, w, b, C, K, true, dy);
  for (int ranks : kConvRanks) {
    const std::string out = p("c" + std::to_string(ranks));
    const Cli c = run_cli("conv1d --tree " + p("t.json") + " --x " + p("x.npy") + " --weight " + p("w.npy") +
                          " --bias " + p("b.npy") + " --silu --dout " + p("dy.npy") + " --ranks " +
                          std::to_string(ranks) + " --out " + out);
    ASSERT_EQ(c.rc, 0) << c.output;
    const std::pair<const char*, const std::vector<double>*> files[] = {
        {"y.npy", &ref.y}, {"dx.npy", &ref.dx}, {"dweight.npy", &ref.dw}, {"dbias.npy", &ref.db}};
    for (const auto& [name, want] : files) {
      const NpyArray a = load_npy(out + "/" + name);
      EXPECT_LT(max_error(a.data, *want), 1e-11) << name << " ranks " << ranks;
    }
  }
  const Cli bad = run_cli("conv1d --tree " + p("t.json") + " --x " + p("x.npy") + " --weight " + p("b.npy") + " --out " +
                          p("cbad"));
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.output.find("weight: expected"), std::string::npos) << bad.output;
  EXPECT_FALSE(fs::exists(p("cbad")));
#ifndef TREECP_HAVE_MPI
  const Cli multi = run_cli("conv1d --tree " + p("t.json") + " --x " + p("x.npy") + " --weight " + p("w.npy") +
                            " --ranks 2 --out " + p("cm"));
  EXPECT_NE(multi.rc, 0);
  EXPECT_NE(multi.output.find("needs MPI"), std::string::npos) << multi.output;
#endif
}

}  // namespace
}  // namespace treecp
