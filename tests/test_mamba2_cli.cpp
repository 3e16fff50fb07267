// `treecp mamba2` end to end: files in, files out, in one process and (re-launched under mpirun) on
// several ranks with each strategy; outputs equal the tree reference; bad inputs refused in one line
// with nothing written.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <string>

#include "common/cli.hpp"
#include "core/npy.hpp"
#include "common/mamba2.hpp"

namespace treecp {
namespace {

namespace fs = std::filesystem;
using testing::Mamba2Data;

#ifdef TREECP_HAVE_MPI
const int kRanks = 3;
#else
const int kRanks = 1;
#endif

class Mamba2Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::write_file(dir / "t.json",
                        R"({"segments":[{"parent":-1,"length":30},{"parent":0,"length":7},)"
                        R"({"parent":1,"length":2},{"parent":0,"length":12},{"parent":-1,"length":5}]})");
    row = load_row(dir / "t.json");
    d = testing::random_mamba2_data(row.tokens(), 4, 3, 2, 5, true, 5);
  }
  void save(const std::string& name, const std::vector<int64_t>& shape, const std::vector<double>& v,
            DType t = DType::F64) {
    testing::write_file(dir / name, npy_bytes(shape, v.data(), t));
  }
  void save_all(DType t) {
    const int64_t S = d.S;
    save("x.npy", {S, 4, 3}, d.x, t);
    save("dt.npy", {S, 4}, d.dt, t);
    save("a.npy", {4}, d.A, t);
    save("b.npy", {S, 2, 5}, d.B, t);
    save("c.npy", {S, 2, 5}, d.C, t);
    save("d.npy", {4}, d.D, t);
    save("dy.npy", {S, 4, 3}, d.dy, t);
  }
  std::string inputs() const {
    return "mamba2 --tree " + dir / "t.json" + " --x " + dir / "x.npy" + " --dt " + dir / "dt.npy" + " --a " +
           dir / "a.npy" + " --b " + dir / "b.npy" + " --c " + dir / "c.npy";
  }
  testing::CliRun run(const std::string& args) { return testing::run_treecp(args, dir / "log.txt"); }
  std::vector<double> load(const std::string& name) const { return load_npy(dir / name).data; }

  testing::TempDir dir{"treecp_mamba2_cli"};
  Row row;
  Mamba2Data d;
};

TEST_F(Mamba2Cli, MatchesTheReferenceOnOneAndSeveralRanks) {
  save_all(DType::F64);
  const testing::Mamba2Result ref = testing::mamba2_tree_reference(row, d);
  for (int ranks : {1, kRanks}) {
    for (const char* strategy : {"transpose", "summary", "auto"}) {
      const std::string out = dir / ("out_" + std::to_string(ranks) + strategy);
      const auto r = run(inputs() + " --d " + dir / "d.npy" + " --dout " + dir / "dy.npy" + " --ranks " +
                         std::to_string(ranks) + " --strategy " + strategy + " --out " + out);
      ASSERT_EQ(r.status, 0) << r.log;
      EXPECT_NE(r.log.find("float64, with backward"), std::string::npos) << r.log;
      const std::pair<const char*, const std::vector<double>*> files[] = {
          {"y.npy", &ref.y},   {"dx.npy", &ref.dx}, {"ddt.npy", &ref.ddt}, {"da.npy", &ref.dA},
          {"db.npy", &ref.dB}, {"dc.npy", &ref.dC}, {"dd.npy", &ref.dD}};
      for (const auto& [name, want] : files) {
        const std::vector<double> got = load_npy(out + "/" + name).data;
        EXPECT_LT(testing::max_abs_diff(got, *want), 1e-10 * (1 + testing::max_abs(*want)))
            << name << " ranks " << ranks << " " << strategy;
      }
    }
  }
}

TEST_F(Mamba2Cli, FloatInputsComputeInFloatAndStaleOutputsGo) {
  save_all(DType::F32);
  const std::string out = dir / "out";
  ASSERT_EQ(run(inputs() + " --d " + dir / "d.npy" + " --dout " + dir / "dy.npy" + " --out " + out).status, 0);
  EXPECT_TRUE(fs::exists(out + "/dd.npy"));
  EXPECT_EQ(load_npy(out + "/y.npy").dtype, DType::F32);
  // Without --d and --dout: y alone, and the gradients of the earlier run are gone.
  const auto r = run(inputs() + " --ranks " + std::to_string(kRanks) + " --out " + out);
  ASSERT_EQ(r.status, 0) << r.log;
  EXPECT_TRUE(fs::exists(out + "/y.npy"));
  for (const char* name : {"dx.npy", "ddt.npy", "da.npy", "db.npy", "dc.npy", "dd.npy"})
    EXPECT_FALSE(fs::exists(out + "/" + name)) << name;
  // Float against the double reference within the float recurrence's own error.
  d.D.clear();
  d.with_d = false;
  const auto exact = testing::mamba2_tree_reference(row, d).y, same = testing::mamba2_tree_reference<float>(row, d).y;
  EXPECT_LE(testing::max_abs_diff(load_npy(out + "/y.npy").data, exact),
            testing::tolerance(testing::max_abs_diff(same, exact), exact));
}

TEST_F(Mamba2Cli, RefusesBadInputsAndWritesNothing) {
  save_all(DType::F64);
  const int64_t S = d.S;
  std::vector<double> bad_dt = d.dt, bad_a = d.A, nan_x = d.x;
  bad_dt[3] = 0.0;
  bad_a[1] = 0.5;
  nan_x[7] = std::numeric_limits<double>::quiet_NaN();
  save("dt0.npy", {S, 4}, bad_dt);
  save("apos.npy", {4}, bad_a);
  save("xnan.npy", {S, 4, 3}, nan_x);
  save("x32.npy", {S, 4, 3}, d.x, DType::F32);
  save("b3.npy", {S, 3, 5}, std::vector<double>(static_cast<size_t>(S * 15), 0.1));
  save("cshort.npy", {S - 1, 2, 5}, std::vector<double>(static_cast<size_t>((S - 1) * 10), 0.1));
  const std::string base = inputs();
  auto with = [&](const std::string& flag, const std::string& file) {
    std::string s = base;
    const size_t at = s.find(flag + " ");
    const size_t end = s.find(' ', at + flag.size() + 1);
    return s.replace(at, end == std::string::npos ? std::string::npos : end - at, flag + " " + dir / file);
  };
  const std::pair<std::string, std::string> cases[] = {
      {with("--dt", "dt0.npy"), "dt: element 3 is 0"},
      {with("--a", "apos.npy"), "a: element 1 is 0.5"},
      {with("--x", "xnan.npy"), "x: element 7 is nan"},
      {with("--x", "x32.npy"), "mixing dtypes is refused"},
      {with("--b", "b3.npy"), "groups must divide"},
      {with("--c", "cshort.npy"), "c: expected shape"},
      {base + " --strategy heads", "strategy must be transpose, summary or auto"},
      {base + " --layout ring", "--layout must be one of"},
      {base + " --chunk 0", "--chunk must be in"},
  };
  for (const auto& [args, message] : cases) {
    const std::string out = dir / "never";
    const auto r = run(args + " --ranks " + std::to_string(kRanks) + " --out " + out);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_NE(r.log.find(message), std::string::npos) << args << "\n" << r.log;
    EXPECT_EQ(std::count(r.log.begin(), r.log.end(), '\n'), 1) << r.log;
    EXPECT_FALSE(fs::exists(out)) << args;
  }
}

}  // namespace
}  // namespace treecp
