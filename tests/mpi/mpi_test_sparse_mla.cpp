// Sparse MLA CP on MPI ranks equals one process: exactly the same ids, and the same outputs and
// gradients (double 1e-10), on random trees (ragged, deep, one giant family, many tiny families) with
// windows, frequent ties (small-integer indexer inputs), k above the visible counts, every layout and
// both ways of fetching KV; reused ids (IndexShare); float; ranks that own nothing; bad plans and bad
// ids refused on every rank; the bytes each rank moves within the planner's bound. Run by CTest under
// mpirun with 1 to 6 ranks.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "comm/mpi_communicator.hpp"
#include "core/error.hpp"
#include "kernels/cpu/sparse_mla.hpp"
#include "common/mpi_main.hpp"
#include "plan/sparse_mla_plan.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/row_map.hpp"
#include "runtime/sparse_mla_cp.hpp"
#include "tree/row.hpp"

namespace treecp {
namespace {

MpiCommunicator* g_comm = nullptr;
// The run's seed, the same on every rank (common/mpi_main.hpp broadcasts rank 0's; TREECP_TEST_SEED
// replays a run); TREECP_SEED_TRACE names it in every failure.
uint64_t seed_of_run() { return testing::base_seed(); }

enum class Shape { Ragged, Deep, GiantFamily, TinyFamilies };

Row make_tree(Shape shape, std::mt19937_64& rng) {
  std::vector<Segment> segs;
  auto len = [&](int lo, int hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  switch (shape) {
    case Shape::Ragged: {
      std::vector<int32_t> path;
      const int n = static_cast<int>(len(3, 12));
      for (int i = 0; i < n; ++i) {
        path.resize(static_cast<size_t>(len(0, static_cast<int>(path.size()))));
        segs.push_back({path.empty() ? -1 : path.back(), len(1, 30)});
        path.push_back(i);
      }
      break;
    }
    case Shape::Deep:
      for (int i = 0; i < 8; ++i) segs.push_back({i - 1, len(2, 15)});
      segs.push_back({3, len(4, 12)});
      break;
    case Shape::GiantFamily:
      segs.push_back({-1, len(50, 90)});
      for (int i = 0, kids = static_cast<int>(len(6, 14)); i < kids; ++i) segs.push_back({0, len(1, 10)});
      break;
    case Shape::TinyFamilies:
      for (int f = 0, fams = static_cast<int>(len(8, 20)); f < fams; ++f) {
        const auto root = static_cast<int32_t>(segs.size());
        segs.push_back({-1, len(1, 6)});
        for (int i = 0, kids = static_cast<int>(len(0, 3)); i < kids; ++i) segs.push_back({root, len(1, 4)});
      }
      break;
  }
  return Row(std::move(segs));
}

std::vector<double> random_values(std::mt19937_64& rng, size_t n, bool small_integers) {
  std::vector<double> x(n);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_int_distribution<int> ints(-2, 2);
  for (double& e : x) e = small_integers ? ints(rng) : normal(rng);
  return x;
}

template <class T>
std::vector<T> cast(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

// max |got - ref[owned rows]| / max |ref|, both sides -inf counting as equal.
template <class T>
double max_rel_error(const std::vector<T>& got, const std::vector<T>& ref_full, const std::vector<TokenRange>& owned,
                     int64_t width) {
  const std::vector<T> ref = rows_of<T>(ref_full, width, owned);
  double scale = 1e-300, err = 0;
  for (T x : ref_full) scale = std::isfinite(static_cast<double>(x)) ? std::max(scale, std::abs(static_cast<double>(x))) : scale;
  EXPECT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size() && i < got.size(); ++i) {
    if (std::isinf(static_cast<double>(ref[i])) && got[i] == ref[i]) continue;
    const double d = std::abs(static_cast<double>(got[i]) - static_cast<double>(ref[i]));
    err = std::max(err, std::isfinite(d) ? d : 1e300);
  }
  return err / scale;
}

struct Dims {
  int hi = 3, di = 8, h = 4, dqk = 12, dv = 8;
};

struct Layer {
  std::vector<double> qi, ki, w, q, kv, dout;
};

Layer random_layer(const Row& row, const Dims& d, bool ties, std::mt19937_64& rng) {
  const auto S = static_cast<size_t>(row.tokens());
  Layer l;
  l.qi = random_values(rng, S * d.hi * d.di, ties);
  l.ki = random_values(rng, S * d.di, ties);
  l.w = random_values(rng, S * d.hi, ties);
  l.q = random_values(rng, S * d.h * d.dqk, false);
  l.kv = random_values(rng, S * d.dqk, false);
  l.dout = random_values(rng, S * d.h * d.dv, false);
  return l;
}

template <class T>
cpu::SparseMlaResult<T> one_process(const Row& row, const Dims& d, int64_t topk, int64_t window, const Layer& l,
                                    const std::vector<int64_t>* ids) {
  const auto qi = cast<T>(l.qi), ki = cast<T>(l.ki), w = cast<T>(l.w), q = cast<T>(l.q), kv = cast<T>(l.kv),
             dout = cast<T>(l.dout);
  cpu::SparseMlaProblem<T> p;
  p.hi = d.hi, p.di = d.di, p.h = d.h, p.dqk = d.dqk, p.dv = d.dv, p.topk = topk, p.window = window;
  p.qi = qi.data(), p.ki = ki.data(), p.w = w.data(), p.q = q.data(), p.kv = kv.data(), p.dout = dout.data();
  p.ids = ids ? ids->data() : nullptr;
  return cpu::sparse_mla_reference(row, p);
}

// Costs whose byte sizes are those of the CPU run, so that the prediction bounds what it moves; no
// fixed per-stage or per-message terms and transfers as slow as the indexer's compute, so that the
// planner pipelines several waves even on rows this small.
template <class T>
SparseMlaCosts cpu_costs(const Dims& d) {
  SparseMlaCosts c;
  c.shape.hi = d.hi, c.shape.di = d.di, c.shape.h = d.h, c.shape.dqk = d.dqk, c.shape.dv = d.dv;
  c.shape.bytes_per_element = c.shape.dkv_bytes_per_element = sizeof(T);
  CostModel& ix = c.indexer;
  ix.local_forward_pairs_per_ms = ix.remote_forward_pairs_per_ms = 100.0;
  ix.stage_launch_ms = ix.range_ms = ix.merge_ms_per_query_token = ix.underfill_ms = 0.0;
  ix.intra_node = ix.inter_node = Link{0.0, 400.0};
  ix.rank_bandwidth_bytes_per_ms = 400.0;
  return c;
}

struct Case {
  Shape shape;
  int64_t window;
  int64_t topk;
  bool ties;
  Layout layout;
  std::string fetch;
};

struct Outputs {
  std::vector<int64_t> ids;
  double o = 0, lse = 0, dq = 0, dkv = 0;  // errors
};

template <class T>
void run_case(const Case& c, uint64_t seed, double tol) {
  Communicator& comm = *g_comm;
  std::mt19937_64 rng(seed);
  const Row row = make_tree(c.shape, rng);
  const int64_t S = row.tokens();
  const Dims d;
  const Layer layer = random_layer(row, d, c.ties, rng);
  const cpu::SparseMlaResult<T> ref = one_process<T>(row, d, c.topk, c.window, layer, nullptr);

  SparseMlaPlanOptions opt;
  opt.plan.layout = c.layout;
  opt.window = c.window;
  opt.plan.chunk_tokens = std::max<int64_t>(1, S / 23);  // many chunks: fragmented ownership, several waves
  opt.topk = c.topk;
  opt.fetch = c.fetch;
  const SparseMlaPlan plan = make_sparse_mla_plan(row, comm.size(), cpu_costs<T>(d), opt);
  CpuBackend<T> be;
  SparseMlaCP<CpuBackend<T>> cp(plan, row, SparseMlaDims{d.hi, d.di, d.h, d.dqk, d.dv, c.topk, 0.0}, comm, be);
  const auto& owned = plan.plan.ranks[static_cast<size_t>(comm.rank())].owned;
  const int64_t rows = cp.owned_rows(), ow = int64_t{d.h} * d.dv, qw = int64_t{d.h} * d.dqk;
  const auto mine = [&](const std::vector<double>& full, int64_t width) { return rows_of<T>(cast<T>(full), width, owned); };
  const std::vector<T> qi = mine(layer.qi, int64_t{d.hi} * d.di), ki = mine(layer.ki, d.di), w = mine(layer.w, d.hi),
                       q = mine(layer.q, qw), kv = mine(layer.kv, d.dqk), dout = mine(layer.dout, ow);
  std::vector<int64_t> ids;
  std::vector<T> o(static_cast<size_t>(rows * ow)), lse(static_cast<size_t>(rows * d.h)), dq(q.size()), dkv(kv.size());
  cp.forward(qi, ki, w, q, kv, ids, o, lse);
  cp.backward(dout, dq, dkv);

  const std::string what = std::string(layout_name(c.layout)) + " fetch " + kv_fetch_name(plan.fetch) + " window " + std::to_string(c.window) +
                           " k " + std::to_string(c.topk) + (c.ties ? " ties" : "") + " rank " +
                           std::to_string(comm.rank()) + " of " + std::to_string(comm.size()) + " seed " + std::to_string(seed);
  EXPECT_EQ(ids, rows_of<int64_t>(ref.ids, c.topk, owned)) << "ids " << what;
  EXPECT_LE(max_rel_error(o, ref.o, owned, ow), tol) << "O " << what;
  EXPECT_LE(max_rel_error(lse, ref.lse, owned, d.h), tol) << "LSE " << what;
  EXPECT_LE(max_rel_error(dq, ref.dq, owned, qw), tol) << "dQ " << what;
  EXPECT_LE(max_rel_error(dkv, ref.dkv, owned, d.dqk), tol) << "dKV " << what;
  // What moved stays within the plan's bound, which holds for every input.
  const SparseMlaRankCost& predicted = plan.prediction.ranks[static_cast<size_t>(comm.rank())];
  EXPECT_LE(cp.traffic().bytes_sent, predicted.bytes_sent) << what;
  EXPECT_LE(cp.traffic().bytes_received, predicted.bytes_received) << what;
  EXPECT_LE(cp.traffic().remote_rows, predicted.selected_rows) << what;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  const Shape shapes[] = {Shape::Ragged, Shape::Deep, Shape::GiantFamily, Shape::TinyFamilies};
  const char* fetches[] = {"waves", "selected", "auto"};
  int i = 0;
  for (Layout layout : kLayouts) {
    for (Shape s : shapes) {
      const int64_t window = i % 3 == 0 ? 0 : 4 + i % 9;
      const int64_t topk = i % 4 == 3 ? 500 : 2 + i % 7;  // 500: more than any query sees
      out.push_back({s, window, topk, i % 2 == 0, layout, fetches[i % 3]});
      ++i;
    }
  }
  return out;
}

TEST(SparseMlaCP, DoubleEqualsOneProcess) {
  TREECP_SEED_TRACE;
  uint64_t n = 0;
  for (const Case& c : cases()) run_case<double>(c, seed_of_run() * 131 + n++, 1e-10);
}

TEST(SparseMlaCP, FloatEqualsOneProcess) {
  // The same selection as a float run in one process; outputs within a few times that run's own error
  // against double (on the same selection, through the ids of the float run).
  TREECP_SEED_TRACE;
  uint64_t n = 0;
  for (const Case& c : cases()) {
    if (n++ % 3 != 0) continue;
    std::mt19937_64 rng(seed_of_run() * 71 + n);
    const Row row = make_tree(c.shape, rng);
    const Dims d;
    const Layer layer = random_layer(row, d, c.ties, rng);
    const cpu::SparseMlaResult<float> ref = one_process<float>(row, d, c.topk, c.window, layer, nullptr);
    Layer rounded = layer;  // the float inputs, exactly, in double
    for (auto* v : {&rounded.q, &rounded.kv, &rounded.dout}) {
      for (double& x : *v) x = static_cast<float>(x);
    }
    const cpu::SparseMlaResult<double> exact = one_process<double>(row, d, c.topk, c.window, rounded, &ref.ids);
    const std::vector<TokenRange> all{{0, row.tokens()}};
    auto err = [&](const std::vector<float>& a, const std::vector<double>& b, int64_t width) {
      return max_rel_error(std::vector<double>(a.begin(), a.end()), b, all, width);
    };
    const double tol = 4 * std::max({err(ref.o, exact.o, d.h * d.dv), err(ref.dq, exact.dq, d.h * d.dqk),
                                     err(ref.dkv, exact.dkv, d.dqk)}) + 1e-6;
    run_case<float>(c, seed_of_run() * 71 + n, tol);
  }
}

TEST(SparseMlaCP, SharedIdsEqualOneProcess) {
  // IndexShare: a second layer reuses the first layer's canonical ids under a plan made for a layer
  // without an indexer (only the selected rows travel).
  TREECP_SEED_TRACE;
  Communicator& comm = *g_comm;
  int64_t remote_rows = 0;
  for (int t = 0; t < 4; ++t) {
    std::mt19937_64 rng(seed_of_run() * 17 + static_cast<uint64_t>(t));
    const Row row = make_tree(static_cast<Shape>(t), rng);
    const Dims d;
    const int64_t topk = 3 + t, window = t % 2 ? 6 : 0;
    const Layer first = random_layer(row, d, true, rng), second = random_layer(row, d, false, rng);
    const std::vector<int64_t> ids = one_process<double>(row, d, topk, window, first, nullptr).ids;
    const cpu::SparseMlaResult<double> ref = one_process<double>(row, d, topk, window, second, &ids);
    SparseMlaPlanOptions opt;
    opt.plan.layout = t % 2 ? Layout::Zigzag : Layout::Contiguous;  // the searched plan may rightly keep a small row on one rank
    opt.window = window;
    opt.plan.chunk_tokens = std::max<int64_t>(1, row.tokens() / 17);
    opt.topk = topk;
    opt.full_index = false;
    const SparseMlaPlan plan = make_sparse_mla_plan(row, comm.size(), cpu_costs<double>(d), opt);
    EXPECT_EQ(plan.fetch, KvFetch::Selected);
    CpuBackend<double> be;
    SparseMlaCP<CpuBackend<double>> cp(plan, row, SparseMlaDims{d.hi, d.di, d.h, d.dqk, d.dv, topk, 0.0}, comm, be);
    const auto& owned = plan.plan.ranks[static_cast<size_t>(comm.rank())].owned;
    const int64_t rows = cp.owned_rows(), ow = int64_t{d.h} * d.dv, qw = int64_t{d.h} * d.dqk;
    const auto q = rows_of<double>(second.q, qw, owned), kv = rows_of<double>(second.kv, d.dqk, owned);
    std::vector<double> o(static_cast<size_t>(rows * ow)), lse(static_cast<size_t>(rows * d.h)), dq(q.size()), dkv(kv.size());
    cp.forward_shared(rows_of<int64_t>(ids, topk, owned), q, kv, o, lse);
    cp.backward(rows_of<double>(second.dout, ow, owned), dq, dkv);
    EXPECT_LE(max_rel_error(o, ref.o, owned, ow), 1e-10) << "tree " << t;
    EXPECT_LE(max_rel_error(lse, ref.lse, owned, d.h), 1e-10) << "tree " << t;
    EXPECT_LE(max_rel_error(dq, ref.dq, owned, qw), 1e-10) << "tree " << t;
    EXPECT_LE(max_rel_error(dkv, ref.dkv, owned, d.dqk), 1e-10) << "tree " << t;
    EXPECT_LE(cp.traffic().bytes_received, plan.prediction.ranks[static_cast<size_t>(comm.rank())].bytes_received);
    remote_rows += cp.traffic().remote_rows;
  }
  // the lists really read rows of other ranks (the deep chain cannot be split without)
  comm.all_reduce_sum(&remote_rows, 1, CommType::I64);
  if (comm.size() > 1) {
    EXPECT_GT(remote_rows, 0);
  }
}

TEST(SparseMlaCP, BadSharedIdsRefusedOnEveryRank) {
  // DESIGN.md's example: query 8 (completion B) must not read completion A's token 6. Only the rank that
  // owns query 8 sees the bad entry; every rank throws.
  Communicator& comm = *g_comm;
  const Row row({{-1, 4}, {0, 3}, {0, 2}});
  const Dims d;
  SparseMlaPlanOptions opt;
  opt.plan.layout = Layout::Contiguous;
  opt.plan.chunk_tokens = 1;
  opt.topk = 2;
  opt.full_index = false;
  const SparseMlaPlan plan = make_sparse_mla_plan(row, comm.size(), cpu_costs<double>(d), opt);
  CpuBackend<double> be;
  SparseMlaCP<CpuBackend<double>> cp(plan, row, SparseMlaDims{d.hi, d.di, d.h, d.dqk, d.dv, 2, 0.0}, comm, be);
  const auto& owned = plan.plan.ranks[static_cast<size_t>(comm.rank())].owned;
  std::vector<int64_t> all(18, -1);
  for (int64_t q = 0; q < 9; ++q) all[static_cast<size_t>(q * 2)] = q;  // every query reads itself
  all[17] = 6;
  const int64_t rows = cp.owned_rows();
  std::vector<double> q(static_cast<size_t>(rows * d.h * d.dqk), 0.5), kv(static_cast<size_t>(rows * d.dqk), 0.25),
      o(static_cast<size_t>(rows * d.h * d.dv)), lse(static_cast<size_t>(rows * d.h));
  try {
    cp.forward_shared(rows_of<int64_t>(all, 2, owned), q, kv, o, lse);
    ADD_FAILURE() << "a list reading a sibling's token was accepted";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(m.find("query 8, entry 1: key 6 is not visible") != std::string::npos ||
                m.find("refused on another rank") != std::string::npos)
        << m;
  }
}

TEST(SparseMlaCP, RankWithNoTokensTakesPart) {
  // 3 tokens over up to 6 ranks: some ranks own nothing and still enter every collective.
  Communicator& comm = *g_comm;
  const Row row({{-1, 2}, {0, 1}});
  const Dims d;
  std::mt19937_64 rng(seed_of_run() + 5);
  const Layer layer = random_layer(row, d, false, rng);
  const cpu::SparseMlaResult<double> ref = one_process<double>(row, d, 2, 0, layer, nullptr);
  for (const char* fetch : {"waves", "selected"}) {
    SparseMlaPlanOptions opt;
    opt.plan.layout = Layout::Contiguous;
    opt.plan.chunk_tokens = 1;
    opt.topk = 2;
    opt.fetch = fetch;
    const SparseMlaPlan plan = make_sparse_mla_plan(row, comm.size(), cpu_costs<double>(d), opt);
    CpuBackend<double> be;
    SparseMlaCP<CpuBackend<double>> cp(plan, row, SparseMlaDims{d.hi, d.di, d.h, d.dqk, d.dv, 2, 0.0}, comm, be);
    const auto& owned = plan.plan.ranks[static_cast<size_t>(comm.rank())].owned;
    const int64_t rows = cp.owned_rows(), ow = int64_t{d.h} * d.dv, qw = int64_t{d.h} * d.dqk;
    const auto qi = rows_of<double>(layer.qi, int64_t{d.hi} * d.di, owned), ki = rows_of<double>(layer.ki, d.di, owned),
               w = rows_of<double>(layer.w, d.hi, owned), q = rows_of<double>(layer.q, qw, owned),
               kv = rows_of<double>(layer.kv, d.dqk, owned);
    std::vector<int64_t> ids;
    std::vector<double> o(static_cast<size_t>(rows * ow)), lse(static_cast<size_t>(rows * d.h)), dq(q.size()), dkv(kv.size());
    cp.forward(qi, ki, w, q, kv, ids, o, lse);
    cp.backward(rows_of<double>(layer.dout, ow, owned), dq, dkv);
    EXPECT_EQ(ids, rows_of<int64_t>(ref.ids, 2, owned)) << fetch;
    EXPECT_LE(max_rel_error(o, ref.o, owned, ow), 1e-12) << fetch;
    EXPECT_LE(max_rel_error(dkv, ref.dkv, owned, d.dqk), 1e-12) << fetch;
  }
}

TEST(SparseMlaCP, MismatchedPlanRefusedOnEveryRank) {
  Communicator& comm = *g_comm;
  const Row row({{-1, 40}, {0, 20}, {0, 30}});
  const Dims d;
  SparseMlaPlanOptions opt;
  opt.plan.layout = Layout::Zigzag;
  opt.plan.chunk_tokens = 5;
  opt.topk = 4;
  CpuBackend<double> be;
  const SparseMlaDims dims{d.hi, d.di, d.h, d.dqk, d.dv, 4, 0.0};
  const SparseMlaPlan other = make_sparse_mla_plan(row, comm.size() + 1, cpu_costs<double>(d), opt);
  EXPECT_THROW((SparseMlaCP<CpuBackend<double>>(other, row, dims, comm, be)), Error);
  const SparseMlaPlan plan = make_sparse_mla_plan(row, comm.size(), cpu_costs<double>(d), opt);
  const Row longer({{-1, 40}, {0, 20}, {0, 31}});
  EXPECT_THROW((SparseMlaCP<CpuBackend<double>>(plan, longer, dims, comm, be)), Error);
  SparseMlaDims wrong_k = dims;
  wrong_k.topk = 5;
  EXPECT_THROW((SparseMlaCP<CpuBackend<double>>(plan, row, wrong_k, comm, be)), Error);
  // corrupted on rank 0 only: every rank refuses, none hangs
  SparseMlaPlan broken = plan;
  if (comm.rank() == 0) {
    for (auto& st : broken.plan.ranks[0].stages) {
      if (!st.slices.empty()) {
        st.slices.pop_back();
        break;
      }
    }
  }
  EXPECT_THROW((SparseMlaCP<CpuBackend<double>>(broken, row, dims, comm, be)), Error);
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
