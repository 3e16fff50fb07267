// The stream-ordered dense attention protocol on ranks that are threads of this process, over a
// communicator that completes every started exchange late and out of order (comm/thread_communicator.hpp):
// outputs and gradients equal the single-process double reference at 1-6 ranks, for every layout, with
// windows, sinks and GQA, with the received KV kept or fetched again in the backward, through the stateful
// and the stateless backward. Also: the runtime's real peak memory equals plan/memory.hpp's prediction.
#include <gtest/gtest.h>

#include <cmath>
#include <exception>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "comm/counting_communicator.hpp"
#include "comm/thread_communicator.hpp"
#include "core/random.hpp"
#include "kernels/cpu/attention.hpp"
#include "plan/gdn_plan.hpp"
#include "plan/memory.hpp"
#include "plan/planner.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/dense_attention.hpp"
#include "runtime/redistribute.hpp"
#include "runtime/reference.hpp"
#include "runtime/row_map.hpp"
#include "tree/row.hpp"

#include "common/common.hpp"
#include "common/threads.hpp"

namespace treecp {
namespace {

using testing::on_threads;

std::vector<double> values(uint64_t seed, int64_t n) {
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = uniform_at(seed, static_cast<uint64_t>(i));
  return out;
}

// Random inputs of a whole row (seeds seed .. seed + 4: q, k, v, dy, the sink) for an attention shape.
struct RowInputs {
  std::vector<double> q, k, v, dy, sink;
};
RowInputs row_inputs(uint64_t seed, int64_t tokens, const AttentionShape& s) {
  return {values(seed, tokens * s.q_width()), values(seed + 1, tokens * s.k_width()),
          values(seed + 2, tokens * s.v_width()), values(seed + 3, tokens * s.o_width()), values(seed + 4, s.hq)};
}

// One rank's forward+backward arrays: its owned rows of the inputs, and the outputs and gradients the
// runtime fills for its `rows` owned rows.
struct RankArrays {
  std::vector<float> q, k, v, dy, sink, y, lse, dq, dk, dv, dsink;
};
RankArrays rank_arrays(const RowInputs& in, const AttentionShape& s, const std::vector<TokenRange>& owned, int64_t rows) {
  auto zeros = [](int64_t n) { return std::vector<float>(static_cast<size_t>(n), 0.f); };
  return {rows_of<float>(in.q, s.q_width(), owned), rows_of<float>(in.k, s.k_width(), owned),
          rows_of<float>(in.v, s.v_width(), owned), rows_of<float>(in.dy, s.o_width(), owned),
          std::vector<float>(in.sink.begin(), in.sink.end()), zeros(rows * s.o_width()), zeros(rows * s.hq),
          zeros(rows * s.q_width()), zeros(rows * s.k_width()), zeros(rows * s.v_width()), zeros(s.hq)};
}

// max |got - ref| / max |ref| over the rows `ranges` selects (got holds them in order); -inf matches -inf.
double rel_error(const std::vector<double>& got, const std::vector<double>& ref_full,
                 const std::vector<TokenRange>& ranges, int64_t width) {
  const std::vector<double> ref = rows_of<double>(ref_full, width, ranges);
  double scale = 1e-30, err = 0;
  for (double x : ref_full)
    if (std::isfinite(x)) scale = std::max(scale, std::abs(x));
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i]) && got[i] == ref[i]) continue;
    const double d = std::abs(got[i] - ref[i]);
    err = std::max(err, std::isfinite(d) ? d : 1e300);
  }
  return err / scale;
}

struct Case {
  int ranks;
  Layout layout;
  int64_t window;
  bool sink;
  int hq, hkv, d, dv;
  BackwardKv kv;
  bool stateless;
};

void run_case(const Case& c, uint64_t seed) {
  testing::Rng rng = testing::test_rng(seed);
  const Row row = testing::random_tree(rng, {.segments = 4 + static_cast<int>(rng() % 14), .max_len = 30});
  const int64_t S = row.tokens();
  const int64_t qw = int64_t{c.hq} * c.d, kw = int64_t{c.hkv} * c.d, vw = int64_t{c.hkv} * c.dv,
                ow = int64_t{c.hq} * c.dv;
  const auto q = values(seed * 8 + 1, S * qw), k = values(seed * 8 + 2, S * kw), v = values(seed * 8 + 3, S * vw),
             dy = values(seed * 8 + 4, S * ow);
  std::vector<double> sink = values(seed * 8 + 5, c.hq);
  for (double& s : sink) s *= 3;
  const AttentionShape shape{c.hq, c.hkv, c.d, c.dv, c.window};
  AttentionInputs<double> prob;
  prob.q = q.data(), prob.k = k.data(), prob.v = v.data(), prob.dout = dy.data();
  prob.sink = c.sink ? sink.data() : nullptr;
  const AttentionResult<double> ref = attention_reference(row, shape, prob);

  PlanOptions opt;
  opt.layout = c.layout;
  opt.chunk_tokens = std::max<int64_t>(1, S / 19);  // many chunks: fragmented ownership, several waves
  const Plan plan = make_plan(row, c.ranks, shape, CostModel{}, opt);
  std::vector<double> dsink_total(static_cast<size_t>(c.hq), 0.0);
  std::mutex sum_lock;
  ThreadCommOptions copt;
  copt.late = true;
  copt.seed = seed;
  copt.max_pause_us = 50;
  const std::string what = std::string(layout_name(c.layout)) + " ranks " + std::to_string(c.ranks) + " window " + std::to_string(c.window) +
                           (c.sink ? " sink" : "") + (c.kv == BackwardKv::Refetch ? " refetch" : " keep") +
                           (c.stateless ? " stateless" : "") + " seed " + std::to_string(seed);
  on_threads(c.ranks, copt, [&](int r, Communicator& comm) {
    CpuBackend<double> be;
    DenseAttentionOptions o;
    o.backward_kv = c.kv;
    DenseAttentionCP<CpuBackend<double>> cp(plan, row, shape, comm, be, o);
    const auto& owned = plan.ranks[static_cast<size_t>(r)].owned;
    const auto q_own = rows_of<double>(q, qw, owned), k_own = rows_of<double>(k, kw, owned),
               v_own = rows_of<double>(v, vw, owned), dy_own = rows_of<double>(dy, ow, owned);
    const int64_t rows = cp.owned_rows();
    std::vector<double> y(static_cast<size_t>(rows * ow)), lse(static_cast<size_t>(rows * c.hq)),
        o_pre(static_cast<size_t>(rows * ow)), dq(static_cast<size_t>(rows * qw)), dk(static_cast<size_t>(rows * kw)),
        dv(static_cast<size_t>(rows * vw)), dsink(static_cast<size_t>(c.hq), 0.0);
    const std::vector<double>* sp = c.sink ? &sink : nullptr;
    cp.forward(q_own, k_own, v_own, sp, y, lse, c.stateless ? &o_pre : nullptr);
    if (c.stateless) {
      cp.backward(q_own, k_own, v_own, sp, c.sink ? o_pre : y, lse, dy_own, dq, dk, dv, c.sink ? &dsink : nullptr);
    } else {
      cp.backward(dy_own, dq, dk, dv, c.sink ? &dsink : nullptr);
    }
    EXPECT_LE(rel_error(y, ref.o, owned, ow), 1e-10) << "O " << what << " rank " << r;
    EXPECT_LE(rel_error(lse, ref.lse, owned, c.hq), 1e-10) << "LSE " << what << " rank " << r;
    EXPECT_LE(rel_error(dq, ref.dq, owned, qw), 1e-10) << "dQ " << what << " rank " << r;
    EXPECT_LE(rel_error(dk, ref.dk, owned, kw), 1e-10) << "dK " << what << " rank " << r;
    EXPECT_LE(rel_error(dv, ref.dv, owned, vw), 1e-10) << "dV " << what << " rank " << r;
    std::lock_guard<std::mutex> lock(sum_lock);
    for (int h = 0; h < c.hq; ++h) dsink_total[static_cast<size_t>(h)] += dsink[static_cast<size_t>(h)];
  });
  if (c.sink) {
    EXPECT_LE(rel_error(dsink_total, ref.dsink, {{0, 1}}, c.hq), 1e-10) << "dsink " << what;
  }
}

TEST(ThreadRanks, LateOutOfOrderExchangesEqualOneProcess) {
  uint64_t seed = 7000;
  int i = 0;
  for (int ranks = 1; ranks <= 6; ++ranks) {
    for (size_t l = 0; l < std::size(kLayouts); ++l, ++i) {
      const bool gqa = i % 2 == 0;
      Case c{ranks, kLayouts[l], (i % 3 == 0) ? int64_t{0} : int64_t{2 + i % 13}, i % 4 != 1,
             gqa ? 4 : 2, 2, 8, gqa ? 8 : 6, i % 3 == 2 ? BackwardKv::Refetch : BackwardKv::Keep, i % 5 == 3};
      run_case(c, seed++);
    }
  }
}

TEST(ThreadRanks, RankThatOwnsNothingTakesPart) {
  // Two tokens for five ranks: three ranks own nothing and still enter every exchange.
  const Row row(std::vector<Segment>{{-1, 1}, {0, 1}});
  const AttentionShape shape{1, 1, 4, 4};
  const Plan plan = make_plan(row, 5, shape, CostModel{}, PlanOptions{});
  const auto q = values(11, 2 * 4), k = values(12, 2 * 4), v = values(13, 2 * 4), dy = values(14, 2 * 4);
  AttentionInputs<double> prob;
  prob.q = q.data(), prob.k = k.data(), prob.v = v.data(), prob.dout = dy.data();
  const auto ref = attention_reference(row, shape, prob);
  ThreadCommOptions copt;
  copt.late = true;
  on_threads(5, copt, [&](int r, Communicator& comm) {
    CpuBackend<double> be;
    DenseAttentionCP<CpuBackend<double>> cp(plan, row, shape, comm, be);
    const auto& owned = plan.ranks[static_cast<size_t>(r)].owned;
    const int64_t rows = cp.owned_rows();
    std::vector<double> y(static_cast<size_t>(rows * 4)), lse(static_cast<size_t>(rows)), dq(y.size()), dk(y.size()),
        dv(y.size());
    const auto qo = rows_of<double>(q, 4, owned), ko = rows_of<double>(k, 4, owned), vo = rows_of<double>(v, 4, owned);
    cp.forward(qo, ko, vo, nullptr, y, lse);  // the inputs outlive backward()
    cp.backward(rows_of<double>(dy, 4, owned), dq, dk, dv, nullptr);
    EXPECT_LE(rel_error(y, ref.o, owned, 4), 1e-12);
    EXPECT_LE(rel_error(dk, ref.dk, owned, 4), 1e-12) << "rank " << r;
  });
}

TEST(ThreadRanks, ExchangesReallyCompleteLate) {
  // What the protocol tests rely on: data lands only by wait(), not when the exchange starts.
  ThreadCommOptions copt;
  copt.late = true;
  on_threads(3, copt, [&](int r, Communicator& comm) {
    std::vector<double> send(3, 1.0 + r), recv(3, -1.0);
    auto pending = comm.start_all_to_all_v(send.data(), {1, 1, 1}, {0, 1, 2}, recv.data(), {1, 1, 1}, {0, 1, 2},
                                           CommType::F64);
    comm.barrier();  // every rank has started; still nothing may have landed
    EXPECT_EQ(recv, (std::vector<double>{-1, -1, -1})) << "rank " << r;
    pending->wait();
    EXPECT_EQ(recv, (std::vector<double>{1, 2, 3})) << "rank " << r;
  });
}

TEST(ThreadRanks, MismatchedCollectivesAndTimeoutsAreErrors) {
  ThreadCommOptions copt;
  copt.timeout_s = 0.5;
  EXPECT_THROW(on_threads(2, copt,
                          [&](int r, Communicator& comm) {
                            if (r == 0) comm.barrier();  // rank 1 never comes
                          }),
               Error);
  try {
    on_threads(2, copt, [&](int r, Communicator& comm) {
      int64_t x = 1;
      if (r == 0) comm.barrier();
      else comm.all_reduce_sum(&x, 1, CommType::I64);
    });
    ADD_FAILURE() << "mismatched collectives were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("called"), std::string::npos) << e.what();
  }
}

TEST(ThreadRanks, PeakMemoryEqualsThePrediction) {
  uint64_t seed = 9100;
  for (int ranks : {1, 2, 3, 5}) {
    for (bool refetch : {false, true}) {
      for (bool sink : {false, true}) {
        testing::Rng rng = testing::test_rng(seed++);
        const Row row = testing::random_tree(rng, {.segments = 12, .max_len = 40});
        const int64_t S = row.tokens();
        PlanOptions opt;
        opt.layout = Layout::Zigzag;
        opt.chunk_tokens = std::max<int64_t>(1, S / 17);
        const int hq = 4, hkv = 2, d = 8, dv = 6;
        const AttentionShape shape{hq, hkv, d, dv};
        const Plan plan = make_plan(row, ranks, shape, CostModel{}, opt);
        const RowInputs in = row_inputs(seed, S, shape);
        on_threads(ranks, ThreadCommOptions{}, [&](int r, Communicator& comm) {
          CpuBackend<float> be;
          DenseAttentionOptions o;
          o.backward_kv = refetch ? BackwardKv::Refetch : BackwardKv::Keep;
          DenseAttentionCP<CpuBackend<float>> cp(plan, row, shape, comm, be, o);
          const int64_t rows = cp.owned_rows();
          RankArrays a = rank_arrays(in, shape, plan.ranks[static_cast<size_t>(r)].owned, rows);
          const int64_t before = be.live_bytes();
          be.reset_peak();
          cp.forward(a.q, a.k, a.v, sink ? &a.sink : nullptr, a.y, a.lse);
          const int64_t fwd_peak = be.peak_bytes() - before, kept = be.live_bytes() - before;
          be.reset_peak();
          cp.backward(a.dy, a.dq, a.dk, a.dv, sink ? &a.dsink : nullptr);
          const int64_t bwd_peak = be.peak_bytes() - before;

          RuntimeMemoryInput mem;
          mem.owned_rows = rows;
          for (const WaveSchedule& w : cp.schedule().waves) {
            mem.fetched_rows.push_back(w.fetched.rows());
            mem.sent_rows.push_back(w.send_total);
          }
          mem.hq = hq, mem.hkv = hkv, mem.d = d, mem.dv = dv;
          mem.sink = sink;
          mem.refetch = refetch;
          mem.act_bytes = mem.stat_bytes = mem.grad_bytes = 4;
          const RuntimeMemory m = attention_runtime_memory(mem);
          const std::string what = "ranks " + std::to_string(ranks) + " rank " + std::to_string(r) +
                                   (refetch ? " refetch" : " keep") + (sink ? " sink" : "");
          EXPECT_EQ(fwd_peak, m.forward_peak_bytes) << what;
          EXPECT_EQ(kept, m.kept_bytes) << what;
          EXPECT_EQ(bwd_peak, m.backward_peak_bytes) << what;
          EXPECT_EQ(be.live_bytes(), before) << "buffers not given back, " << what;
          if (!refetch && !cp.schedule().waves.empty() && cp.schedule().waves[0].fetched.rows() > 0) {
            EXPECT_GT(m.kept_bytes, 0) << what;
          }
        });
      }
    }
  }
}

}  // namespace
}  // namespace treecp

namespace treecp {
namespace {

// The planner's per-rank memory bound (PlanReport / Evaluator) is the runtime's real peak plus the owned
// activations, and a memory limit between the two choices makes the planner fetch KV again in the backward,
// which the runtime then does (less memory, the same results).
TEST(ThreadRanks, PlannerMemoryBoundIsTheRuntimePeak) {
  uint64_t seed = 9400;
  for (int ranks : {2, 3, 4}) {
    testing::Rng rng = testing::test_rng(seed++);
    const Row row = testing::random_tree(rng, {.segments = 14, .max_len = 40});
    const int64_t S = row.tokens();
    const int hq = 4, hkv = 2, d = 8, dv = 8;
    const AttentionShape shape{hq, hkv, d, dv};
    CostModel costs;
    costs.kv_bytes_per_element = costs.dkv_bytes_per_element = 4;  // float on the CPU backend
    costs.activation_bytes_per_token = 0;
    costs.memory_limit_bytes_per_rank = 0;
    PlanOptions opt;
    opt.layout = Layout::Zigzag;
    opt.chunk_tokens = std::max<int64_t>(1, S / 17);
    for (const char* mode : {"keep", "refetch"}) {
      opt.backward_kv = mode;
      PlanReport report;
      const Plan plan = make_plan(row, ranks, shape, costs, opt, &report);
      ASSERT_EQ(plan.refetch_backward, std::string(mode) == "refetch");
      const int64_t bound = report.layouts[1].peak_memory_bytes;  // zigzag, the largest rank's
      std::vector<int64_t> peaks(static_cast<size_t>(ranks));
      const RowInputs in = row_inputs(seed, S, shape);
      on_threads(ranks, ThreadCommOptions{}, [&](int r, Communicator& comm) {
        CpuBackend<float> be;
        DenseAttentionCP<CpuBackend<float>> cp(plan, row, shape, comm, be);
        RankArrays a = rank_arrays(in, shape, plan.ranks[static_cast<size_t>(r)].owned, cp.owned_rows());
        const int64_t before = be.live_bytes();
        be.reset_peak();
        cp.forward(a.q, a.k, a.v, &a.sink, a.y, a.lse);  // with a sink: the planner bounds that case
        cp.backward(a.dy, a.dq, a.dk, a.dv, &a.dsink);
        peaks[static_cast<size_t>(r)] = be.peak_bytes() - before;
      });
      EXPECT_EQ(*std::max_element(peaks.begin(), peaks.end()), bound) << mode << " ranks " << ranks;
    }
    // A limit between the two peaks: auto fetches again and fits.
    opt.backward_kv = "keep";
    PlanReport keep_report, refetch_report;
    make_plan(row, ranks, shape, costs, opt, &keep_report);
    opt.backward_kv = "refetch";
    make_plan(row, ranks, shape, costs, opt, &refetch_report);
    const int64_t keep_peak = keep_report.layouts[1].peak_memory_bytes,
                  refetch_peak = refetch_report.layouts[1].peak_memory_bytes;
    if (refetch_peak < keep_peak) {
      costs.memory_limit_bytes_per_rank = (keep_peak + refetch_peak) / 2;
      opt.backward_kv = "auto";
      PlanReport report;
      const Plan plan = make_plan(row, ranks, shape, costs, opt, &report);
      EXPECT_TRUE(plan.refetch_backward) << "ranks " << ranks;
      EXPECT_TRUE(report.layouts[1].fits_memory);
      EXPECT_GE(report.layouts[1].makespan_ms, keep_report.layouts[1].makespan_ms) << "fetching again costs time";
    }
  }
}

// redistribute and redistribute_grad (one move, two buffer kinds) land every rank's rows of the destination
// ownership, from any source ownership, at 1-4 ranks (the GDN plan's layout and back: what the package does).
TEST(Redistribute, MovesEveryRowToItsNewOwnerAndBack) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(31);
  const Row row = testing::random_tree(rng, {.segments = 8, .max_len = 25});
  const int64_t width = 3;
  const std::vector<double> full = testing::randn(static_cast<size_t>(row.tokens() * width), rng);
  for (int ranks = 1; ranks <= 4; ++ranks) {
    const Ownership from = contiguous_ownership(row.tokens(), ranks);
    std::vector<uint8_t> chained(static_cast<size_t>(row.num_segments()));
    for (auto& c : chained) c = static_cast<uint8_t>(rng() % 2);
    const Ownership to = gdn_ownership(row, make_gdn_plan(row, ranks, chained));
    on_threads(ranks, ThreadCommOptions{}, [&](int r, Communicator& comm) {
      CpuBackend<double> be;
      const auto mine = rows_of<double>(full, width, from[static_cast<size_t>(r)]);
      const auto moved = redistribute(comm, be, mine, from, to, width);
      EXPECT_EQ(moved, rows_of<double>(full, width, to[static_cast<size_t>(r)])) << "ranks " << ranks << " rank " << r;
      EXPECT_EQ(redistribute_grad(comm, be, moved, to, from, width), mine) << "ranks " << ranks << " rank " << r;
    });
  }
}

// A move in which no row changes rank (one rank; every rank's tokens kept, in other ranges) is a local copy: the same
// rows land where the all-to-all would put them, and no rank calls the collective; one row crossing ranks brings the
// collective back on every rank.
TEST(Redistribute, AMoveWithinEachRankCallsNoCollective) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(32);
  const int64_t tokens = 97, width = 2;
  const std::vector<double> full = testing::randn(static_cast<size_t>(tokens * width), rng);
  for (int ranks = 1; ranks <= 4; ++ranks) {
    // each rank its contiguous share in two ranges, `to` the same tokens in three (ranges are in token order)
    Ownership from(static_cast<size_t>(ranks)), to(static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r) {
      const int64_t b = tokens * r / ranks, e = tokens * (r + 1) / ranks, m = (b + e) / 2;
      from[static_cast<size_t>(r)] = {{b, m}, {m, e}};
      to[static_cast<size_t>(r)] = {{b, (b + m) / 2}, {(b + m) / 2, (m + e) / 2}, {(m + e) / 2, e}};
    }
    for (const bool cross : {false, true}) {
      Ownership dst = to;
      if (cross && ranks > 1) {  // rank 0's last token goes to rank 1
        const int64_t e0 = tokens / ranks;
        dst[0] = {{0, e0 / 2}, {e0 / 2, e0 - 1}};
        dst[1].insert(dst[1].begin(), TokenRange{e0 - 1, e0});
      }
      on_threads(ranks, ThreadCommOptions{}, [&](int r, Communicator& inner) {
        CountingCommunicator comm(inner);
        CpuBackend<double> be;
        const auto mine = rows_of<double>(full, width, from[static_cast<size_t>(r)]);
        EXPECT_EQ(redistribute(comm, be, mine, from, dst, width), rows_of<double>(full, width, dst[static_cast<size_t>(r)]))
            << "ranks " << ranks << " rank " << r << " cross " << cross;
        EXPECT_EQ(comm.exchanges(), cross && ranks > 1 ? 1 : 0) << "ranks " << ranks << " rank " << r;
      });
    }
  }
}

}  // namespace
}  // namespace treecp
