// The CPU sparse MLA kernels against independent oracles: a brute-force indexer over Row::visible with
// exact (small-integer) scores, so that ties are frequent and the tie rule is checked exactly; stages
// over random key splits and buffer orders merged = one pass, bit for bit; sparse attention against a
// per-query softmax written from the definitions in long double; finite differences; each trajectory
// run alone; ids reused (IndexShare); and the error rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "runtime/row_map.hpp"
#include "core/error.hpp"
#include "kernels/cpu/sparse_mla.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

#include "common/common.hpp"

namespace treecp {
namespace {

using cpu::SparseMlaProblem;
using cpu::SparseMlaResult;

using testing::base_seed;  // tests/common: TREECP_TEST_SEED=N replays a run, failures print the seed
using testing::randn;
using testing::test_rng;

// A random row of `segments` segments, lengths 1..max_len, paths up to 6 segments deep.
Row random_tree(std::mt19937_64& rng, int segments, int max_len) {
  return testing::random_tree(rng, {.segments = segments, .max_len = max_len, .max_depth = 6});
}

// Small integers: every indexer score is an exact integer in float and double, and ties are common.
std::vector<double> randi(size_t n, std::mt19937_64& rng, int lo, int hi) {
  std::uniform_int_distribution<int> d(lo, hi);
  std::vector<double> x(n);
  for (double& e : x) e = d(rng);
  return x;
}

struct Inputs {
  int hi = 0, di = 0, h = 0, dqk = 0, dv = 0;
  int64_t topk = 0, window = 0;
  double scale = 0;
  std::vector<double> qi, ki, w, q, kv, dout;
};

Inputs random_inputs(const Row& row, int hi, int di, int h, int dqk, int dv, int64_t topk, int64_t window,
                     bool integer_scores, std::mt19937_64& rng) {
  const auto S = static_cast<size_t>(row.tokens());
  Inputs in{hi, di, h, dqk, dv, topk, window, 0.7 / std::sqrt(static_cast<double>(dqk)), {}, {}, {}, {}, {}, {}};
  if (integer_scores) {
    in.qi = randi(S * hi * di, rng, -2, 2);
    in.ki = randi(S * di, rng, -2, 2);
    in.w = randi(S * hi, rng, -1, 3);
  } else {
    in.qi = randn(S * hi * di, rng);
    in.ki = randn(S * di, rng);
    in.w = randn(S * hi, rng);
  }
  in.q = randn(S * h * dqk, rng, 1.5);
  in.kv = randn(S * dqk, rng, 1.5);
  in.dout = randn(S * h * dv, rng);
  return in;
}

template <class T>
std::vector<T> cast(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

struct Result {
  std::vector<int64_t> ids;
  std::vector<double> score, o, lse, dq, dkv;
};

template <class T>
Result run_library(const Row& row, const Inputs& in, const std::vector<int64_t>* ids = nullptr, bool backward = true) {
  const auto qi = cast<T>(in.qi), ki = cast<T>(in.ki), w = cast<T>(in.w), q = cast<T>(in.q), kv = cast<T>(in.kv),
             dout = cast<T>(in.dout);
  SparseMlaProblem<T> p;
  p.hi = in.hi, p.di = in.di, p.h = in.h, p.dqk = in.dqk, p.dv = in.dv, p.topk = in.topk, p.window = in.window;
  p.scale = static_cast<T>(in.scale);
  p.qi = qi.data(), p.ki = ki.data(), p.w = w.data(), p.q = q.data(), p.kv = kv.data();
  p.ids = ids ? ids->data() : nullptr;
  p.dout = backward ? dout.data() : nullptr;
  const SparseMlaResult<T> r = cpu::sparse_mla_reference(row, p);
  auto wide = [](const std::vector<T>& x) { return std::vector<double>(x.begin(), x.end()); };
  return {r.ids, wide(r.score), wide(r.o), wide(r.lse), wide(r.dq), wide(r.dkv)};
}

// Brute force: every visible key of every query scored in long double, ordered by (score desc, id asc).
void indexer_oracle(const Row& row, const Inputs& in, std::vector<int64_t>& ids, std::vector<long double>& score) {
  const int64_t S = row.tokens(), K = in.topk;
  ids.assign(static_cast<size_t>(S * K), -1);
  score.assign(static_cast<size_t>(S * K), -std::numeric_limits<long double>::infinity());
  for (int64_t q = 0; q < S; ++q) {
    std::vector<std::pair<long double, int64_t>> c;
    for (int64_t j = 0; j < S; ++j) {
      if (!row.visible(q, j, in.window)) continue;
      long double s = 0;
      for (int h = 0; h < in.hi; ++h) {
        long double d = 0;
        for (int x = 0; x < in.di; ++x) d += static_cast<long double>(in.qi[(q * in.hi + h) * in.di + x]) * in.ki[j * in.di + x];
        s += static_cast<long double>(in.w[q * in.hi + h]) * std::max<long double>(d, 0);
      }
      c.push_back({s, j});
    }
    std::sort(c.begin(), c.end(), [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
    for (int64_t e = 0; e < std::min<int64_t>(K, static_cast<int64_t>(c.size())); ++e) {
      ids[static_cast<size_t>(q * K + e)] = c[static_cast<size_t>(e)].second;
      score[static_cast<size_t>(q * K + e)] = c[static_cast<size_t>(e)].first;
    }
  }
}

// Sparse attention from the definitions over the given lists (kv rows = canonical ids), inputs rounded
// to In, accumulated in Acc, sequential sums.
template <class In, class Acc>
Result sparse_oracle(const Inputs& in, const std::vector<int64_t>& ids, int64_t S) {
  auto r = [](double x) { return static_cast<Acc>(static_cast<In>(x)); };
  const int H = in.h, dqk = in.dqk, dv = in.dv;
  const int64_t K = in.topk;
  const Acc scale = r(in.scale);
  std::vector<Acc> o(static_cast<size_t>(S * H * dv), 0), lse(static_cast<size_t>(S * H), 0),
      dq(static_cast<size_t>(S * H * dqk), 0), dkv(static_cast<size_t>(S * dqk), 0);
  for (int64_t q = 0; q < S; ++q) {
    std::vector<int64_t> list;
    for (int64_t e = 0; e < K; ++e) {
      if (ids[static_cast<size_t>(q * K + e)] >= 0) list.push_back(ids[static_cast<size_t>(q * K + e)]);
    }
    for (int h = 0; h < H; ++h) {
      const size_t qh = static_cast<size_t>(q * H + h);
      if (list.empty()) {
        lse[qh] = -std::numeric_limits<Acc>::infinity();
        continue;
      }
      std::vector<Acc> s(list.size()), p(list.size());
      Acc mx = -std::numeric_limits<Acc>::infinity();
      for (size_t j = 0; j < list.size(); ++j) {
        Acc d = 0;
        for (int x = 0; x < dqk; ++x) d += r(in.q[qh * dqk + x]) * r(in.kv[list[j] * dqk + x]);
        s[j] = scale * d;
        mx = std::max(mx, s[j]);
      }
      Acc sum = 0;
      for (size_t j = 0; j < list.size(); ++j) sum += (p[j] = std::exp(s[j] - mx));
      for (size_t j = 0; j < list.size(); ++j) {
        p[j] /= sum;
        for (int x = 0; x < dv; ++x) o[qh * dv + x] += p[j] * r(in.kv[list[j] * dqk + x]);
      }
      lse[qh] = mx + std::log(sum);
      Acc delta = 0;
      for (int x = 0; x < dv; ++x) delta += r(in.dout[qh * dv + x]) * o[qh * dv + x];
      for (size_t j = 0; j < list.size(); ++j) {
        Acc dp = 0;
        for (int x = 0; x < dv; ++x) dp += r(in.dout[qh * dv + x]) * r(in.kv[list[j] * dqk + x]);
        const Acc ds = p[j] * (dp - delta) * scale;
        for (int x = 0; x < dqk; ++x) {
          dq[qh * dqk + x] += ds * r(in.kv[list[j] * dqk + x]);
          dkv[list[j] * dqk + x] += ds * r(in.q[qh * dqk + x]);
        }
        for (int x = 0; x < dv; ++x) dkv[list[j] * dqk + x] += p[j] * r(in.dout[qh * dv + x]);
      }
    }
  }
  auto wide = [](const std::vector<Acc>& x) { return std::vector<double>(x.begin(), x.end()); };
  return {ids, {}, wide(o), wide(lse), wide(dq), wide(dkv)};
}

// max |got - ref| / max |ref|; -inf on both sides counts as equal.
double rel_err(const std::vector<double>& got, const std::vector<double>& ref) {
  EXPECT_EQ(got.size(), ref.size());
  double scale = 1e-300, err = 0;
  for (size_t i = 0; i < ref.size() && i < got.size(); ++i) {
    if (std::isinf(ref[i]) && got[i] == ref[i]) continue;
    scale = std::max(scale, std::abs(ref[i]));
    const double d = std::abs(got[i] - ref[i]);
    err = std::max(err, std::isfinite(d) ? d : 1e300);
  }
  return err / scale;
}

std::vector<int64_t> visible_counts(const Row& row, int64_t window) {
  std::vector<int64_t> n(static_cast<size_t>(row.tokens()), 0);
  for (int64_t q = 0; q < row.tokens(); ++q) {
    for (int64_t j = 0; j <= q; ++j) n[static_cast<size_t>(q)] += row.visible(q, j, window) ? 1 : 0;
  }
  return n;
}

TEST(SparseMla, IndexerMatchesBruteForceWithTies) {
  // Integer inputs: scores are exact, many are equal, and the order of equal scores must follow the
  // canonical id. Includes k = 1, k larger than every visible set, windows, float and double.
  TREECP_SEED_TRACE;
  std::mt19937_64 rng = test_rng(11);
  int ties_seen = 0;
  for (int trial = 0; trial < 12; ++trial) {
    const Row row = random_tree(rng, 2 + trial % 7, 14);
    const int64_t window = trial % 3 == 0 ? 0 : 2 + trial % 5;
    const int64_t topk = std::vector<int64_t>{1, 2, 5, 9, 64}[static_cast<size_t>(trial % 5)];
    const Inputs in = random_inputs(row, 1 + trial % 4, 1 + trial % 5, 2, 8, 4, topk, window, true, rng);
    std::vector<int64_t> ids;
    std::vector<long double> score;
    indexer_oracle(row, in, ids, score);
    for (size_t i = 1; i < score.size(); ++i) ties_seen += ids[i] >= 0 && score[i] == score[i - 1] && (i % topk) != 0;
    const Result d = run_library<double>(row, in, nullptr, false);
    const Result f = run_library<float>(row, in, nullptr, false);
    const std::string what = "trial " + std::to_string(trial) + " window " + std::to_string(window) + " k " + std::to_string(topk);
    EXPECT_EQ(d.ids, ids) << "double " << what;
    EXPECT_EQ(f.ids, ids) << "float " << what;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0) {
        EXPECT_TRUE(std::isinf(d.score[i]) && d.score[i] < 0) << what;
      } else {
        EXPECT_EQ(d.score[i], static_cast<double>(score[i])) << what;
        EXPECT_EQ(f.score[i], static_cast<double>(score[i])) << what;
      }
    }
  }
  EXPECT_GT(ties_seen, 20) << "the inputs should produce many equal scores";
}

TEST(SparseMla, IndexerRandomInputsAndFewerThanK) {
  // Real-valued inputs in double against the long-double brute force; with k above every visible count
  // each query keeps exactly its visible keys.
  TREECP_SEED_TRACE;
  std::mt19937_64 rng = test_rng(12);
  for (int trial = 0; trial < 6; ++trial) {
    const Row row = random_tree(rng, 6, 20);
    const int64_t window = trial % 2 ? 6 : 0;
    const int64_t topk = trial < 3 ? 4 : row.tokens() + 3;
    const Inputs in = random_inputs(row, 4, 16, 2, 8, 4, topk, window, false, rng);
    std::vector<int64_t> ids;
    std::vector<long double> score;
    indexer_oracle(row, in, ids, score);
    const Result d = run_library<double>(row, in, nullptr, false);
    EXPECT_EQ(d.ids, ids) << "trial " << trial;
    const std::vector<int64_t> n = visible_counts(row, window);
    for (int64_t q = 0; q < row.tokens(); ++q) {
      int64_t valid = 0;
      for (int64_t e = 0; e < topk; ++e) {
        const int64_t id = d.ids[static_cast<size_t>(q * topk + e)];
        if (id >= 0) {
          EXPECT_EQ(valid, e) << "padding must follow the valid entries";
          ++valid;
          EXPECT_NEAR(d.score[static_cast<size_t>(q * topk + e)], static_cast<double>(score[static_cast<size_t>(q * topk + e)]),
                      1e-12 * (1 + std::abs(static_cast<double>(score[static_cast<size_t>(q * topk + e)]))));
        }
      }
      EXPECT_EQ(valid, std::min(topk, n[static_cast<size_t>(q)])) << "query " << q;
    }
  }
}

// Random stage splits: key chunks go to random stages, each stage's keys sit in a buffer in a random
// range order; merging the stages' lists in a random order gives the single pass's ids and scores
// exactly (float, real-valued inputs: bit-identical scores wherever a key sits).
template <class T>
void check_stage_splits(uint64_t salt) {
  std::mt19937_64 rng = test_rng(salt);
  for (int trial = 0; trial < 8; ++trial) {
    const Row row = random_tree(rng, 7, 40);
    const int64_t S = row.tokens();
    const int64_t window = trial % 3 == 1 ? 9 : 0;
    const int64_t topk = trial % 2 ? 3 : 17;
    const int hi = 3, di = 11 + trial;
    Inputs in = random_inputs(row, hi, di, 1, 4, 2, topk, window, false, rng);
    const auto qi = cast<T>(in.qi), ki = cast<T>(in.ki), w = cast<T>(in.w);
    const Result one = run_library<T>(row, in, nullptr, false);
    // chunk bounds and a stage per chunk
    std::vector<int64_t> bounds{0};
    while (bounds.back() < S) bounds.push_back(std::min(S, bounds.back() + std::uniform_int_distribution<int64_t>(1, 9)(rng)));
    const int stages = 1 + trial % 4;
    std::vector<int> stage_of(bounds.size() - 1);
    for (int& s : stage_of) s = std::uniform_int_distribution<int>(0, stages - 1)(rng);
    const std::vector<Slice> pieces = split_slices(row_slices(row, window), bounds);
    std::vector<T> acc_s(static_cast<size_t>(S * topk)), part_s(acc_s.size());
    std::vector<int64_t> acc_i(acc_s.size()), part_i(acc_s.size());
    std::vector<int> stage_order(static_cast<size_t>(stages));
    std::iota(stage_order.begin(), stage_order.end(), 0);
    std::shuffle(stage_order.begin(), stage_order.end(), rng);
    for (size_t n = 0; n < stage_order.size(); ++n) {
      const int st = stage_order[n];
      // this stage's key chunks, in a random buffer order
      std::vector<size_t> chunks;
      for (size_t c = 0; c < stage_of.size(); ++c) {
        if (stage_of[c] == st) chunks.push_back(c);
      }
      std::shuffle(chunks.begin(), chunks.end(), rng);
      std::vector<TokenRange> kranges;  // in buffer order
      std::vector<T> kbuf;
      std::vector<int64_t> key_ids;
      for (size_t c : chunks) {
        kranges.push_back({bounds[c], bounds[c + 1]});
        for (int64_t t = bounds[c]; t < bounds[c + 1]; ++t) {
          key_ids.push_back(t);
          kbuf.insert(kbuf.end(), ki.begin() + t * di, ki.begin() + (t + 1) * di);
        }
      }
      std::vector<Slice> mine;
      for (const Slice& p : pieces) {
        if (stage_of[static_cast<size_t>(std::upper_bound(bounds.begin(), bounds.end(), p.k_begin) - bounds.begin() - 1)] == st) mine.push_back(p);
      }
      const std::vector<Slice> buf = to_buffer(mine, RowMap({{0, S}}), RowMap(kranges));
      cpu::IndexerArgs<T> a;
      a.shape = {S, static_cast<int64_t>(key_ids.size()), hi, di, topk};
      a.qi = cpu::dense_view<const T>(qi.data(), hi, di);
      a.w = cpu::dense_view<const T>(w.data(), hi, 1);
      a.ki = kbuf.data();
      a.ki_row_stride = di;
      a.key_ids = key_ids.data();
      a.score = n == 0 ? acc_s.data() : part_s.data();
      a.ids = n == 0 ? acc_i.data() : part_i.data();
      cpu::indexer_topk(a, buf);
      if (n > 0) cpu::topk_merge(cpu::TopkMergeArgs<T>{S, topk, acc_s.data(), acc_i.data(), part_s.data(), part_i.data()});
    }
    EXPECT_EQ(acc_i, one.ids) << "trial " << trial << " stages " << stages;
    EXPECT_EQ(std::vector<double>(acc_s.begin(), acc_s.end()), one.score) << "trial " << trial;
  }
}

TEST(SparseMla, StagedIndexerEqualsOnePassExactly) {
  TREECP_SEED_TRACE;
  check_stage_splits<float>(21);
  check_stage_splits<double>(22);
}

TEST(SparseMla, SparseAttentionMatchesOracle) {
  // Random lists (-1 entries anywhere, repeated keys across queries), double against long double and
  // float within a few times the error of a plain float evaluation of the same definitions.
  TREECP_SEED_TRACE;
  std::mt19937_64 rng = test_rng(31);
  for (int trial = 0; trial < 6; ++trial) {
    const Row row = random_tree(rng, 5, 30);
    const int64_t S = row.tokens();
    const int h = trial % 2 ? 8 : 3, dqk = trial % 2 ? 40 : 13, dv = trial % 2 ? 32 : 5;
    const Inputs in = random_inputs(row, 1, 1, h, dqk, dv, 7, 0, false, rng);
    std::vector<int64_t> ids(static_cast<size_t>(S * in.topk), -1);
    for (int64_t q = 0; q < S; ++q) {
      std::vector<int64_t> all(static_cast<size_t>(S));
      std::iota(all.begin(), all.end(), int64_t{0});
      std::shuffle(all.begin(), all.end(), rng);
      const int64_t n = std::uniform_int_distribution<int64_t>(0, std::min<int64_t>(in.topk, S))(rng);
      for (int64_t e = 0; e < n; ++e) ids[static_cast<size_t>(q * in.topk + e)] = all[static_cast<size_t>(e)];
      std::shuffle(ids.begin() + q * in.topk, ids.begin() + (q + 1) * in.topk, rng);
    }
    // The kernels directly (ids need not be visible here: the kernel sees buffer rows only).
    auto run = [&](auto tag) {
      using T = decltype(tag);
      const auto q = cast<T>(in.q), kv = cast<T>(in.kv), dout = cast<T>(in.dout);
      std::vector<T> o(static_cast<size_t>(S * h * dv)), lse(static_cast<size_t>(S * h)), dq(q.size(), T(0)), dkv(kv.size(), T(0));
      const cpu::SparseShape sh{S, S, h, dqk, dv, in.topk};
      cpu::SparseForwardArgs<T> f{sh, cpu::dense_view<const T>(q.data(), h, dqk), kv.data(), dqk, ids.data(),
                                  cpu::dense_view(o.data(), h, dv), cpu::dense_view(lse.data(), h, 1), static_cast<T>(in.scale)};
      cpu::sparse_attention_forward(f);
      cpu::SparseBackwardArgs<T> b{sh, f.q, kv.data(), dqk, ids.data(), cpu::dense_view<const T>(o.data(), h, dv),
                                   cpu::dense_view<const T>(lse.data(), h, 1), cpu::dense_view<const T>(dout.data(), h, dv),
                                   cpu::dense_view(dq.data(), h, dqk), dkv.data(), dqk, static_cast<T>(in.scale)};
      cpu::sparse_attention_backward(b);
      auto wide = [](const std::vector<T>& x) { return std::vector<double>(x.begin(), x.end()); };
      return Result{ids, {}, wide(o), wide(lse), wide(dq), wide(dkv)};
    };
    const Result ref = sparse_oracle<double, long double>(in, ids, S);
    const Result ref_fl = sparse_oracle<float, long double>(in, ids, S), ref_ff = sparse_oracle<float, float>(in, ids, S);
    const Result d = run(double{}), f = run(float{});
    const std::string what = "trial " + std::to_string(trial);
    for (auto field : {&Result::o, &Result::lse, &Result::dq, &Result::dkv}) {
      EXPECT_LE(rel_err(d.*field, ref.*field), 1e-13) << what;
      EXPECT_LE(rel_err(f.*field, ref_fl.*field), 4 * rel_err(ref_ff.*field, ref_fl.*field) + 1e-6) << what;
    }
    for (int64_t q = 0; q < S; ++q) {  // an empty list: O = 0, LSE = -inf
      if (std::all_of(ids.begin() + q * in.topk, ids.begin() + (q + 1) * in.topk, [](int64_t x) { return x < 0; })) {
        EXPECT_TRUE(std::isinf(d.lse[static_cast<size_t>(q * h)]) && d.lse[static_cast<size_t>(q * h)] < 0);
        EXPECT_EQ(d.o[static_cast<size_t>(q * h * dv)], 0.0);
      }
    }
  }
}

TEST(SparseMla, ModelDimsMatchOracle) {
  // Whole vectors in both instruction sets (H 16, Dqk 72, Dv 64, k 24) through the whole-row path, then
  // the SSE2 copy against the same oracle.
  TREECP_SEED_TRACE;
  std::mt19937_64 rng = test_rng(32);
  const Row row({{-1, 40}, {0, 30}, {0, 25}, {2, 9}});
  const Inputs in = random_inputs(row, 8, 32, 16, 72, 64, 24, 0, false, rng);
  for (const char* isa : {"", "baseline"}) {
    if (*isa) ::setenv("TREECP_CPU_ISA", isa, 1);
    const Result d = run_library<double>(row, in), f = run_library<float>(row, in);
    const Result ref = sparse_oracle<double, long double>(in, d.ids, row.tokens());
    const Result ref_ff = sparse_oracle<float, float>(in, f.ids, row.tokens());
    const Result ref_fl = sparse_oracle<float, long double>(in, f.ids, row.tokens());
    for (auto field : {&Result::o, &Result::lse, &Result::dq, &Result::dkv}) {
      EXPECT_LE(rel_err(d.*field, ref.*field), 1e-13) << isa;
      EXPECT_LE(rel_err(f.*field, ref_fl.*field), 4 * rel_err(ref_ff.*field, ref_fl.*field) + 1e-6) << isa;
    }
    ::unsetenv("TREECP_CPU_ISA");
  }
}

TEST(SparseMla, GradientsMatchFiniteDifferences) {
  // J = sum(dout * o) in double; the selection depends on the indexer inputs only, so it stays fixed
  // while q and kv move.
  TREECP_SEED_TRACE;
  std::mt19937_64 rng = test_rng(41);
  for (int trial = 0; trial < 3; ++trial) {
    const Row row = trial == 0 ? Row({{-1, 4}, {0, 3}, {0, 2}}) : random_tree(rng, 4, 5);
    const Inputs in = random_inputs(row, 2, 3, 2, 5, 3, 3, trial == 2 ? 3 : 0, false, rng);
    const Result base = run_library<double>(row, in);
    auto loss = [&](const Inputs& x) {
      const Result r = run_library<double>(row, x, nullptr, false);
      EXPECT_EQ(r.ids, base.ids);
      double j = 0;
      for (size_t i = 0; i < r.o.size(); ++i) j += x.dout[i] * r.o[i];
      return j;
    };
    const double step = 1e-5;
    auto check = [&](std::vector<double> Inputs::*field, const std::vector<double>& grad, const char* name) {
      for (size_t i = 0; i < grad.size(); ++i) {
        Inputs plus = in, minus = in;
        (plus.*field)[i] += step;
        (minus.*field)[i] -= step;
        const double fd = (loss(plus) - loss(minus)) / (2 * step);
        EXPECT_NEAR(grad[i], fd, 1e-7 * (1 + std::abs(fd))) << name << "[" << i << "] trial " << trial;
      }
    };
    check(&Inputs::q, base.dq, "dq");
    check(&Inputs::kv, base.dkv, "dkv");
  }
}

// Each trajectory alone as one causal sequence: the same selection (ids mapped back), outputs, and
// gradients summed over copies (dout split over a shared token's copies so the loss is the tree's).
TEST(SparseMla, PackedEqualsFlattenedTrajectories) {
  TREECP_SEED_TRACE;
  std::mt19937_64 rng = test_rng(51);
  for (int trial = 0; trial < 5; ++trial) {
    const Row row = random_tree(rng, 8, 9);
    const int64_t window = trial % 2 ? 5 : 0;
    const Inputs in = random_inputs(row, 2, 4, 2, 6, 4, 4, window, trial >= 3, rng);
    const Result tree = run_library<double>(row, in);
    const int64_t S = row.tokens(), K = in.topk;
    std::vector<int> copies(static_cast<size_t>(S), 0);
    std::vector<std::vector<int64_t>> paths;
    for (int32_t leaf : row.leaves()) {
      std::vector<int64_t> path;
      for (int32_t s : row.ancestor_chain(leaf)) {
        for (int64_t t = row.start(s); t < row.end(s); ++t) path.push_back(t);
      }
      for (int64_t t : path) ++copies[static_cast<size_t>(t)];
      paths.push_back(std::move(path));
    }
    std::vector<double> dq(tree.dq.size(), 0), dkv(tree.dkv.size(), 0);
    for (const auto& path : paths) {
      const auto n = static_cast<int64_t>(path.size());
      Inputs f = in;
      auto gather = [&](const std::vector<double>& x, int width) {
        std::vector<double> out;
        for (int64_t t : path) out.insert(out.end(), x.begin() + t * width, x.begin() + (t + 1) * width);
        return out;
      };
      f.qi = gather(in.qi, in.hi * in.di);
      f.ki = gather(in.ki, in.di);
      f.w = gather(in.w, in.hi);
      f.q = gather(in.q, in.h * in.dqk);
      f.kv = gather(in.kv, in.dqk);
      f.dout = gather(in.dout, in.h * in.dv);
      for (int64_t i = 0; i < n; ++i) {
        for (int x = 0; x < in.h * in.dv; ++x) f.dout[static_cast<size_t>(i * in.h * in.dv + x)] /= copies[static_cast<size_t>(path[static_cast<size_t>(i)])];
      }
      const Result r = run_library<double>(Row({{-1, n}}), f);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = path[static_cast<size_t>(i)];
        for (int64_t e = 0; e < K; ++e) {
          const int64_t fid = r.ids[static_cast<size_t>(i * K + e)];
          ASSERT_EQ(fid < 0 ? -1 : path[static_cast<size_t>(fid)], tree.ids[static_cast<size_t>(t * K + e)])
              << "trial " << trial << " token " << t << " entry " << e;
        }
        for (int x = 0; x < in.h * in.dv; ++x) {
          ASSERT_NEAR(r.o[static_cast<size_t>(i * in.h * in.dv + x)], tree.o[static_cast<size_t>(t * in.h * in.dv + x)], 1e-13);
        }
        for (int x = 0; x < in.h; ++x) ASSERT_NEAR(r.lse[static_cast<size_t>(i * in.h + x)], tree.lse[static_cast<size_t>(t * in.h + x)], 1e-13);
        for (int x = 0; x < in.h * in.dqk; ++x) dq[static_cast<size_t>(t * in.h * in.dqk + x)] += r.dq[static_cast<size_t>(i * in.h * in.dqk + x)];
        for (int x = 0; x < in.dqk; ++x) dkv[static_cast<size_t>(t * in.dqk + x)] += r.dkv[static_cast<size_t>(i * in.dqk + x)];
      }
    }
    EXPECT_LT(rel_err(dq, tree.dq), 1e-12) << "trial " << trial;
    EXPECT_LT(rel_err(dkv, tree.dkv), 1e-12) << "trial " << trial;
  }
}

TEST(SparseMla, IndexShareReusesIds) {
  // Another layer's ids: the indexer is skipped, ids come back unchanged, and the attention equals a run
  // of that layer on the same lists in any order within a list.
  TREECP_SEED_TRACE;
  std::mt19937_64 rng = test_rng(61);
  const Row row = random_tree(rng, 6, 12);
  const Inputs layer1 = random_inputs(row, 2, 4, 2, 6, 4, 5, 4, false, rng);
  const Inputs layer2 = random_inputs(row, 2, 4, 2, 6, 4, 5, 4, false, rng);
  const Result full = run_library<double>(row, layer1);
  const Result shared = run_library<double>(row, layer2, &full.ids);
  EXPECT_EQ(shared.ids, full.ids);
  EXPECT_TRUE(shared.score.empty());
  const Result ref = sparse_oracle<double, long double>(layer2, full.ids, row.tokens());
  for (auto field : {&Result::o, &Result::lse, &Result::dq, &Result::dkv}) EXPECT_LE(rel_err(shared.*field, ref.*field), 1e-13);
  std::vector<int64_t> shuffled = full.ids;
  for (int64_t q = 0; q < row.tokens(); ++q) std::shuffle(shuffled.begin() + q * 5, shuffled.begin() + (q + 1) * 5, rng);
  const Result again = run_library<double>(row, layer2, &shuffled);
  EXPECT_EQ(again.ids, shuffled);
  for (auto field : {&Result::o, &Result::lse, &Result::dq, &Result::dkv}) EXPECT_LE(rel_err(again.*field, shared.*field), 1e-13);
}

TEST(SparseMla, BadIdsAndShapesRefused) {
  const Row row({{-1, 4}, {0, 3}, {0, 2}});  // DESIGN.md's example: root 0-3, A 4-6, B 7-8
  auto expect_error = [&](std::vector<int64_t> ids, int64_t window, const std::string& needle) {
    try {
      cpu::check_selected_ids(row, window, 2, 0, 9, ids.data());
      ADD_FAILURE() << "accepted, expected: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  std::vector<int64_t> ok = {0, -1, 0, 1, 1, -1, 3, 2, 4, 0, 5, 4, 6, 3, -1, 7, 8, 3};
  EXPECT_NO_THROW(cpu::check_selected_ids(row, 0, 2, 0, 9, ok.data()));
  std::vector<int64_t> bad = ok;
  bad[16] = 6;  // query 8 (completion B) never sees completion A's token 6
  expect_error(bad, 0, "query 8, entry 0: key 6 is not visible");
  expect_error(ok, 3, "query 4, entry 1: key 0 is not visible to the query (tree and window)");
  bad = ok;
  bad[2] = 9;
  expect_error(bad, 0, "query 1, entry 0: 9 is not a token id");
  bad = ok;
  bad[3] = -2;
  expect_error(bad, 0, "query 1, entry 1: -2 is not a token id");
  bad = ok;
  bad[9] = 4;
  expect_error(bad, 0, "query 4 lists key 4 twice");
  // shapes
  SparseMlaProblem<double> p;
  p.h = 1, p.dqk = 4, p.dv = 5, p.topk = 2;
  std::vector<double> x(9 * 5, 0.5);
  p.q = x.data(), p.kv = x.data(), p.ids = ok.data();
  EXPECT_THROW(cpu::sparse_mla_reference(row, p), Error);  // dv > dqk
  p.dv = 2;
  p.topk = 0;
  EXPECT_THROW(cpu::sparse_mla_reference(row, p), Error);
  p.topk = 2;
  p.ids = nullptr;
  EXPECT_THROW(cpu::sparse_mla_reference(row, p), Error);  // no indexer inputs and no ids
}

}  // namespace
}  // namespace treecp
