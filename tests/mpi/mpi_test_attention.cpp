// Dense attention CP on MPI ranks equals the single-process result: random trees (deep, ragged,
// single-token segments, one giant family, many tiny families), windows, sinks, GQA, every layout,
// float and double. Run by CTest under mpirun with 1 to 6 ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "comm/mpi_communicator.hpp"
#include "common/common.hpp"
#include "common/mpi_main.hpp"
#include "core/error.hpp"
#include "kernels/cpu/attention.hpp"
#include "runtime/reference.hpp"
#include "plan/cost.hpp"
#include "plan/planner.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/dense_attention.hpp"
#include "runtime/redistribute.hpp"
#include "tree/row.hpp"

namespace treecp {
namespace {

MpiCommunicator* g_comm = nullptr;

enum class Shape { Ragged, Deep, SingleTokens, GiantFamily, TinyFamilies };

Row make_tree(Shape shape, testing::Rng& rng) {
  auto n = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  switch (shape) {
    case Shape::Ragged:
      return testing::random_tree(rng, {.segments = n(3, 14), .max_len = 40, .max_depth = 14});
    case Shape::Deep:
      return testing::random_tree(
          rng, {.segments = 12, .min_len = 2, .max_len = 20, .max_depth = 12, .min_children = 1, .max_children = 2});
    case Shape::SingleTokens:
      return testing::random_tree(rng, {.segments = 15, .min_len = 1, .max_len = 1, .max_depth = 12, .max_children = 2});
    case Shape::GiantFamily:
      return testing::random_tree(rng, {.segments = n(11, 21), .max_len = 12, .max_depth = 2, .min_children = 20,
                                        .max_children = 20, .root_min_len = 60, .root_max_len = 120});
    case Shape::TinyFamilies:
      return testing::random_tree(rng, {.segments = n(15, 50), .max_len = 4, .max_depth = 2, .root_min_len = 1,
                                        .root_max_len = 6});
  }
  return Row();
}

// Uniform in [-1, 1), in the run's precision.
template <class T>
std::vector<T> random_array(testing::Rng& rng, int64_t n) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> out(static_cast<size_t>(n));
  for (T& x : out) x = static_cast<T>(u(rng));
  return out;
}

template <class T>
std::vector<double> widen(const std::vector<T>& x) {
  return std::vector<double>(x.begin(), x.end());
}

struct Case {
  Shape tree;
  AttentionShape shape;
  bool sink;
  Layout layout;
};

// double: within 1e-10 of the single-process double run, relative to the array's largest entry.
// float: within 4x what the single-process float run differs from the double run on the same
// (float-rounded) inputs, plus 1e-6 of the largest entry (STYLE.md).
template <class T>
void run_case(const Case& c, uint64_t salt) {
  Communicator& comm = *g_comm;
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(salt);
  const Row row = make_tree(c.tree, rng);
  const int64_t S = row.tokens();
  const AttentionShape& shape = c.shape;
  const int64_t qw = shape.q_width(), kw = shape.k_width(), vw = shape.v_width(), ow = shape.o_width();
  const auto q = random_array<T>(rng, S * qw), k = random_array<T>(rng, S * kw), v = random_array<T>(rng, S * vw),
             dy = random_array<T>(rng, S * ow);
  std::vector<T> sink = random_array<T>(rng, shape.hq);
  for (T& s : sink) s *= 3;  // logits of the order of the scores

  AttentionInputs<T> prob;
  prob.q = q.data(), prob.k = k.data(), prob.v = v.data(), prob.dout = dy.data();
  prob.sink = c.sink ? sink.data() : nullptr;
  const AttentionResult<T> ref = attention_reference(row, shape, prob);
  const AttentionResult<double> exact = attention_reference_double(row, shape, prob);

  PlanOptions opt;
  opt.layout = c.layout;
  opt.chunk_tokens = std::max<int64_t>(1, S / 23);  // many chunks: fragmented ownership, several waves
  const Plan plan = make_plan(row, comm.size(), shape, CostModel{}, opt);
  CpuBackend<T> be;
  DenseAttentionCP<CpuBackend<T>> cp(plan, row, shape, comm, be);
  const auto& owned = plan.ranks[static_cast<size_t>(comm.rank())].owned;

  // q arrives in the data loader's contiguous shards and is redistributed to the plan's ownership;
  // k, v, dy are taken directly (both paths must agree with the reference).
  const Ownership to = plan_ownership(plan), from = contiguous_ownership(S, comm.size());
  const std::vector<T> q_own = redistribute(comm, be, rows_of<T>(q, qw, from[static_cast<size_t>(comm.rank())]), from, to, qw);
  const std::vector<T> k_own = rows_of<T>(k, kw, owned), v_own = rows_of<T>(v, vw, owned), dy_own = rows_of<T>(dy, ow, owned);
  const int64_t rows = cp.owned_rows();
  std::vector<T> y(static_cast<size_t>(rows * ow)), lse(static_cast<size_t>(rows * shape.hq));
  std::vector<T> dq(static_cast<size_t>(rows * qw)), dk(static_cast<size_t>(rows * kw)), dv(static_cast<size_t>(rows * vw));
  std::vector<T> dsink(static_cast<size_t>(shape.hq), T(0));
  cp.forward(q_own, k_own, v_own, c.sink ? &sink : nullptr, y, lse);
  cp.backward(dy_own, dq, dk, dv, c.sink ? &dsink : nullptr);
  comm.all_reduce_sum(dsink.data(), shape.hq, CpuBackend<T>::comm_type);  // a replicated weight: the caller reduces

  const std::string what = std::string(layout_name(c.layout)) + " window " + std::to_string(shape.window) + (c.sink ? " sink" : "") + " rank " +
                           std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + " case " +
                           std::to_string(salt);
  auto check = [&](const char* name, const std::vector<T>& got, const std::vector<T>& same,
                   const std::vector<double>& full, const std::vector<TokenRange>& ranges, int64_t width) {
    const std::vector<double> want = rows_of<double>(full, width, ranges);
    const double scale = std::max(1e-30, testing::max_abs(full));
    if constexpr (sizeof(T) == 8) {
      EXPECT_LE(testing::max_error(got, want), 1e-10 * scale) << name << " " << what;
    } else {
      EXPECT_TRUE(testing::within_reference(got, rows_of<double>(widen(same), width, ranges), want, 4.0, 1e-6 * scale))
          << name << " " << what;
    }
  };
  check("O", y, ref.o, exact.o, owned, ow);
  check("LSE", lse, ref.lse, exact.lse, owned, shape.hq);
  check("dQ", dq, ref.dq, exact.dq, owned, qw);
  check("dK", dk, ref.dk, exact.dk, owned, kw);
  check("dV", dv, ref.dv, exact.dv, owned, vw);
  if (c.sink) check("dsink", dsink, ref.dsink, exact.dsink, {{0, 1}}, shape.hq);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  const Shape shapes[] = {Shape::Ragged, Shape::Deep, Shape::SingleTokens, Shape::GiantFamily, Shape::TinyFamilies};
  int i = 0;
  for (Layout layout : kLayouts) {
    for (Shape s : shapes) {
      const bool gqa = i % 2 == 0;
      const AttentionShape shape{gqa ? 4 : 2, 2, 8, gqa ? 8 : 6, (i % 3 == 0) ? int64_t{0} : int64_t{3 + i % 11}};
      out.push_back({s, shape, i % 4 != 1, layout});
      ++i;
    }
  }
  return out;
}

TEST(DenseAttentionCP, DoubleEqualsSingleProcess) {
  uint64_t salt = 100;
  for (const Case& c : cases()) run_case<double>(c, salt++);
}

TEST(DenseAttentionCP, FloatEqualsSingleProcess) {
  uint64_t salt = 500;
  for (const Case& c : cases()) {
    if (salt % 2 == 0) run_case<float>(c, salt);
    ++salt;
  }
}

TEST(DenseAttentionCP, RankWithNoTokensTakesPart) {
  // 3 tokens over up to 4 ranks: some ranks own nothing and still enter every collective.
  Communicator& comm = *g_comm;
  const Row row({{-1, 2}, {0, 1}});
  PlanOptions opt;
  opt.layout = Layout::Contiguous;
  opt.chunk_tokens = 1;
  const AttentionShape shape{2, 1, 4, 4};
  const Plan plan = make_plan(row, comm.size(), shape, CostModel{}, opt);
  CpuBackend<double> be;
  DenseAttentionCP<CpuBackend<double>> cp(plan, row, shape, comm, be);
  testing::Rng rng = testing::test_rng(1);
  const auto q = random_array<double>(rng, 3 * 8), k = random_array<double>(rng, 3 * 4),
             v = random_array<double>(rng, 3 * 4), dy = random_array<double>(rng, 3 * 8);
  AttentionInputs<double> prob;
  prob.q = q.data(), prob.k = k.data(), prob.v = v.data(), prob.dout = dy.data();
  const auto ref = attention_reference(row, shape, prob);
  const auto& owned = plan.ranks[static_cast<size_t>(comm.rank())].owned;
  std::vector<double> y(static_cast<size_t>(cp.owned_rows() * 8)), lse(static_cast<size_t>(cp.owned_rows() * 2)),
      dq(y.size()), dk(static_cast<size_t>(cp.owned_rows() * 4)), dv(dk.size());
  // the inputs must outlive backward()
  const auto q_own = rows_of<double>(q, 8, owned), k_own = rows_of<double>(k, 4, owned), v_own = rows_of<double>(v, 4, owned);
  cp.forward(q_own, k_own, v_own, nullptr, y, lse);
  cp.backward(rows_of<double>(dy, 8, owned), dq, dk, dv, nullptr);
  EXPECT_LE(testing::max_error(y, rows_of<double>(ref.o, 8, owned)), 1e-12);
  EXPECT_LE(testing::max_error(dk, rows_of<double>(ref.dk, 4, owned)), 1e-12);
  EXPECT_LE(testing::max_error(dv, rows_of<double>(ref.dv, 4, owned)), 1e-12);
}

TEST(DenseAttentionCP, MismatchedPlanRefusedOnEveryRank) {
  Communicator& comm = *g_comm;
  const Row row({{-1, 40}, {0, 20}, {0, 30}});
  PlanOptions opt;
  opt.layout = Layout::Zigzag;
  opt.chunk_tokens = 5;
  CpuBackend<double> be;
  const AttentionShape shape{2, 1, 4, 4};
  // wrong rank count
  const Plan other = make_plan(row, comm.size() + 1, shape, CostModel{}, opt);
  try {
    DenseAttentionCP<CpuBackend<double>> cp(other, row, shape, comm, be);
    ADD_FAILURE() << "a plan for another rank count was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("plan"), std::string::npos) << e.what();
  }
  // a plan for another row
  const Plan plan = make_plan(row, comm.size(), shape, CostModel{}, opt);
  const Row longer({{-1, 40}, {0, 20}, {0, 31}});
  EXPECT_THROW((DenseAttentionCP<CpuBackend<double>>(plan, longer, shape, comm, be)), Error);
  // a plan for another window: the layer's window is the shape's, the plan's visibility must match it
  AttentionShape windowed = shape;
  windowed.window = 7;
  try {
    DenseAttentionCP<CpuBackend<double>> cp(plan, row, windowed, comm, be);
    ADD_FAILURE() << "a plan without a window was accepted for a layer with one";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("window"), std::string::npos) << e.what();
  }
  // corrupted on rank 0 only: every rank refuses, none hangs
  Plan broken = plan;
  if (comm.rank() == 0) {
    for (auto& st : broken.ranks[0].stages) {
      if (!st.slices.empty()) {
        st.slices.pop_back();
        break;
      }
    }
  }
  EXPECT_THROW((DenseAttentionCP<CpuBackend<double>>(broken, row, shape, comm, be)), Error);
}

}  // namespace
}  // namespace treecp

int main(int argc, char** argv) {
  return treecp::testing::run_on_all_ranks(argc, argv, [] {
    treecp::MpiCommunicator comm;
    treecp::g_comm = &comm;
    return RUN_ALL_TESTS();
  });
}
