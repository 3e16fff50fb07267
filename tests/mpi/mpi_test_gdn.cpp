// GDN/KDA context parallelism under mpirun with 1-6 ranks: every rank's outputs and gradients equal
// the one-process tree reference on random trees (deep ones, short shards, ranks owning nothing,
// chained and local segments in every combination, packed documents in the contiguous, zigzag and
// doc-zigzag layouts, GDN and KDA gates), in double and float; the
// summary scan gives the same states whatever the rank count.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

#include "comm/mpi_communicator.hpp"
#include "common/gdn.hpp"
#include "common/mpi_main.hpp"
#include "runtime/conv_cp.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/gdn_cp.hpp"
#include "plan/gdn_plan.hpp"

namespace treecp {
namespace {

using testing::GdnData;
using testing::max_abs;
using testing::max_error;

struct Case {
  uint64_t seed;
  int max_segments;
  int64_t min_len, max_len;
  int depth;
  int chain_mode;  // 0 none, 1 all, 2 random, 3 planner; 4, 5, 6: the contiguous, zigzag, doc-zigzag layouts
};

const GdnLayout kLayoutModes[] = {GdnLayout::Contiguous, GdnLayout::Zigzag, GdnLayout::DocZigzag};

std::vector<uint8_t> chained_set(const Row& row, int mode, testing::Rng& rng, int ranks) {
  const size_t n = static_cast<size_t>(row.num_segments());
  std::vector<uint8_t> c(n, 0);
  if (mode == 3) {
    // A shape whose summaries are cheap next to the tokens: the planner chains the long segments.
    const GdnShape shape;  // DESIGN.md's GDN shape
    GdnCostModel m;
    m.link.latency_ms = 0.0;
    return plan_gdn(row, ranks, shape, m).chained;
  }
  for (size_t s = 0; s < n; ++s) c[s] = mode == 1 ? 1 : mode == 2 ? static_cast<uint8_t>(rng() % 2) : 0;
  return c;
}

template <class T>
void check_case(MpiCommunicator& comm, const Case& cs, GdnGate gate) {
  // Every rank draws the same row and inputs: the run's seed is agreed on (common/mpi_main.hpp).
  testing::Rng rng = testing::test_rng(cs.seed);
  const Row row = testing::random_tree(
      rng, {.segments = cs.max_segments, .min_len = cs.min_len, .max_len = cs.max_len, .max_depth = cs.depth});
  const GdnData d = testing::random_gdn_data(row.tokens(), 2, 4, 3, gate, rng);
  const double scale = 0.75;
  const auto ref = testing::gdn_tree_reference(row, d, scale);
  const GdnPlan plan = cs.chain_mode >= 4
                           ? gdn_layout_plan(row, comm.size(), kLayoutModes[cs.chain_mode - 4])
                           : make_gdn_plan(row, comm.size(), chained_set(row, cs.chain_mode, rng, comm.size()));
  validate_gdn_plan(row, plan);
  const auto ranges = gdn_rank_ranges(row, plan, comm.rank());
  const int64_t tokens = tokens_of(ranges);
  // Chunks of 5 cross every boundary; the default 64 runs on the longer rows.
  const int chunk = cs.max_len >= 80 ? 64 : 5;
  const GdnShape shape = d.shape(scale, chunk);
  const testing::GdnRun<T> got = testing::run_gdn_cp(comm, row, plan, shape, testing::gdn_buffers<T>(d, ranges));
  // double: rounding only. float: within a small multiple of the error that the same kernels make in
  // float in one process (all segments local), measured per array against the double reference.
  const bool is_double = sizeof(T) == 8;
  testing::GdnReference fref;
  if (!is_double) {
    auto self = make_self_communicator();
    const GdnPlan one = make_gdn_plan(row, 1, std::vector<uint8_t>(static_cast<size_t>(row.num_segments()), 0));
    const auto f = testing::run_gdn_cp(*self, row, one, shape, testing::gdn_buffers<float>(d, {{0, row.tokens()}}));
    auto widen = [](const std::vector<float>& x) { return std::vector<double>(x.begin(), x.end()); };
    fref = {widen(f.y), widen(f.dq), widen(f.dk), widen(f.dv), widen(f.dg), widen(f.dbeta)};
  }
  auto expect_close = [&](const std::vector<T>& got, const std::vector<double>& want, int64_t width, const char* name) {
    const std::vector<double> mine = rows_of<double>(want, width, ranges);
    const std::string what = std::string(name) + " rank " + std::to_string(comm.rank()) + "/" +
                             std::to_string(comm.size()) + " case " + std::to_string(cs.seed) + " mode " +
                             std::to_string(cs.chain_mode) + " chained " + std::to_string(plan.chained_segments()) +
                             " tokens " + std::to_string(tokens);
    if (is_double) {
      EXPECT_LE(max_error(got, mine), 1e-10 * (1 + max_abs(want))) << what;
      return;
    }
    const std::vector<double>* same = name == std::string("y") ? &fref.y : name == std::string("dq") ? &fref.dq
                                    : name == std::string("dk") ? &fref.dk : name == std::string("dv") ? &fref.dv
                                    : name == std::string("dg") ? &fref.dg : &fref.dbeta;
    EXPECT_TRUE(testing::within_reference(got, rows_of<double>(*same, width, ranges), mine, 4.0,
                                          1e-6 * (1 + max_abs(want))))
        << what;
  };
  expect_close(got.y, ref.y, d.H * d.dv, "y");
  expect_close(got.dq, ref.dq, d.H * d.dk, "dq");
  expect_close(got.dk, ref.dk, d.H * d.dk, "dk");
  expect_close(got.dv, ref.dv, d.H * d.dv, "dv");
  expect_close(got.dg, ref.dg, d.H * d.g_width(), "dg");
  expect_close(got.dbeta, ref.dbeta, d.H, "dbeta");
}

const Case kCases[] = {
    {1, 6, 1, 30, 3, 0},   {2, 6, 1, 30, 3, 1},   {3, 10, 1, 25, 4, 2},  {4, 10, 1, 25, 4, 2},
    {5, 12, 1, 6, 6, 1},   {6, 12, 1, 6, 6, 2},   // deep trees of very short segments (shards of 0-2 tokens)
    {7, 2, 1, 3, 2, 0},    {8, 1, 2, 2, 1, 1},    // tiny rows: most ranks own nothing
    {9, 8, 20, 120, 3, 3}, {10, 14, 1, 80, 5, 3},
    // Packed documents (depth 1) in the three layouts (chains visiting ranks out of order), short and
    // long ones; a tree in doc-zigzag.
    {11, 8, 1, 30, 1, 4},  {12, 8, 1, 30, 1, 5},  {13, 8, 1, 30, 1, 6},  {14, 3, 40, 90, 1, 5},
    {15, 10, 1, 25, 3, 6},
};

TEST(MpiGdn, DoubleEqualsReferenceGdn) {
  MpiCommunicator comm;
  for (const Case& c : kCases) check_case<double>(comm, c, GdnGate::Scalar);
}

TEST(MpiGdn, DoubleEqualsReferenceKda) {
  MpiCommunicator comm;
  for (const Case& c : kCases) check_case<double>(comm, c, GdnGate::PerChannel);
}

TEST(MpiGdn, FloatWithinTolerance) {
  MpiCommunicator comm;
  for (int i : {2, 3, 9}) {
    check_case<float>(comm, kCases[i], GdnGate::Scalar);
    check_case<float>(comm, kCases[i], GdnGate::PerChannel);
  }
}

// The exclusive scan of one chain's shard summaries gives every rank the summary of exactly the
// tokens before its cut, as computed in one process, whatever the number of ranks.
TEST(MpiGdn, ScanIndependentOfRankCount) {
  MpiCommunicator comm;
  const int N = comm.size(), me = comm.rank();
  const int64_t S = 97;
  testing::Rng rng = testing::test_rng(5);
  const GdnData d = testing::random_gdn_data(S, 2, 4, 3, GdnGate::PerChannel, rng);
  const auto buf = testing::gdn_buffers<double>(d, {{0, S}});
  const GdnShape shape = d.shape(1.0, 8);
  CpuBackend<double> be;
  const GdnInputs<std::vector<double>> in{&buf.q, &buf.k, &buf.v, &buf.g, &buf.beta};
  for (int dir : {+1, -1}) {
    // Rank r's shard is [cut(r), cut(r+1)) in scan order; rank 0 of the scan order may hold nothing.
    auto cut = [&](int pos) { return pos == 0 ? 0 : S * pos / N; };
    const int pos = dir > 0 ? me : N - 1 - me;
    const AffineShape af = shape.affine();
    std::vector<double> own = be.alloc(af.map_elements()), excl;
    be.gdn_summary(shape, in, cut(pos), cut(pos + 1) - cut(pos), own, 0);
    const bool have = affine_exclusive_scan(comm, be, af, dir, 1, own, excl);
    EXPECT_EQ(have, pos > 0);
    if (!have) continue;
    std::vector<double> want = be.alloc(af.map_elements());
    be.gdn_summary(shape, in, 0, cut(pos), want, 0);
    EXPECT_LT(max_error(excl, want), 1e-12) << "rank " << me << " of " << N << " direction " << dir;
  }
}

// Conv1d halos across ranks: shards shorter than K (the halo spans several ranks), forks whose
// parent lives elsewhere, ranks that own nothing, and the GDN plan's non-contiguous layouts.
TEST(MpiConv1d, EqualsExplicitPaths) {
  MpiCommunicator comm;
  const int N = comm.size(), me = comm.rank();
  testing::Rng rng = testing::test_rng(1);
  for (int tree = 1; tree <= 5; ++tree) {
    const Row row = testing::random_tree(rng, {.segments = 3 + tree * 2, .max_len = tree % 2 ? 3 : 12});
    for (int K : {2, 4, 7}) {
      for (int lay = 0; lay < 2; ++lay) {
        Ownership layout = contiguous_ownership(row.tokens(), N);
        if (lay == 1) {
          std::vector<uint8_t> chained(static_cast<size_t>(row.num_segments()));
          for (size_t s = 0; s < chained.size(); ++s) chained[s] = static_cast<uint8_t>((s + tree) % 2);
          layout = gdn_ownership(row, make_gdn_plan(row, N, chained));
        }
        const int C = 3;
        const bool silu = (tree + K) % 2 == 0;
        const std::vector<double> x = testing::randn(static_cast<size_t>(row.tokens() * C), rng),
                                  w = testing::randn(static_cast<size_t>(C * K), rng), b = testing::randn(C, rng),
                                  dy = testing::randn(x.size(), rng);
        const auto ref = testing::conv_tree_reference(row, x, w, b, C, K, silu, dy);
        const auto& mine = layout[static_cast<size_t>(me)];
        const auto xl = rows_of<double>(x, C, mine), dyl = rows_of<double>(dy, C, mine);
        std::vector<double> y(xl.size()), dx(xl.size()), dw(w.size()), db(b.size());
        CpuBackend<double> be;
        ConvCP<CpuBackend<double>> conv(layout, row, ConvShape{C, K, silu}, comm, be);
        conv.forward(xl, w, &b, y);
        conv.backward(dyl, dx, dw, &db);
        EXPECT_LT(max_error(y, rows_of<double>(ref.y, C, mine)), 1e-12) << "tree " << tree << " K " << K << " layout " << lay;
        EXPECT_LT(max_error(dx, rows_of<double>(ref.dx, C, mine)), 1e-12) << "tree " << tree << " K " << K;
        EXPECT_LT(max_error(dw, ref.dw), 1e-11);
        EXPECT_LT(max_error(db, ref.db), 1e-11);
      }
    }
  }
}

}  // namespace
}  // namespace treecp

// Runs the suite on every rank; the exit status is failure on every rank if any rank failed.
int main(int argc, char** argv) {
  return treecp::testing::run_on_all_ranks(argc, argv, [] { return RUN_ALL_TESTS(); });
}
