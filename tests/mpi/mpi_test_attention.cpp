// Dense attention CP on MPI ranks equals the single-process result: random trees (deep, ragged,
// single-token segments, one giant family, many tiny families), windows, sinks, GQA, every layout,
// float and double. Run by CTest under mpirun with 1, 2, 3 and 4 ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "comm/mpi_communicator.hpp"
#include "mpi_gtest_main.hpp"
#include "core/error.hpp"
#include "core/random.hpp"
#include "kernels/cpu/attention.hpp"
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

std::vector<Segment> make_tree(Shape shape, std::mt19937_64& rng) {
  std::vector<Segment> segs;
  auto len = [&](int lo, int hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  switch (shape) {
    case Shape::Ragged: {
      std::vector<int32_t> path;
      const int n = static_cast<int>(len(3, 14));
      for (int i = 0; i < n; ++i) {
        const auto keep = static_cast<size_t>(len(0, static_cast<int>(path.size())));
        path.resize(keep);
        segs.push_back({path.empty() ? -1 : path.back(), len(1, 40)});
        path.push_back(i);
      }
      break;
    }
    case Shape::Deep: {
      int32_t parent = -1;
      for (int i = 0; i < 10; ++i) {
        segs.push_back({parent, len(2, 20)});
        parent = i;
      }
      segs.push_back({3, len(5, 15)});
      segs.push_back({11, len(1, 9)});
      break;
    }
    case Shape::SingleTokens: {
      segs.push_back({-1, 1});
      for (int i = 0; i < 12; ++i) segs.push_back({static_cast<int32_t>(len(0, static_cast<int>(segs.size()) - 1) == 0 ? 0 : segs.size() - 1), 1});
      segs.push_back({-1, 3});
      segs.push_back({static_cast<int32_t>(segs.size() - 1), 1});
      break;
    }
    case Shape::GiantFamily: {
      segs.push_back({-1, len(60, 120)});
      const int kids = static_cast<int>(len(10, 20));
      for (int i = 0; i < kids; ++i) segs.push_back({0, len(1, 12)});
      break;
    }
    case Shape::TinyFamilies: {
      const int fams = static_cast<int>(len(10, 25));
      for (int f = 0; f < fams; ++f) {
        const auto root = static_cast<int32_t>(segs.size());
        segs.push_back({-1, len(1, 6)});
        const int kids = static_cast<int>(len(0, 3));
        for (int i = 0; i < kids; ++i) segs.push_back({root, len(1, 4)});
      }
      break;
    }
  }
  // SingleTokens chains must stay in DFS preorder: attach to the previous segment or to the root only
  // when the previous one is the root's subtree tail; rebuild defensively through Row to be sure.
  try {
    Row check(segs);
  } catch (const Error&) {
    for (size_t i = 1; i < segs.size(); ++i) {
      if (segs[i].parent != -1) segs[i].parent = static_cast<int32_t>(i - 1);
    }
  }
  return segs;
}

template <class T>
std::vector<T> random_array(uint64_t seed, int64_t n) {
  std::vector<T> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = static_cast<T>(uniform_at(seed, static_cast<uint64_t>(i)));
  return out;
}

template <class T>
double max_rel_error(const std::vector<T>& got, const std::vector<T>& ref_full, const std::vector<TokenRange>& ranges,
                     int64_t width) {
  const std::vector<T> ref = rows_of<T>(ref_full, width, ranges);
  double scale = 1e-30, err = 0;
  for (T x : ref_full) scale = std::max(scale, std::abs(static_cast<double>(x)));
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = std::abs(static_cast<double>(got[i]) - static_cast<double>(ref[i]));
    err = std::max(err, std::isfinite(d) ? d : 1e300);
  }
  return err / scale;
}

struct Case {
  Shape shape;
  int hq, hkv, d, dv;
  int64_t window;
  bool sink;
  std::string layout;
};

template <class T>
void run_case(const Case& c, uint64_t seed, double tol) {
  Communicator& comm = *g_comm;
  std::mt19937_64 rng(seed);
  const Row row(make_tree(c.shape, rng));
  const int64_t S = row.tokens();
  const int64_t qw = int64_t{c.hq} * c.d, kw = int64_t{c.hkv} * c.d, vw = int64_t{c.hkv} * c.dv, ow = int64_t{c.hq} * c.dv;
  const auto q = random_array<T>(seed * 7 + 1, S * qw), k = random_array<T>(seed * 7 + 2, S * kw),
             v = random_array<T>(seed * 7 + 3, S * vw), dy = random_array<T>(seed * 7 + 4, S * ow);
  std::vector<T> sink = random_array<T>(seed * 7 + 5, c.hq);
  for (T& s : sink) s *= 3;  // logits of the order of the scores

  cpu::AttentionProblem<T> prob;
  prob.hq = c.hq, prob.hkv = c.hkv, prob.d = c.d, prob.dv = c.dv, prob.window = c.window;
  prob.q = q.data(), prob.k = k.data(), prob.v = v.data(), prob.dout = dy.data();
  prob.sink = c.sink ? sink.data() : nullptr;
  const cpu::AttentionResult<T> ref = cpu::attention_reference(row, prob);

  PlanOptions opt;
  opt.layout = c.layout;
  opt.window = c.window;
  opt.chunk_tokens = std::max<int64_t>(1, S / 23);  // many chunks: fragmented ownership, several waves
  const Plan plan = make_plan(row, comm.size(), CostModel{}, opt);
  AttentionDims shape{c.hq, c.hkv, c.d, c.dv, 0.0};
  CpuBackend<T> be;
  DenseAttentionCP<CpuBackend<T>> cp(plan, row, shape, comm, be);
  const auto& owned = plan.ranks[static_cast<size_t>(comm.rank())].owned;

  // q arrives in the data loader's contiguous shards and is redistributed to the plan's ownership;
  // k, v, dy are taken directly (both paths must agree with the reference).
  std::vector<std::vector<TokenRange>> to(static_cast<size_t>(comm.size()));
  for (int r = 0; r < comm.size(); ++r) to[static_cast<size_t>(r)] = plan.ranks[static_cast<size_t>(r)].owned;
  const auto from = contiguous_layout(S, comm.size());
  const std::vector<T> q_own = redistribute(comm, be, rows_of<T>(q, qw, from[static_cast<size_t>(comm.rank())]), from, to, qw);
  const std::vector<T> k_own = rows_of<T>(k, kw, owned), v_own = rows_of<T>(v, vw, owned), dy_own = rows_of<T>(dy, ow, owned);
  const int64_t rows = cp.owned_rows();
  std::vector<T> y(static_cast<size_t>(rows * ow)), lse(static_cast<size_t>(rows * c.hq));
  std::vector<T> dq(static_cast<size_t>(rows * qw)), dk(static_cast<size_t>(rows * kw)), dv(static_cast<size_t>(rows * vw));
  std::vector<T> dsink(static_cast<size_t>(c.hq), T(0));
  cp.forward(q_own, k_own, v_own, c.sink ? &sink : nullptr, y, lse);
  cp.backward(dy_own, dq, dk, dv, c.sink ? &dsink : nullptr);
  comm.all_reduce_sum(dsink.data(), c.hq, CpuBackend<T>::comm_type);  // a replicated weight: the caller reduces

  const std::string what = c.layout + " window " + std::to_string(c.window) + (c.sink ? " sink" : "") + " rank " +
                           std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + " seed " + std::to_string(seed);
  EXPECT_LE(max_rel_error(y, ref.o, owned, ow), tol) << "O " << what;
  std::vector<T> ref_lse = ref.lse, got_lse = lse;
  for (T& x : ref_lse) x = std::isfinite(x) ? x : T(-1e4);  // rows with no key: -inf on both sides
  for (T& x : got_lse) x = std::isfinite(x) ? x : T(-1e4);
  EXPECT_LE(max_rel_error(got_lse, ref_lse, owned, c.hq), tol) << "LSE " << what;
  EXPECT_LE(max_rel_error(dq, ref.dq, owned, qw), tol) << "dQ " << what;
  EXPECT_LE(max_rel_error(dk, ref.dk, owned, kw), tol) << "dK " << what;
  EXPECT_LE(max_rel_error(dv, ref.dv, owned, vw), tol) << "dV " << what;
  if (c.sink) {
    EXPECT_LE(max_rel_error(dsink, ref.dsink, {{0, 1}}, c.hq), tol) << "dsink " << what;
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  const Shape shapes[] = {Shape::Ragged, Shape::Deep, Shape::SingleTokens, Shape::GiantFamily, Shape::TinyFamilies};
  int i = 0;
  for (const std::string& layout : layout_names()) {
    for (Shape s : shapes) {
      const bool gqa = i % 2 == 0;
      out.push_back({s, gqa ? 4 : 2, 2, 8, gqa ? 8 : 6, (i % 3 == 0) ? int64_t{0} : int64_t{3 + i % 11}, i % 4 != 1, layout});
      ++i;
    }
  }
  return out;
}

TEST(DenseAttentionCP, DoubleEqualsSingleProcess) {
  uint64_t seed = 100;
  for (const Case& c : cases()) run_case<double>(c, seed++, 1e-10);
}

TEST(DenseAttentionCP, FloatEqualsSingleProcess) {
  uint64_t seed = 500;
  for (const Case& c : cases()) {
    if (seed % 2 == 0) run_case<float>(c, seed, 1e-5);
    ++seed;
  }
}

TEST(DenseAttentionCP, RankWithNoTokensTakesPart) {
  // 3 tokens over up to 4 ranks: some ranks own nothing and still enter every collective.
  Communicator& comm = *g_comm;
  const Row row({{-1, 2}, {0, 1}});
  PlanOptions opt;
  opt.layout = "contiguous";
  opt.chunk_tokens = 1;
  const Plan plan = make_plan(row, comm.size(), CostModel{}, opt);
  CpuBackend<double> be;
  DenseAttentionCP<CpuBackend<double>> cp(plan, row, AttentionDims{2, 1, 4, 4, 0.0}, comm, be);
  const auto q = random_array<double>(1, 3 * 8), k = random_array<double>(2, 3 * 4), v = random_array<double>(3, 3 * 4),
             dy = random_array<double>(4, 3 * 8);
  cpu::AttentionProblem<double> prob;
  prob.hq = 2, prob.hkv = 1, prob.d = 4, prob.dv = 4;
  prob.q = q.data(), prob.k = k.data(), prob.v = v.data(), prob.dout = dy.data();
  const auto ref = cpu::attention_reference(row, prob);
  const auto& owned = plan.ranks[static_cast<size_t>(comm.rank())].owned;
  std::vector<double> y(static_cast<size_t>(cp.owned_rows() * 8)), lse(static_cast<size_t>(cp.owned_rows() * 2)),
      dq(y.size()), dk(static_cast<size_t>(cp.owned_rows() * 4)), dv(dk.size());
  // the inputs must outlive backward()
  const auto q_own = rows_of<double>(q, 8, owned), k_own = rows_of<double>(k, 4, owned), v_own = rows_of<double>(v, 4, owned);
  cp.forward(q_own, k_own, v_own, nullptr, y, lse);
  cp.backward(rows_of<double>(dy, 8, owned), dq, dk, dv, nullptr);
  EXPECT_LE(max_rel_error(y, ref.o, owned, 8), 1e-12);
  EXPECT_LE(max_rel_error(dk, ref.dk, owned, 4), 1e-12);
  EXPECT_LE(max_rel_error(dv, ref.dv, owned, 4), 1e-12);
}

TEST(DenseAttentionCP, MismatchedPlanRefusedOnEveryRank) {
  Communicator& comm = *g_comm;
  const Row row({{-1, 40}, {0, 20}, {0, 30}});
  PlanOptions opt;
  opt.layout = "zigzag";
  opt.chunk_tokens = 5;
  CpuBackend<double> be;
  const AttentionDims shape{2, 1, 4, 4, 0.0};
  // wrong rank count
  const Plan other = make_plan(row, comm.size() + 1, CostModel{}, opt);
  try {
    DenseAttentionCP<CpuBackend<double>> cp(other, row, shape, comm, be);
    ADD_FAILURE() << "a plan for another rank count was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("plan"), std::string::npos) << e.what();
  }
  // a plan for another row
  const Plan plan = make_plan(row, comm.size(), CostModel{}, opt);
  const Row longer({{-1, 40}, {0, 20}, {0, 31}});
  EXPECT_THROW((DenseAttentionCP<CpuBackend<double>>(plan, longer, shape, comm, be)), Error);
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
