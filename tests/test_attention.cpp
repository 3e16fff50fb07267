// The CPU attention algebra against independent oracles: a dense per-query softmax in long double
// built from Row::visible, each trajectory run alone as a causal sequence, finite differences, random
// stage splits merged, the DESIGN.md 9-token example, and the empty-row rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/cpu/attention.hpp"
#include "runtime/reference.hpp"
#include "runtime/row_map.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

#include "common/common.hpp"

namespace treecp {
namespace {

using cpu::AttnBackwardArgs;
using cpu::AttnForwardArgs;
using cpu::dense_view;
using cpu::HeadView;

constexpr double kInf = std::numeric_limits<double>::infinity();

using testing::max_error;
using testing::randn;
using testing::Rng;
using testing::test_rng;

// A random row of `segments` segments, lengths 1..max_len, paths up to 6 segments deep.
Row random_tree(Rng& rng, int segments, int max_len) {
  return testing::random_tree(rng, {.segments = segments, .max_len = max_len, .max_depth = 6});
}

// DESIGN.md's example: root 0-3, completion A 4-6, completion B 7-8.
Row small_example() { return Row({{-1, 4}, {0, 3}, {0, 2}}); }

struct Inputs {
  int hq = 0, hkv = 0, d = 0, dv = 0;
  int64_t window = 0;
  double scale = 0;
  std::vector<double> q, k, v, sink, dout;  // sink empty: none
  AttentionShape shape() const { return {hq, hkv, d, dv, window, scale}; }
};

Inputs random_inputs(const Row& row, int hq, int hkv, int d, int dv, int64_t window, bool sink, Rng& rng) {
  const auto S = static_cast<size_t>(row.tokens());
  Inputs in{hq, hkv, d, dv, window, 1.0 / std::sqrt(static_cast<double>(d)), {}, {}, {}, {}, {}};
  in.q = randn(S * hq * d, rng, 1.5);
  in.k = randn(S * hkv * d, rng, 1.5);
  in.v = randn(S * hkv * dv, rng);
  in.dout = randn(S * hq * dv, rng);
  if (sink) in.sink = randn(static_cast<size_t>(hq), rng, 2.0);
  return in;
}

template <class T>
std::vector<T> cast(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

// Library run in precision T on inputs rounded to T; results widened to double.
struct Result {
  std::vector<double> o, lse, dq, dk, dv, dsink;
  double dsink_terms = 0;  // dense oracle only: max over heads of sum_rows |dJ/da term|, the scale of dsink's rounding
};

template <class T>
Result run_library(const Row& row, const Inputs& in, bool backward = true) {
  const auto q = cast<T>(in.q), k = cast<T>(in.k), v = cast<T>(in.v), sink = cast<T>(in.sink), dout = cast<T>(in.dout);
  AttentionInputs<T> p;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.sink = sink.empty() ? nullptr : sink.data();
  p.dout = backward ? dout.data() : nullptr;
  const AttentionResult<T> r = attention_reference(row, in.shape(), p);
  auto wide = [](const std::vector<T>& x) { return std::vector<double>(x.begin(), x.end()); };
  return {wide(r.o), wide(r.lse), wide(r.dq), wide(r.dk), wide(r.dv), wide(r.dsink)};
}

// The dense oracle: per query and head, the visible keys from Row::visible, softmax, sink, and the
// gradients written out from the definitions, accumulated in Acc on inputs rounded to In.
template <class In, class Acc>
Result dense_oracle(const Row& row, const Inputs& in) {
  const int64_t S = row.tokens();
  const int G = in.hq / in.hkv;
  auto r = [](double x) { return static_cast<Acc>(static_cast<In>(x)); };
  Result res;
  res.o.assign(static_cast<size_t>(S * in.hq * in.dv), 0);
  res.lse.assign(static_cast<size_t>(S * in.hq), -kInf);
  res.dq.assign(static_cast<size_t>(S * in.hq * in.d), 0);
  res.dk.assign(static_cast<size_t>(S * in.hkv * in.d), 0);
  res.dv.assign(static_cast<size_t>(S * in.hkv * in.dv), 0);
  res.dsink.assign(in.sink.empty() ? 0 : static_cast<size_t>(in.hq), 0);
  std::vector<Acc> dk(res.dk.size(), 0), dv(res.dv.size(), 0), dsink(res.dsink.size(), 0), dsink_abs = dsink;
  const Acc scale = static_cast<Acc>(static_cast<In>(in.scale));
  for (int64_t i = 0; i < S; ++i) {
    std::vector<int64_t> keys;
    for (int64_t j = 0; j < S; ++j) {
      if (row.visible(i, j, in.window)) keys.push_back(j);
    }
    for (int h = 0; h < in.hq; ++h) {
      const int g = h / G;
      const auto qi = [&](int c) { return r(in.q[static_cast<size_t>((i * in.hq + h) * in.d + c)]); };
      const auto kj = [&](int64_t j, int c) { return r(in.k[static_cast<size_t>((j * in.hkv + g) * in.d + c)]); };
      const auto vj = [&](int64_t j, int c) { return r(in.v[static_cast<size_t>((j * in.hkv + g) * in.dv + c)]); };
      std::vector<Acc> s(keys.size()), o(static_cast<size_t>(in.dv), 0);
      Acc mx = -std::numeric_limits<Acc>::infinity();
      for (size_t t = 0; t < keys.size(); ++t) {
        Acc dot = 0;
        for (int c = 0; c < in.d; ++c) dot += qi(c) * kj(keys[t], c);
        s[t] = dot * scale;
        mx = std::max(mx, s[t]);
      }
      Acc z = 0;
      for (Acc x : s) z += std::exp(x - mx);
      const Acc lse = keys.empty() ? -std::numeric_limits<Acc>::infinity() : mx + std::log(z);
      std::vector<Acc> p(keys.size());
      for (size_t t = 0; t < keys.size(); ++t) {
        p[t] = std::exp(s[t] - lse);
        for (int c = 0; c < in.dv; ++c) o[static_cast<size_t>(c)] += p[t] * vj(keys[t], c);
      }
      // the sink: token weight w = e^L / (e^L + e^a)
      Acc w = keys.empty() ? 0 : 1;
      if (!in.sink.empty() && !keys.empty()) {
        const Acc a = r(in.sink[static_cast<size_t>(h)]);
        w = 1 / (1 + std::exp(a - lse));
      }
      const size_t ro = static_cast<size_t>((i * in.hq + h) * in.dv);
      for (int c = 0; c < in.dv; ++c) res.o[ro + c] = static_cast<double>(w * o[static_cast<size_t>(c)]);
      res.lse[static_cast<size_t>(i * in.hq + h)] = static_cast<double>(lse);
      if (keys.empty()) continue;
      // y = w o: dJ/do = w g, dJ/dL = w (1 - w) g.o, dJ/da = -w (1 - w) g.o
      Acc go = 0;
      std::vector<Acc> dy(static_cast<size_t>(in.dv));
      for (int c = 0; c < in.dv; ++c) {
        dy[static_cast<size_t>(c)] = r(in.dout[ro + c]);
        go += dy[static_cast<size_t>(c)] * o[static_cast<size_t>(c)];
      }
      const Acc dl = w * (1 - w) * go;
      if (!in.sink.empty()) {
        dsink[static_cast<size_t>(h)] -= dl;
        dsink_abs[static_cast<size_t>(h)] += std::abs(dl);
      }
      for (size_t t = 0; t < keys.size(); ++t) {
        Acc gv = 0;
        for (int c = 0; c < in.dv; ++c) gv += dy[static_cast<size_t>(c)] * vj(keys[t], c);
        // dJ/ds = w p (g.v - g.o) + p dJ/dL
        const Acc ds = w * p[t] * (gv - go) + p[t] * dl;
        const int64_t j = keys[t];
        for (int c = 0; c < in.d; ++c) {
          res.dq[static_cast<size_t>((i * in.hq + h) * in.d + c)] += static_cast<double>(scale * ds * kj(j, c));
          dk[static_cast<size_t>((j * in.hkv + g) * in.d + c)] += scale * ds * qi(c);
        }
        for (int c = 0; c < in.dv; ++c) {
          dv[static_cast<size_t>((j * in.hkv + g) * in.dv + c)] += w * p[t] * dy[static_cast<size_t>(c)];
        }
      }
    }
  }
  for (size_t x = 0; x < dk.size(); ++x) res.dk[x] = static_cast<double>(dk[x]);
  for (size_t x = 0; x < dv.size(); ++x) res.dv[x] = static_cast<double>(dv[x]);
  for (size_t x = 0; x < dsink.size(); ++x) {
    res.dsink[x] = static_cast<double>(dsink[x]);
    res.dsink_terms = std::max(res.dsink_terms, static_cast<double>(dsink_abs[x]));
  }
  return res;
}

bool all_finite(const std::vector<double>& x) {
  return std::all_of(x.begin(), x.end(), [](double e) { return std::isfinite(e); });
}

// Every array of the library run within k x (same-precision oracle's error) + atol of the long double oracle.
// dsink is one sum over all rows per head, so the same-precision oracle's error on it is a single,
// sometimes lucky, sample; its atol adds one rounding of T per term of that sum (2 eps sum |term|).
template <class T>
void expect_matches_oracle(const Row& row, const Inputs& in, double k, double atol, const std::string& what) {
  const Result got = run_library<T>(row, in);
  const Result exact = dense_oracle<T, long double>(row, in);
  const Result same = dense_oracle<T, T>(row, in);
  const char* names[] = {"o", "lse", "dq", "dk", "dv", "dsink"};
  const std::vector<double>* g[] = {&got.o, &got.lse, &got.dq, &got.dk, &got.dv, &got.dsink};
  const std::vector<double>* e[] = {&exact.o, &exact.lse, &exact.dq, &exact.dk, &exact.dv, &exact.dsink};
  const std::vector<double>* s[] = {&same.o, &same.lse, &same.dq, &same.dk, &same.dv, &same.dsink};
  for (int a = 0; a < 6; ++a) {
    const double ref_err = max_error(*s[a], *e[a]);
    const double sum_atol = a == 5 ? 2 * std::numeric_limits<T>::epsilon() * exact.dsink_terms : 0.0;
    EXPECT_LE(max_error(*g[a], *e[a]), k * ref_err + atol + sum_atol) << what << " " << names[a] << " (oracle in same precision "
                                                          << ref_err << ")";
  }
}

// ---------------------------------------------------------------------------------------------------

TEST(Attention, MatchesDenseOracleOnRandomTreesDouble) {
  TREECP_SEED_TRACE;
  Rng rng = test_rng(101);
  struct Config {
    int hq, hkv, d, dv;
  };
  for (const Config c : {Config{2, 2, 8, 8}, Config{4, 2, 5, 3}, Config{3, 1, 16, 9}, Config{4, 1, 1, 1}}) {
    for (int64_t window : {0, 1, 3, 9}) {
      for (bool sink : {false, true}) {
        const Row row = random_tree(rng, 8, 9);
        const Inputs in = random_inputs(row, c.hq, c.hkv, c.d, c.dv, window, sink, rng);
        expect_matches_oracle<double>(row, in, 4.0, 1e-14,
                                      "hq " + std::to_string(c.hq) + " hkv " + std::to_string(c.hkv) + " window " +
                                          std::to_string(window) + " sink " + std::to_string(sink));
      }
    }
  }
}

TEST(Attention, MatchesDenseOracleOnRandomTreesFloat) {
  TREECP_SEED_TRACE;
  Rng rng = test_rng(202);
  for (int64_t window : {0, 4}) {
    for (bool sink : {false, true}) {
      // d = dv = 24: the vector tiles (8 floats) and their tails both run
      const Row row = random_tree(rng, 10, 40);
      const Inputs in = random_inputs(row, 4, 2, 24, 20, window, sink, rng);
      expect_matches_oracle<float>(row, in, 4.0, 1e-7, "float window " + std::to_string(window));
    }
  }
}

// The x86-64 baseline copy of the kernels (SSE2, C library exp) against the same oracle; on machines
// without AVX2 the default run already covers it.
TEST(Attention, BaselineInstructionSetMatchesDenseOracle) {
  ::setenv("TREECP_CPU_ISA", "baseline", 1);
  TREECP_SEED_TRACE;
  Rng rng = test_rng(250);
  for (int64_t window : {0, 70}) {
    const Row row({{-1, 140}, {0, 70}, {0, 9}});
    const Inputs in = random_inputs(row, 4, 2, 20, 12, window, true, rng);
    expect_matches_oracle<double>(row, in, 4.0, 1e-14, "baseline double window " + std::to_string(window));
    expect_matches_oracle<float>(row, in, 4.0, 1e-7, "baseline float window " + std::to_string(window));
  }
  ::unsetenv("TREECP_CPU_ISA");
}

TEST(Attention, LongSegmentsCrossManyTiles) {
  // Segments longer than the key block (64) and query blocks (128 rows / group) with windows that
  // cut tiles in the middle: checks tile bounds and the online softmax's rescaling.
  TREECP_SEED_TRACE;
  Rng rng = test_rng(303);
  const Row row({{-1, 150}, {0, 90}, {1, 70}, {0, 130}, {-1, 77}});
  for (int64_t window : {0, 65, 200}) {
    Inputs in = random_inputs(row, 4, 1, 8, 8, window, true, rng);
    // a few large scores so that the running maximum moves between key blocks
    for (size_t i = 0; i < in.k.size(); i += 97) in.k[i] *= 6;
    expect_matches_oracle<double>(row, in, 4.0, 1e-14, "window " + std::to_string(window));
  }
}

TEST(Attention, ModelHeadDimsMatchDenseOracle) {
  // D = Dv = 64 as in the benchmark shape: full vector tiles in both instruction-set widths.
  TREECP_SEED_TRACE;
  Rng rng = test_rng(350);
  const Row row({{-1, 130}, {0, 70}, {1, 40}, {0, 66}});
  for (int64_t window : {0, 100}) {
    const Inputs in = random_inputs(row, 4, 1, 64, 64, window, window > 0, rng);
    expect_matches_oracle<double>(row, in, 4.0, 1e-14, "D 64 double window " + std::to_string(window));
    expect_matches_oracle<float>(row, in, 4.0, 1e-7, "D 64 float window " + std::to_string(window));
  }
}

// (a) Each trajectory as an ordinary causal sequence with its prefix duplicated.
TEST(Attention, PackedEqualsFlattenedTrajectories) {
  TREECP_SEED_TRACE;
  Rng rng = test_rng(404);
  for (int trial = 0; trial < 6; ++trial) {
    const Row row = random_tree(rng, 9, 8);
    const int64_t window = trial % 3 == 2 ? 4 : 0;
    const Inputs in = random_inputs(row, 4, 2, 6, 5, window, trial % 2 == 1, rng);
    const Result tree = run_library<double>(row, in);
    const int64_t S = row.tokens();
    // copies[t]: how many trajectories contain token t (leaves under its segment)
    std::vector<int> copies(static_cast<size_t>(S), 0);
    const std::vector<int32_t> leaves = row.leaves();
    std::vector<std::vector<int64_t>> paths;
    for (int32_t leaf : leaves) {
      std::vector<int64_t> path;
      for (int32_t s : row.ancestor_chain(leaf)) {
        for (int64_t t = row.start(s); t < row.end(s); ++t) path.push_back(t);
      }
      for (int64_t t : path) ++copies[static_cast<size_t>(t)];
      paths.push_back(std::move(path));
    }
    Result sum;
    sum.dq.assign(tree.dq.size(), 0);
    sum.dk.assign(tree.dk.size(), 0);
    sum.dv.assign(tree.dv.size(), 0);
    sum.dsink.assign(tree.dsink.size(), 0);
    for (const auto& path : paths) {
      const auto n = static_cast<int64_t>(path.size());
      const Row flat({{-1, n}});
      Inputs f = in;
      auto gather = [&](const std::vector<double>& x, int width) {
        std::vector<double> out;
        for (int64_t t : path) out.insert(out.end(), x.begin() + t * width, x.begin() + (t + 1) * width);
        return out;
      };
      f.q = gather(in.q, in.hq * in.d);
      f.k = gather(in.k, in.hkv * in.d);
      f.v = gather(in.v, in.hkv * in.dv);
      f.dout = gather(in.dout, in.hq * in.dv);
      // split each query's upstream gradient over its copies, so the summed loss is the tree's
      for (int64_t i = 0; i < n; ++i) {
        for (int x = 0; x < in.hq * in.dv; ++x) f.dout[static_cast<size_t>(i * in.hq * in.dv + x)] /= copies[path[i]];
      }
      const Result r = run_library<double>(flat, f);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = path[static_cast<size_t>(i)];
        for (int x = 0; x < in.hq * in.dv; ++x) {
          ASSERT_NEAR(r.o[static_cast<size_t>(i * in.hq * in.dv + x)], tree.o[static_cast<size_t>(t * in.hq * in.dv + x)],
                      1e-13)
              << "trial " << trial << " token " << t;
        }
        for (int h = 0; h < in.hq; ++h) {
          ASSERT_NEAR(r.lse[static_cast<size_t>(i * in.hq + h)], tree.lse[static_cast<size_t>(t * in.hq + h)], 1e-13);
        }
        auto add = [&](std::vector<double>& acc, const std::vector<double>& part, int width) {
          for (int x = 0; x < width; ++x) acc[static_cast<size_t>(t * width + x)] += part[static_cast<size_t>(i * width + x)];
        };
        add(sum.dq, r.dq, in.hq * in.d);
        add(sum.dk, r.dk, in.hkv * in.d);
        add(sum.dv, r.dv, in.hkv * in.dv);
      }
      for (size_t h = 0; h < sum.dsink.size(); ++h) sum.dsink[h] += r.dsink[h];
    }
    EXPECT_LT(max_error(sum.dq, tree.dq), 1e-12) << "trial " << trial;
    EXPECT_LT(max_error(sum.dk, tree.dk), 1e-12) << "trial " << trial;
    EXPECT_LT(max_error(sum.dv, tree.dv), 1e-12) << "trial " << trial;
    EXPECT_LT(max_error(sum.dsink, tree.dsink), 1e-12) << "trial " << trial;
  }
}

// (b) Central differences of J = sum(dout * y) in double.
TEST(Attention, GradientsMatchFiniteDifferences) {
  TREECP_SEED_TRACE;
  Rng rng = test_rng(505);
  for (int trial = 0; trial < 4; ++trial) {
    const Row row = trial == 0 ? small_example() : random_tree(rng, 4, 4);
    const int64_t window = trial % 2 == 1 ? 3 : 0;
    Inputs in = random_inputs(row, 2, 1, 3, 2, window, true, rng);
    const Result base = run_library<double>(row, in);
    auto loss = [&](const Inputs& x) {
      const Result r = run_library<double>(row, x, false);
      double j = 0;
      for (size_t i = 0; i < r.o.size(); ++i) j += x.dout[i] * r.o[i];
      return j;
    };
    const double h = 1e-5;
    auto check = [&](std::vector<double> Inputs::*field, const std::vector<double>& grad, const char* name) {
      for (size_t i = 0; i < grad.size(); ++i) {
        Inputs plus = in, minus = in;
        (plus.*field)[i] += h;
        (minus.*field)[i] -= h;
        const double fd = (loss(plus) - loss(minus)) / (2 * h);
        EXPECT_NEAR(grad[i], fd, 1e-8 * (1 + std::abs(fd))) << name << "[" << i << "] trial " << trial;
      }
    };
    check(&Inputs::q, base.dq, "dq");
    check(&Inputs::k, base.dk, "dk");
    check(&Inputs::v, base.dv, "dv");
    check(&Inputs::sink, base.dsink, "dsink");
  }
}

// ---- stage form: random splits into ranks (query rows) and stages (keys), merged

// sorted canonical ids -> one range per run of consecutive ids, laid out in that order
RowMap compact_map(const std::vector<int64_t>& tokens) {
  std::vector<TokenRange> runs;
  for (int64_t t : tokens) {
    if (!runs.empty() && runs.back().end == t) {
      ++runs.back().end;
    } else {
      runs.push_back({t, t + 1});
    }
  }
  return RowMap(std::move(runs));
}

template <class X>
std::vector<X> gather_rows(const std::vector<X>& x, const std::vector<int64_t>& rows, int64_t width) {
  std::vector<X> out;
  out.reserve(rows.size() * static_cast<size_t>(width));
  for (int64_t t : rows) out.insert(out.end(), x.begin() + t * width, x.begin() + (t + 1) * width);
  return out;
}

template <class X>
void scatter_add(std::vector<X>& dst, const std::vector<X>& src, const std::vector<int64_t>& rows, int64_t width) {
  for (size_t i = 0; i < rows.size(); ++i) {
    for (int64_t x = 0; x < width; ++x) dst[static_cast<size_t>(rows[i] * width + x)] += src[i * width + x];
  }
}

// (c) Keys split at random into stages (arbitrary token sets), queries split into contiguous owner
// ranges; per owner: stage forwards in buffer coordinates, merged, sink once; staged backward with the
// complete O/LSE, and again through merge_backward with each stage's own O/LSE. Both equal one shot.
TEST(Attention, RandomStageSplitsEqualOneShot) {
  TREECP_SEED_TRACE;
  Rng rng = test_rng(606);
  for (int trial = 0; trial < 8; ++trial) {
    const Row row = random_tree(rng, 7, 12);
    const int64_t S = row.tokens();
    const int64_t window = trial % 4 == 3 ? 5 : 0;
    const Inputs in = random_inputs(row, 4, 2, 6, 4, window, true, rng);
    const Result one = run_library<double>(row, in);
    const int hq = in.hq, hkv = in.hkv, d = in.d, dv = in.dv;
    const int n_stages = 1 + trial % 4;
    const int n_owners = 1 + (trial * 3) % 5;

    std::vector<std::vector<int64_t>> stage_keys(static_cast<size_t>(n_stages));
    for (int64_t t = 0; t < S; ++t) {
      stage_keys[std::uniform_int_distribution<size_t>(0, n_stages - 1)(rng)].push_back(t);
    }
    std::vector<int64_t> cuts{0, S};
    for (int i = 1; i < n_owners; ++i) cuts.push_back(std::uniform_int_distribution<int64_t>(0, S)(rng));
    std::sort(cuts.begin(), cuts.end());

    const std::vector<Slice> canonical = row_slices(row, window);
    std::vector<double> o(one.o.size()), lse(one.lse.size()), dq(one.dq.size(), 0), dk(one.dk.size(), 0),
        dvv(one.dv.size(), 0), dsink(static_cast<size_t>(hq), 0);
    std::vector<double> dq2 = dq, dk2 = dk, dv2 = dvv;
    for (int owner = 0; owner < n_owners; ++owner) {
      std::vector<int64_t> qrows;
      for (int64_t t = cuts[owner]; t < cuts[owner + 1]; ++t) qrows.push_back(t);
      const auto nq = static_cast<int64_t>(qrows.size());
      const auto q = gather_rows(in.q, qrows, hq * d);
      const auto dout = gather_rows(in.dout, qrows, hq * dv);
      std::vector<std::vector<double>> o_r(static_cast<size_t>(n_stages)), l_r(static_cast<size_t>(n_stages));
      std::vector<std::vector<Slice>> slices_r(static_cast<size_t>(n_stages));
      for (int st = 0; st < n_stages; ++st) {
        const auto& keys = stage_keys[static_cast<size_t>(st)];
        slices_r[st] = to_buffer(canonical, compact_map(qrows), compact_map(keys));
        const auto k = gather_rows(in.k, keys, hkv * d), v = gather_rows(in.v, keys, hkv * dv);
        o_r[st].resize(static_cast<size_t>(nq * hq * dv));
        l_r[st].resize(static_cast<size_t>(nq * hq));
        const int64_t nk = static_cast<int64_t>(keys.size());
        cpu::attention_forward(AttnForwardArgs<double>{in.shape(), nq, nk, dense_view(q.data(), hq, d),
                                                       dense_view(k.data(), hkv, d), dense_view(v.data(), hkv, dv),
                                                       dense_view(o_r[st].data(), hq, dv),
                                                       dense_view(l_r[st].data(), hq, 1)},
                               slices_r[st]);
      }
      std::vector<HeadView<const double>> ov, lv;
      for (int st = 0; st < n_stages; ++st) {
        ov.push_back(dense_view<const double>(o_r[st].data(), hq, dv));
        lv.push_back(dense_view<const double>(l_r[st].data(), hq, 1));
      }
      std::vector<double> om(static_cast<size_t>(nq * hq * dv)), lm(static_cast<size_t>(nq * hq)), y(om.size());
      const cpu::MergeArgs<double> margs{nq, hq, dv, n_stages, ov.data(), lv.data(), dense_view(om.data(), hq, dv),
                                         dense_view(lm.data(), hq, 1)};
      cpu::merge_forward(margs);
      const cpu::SinkArgs<double> sargs{nq, hq, dv, in.sink.data(), dense_view<const double>(om.data(), hq, dv),
                                        dense_view<const double>(lm.data(), hq, 1), dense_view(y.data(), hq, dv)};
      cpu::sink_forward(sargs);
      for (int64_t i = 0; i < nq; ++i) {
        for (int x = 0; x < hq * dv; ++x) o[static_cast<size_t>(qrows[i] * hq * dv + x)] = y[static_cast<size_t>(i * hq * dv + x)];
        for (int h = 0; h < hq; ++h) lse[static_cast<size_t>(qrows[i] * hq + h)] = lm[static_cast<size_t>(i * hq + h)];
      }

      // backward: sink once, then every stage with the complete O/LSE
      std::vector<double> do_tok(om.size()), dlse(lm.size());
      cpu::sink_backward(cpu::SinkBackwardArgs<double>{sargs, dense_view(dout.data(), hq, dv),
                                                       dense_view(do_tok.data(), hq, dv), dense_view(dlse.data(), hq, 1),
                                                       dsink.data()});
      // the other interface: per-stage adjoints from merge_backward, each stage with its own O/LSE
      std::vector<std::vector<double>> do_r(static_cast<size_t>(n_stages)), dl_r(static_cast<size_t>(n_stages));
      std::vector<HeadView<double>> dov, dlv;
      for (int st = 0; st < n_stages; ++st) {
        do_r[st].resize(om.size());
        dl_r[st].resize(lm.size());
        dov.push_back(dense_view(do_r[st].data(), hq, dv));
        dlv.push_back(dense_view(dl_r[st].data(), hq, 1));
      }
      cpu::merge_backward(cpu::MergeBackwardArgs<double>{margs, dense_view<const double>(do_tok.data(), hq, dv),
                                                         dense_view<const double>(dlse.data(), hq, 1), dov.data(),
                                                         dlv.data()});
      std::vector<double> dq_own(static_cast<size_t>(nq * hq * d), 0), dq_own2 = dq_own;
      for (int st = 0; st < n_stages; ++st) {
        const auto& keys = stage_keys[static_cast<size_t>(st)];
        const auto k = gather_rows(in.k, keys, hkv * d), v = gather_rows(in.v, keys, hkv * dv);
        std::vector<double> dk_buf(k.size(), 0), dv_buf(v.size(), 0), dk_buf2 = dk_buf, dv_buf2 = dv_buf;
        AttnBackwardArgs<double> b{in.shape(),
                                   nq,
                                   static_cast<int64_t>(keys.size()),
                                   dense_view(q.data(), hq, d),
                                   dense_view(k.data(), hkv, d),
                                   dense_view(v.data(), hkv, dv),
                                   dense_view<const double>(om.data(), hq, dv),
                                   dense_view<const double>(lm.data(), hq, 1),
                                   dense_view<const double>(do_tok.data(), hq, dv),
                                   dense_view<const double>(dlse.data(), hq, 1),
                                   dense_view(dq_own.data(), hq, d),
                                   dense_view(dk_buf.data(), hkv, d),
                                   dense_view(dv_buf.data(), hkv, dv)};
        cpu::attention_backward(b, slices_r[st]);
        b.o = dense_view<const double>(o_r[st].data(), hq, dv);
        b.lse = dense_view<const double>(l_r[st].data(), hq, 1);
        b.dout = dense_view<const double>(do_r[st].data(), hq, dv);
        b.dlse = dense_view<const double>(dl_r[st].data(), hq, 1);
        b.dq = dense_view(dq_own2.data(), hq, d);
        b.dk = dense_view(dk_buf2.data(), hkv, d);
        b.dv = dense_view(dv_buf2.data(), hkv, dv);
        cpu::attention_backward(b, slices_r[st]);
        scatter_add(dk, dk_buf, keys, hkv * d);
        scatter_add(dvv, dv_buf, keys, hkv * dv);
        scatter_add(dk2, dk_buf2, keys, hkv * d);
        scatter_add(dv2, dv_buf2, keys, hkv * dv);
      }
      scatter_add(dq, dq_own, qrows, hq * d);
      scatter_add(dq2, dq_own2, qrows, hq * d);
    }
    const std::string what = "trial " + std::to_string(trial) + " stages " + std::to_string(n_stages) + " owners " +
                             std::to_string(n_owners);
    EXPECT_LT(max_error(o, one.o), 1e-12) << what;
    EXPECT_LT(max_error(lse, one.lse), 1e-12) << what;
    EXPECT_LT(max_error(dq, one.dq), 1e-12) << what;
    EXPECT_LT(max_error(dk, one.dk), 1e-12) << what;
    EXPECT_LT(max_error(dvv, one.dv), 1e-12) << what;
    EXPECT_LT(max_error(dsink, one.dsink), 1e-12) << what;
    EXPECT_LT(max_error(dq2, one.dq), 1e-12) << what << " (merge_backward interface)";
    EXPECT_LT(max_error(dk2, one.dk), 1e-12) << what << " (merge_backward interface)";
    EXPECT_LT(max_error(dv2, one.dv), 1e-12) << what << " (merge_backward interface)";
  }
}

TEST(Attention, BufferSlicesKeepExactlyTheMappedPairs) {
  TREECP_SEED_TRACE;
  Rng rng = test_rng(707);
  for (int trial = 0; trial < 20; ++trial) {
    const Row row = random_tree(rng, 6, 10);
    const int64_t S = row.tokens();
    const int64_t window = trial % 2 ? 4 : 0;
    std::vector<int64_t> qs, ks;
    for (int64_t t = 0; t < S; ++t) {
      if (rng() % 2) qs.push_back(t);
      if (rng() % 3) ks.push_back(t);
    }
    // the query runs laid out in reverse order, so buffer rows are not token order
    std::vector<TokenRange> q_runs = compact_map(qs).ranges();
    std::reverse(q_runs.begin(), q_runs.end());
    const RowMap qmap(q_runs), kmap = compact_map(ks);
    std::vector<int64_t> q_token(static_cast<size_t>(qmap.rows()));
    for (size_t i = 0; i < qmap.ranges().size(); ++i) {
      for (int64_t t = qmap.ranges()[i].begin; t < qmap.ranges()[i].end; ++t)
        q_token[static_cast<size_t>(qmap.offset(i) + t - qmap.ranges()[i].begin)] = t;
    }
    const auto slices = to_buffer(row_slices(row, window), qmap, kmap);
    std::vector<char> seen(static_cast<size_t>(qs.size() * ks.size()), 0);
    int64_t area = 0;
    for (const Slice& s : slices) {
      area += s.area();
      for (int64_t qb = s.q_begin; qb < s.q_end; ++qb) {
        for (int64_t kb = s.k_begin; kb < s.k_end; ++kb) {
          if (!s.contains(qb, kb)) continue;
          ASSERT_GE(qb, 0);
          const int64_t q = q_token[static_cast<size_t>(qb)], k = ks[static_cast<size_t>(kb)];
          EXPECT_TRUE(row.visible(q, k, window)) << "q " << q << " k " << k;
          EXPECT_EQ(seen[static_cast<size_t>(qb * ks.size() + kb)]++, 0) << "pair twice";
        }
      }
    }
    int64_t expected = 0;
    for (int64_t q : qs) {
      for (int64_t k : ks) expected += row.visible(q, k, window);
    }
    EXPECT_EQ(area, expected) << "trial " << trial;
  }
  // the header's example: queries {4,5,6} against fetched keys {2,3}
  const auto stage = to_buffer(row_slices(small_example()), RowMap({{4, 7}}), RowMap({{2, 4}}));
  ASSERT_EQ(stage.size(), 1u);
  EXPECT_EQ(stage[0].q_begin, 0);
  EXPECT_EQ(stage[0].q_end, 3);
  EXPECT_EQ(stage[0].k_begin, 0);
  EXPECT_EQ(stage[0].k_end, 2);
  EXPECT_EQ(stage[0].area(), 6);
  EXPECT_THROW(RowMap({{0, 4}, {2, 6}}), Error);  // canonical overlap
  EXPECT_THROW(RowMap({{6, 4}}), Error);          // reversed range
}

// (d) DESIGN.md's 9-token example with a window of 3: query 8 sees physical 3, 7, 8 and never A.
TEST(Attention, WindowNeverReachesSibling) {
  const Row row = small_example();
  TREECP_SEED_TRACE;
  Rng rng = test_rng(808);
  Inputs in = random_inputs(row, 1, 1, 4, 3, 3, false, rng);
  std::vector<std::vector<int64_t>> seen(9);
  for (const Slice& s : row_slices(row, 3)) {
    for (int64_t q = s.q_begin; q < s.q_end; ++q) {
      for (int64_t k = s.k_begin; k < s.k_end; ++k) {
        if (s.contains(q, k)) seen[static_cast<size_t>(q)].push_back(k);
      }
    }
  }
  std::sort(seen[8].begin(), seen[8].end());
  EXPECT_EQ(seen[8], (std::vector<int64_t>{3, 7, 8}));
  std::sort(seen[6].begin(), seen[6].end());
  EXPECT_EQ(seen[6], (std::vector<int64_t>{4, 5, 6}));

  const Result base = run_library<double>(row, in);
  // O[8] by hand: softmax over keys 3, 7, 8
  double s[3], mx = -kInf;
  const int64_t keys[3] = {3, 7, 8};
  for (int t = 0; t < 3; ++t) {
    s[t] = 0;
    for (int c = 0; c < 4; ++c) s[t] += in.q[8 * 4 + c] * in.k[static_cast<size_t>(keys[t] * 4 + c)];
    s[t] *= in.scale;
    mx = std::max(mx, s[t]);
  }
  double z = 0;
  for (double x : s) z += std::exp(x - mx);
  for (int c = 0; c < 3; ++c) {
    double o = 0;
    for (int t = 0; t < 3; ++t) o += std::exp(s[t] - mx) / z * in.v[static_cast<size_t>(keys[t] * 3 + c)];
    EXPECT_NEAR(base.o[static_cast<size_t>(8 * 3 + c)], o, 1e-14);
  }
  // Changing completion A's keys and values changes nothing of B's outputs.
  Inputs changed = in;
  for (int64_t t = 4; t < 7; ++t) {
    for (int c = 0; c < 4; ++c) changed.k[static_cast<size_t>(t * 4 + c)] += 3.0;
    for (int c = 0; c < 3; ++c) changed.v[static_cast<size_t>(t * 3 + c)] -= 2.0;
  }
  const Result other = run_library<double>(row, changed);
  for (size_t i = 7 * 3; i < 9 * 3; ++i) EXPECT_EQ(base.o[i], other.o[i]);
  EXPECT_NE(base.o[6 * 3], other.o[6 * 3]);  // the change is seen where it should be
  // B's upstream gradients never reach A's keys and values, nor the root's and A's queries.
  Inputs regrad = in;
  for (size_t i = 7 * 3; i < 9 * 3; ++i) regrad.dout[i] *= -5.0;
  const Result third = run_library<double>(row, regrad);
  for (size_t i = 4 * 4; i < 7 * 4; ++i) EXPECT_EQ(base.dk[i], third.dk[i]);
  for (size_t i = 4 * 3; i < 7 * 3; ++i) EXPECT_EQ(base.dv[i], third.dv[i]);
  for (size_t i = 0; i < 7 * 4; ++i) EXPECT_EQ(base.dq[i], third.dq[i]);
  EXPECT_NE(base.dk[3 * 4], third.dk[3 * 4]);  // root token 3 is in B's window
  // without a window, query 8 sees the root and B, still not A
  const auto full = row_slices(row, 0);
  for (const Slice& sl : full) {
    for (int64_t k = 4; k < 7; ++k) EXPECT_FALSE(sl.contains(8, k));
  }
}

// (e) Rows with no key: LSE = -inf, O = 0, and nothing downstream becomes NaN.
TEST(Attention, EmptyRowsAndNegInfMergeWithoutNaN) {
  const int hq = 2, hkv = 1, d = 3, dv = 2;
  const int64_t rows = 6;
  TREECP_SEED_TRACE;
  Rng rng = test_rng(909);
  const auto q = randn(rows * hq * d, rng), k = randn(rows * hkv * d, rng), v = randn(rows * hkv * dv, rng);
  const AttentionShape sh{hq, hkv, d, dv, 0, 0.5};
  // stage A covers rows 0-2, stage B rows 2-3; rows 4, 5 have no key anywhere
  const std::vector<Slice> a{make_slice(0, 3, 0, 3, 0, 100)}, b{make_slice(2, 4, 3, 6, -100, 100)};
  std::vector<double> oa(rows * hq * dv, 7.0), la(rows * hq, 7.0), ob = oa, lb = la;
  auto fwd = [&](const std::vector<Slice>& sl, std::vector<double>& o, std::vector<double>& l) {
    cpu::attention_forward(AttnForwardArgs<double>{sh, rows, rows, dense_view(q.data(), hq, d),
                                                   dense_view(k.data(), hkv, d), dense_view(v.data(), hkv, dv),
                                                   dense_view(o.data(), hq, dv), dense_view(l.data(), hq, 1)},
                           sl);
  };
  fwd(a, oa, la);
  fwd(b, ob, lb);
  for (int64_t r = 3; r < rows; ++r) {
    for (int h = 0; h < hq; ++h) {
      EXPECT_EQ(la[static_cast<size_t>(r * hq + h)], -kInf);
      for (int c = 0; c < dv; ++c) EXPECT_EQ(oa[static_cast<size_t>((r * hq + h) * dv + c)], 0.0);
    }
  }
  EXPECT_EQ(lb[0], -kInf);
  EXPECT_TRUE(std::isfinite(lb[2 * hq]));

  const HeadView<const double> ov[2] = {dense_view<const double>(oa.data(), hq, dv), dense_view<const double>(ob.data(), hq, dv)};
  const HeadView<const double> lv[2] = {dense_view<const double>(la.data(), hq, 1), dense_view<const double>(lb.data(), hq, 1)};
  std::vector<double> om(oa.size(), 9.0), lm(la.size(), 9.0);
  const cpu::MergeArgs<double> margs{rows, hq, dv, 2, ov, lv, dense_view(om.data(), hq, dv), dense_view(lm.data(), hq, 1)};
  cpu::merge_forward(margs);
  EXPECT_TRUE(all_finite(om));
  for (int64_t r = 0; r < rows; ++r) {
    for (int h = 0; h < hq; ++h) {
      const auto i = static_cast<size_t>(r * hq + h);
      // merging with -inf returns the other part exactly
      const double expected = r < 2 ? la[i] : r == 3 ? lb[i] : r >= 4 ? -kInf : lm[i];
      EXPECT_EQ(lm[i], expected) << "row " << r;
    }
  }
  for (size_t i = 0; i < 2 * hq * dv; ++i) EXPECT_EQ(om[i], oa[i]);

  // a sink on empty rows: y = 0, finite gradients, nothing into the sink logit
  std::vector<double> sink{0.3, -1.2}, y(om.size()), g = randn(om.size(), rng), do_tok(om.size()), dl(lm.size()),
      dsink(2, 0.0);
  const cpu::SinkArgs<double> sargs{rows, hq, dv, sink.data(), dense_view<const double>(om.data(), hq, dv),
                                    dense_view<const double>(lm.data(), hq, 1), dense_view(y.data(), hq, dv)};
  cpu::sink_forward(sargs);
  cpu::sink_backward(cpu::SinkBackwardArgs<double>{sargs, dense_view<const double>(g.data(), hq, dv),
                                                   dense_view(do_tok.data(), hq, dv), dense_view(dl.data(), hq, 1),
                                                   dsink.data()});
  EXPECT_TRUE(all_finite(y) && all_finite(do_tok) && all_finite(dl) && all_finite(dsink));
  for (size_t i = 4 * hq * dv; i < y.size(); ++i) EXPECT_EQ(y[i], 0.0);

  // merge backward: parts with -inf and merged rows with -inf get zero adjoints, never NaN
  std::vector<double> d0(om.size()), d1(om.size()), l0(lm.size()), l1(lm.size());
  const HeadView<double> dov[2] = {dense_view(d0.data(), hq, dv), dense_view(d1.data(), hq, dv)};
  const HeadView<double> dlv[2] = {dense_view(l0.data(), hq, 1), dense_view(l1.data(), hq, 1)};
  cpu::merge_backward(cpu::MergeBackwardArgs<double>{margs, dense_view<const double>(do_tok.data(), hq, dv),
                                                     dense_view<const double>(dl.data(), hq, 1), dov, dlv});
  EXPECT_TRUE(all_finite(d0) && all_finite(d1) && all_finite(l0) && all_finite(l1));
  for (size_t i = 4 * hq; i < lm.size(); ++i) EXPECT_EQ(l0[i] + l1[i], 0.0);
  EXPECT_EQ(l1[0], 0.0);

  // backward over rows whose complete LSE is -inf (and no sink): no NaN
  std::vector<double> dq(q.size(), 0), dk(k.size(), 0), dvv(v.size(), 0);
  std::vector<double> lse_empty(lm.size(), -kInf), o_zero(om.size(), 0.0);
  cpu::attention_backward(
      AttnBackwardArgs<double>{sh, rows, rows, dense_view(q.data(), hq, d), dense_view(k.data(), hkv, d),
                               dense_view(v.data(), hkv, dv), dense_view<const double>(o_zero.data(), hq, dv),
                               dense_view<const double>(lse_empty.data(), hq, 1),
                               dense_view<const double>(g.data(), hq, dv), {}, dense_view(dq.data(), hq, d),
                               dense_view(dk.data(), hkv, d), dense_view(dvv.data(), hkv, dv)},
      a);
  EXPECT_TRUE(all_finite(dq) && all_finite(dk) && all_finite(dvv));

  // merging nothing at all
  std::vector<double> o0(om.size(), 1.0), l00(lm.size(), 1.0);
  cpu::merge_forward(cpu::MergeArgs<double>{rows, hq, dv, 0, nullptr, nullptr, dense_view(o0.data(), hq, dv),
                                            dense_view(l00.data(), hq, 1)});
  EXPECT_TRUE(std::all_of(l00.begin(), l00.end(), [](double x) { return x == -kInf; }));
  EXPECT_TRUE(std::all_of(o0.begin(), o0.end(), [](double x) { return x == 0.0; }));
}

TEST(Attention, MergeIsAssociativeAndItsBackwardMatchesFiniteDifferences) {
  TREECP_SEED_TRACE;
  Rng rng = test_rng(1001);
  const int64_t rows = 3;
  const int heads = 2, dv = 3, parts = 3;
  std::vector<std::vector<double>> o(parts), l(parts);
  for (int p = 0; p < parts; ++p) {
    o[p] = randn(rows * heads * dv, rng);
    l[p] = randn(rows * heads, rng, 3.0);
  }
  l[2][1] = -kInf;  // one empty part
  const auto g = randn(rows * heads * dv, rng), gl = randn(rows * heads, rng);
  auto merged = [&](const std::vector<std::vector<double>>& oo, const std::vector<std::vector<double>>& ll, int first,
                    int count, std::vector<double>& om, std::vector<double>& lm) {
    std::vector<HeadView<const double>> ov, lv;
    for (int p = first; p < first + count; ++p) {
      ov.push_back(dense_view(oo[p].data(), heads, dv));
      lv.push_back(dense_view(ll[p].data(), heads, 1));
    }
    om.resize(rows * heads * dv);
    lm.resize(rows * heads);
    cpu::merge_forward(cpu::MergeArgs<double>{rows, heads, dv, count, ov.data(), lv.data(),
                                              dense_view(om.data(), heads, dv), dense_view(lm.data(), heads, 1)});
  };
  std::vector<double> o_all, l_all, o_ab, l_ab, o_abc, l_abc;
  merged(o, l, 0, 3, o_all, l_all);
  merged(o, l, 0, 2, o_ab, l_ab);
  merged({o_ab, o[2]}, {l_ab, l[2]}, 0, 2, o_abc, l_abc);
  EXPECT_LT(max_error(o_all, o_abc), 1e-14);
  EXPECT_LT(max_error(l_all, l_abc), 1e-14);

  auto loss = [&](const std::vector<std::vector<double>>& oo, const std::vector<std::vector<double>>& ll) {
    std::vector<double> om, lm;
    merged(oo, ll, 0, parts, om, lm);
    double j = 0;
    for (size_t i = 0; i < om.size(); ++i) j += g[i] * om[i];
    for (size_t i = 0; i < lm.size(); ++i) j += gl[i] * lm[i];
    return j;
  };
  std::vector<std::vector<double>> dop(parts, std::vector<double>(o_all.size())), dlp(parts, std::vector<double>(l_all.size()));
  std::vector<HeadView<const double>> ov, lv;
  std::vector<HeadView<double>> dov, dlv;
  for (int p = 0; p < parts; ++p) {
    ov.push_back(dense_view<const double>(o[p].data(), heads, dv));
    lv.push_back(dense_view<const double>(l[p].data(), heads, 1));
    dov.push_back(dense_view(dop[p].data(), heads, dv));
    dlv.push_back(dense_view(dlp[p].data(), heads, 1));
  }
  cpu::merge_backward(cpu::MergeBackwardArgs<double>{
      cpu::MergeArgs<double>{rows, heads, dv, parts, ov.data(), lv.data(), dense_view(o_all.data(), heads, dv),
                             dense_view(l_all.data(), heads, 1)},
      dense_view(g.data(), heads, dv), dense_view(gl.data(), heads, 1), dov.data(), dlv.data()});
  const double h = 1e-6;
  for (int p = 0; p < parts; ++p) {
    for (size_t i = 0; i < o[p].size(); ++i) {
      auto plus = o, minus = o;
      plus[p][i] += h;
      minus[p][i] -= h;
      EXPECT_NEAR(dop[p][i], (loss(plus, l) - loss(minus, l)) / (2 * h), 1e-8) << "do part " << p << " [" << i << "]";
    }
    for (size_t i = 0; i < l[p].size(); ++i) {
      if (std::isinf(l[p][i])) {
        EXPECT_EQ(dlp[p][i], 0.0);
        continue;
      }
      auto plus = l, minus = l;
      plus[p][i] += h;
      minus[p][i] -= h;
      EXPECT_NEAR(dlp[p][i], (loss(o, plus) - loss(o, minus)) / (2 * h), 1e-8) << "dlse part " << p << " [" << i << "]";
    }
  }
}

TEST(Attention, StridedViewsEqualDense) {
  // Q, K, V, O inside wider rows (as a fused QKV buffer would hold them) give the dense result.
  TREECP_SEED_TRACE;
  Rng rng = test_rng(1101);
  const Row row = random_tree(rng, 5, 10);
  const int64_t S = row.tokens();
  const int hq = 2, hkv = 1, d = 4, dv = 4;
  const Inputs in = random_inputs(row, hq, hkv, d, dv, 0, false, rng);
  const Result dense = run_library<double>(row, in);
  const int width = hq * d + hkv * d + hkv * dv + 5;  // [q | k | v | pad] per token
  std::vector<double> qkv(static_cast<size_t>(S * width), 0);
  for (int64_t t = 0; t < S; ++t) {
    std::copy_n(in.q.begin() + t * hq * d, hq * d, qkv.begin() + t * width);
    std::copy_n(in.k.begin() + t * hkv * d, hkv * d, qkv.begin() + t * width + hq * d);
    std::copy_n(in.v.begin() + t * hkv * dv, hkv * dv, qkv.begin() + t * width + hq * d + hkv * d);
  }
  std::vector<double> o(static_cast<size_t>(S * (hq * dv + 3))), lse(static_cast<size_t>(S * 2 * hq));
  cpu::attention_forward(
      AttnForwardArgs<double>{in.shape(), S, S, HeadView<const double>{qkv.data(), width, d},
                              HeadView<const double>{qkv.data() + hq * d, width, d},
                              HeadView<const double>{qkv.data() + hq * d + hkv * d, width, dv},
                              HeadView<double>{o.data(), hq * dv + 3, dv}, HeadView<double>{lse.data(), 2 * hq, 2}},
      row_slices(row));
  for (int64_t t = 0; t < S; ++t) {
    for (int h = 0; h < hq; ++h) {
      EXPECT_NEAR(lse[static_cast<size_t>(t * 2 * hq + 2 * h)], dense.lse[static_cast<size_t>(t * hq + h)], 1e-14);
      for (int c = 0; c < dv; ++c) {
        EXPECT_NEAR(o[static_cast<size_t>(t * (hq * dv + 3) + h * dv + c)],
                    dense.o[static_cast<size_t>((t * hq + h) * dv + c)], 1e-14);
      }
    }
  }
}

TEST(Attention, RefusesBadShapesAndSlices) {
  std::vector<double> buf(64, 1.0);
  const auto view = dense_view<const double>(buf.data(), 1, 1);
  // rows of the Q and K buffers, then the shape
  auto fwd = [&](int64_t q_rows, int64_t kv_rows, AttentionShape sh, std::vector<Slice> sl) {
    sh.scale = 1.0;
    cpu::attention_forward(AttnForwardArgs<double>{sh, q_rows, kv_rows, view, view, view, dense_view(buf.data(), 1, 1),
                                                   dense_view(buf.data(), 1, 1)},
                           sl);
  };
  EXPECT_THROW(fwd(4, 4, {3, 2, 1, 1}, {}), Error);                              // hq not a multiple of hkv
  EXPECT_THROW(fwd(4, 4, {1, 1, 0, 1}, {}), Error);                              // d = 0
  EXPECT_THROW(fwd(4, 4, {1, 1, 1, 1}, {make_slice(0, 5, 0, 4, 0, 9)}), Error);  // q outside the buffer
  EXPECT_THROW(fwd(4, 2, {1, 1, 1, 1}, {make_slice(0, 4, 0, 4, 0, 9)}), Error);  // k outside the buffer
  EXPECT_THROW(fwd(4, 4, {1, 1, 1, 1, -1}, {}), Error);                          // negative window
  try {
    fwd(4, 4, {3, 2, 1, 1}, {});
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("hkv"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace treecp
