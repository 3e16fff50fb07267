// `treecp attention` end to end: .npy inputs written here, the CLI run as a process, its outputs read
// back and compared with the library called in this process; refused inputs write nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/cli.hpp"
#include "common/common.hpp"
#include "core/npy.hpp"
#include "kernels/cpu/attention.hpp"
#include "runtime/reference.hpp"
#include "tree/row.hpp"

namespace treecp {
namespace {

namespace fs = std::filesystem;

using testing::CliRun;
using testing::write_file;

struct Dir : testing::TempDir {
  Dir() : TempDir("treecp_attention_cli") {}
};

CliRun run_cli(const Dir& dir, const std::string& args) { return testing::run_treecp("attention " + args, dir / "log.txt"); }

using testing::randn;

// DESIGN.md's 9-token example, Hq = 2, Hkv = 1, D = 4, Dv = 3.
constexpr int kHq = 2, kHkv = 1, kD = 4, kDv = 3;
constexpr int64_t kS = 9;

struct Case {
  Row row{{{-1, 4}, {0, 3}, {0, 2}}};
  std::vector<double> q, k, v, sink, dout;
  explicit Case(uint64_t salt) {
    testing::Rng rng = testing::test_rng(salt);
    q = randn(kS * kHq * kD, rng);
    k = randn(kS * kHkv * kD, rng);
    v = randn(kS * kHkv * kDv, rng);
    sink = randn(kHq, rng);
    dout = randn(kS * kHq * kDv, rng);
  }
  void write(const Dir& dir, DType t) const {
    write_file(dir / "tree.json", row_to_json(row));
    write_file(dir / "q.npy", npy_bytes({kS, kHq, kD}, q.data(), t));
    write_file(dir / "k.npy", npy_bytes({kS, kHkv, kD}, k.data(), t));
    write_file(dir / "v.npy", npy_bytes({kS, kHkv, kDv}, v.data(), t));
    write_file(dir / "sink.npy", npy_bytes({kHq}, sink.data(), t));
    write_file(dir / "dout.npy", npy_bytes({kS, kHq, kDv}, dout.data(), t));
  }
  std::string inputs(const Dir& dir) const {
    return "--tree " + (dir / "tree.json") + " --q " + (dir / "q.npy") + " --k " + (dir / "k.npy") + " --v " +
           (dir / "v.npy");
  }
  template <class T>
  AttentionResult<T> library(int64_t window, bool with_sink, bool backward, T scale = 0) const {
    static std::vector<T> qt, kt, vt, st, dt;
    qt.assign(q.begin(), q.end());
    kt.assign(k.begin(), k.end());
    vt.assign(v.begin(), v.end());
    st.assign(sink.begin(), sink.end());
    dt.assign(dout.begin(), dout.end());
    AttentionInputs<T> p;
    p.q = qt.data();
    p.k = kt.data();
    p.v = vt.data();
    p.sink = with_sink ? st.data() : nullptr;
    p.dout = backward ? dt.data() : nullptr;
    return attention_reference(row, AttentionShape{kHq, kHkv, kD, kDv, window, scale}, p);
  }
};

template <class T>
void expect_array(const std::string& path, const std::vector<int64_t>& shape, DType dtype, const std::vector<T>& want,
                  double tol) {
  ASSERT_TRUE(fs::exists(path)) << path;
  const NpyArray a = load_npy(path);
  EXPECT_EQ(a.shape, shape) << path;
  EXPECT_EQ(a.dtype, dtype) << path;
  ASSERT_EQ(a.data.size(), want.size()) << path;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(static_cast<double>(want[i]))) {
      EXPECT_EQ(a.data[i], static_cast<double>(want[i])) << path << "[" << i << "]";
    } else {
      EXPECT_NEAR(a.data[i], static_cast<double>(want[i]), tol) << path << "[" << i << "]";
    }
  }
}

TEST(AttentionCli, Float64ForwardBackwardWithWindowAndSink) {
  Dir dir;
  const Case c(11);
  c.write(dir, DType::F64);
  const std::string out = dir / "out";
  const CliRun r = run_cli(dir, c.inputs(dir) + " --window 3 --sink " + (dir / "sink.npy") + " --dout " +
                                 (dir / "dout.npy") + " --out " + out);
  ASSERT_EQ(r.status, 0) << r.log;
  const auto want = c.library<double>(3, true, true);
  expect_array(out + "/o.npy", {kS, kHq, kDv}, DType::F64, want.o, 0.0);
  expect_array(out + "/lse.npy", {kS, kHq}, DType::F64, want.lse, 0.0);
  expect_array(out + "/dq.npy", {kS, kHq, kD}, DType::F64, want.dq, 0.0);
  expect_array(out + "/dk.npy", {kS, kHkv, kD}, DType::F64, want.dk, 0.0);
  expect_array(out + "/dv.npy", {kS, kHkv, kDv}, DType::F64, want.dv, 0.0);
  expect_array(out + "/dsink.npy", {kHq}, DType::F64, want.dsink, 0.0);
  // the window and the sink were applied: without them the output differs
  const auto plain = c.library<double>(0, false, false);
  EXPECT_NE(plain.o[8 * kHq * kDv], want.o[8 * kHq * kDv]);
  // a forward-only run into the same directory leaves no gradient of the earlier run behind
  const CliRun again = run_cli(dir, c.inputs(dir) + " --out " + out);
  ASSERT_EQ(again.status, 0) << again.log;
  expect_array(out + "/o.npy", {kS, kHq, kDv}, DType::F64, plain.o, 0.0);
  for (const char* stale : {"/dq.npy", "/dk.npy", "/dv.npy", "/dsink.npy"}) EXPECT_FALSE(fs::exists(out + stale)) << stale;
}

TEST(AttentionCli, Float32ForwardOnlyWithScale) {
  Dir dir;
  const Case c(12);
  c.write(dir, DType::F32);
  const std::string out = dir / "out";
  const CliRun r = run_cli(dir, c.inputs(dir) + " --scale 0.3 --out " + out);
  ASSERT_EQ(r.status, 0) << r.log;
  // float32 in: computed in float on the float-rounded inputs
  const auto want = c.library<float>(0, false, false, 0.3f);
  expect_array(out + "/o.npy", {kS, kHq, kDv}, DType::F32, want.o, 0.0);
  expect_array(out + "/lse.npy", {kS, kHq}, DType::F32, want.lse, 0.0);
  EXPECT_FALSE(fs::exists(out + "/dq.npy"));
  EXPECT_FALSE(fs::exists(out + "/dsink.npy"));
}

TEST(AttentionCli, ShapeErrorNamesTheArrayAndWritesNothing) {
  Dir dir;
  const Case c(13);
  c.write(dir, DType::F64);
  // k with D = 3 instead of 4
  std::vector<double> bad(kS * kHkv * 3, 0.5);
  write_file(dir / "k.npy", npy_bytes({kS, kHkv, 3}, bad.data(), DType::F64));
  const std::string out = dir / "out";
  const CliRun r = run_cli(dir, c.inputs(dir) + " --dout " + (dir / "dout.npy") + " --out " + out);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.log.find("k: expected shape [9, 1, 4]"), std::string::npos) << r.log;
  EXPECT_FALSE(fs::exists(out));

  // dout with the wrong number of heads
  c.write(dir, DType::F64);
  std::vector<double> bad_do(kS * 3 * kDv, 0.5);
  write_file(dir / "dout.npy", npy_bytes({kS, 3, kDv}, bad_do.data(), DType::F64));
  const CliRun r2 = run_cli(dir, c.inputs(dir) + " --dout " + (dir / "dout.npy") + " --out " + out);
  EXPECT_NE(r2.status, 0);
  EXPECT_NE(r2.log.find("dout: expected shape [9, 2, 3]"), std::string::npos) << r2.log;
  EXPECT_FALSE(fs::exists(out));

  // q with a row count that is not the tree's
  std::vector<double> short_q(8 * kHq * kD, 0.5);
  write_file(dir / "q.npy", npy_bytes({8, kHq, kD}, short_q.data(), DType::F64));
  const CliRun r3 = run_cli(dir, c.inputs(dir) + " --out " + out);
  EXPECT_NE(r3.status, 0);
  EXPECT_NE(r3.log.find("q: expected shape [S, Hq, D] with S = 9"), std::string::npos) << r3.log;
  EXPECT_FALSE(fs::exists(out));
}

TEST(AttentionCli, MixedDtypesAreRefused) {
  Dir dir;
  const Case c(14);
  c.write(dir, DType::F64);
  write_file(dir / "v.npy", npy_bytes({kS, kHkv, kDv}, c.v.data(), DType::F32));
  const std::string out = dir / "out";
  const CliRun r = run_cli(dir, c.inputs(dir) + " --out " + out);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.log.find("v is float32 but q is float64"), std::string::npos) << r.log;
  EXPECT_FALSE(fs::exists(out));
}

TEST(AttentionCli, GqaAndNonFiniteInputs) {
  Dir dir;
  const Case c(15);
  c.write(dir, DType::F64);
  // Hq = 2 is not a multiple of Hkv = 3
  std::vector<double> k3(kS * 3 * kD, 0.5), v3(kS * 3 * kDv, 0.5);
  write_file(dir / "k.npy", npy_bytes({kS, 3, kD}, k3.data(), DType::F64));
  write_file(dir / "v.npy", npy_bytes({kS, 3, kDv}, v3.data(), DType::F64));
  const std::string out = dir / "out";
  const CliRun r = run_cli(dir, c.inputs(dir) + " --out " + out);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.log.find("multiple"), std::string::npos) << r.log;
  EXPECT_FALSE(fs::exists(out));

  c.write(dir, DType::F64);
  std::vector<double> q = c.q;
  q[5] = std::nan("");
  write_file(dir / "q.npy", npy_bytes({kS, kHq, kD}, q.data(), DType::F64));
  const CliRun r2 = run_cli(dir, c.inputs(dir) + " --out " + out);
  EXPECT_NE(r2.status, 0);
  EXPECT_NE(r2.log.find("q: element 5"), std::string::npos) << r2.log;
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace treecp
