// Mamba-2 context parallelism under mpirun with 1-6 ranks: both strategies (head transpose, state
// summaries) and the planner's choice give every rank's outputs and gradients of the one-process
// double reference, in double and float, on random trees with token owners from the dense attention
// planner (ranks that own nothing, heads fewer than ranks, B/C groups split over head shards, chained
// and local segments); the bytes each strategy moves are the planner's count; and three deliberate
// bugs are caught.
#include <gtest/gtest.h>
#include <mpi.h>

#include <random>
#include <string>

#include "comm/counting_communicator.hpp"
#include "comm/mpi_communicator.hpp"
#include "common/mpi_main.hpp"
#include "plan/planner.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/mamba2_cp.hpp"
#include "common/mamba2.hpp"

namespace treecp {
namespace {

using testing::Mamba2Data;
using testing::Mamba2Result;

struct Case {
  uint64_t seed;
  int max_segments;
  int64_t min_len, max_len;
  int depth;
  int H, G;
  Layout layout;  // the dense attention planner's
};

const Case kCases[] = {
    {1, 6, 1, 30, 3, 4, 2, Layout::Contiguous}, {2, 8, 1, 25, 4, 8, 2, Layout::Zigzag},   {3, 10, 1, 20, 4, 6, 3, Layout::Searched},
    {4, 12, 1, 6, 6, 2, 1, Layout::Contiguous}, {5, 9, 20, 60, 3, 8, 4, Layout::Family},  // deep trees of short segments
    {6, 2, 1, 3, 2, 5, 1, Layout::Contiguous},  {7, 1, 2, 2, 1, 2, 2, Layout::Zigzag},    // tiny rows: most ranks own nothing
};

// The token owners of a dense attention plan for DESIGN.md's benchmark layer.
Ownership owners(const Row& row, int ranks, Layout layout) {
  PlanOptions o;
  o.layout = layout;
  return plan_ownership(make_plan(row, ranks, AttentionShape{}, CostModel{}, o));
}

// The strategies each case runs: the transpose, the planner's summary plan, summary plans with
// every segment chained and with a random chained set (evenly cut and aligned with the token
// owners), and the planner's own choice.
std::vector<Mamba2Plan> plans_for(const Row& row, const Ownership& tokens, const Mamba2Shape& shape, uint64_t seed) {
  const GdnCostModel m = mamba2_cost_defaults();
  std::vector<Mamba2Plan> out;
  out.push_back(plan_mamba2(row, tokens, shape, m, Mamba2Strategy::Transpose));
  out.push_back(plan_mamba2(row, tokens, shape, m, Mamba2Strategy::Summary));
  std::mt19937_64 rng(seed);
  for (int mode : {1, 2}) {
    Mamba2Plan p = out.back();
    std::vector<uint8_t> chained(static_cast<size_t>(row.num_segments()));
    for (auto& c : chained) c = mode == 1 ? 1 : static_cast<uint8_t>(rng() % 2);
    for (bool aligned : {false, true}) {
      p.chains = aligned ? mamba2_owner_aligned_plan(row, tokens, chained) : make_gdn_plan(row, p.ranks, chained);
      p.summary_price = price_mamba2_summary(row, tokens, p.chains, shape, m);
      out.push_back(p);
    }
  }
  out.push_back(plan_mamba2(row, tokens, shape, m));
  return out;
}

// Runs the plan on this rank; returns its rows (and dA, dD summed over the ranks) and the bytes
// every rank sent, summed.
template <class T>
Mamba2Result run_cp(MpiCommunicator& world, const Row& row, const Mamba2Plan& plan, const Mamba2Shape& shape,
                    const Mamba2Data& d, int64_t* bytes, Mamba2Fault fault = Mamba2Fault::None) {
  CountingCommunicator comm(world);
  const auto& mine = plan.tokens[static_cast<size_t>(world.rank())];
  const auto b = testing::mamba2_buffers<T>(d, mine);
  Mamba2CP<T> cp(plan, row, shape, comm, fault);
  std::vector<T> y(b.x.size()), dx(b.x.size()), ddt(b.dt.size()), dB(b.B.size()), dC(b.C.size()), dA(d.A.size()),
      dD(static_cast<size_t>(d.H));
  cp.forward(
      Mamba2Inputs<T>{b.x.data(), b.dt.data(), b.B.data(), b.C.data(), b.A.data(), d.with_d ? b.D.data() : nullptr},
      y.data());
  cp.backward(b.dy.data(), Mamba2Grads<T>{dx.data(), ddt.data(), dA.data(), dB.data(), dC.data(), dD.data()});
  world.all_reduce_sum(dA.data(), d.H, CpuBackend<T>::comm_type);
  world.all_reduce_sum(dD.data(), d.H, CpuBackend<T>::comm_type);
  int64_t sent = comm.bytes_sent();
  world.all_reduce_sum(&sent, 1, CommType::I64);
  *bytes = sent;
  using testing::widen;
  return {widen(y), widen(dx), widen(ddt), widen(dA), widen(dB), widen(dC), widen(dD)};
}

// Largest error of this rank's rows (and of dA, dD) against a full-row result, per field.
std::vector<double> errors(const Mamba2Result& got, const Mamba2Result& want, const Mamba2Data& d,
                           const std::vector<TokenRange>& mine) {
  return {testing::max_error(got.y, rows_of<double>(want.y, d.H * d.P, mine)),
          testing::max_error(got.dx, rows_of<double>(want.dx, d.H * d.P, mine)),
          testing::max_error(got.ddt, rows_of<double>(want.ddt, d.H, mine)),
          testing::max_abs_diff(got.dA, want.dA),
          testing::max_error(got.dB, rows_of<double>(want.dB, d.G * d.N, mine)),
          testing::max_error(got.dC, rows_of<double>(want.dC, d.G * d.N, mine)),
          testing::max_abs_diff(got.dD, want.dD)};
}

std::vector<double> magnitudes(const Mamba2Result& r) {
  return {testing::max_abs(r.y), testing::max_abs(r.dx), testing::max_abs(r.ddt), testing::max_abs(r.dA),
          testing::max_abs(r.dB), testing::max_abs(r.dC), testing::max_abs(r.dD)};
}

const char* kFields[] = {"y", "dx", "ddt", "dA", "dB", "dC", "dD"};

std::string describe(const MpiCommunicator& comm, const Case& c, const Mamba2Plan& p) {
  return "rank " + std::to_string(comm.rank()) + "/" + std::to_string(comm.size()) + " seed " + std::to_string(c.seed) +
         " H " + std::to_string(c.H) + " " + layout_name(c.layout) + " " + strategy_name(p.strategy) + " chained " +
         std::to_string(p.chains.chained_segments());
}

// Every plan of plans_for on one case: this rank's rows of the double reference (double: to
// rounding; float: within 4x the float recurrence's own error), and the bytes on the wire equal
// to the plan's count.
template <class T>
void check_case(MpiCommunicator& comm, const Case& c, bool with_d, uint64_t data_seed) {
  const Row row = testing::random_tree(testing::test_rng(c.seed), {.segments = c.max_segments, .min_len = c.min_len, .max_len = c.max_len, .max_depth = c.depth});
  const Mamba2Data d = testing::random_mamba2_data(row.tokens(), c.H, 3, c.G, 4, with_d, data_seed);
  const Mamba2Result ref = testing::mamba2_tree_reference(row, d);
  const bool is_double = sizeof(T) == 8;
  const auto same = is_double ? std::vector<double>(7, 0.0)
                              : errors(testing::mamba2_tree_reference<float>(row, d), ref, d, {{0, row.tokens()}});
  const auto mag = magnitudes(ref);
  const Mamba2Shape shape{c.H, d.P, c.G, d.N, static_cast<int>(sizeof(T)), c.max_len >= 40 ? 16 : 4};
  const Ownership tokens = owners(row, comm.size(), c.layout);
  for (const Mamba2Plan& plan : plans_for(row, tokens, shape, c.seed)) {
    int64_t bytes = 0;
    const Mamba2Result r = run_cp<T>(comm, row, plan, shape, d, &bytes);
    const auto err = errors(r, ref, d, tokens[static_cast<size_t>(comm.rank())]);
    for (size_t i = 0; i < err.size(); ++i) {
      const double bound = is_double ? 1e-10 * (1 + mag[i]) : 4 * same[i] + 1e-6 * (1 + mag[i]);
      EXPECT_LE(err[i], bound) << kFields[i] << " " << describe(comm, c, plan);
    }
    EXPECT_EQ(bytes, plan.price().bytes) << "bytes moved vs planned, " << describe(comm, c, plan);
  }
}

TEST(MpiMamba2, DoubleEqualsReferenceEveryStrategy) {
  MpiCommunicator comm;
  for (const Case& c : kCases) check_case<double>(comm, c, c.seed % 2 == 1, c.seed + 40);
}

TEST(MpiMamba2, FloatWithinTheFloatReferenceError) {
  MpiCommunicator comm;
  for (int i : {1, 2, 4}) check_case<float>(comm, kCases[i], true, kCases[i].seed + 41);
}

// Each deliberate bug, where the configuration exposes it (at one rank none can show), makes some
// rank's comparison against the reference fail; without it the same run passes.
TEST(MpiMamba2, DeliberateBugsAreCaught) {
  MpiCommunicator comm;
  const int n = comm.size();
  // Eight heads in two groups: at 3 ranks the middle shard (heads 2-4) starts inside group 0 and
  // reaches into group 1, and group 0 is read by two shards.
  const Row row(std::vector<Segment>{{-1, 10}, {0, 30}, {1, 5}, {0, 7}});
  const Mamba2Data d = testing::random_mamba2_data(row.tokens(), 8, 3, 2, 4, true, 7);
  const Mamba2Result ref = testing::mamba2_tree_reference(row, d);
  const Mamba2Shape shape{8, 3, 2, 4, 8, 8};
  const Ownership tokens = owners(row, n, Layout::Contiguous);
  const auto cuts = mamba2_head_cuts(8, n);
  bool misread = false, shared_group = false;
  for (int r = 0; r < n; ++r) {
    const int h0 = cuts[r], h1 = cuts[r + 1];
    for (int h = h0; h < h1; ++h) misread = misread || (h / 4 - h0 / 4 != (h - h0) / 4);
    if (h0 > 0 && h0 < h1 && (h0 - 1) / 4 == h0 / 4) shared_group = true;
  }
  Mamba2Plan transpose = plan_mamba2(row, tokens, shape, mamba2_cost_defaults(), Mamba2Strategy::Transpose);
  Mamba2Plan summary = plan_mamba2(row, tokens, shape, mamba2_cost_defaults(), Mamba2Strategy::Summary);
  summary.chains = make_gdn_plan(row, n, {0, 1, 0, 0});  // the 30-token child split over every rank
  summary.summary_price = price_mamba2_summary(row, tokens, summary.chains, shape, mamba2_cost_defaults());
  struct Bug {
    Mamba2Fault fault;
    const Mamba2Plan* plan;
    bool exposed;
  };
  const Bug bugs[] = {{Mamba2Fault::ShardReadsGroupZero, &transpose, misread},
                      {Mamba2Fault::GroupGradientsAssigned, &transpose, shared_group},
                      {Mamba2Fault::SummaryWithoutDecay, &summary, n > 1}};
  for (const Bug& bug : bugs) {
    for (Mamba2Fault f : {Mamba2Fault::None, bug.fault}) {
      int64_t bytes = 0;
      const Mamba2Result r = run_cp<double>(comm, row, *bug.plan, shape, d, &bytes, f);
      const auto err = errors(r, ref, d, tokens[static_cast<size_t>(comm.rank())]);
      const auto mag = magnitudes(ref);
      int64_t failed = 0;
      for (size_t i = 0; i < err.size(); ++i) failed += err[i] > 1e-10 * (1 + mag[i]);
      comm.all_reduce_sum(&failed, 1, CommType::I64);
      const bool expect_caught = f != Mamba2Fault::None && bug.exposed;
      EXPECT_EQ(failed > 0, expect_caught) << "fault " << static_cast<int>(f) << " at " << n << " ranks";
    }
  }
  if (n == 3) {
    EXPECT_TRUE(misread);
    EXPECT_TRUE(shared_group);
  }
}

}  // namespace
}  // namespace treecp

// Runs the suite on every rank; the exit status is failure on every rank if any rank failed.
int main(int argc, char** argv) {
  return treecp::testing::run_on_all_ranks(argc, argv, [] { return RUN_ALL_TESTS(); });
}
