// A hybrid stack (attention, GDN, GDN, attention with a window) under mpirun with 1-6 ranks: forward
// and backward through runtime/hybrid.hpp on the CPU backend equal one process built from independent
// references (attention_reference; conv1d by explicit root-to-token paths; GDN/KDA by the token
// recurrence), on random trees and GDN plans with local and chained segments, in double and float.
// The attention layers share one ownership and the two GDN layers one island: the activations move
// only where the ownership changes.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "comm/mpi_communicator.hpp"
#include "kernels/cpu/gdn.hpp"
#include "common/common.hpp"
#include "common/gdn.hpp"
#include "common/mpi_main.hpp"
#include "plan/planner.hpp"
#include "runtime/cpu_backend.hpp"
#include "runtime/hybrid.hpp"
#include "runtime/reference.hpp"

namespace treecp {
namespace {

using testing::max_abs;
using testing::max_error;

constexpr int kHeads = 2, kDim = 4, kWidth = kHeads * kDim;

// The stack's layers; gate kinds and conv widths differ between the two GDN layers.
std::vector<HybridLayer> stack_layers(int64_t window, GdnGate gate) {
  HybridLayer a;
  a.kind = LayerKind::Attention;
  a.attention = AttentionShape{kHeads, kHeads, kDim, kDim};
  HybridLayer g1;
  g1.kind = LayerKind::Gdn;
  g1.gdn = GdnShape{kHeads, kDim, kDim, gate, 0.5, 5};
  g1.conv = ConvShape{kWidth, 3, true};
  HybridLayer g2 = g1;
  g2.gdn.gate = gate == GdnGate::Scalar ? GdnGate::PerChannel : GdnGate::Scalar;
  g2.gdn.chunk = 4;
  g2.conv = ConvShape{kWidth, 4, false};
  HybridLayer w = a;
  w.attention.window = window;
  return {a, g1, g2, w};
}

// Whole-row inputs: the stack's input and output gradient, and each GDN layer's parameters.
struct StackData {
  std::vector<double> h, dout;
  struct Gdn {
    std::vector<double> w, b, g, beta;
  };
  std::vector<Gdn> gdn;
};

StackData random_data(const Row& row, const std::vector<HybridLayer>& layers, testing::Rng& rng) {
  const size_t S = static_cast<size_t>(row.tokens());
  std::uniform_real_distribution<double> u01(0.0, 1.0);
  StackData d;
  d.h = testing::randn(S * kWidth, rng, 0.7);
  d.dout = testing::randn(S * kWidth, rng);
  for (const HybridLayer& L : layers) {
    if (L.kind != LayerKind::Gdn) continue;
    StackData::Gdn g;
    g.w = testing::randn(static_cast<size_t>(L.conv.channels * L.conv.width), rng, 0.6);
    g.b = testing::randn(static_cast<size_t>(L.conv.channels), rng, 0.2);
    g.g.resize(S * static_cast<size_t>(L.gdn.g_width()));
    for (double& x : g.g) x = -0.5 * u01(rng);
    g.beta.resize(S * static_cast<size_t>(L.gdn.heads));
    for (double& x : g.beta) x = 0.05 + 0.9 * u01(rng);
    d.gdn.push_back(std::move(g));
  }
  return d;
}

// The stack's output and gradients, whole row (reference) or a rank's rows (CP).
struct StackResult {
  std::vector<double> out, dh;
  std::vector<StackData::Gdn> grads;  // per GDN layer: dweight, dbias, dg, dbeta
};

// x / sqrt(|x|² + eps) per dim-vector, and its backward, written out here (the CPU kernel's copy is
// kernels/cpu/gdn.hpp's l2norm_forward/backward).
std::vector<double> normalized(const std::vector<double>& x, int dim) {
  std::vector<double> y(x.size());
  for (size_t g = 0; g < x.size(); g += static_cast<size_t>(dim)) {
    double ss = kL2NormEps;
    for (int i = 0; i < dim; ++i) ss += x[g + i] * x[g + i];
    for (int i = 0; i < dim; ++i) y[g + i] = x[g + i] / std::sqrt(ss);
  }
  return y;
}
std::vector<double> normalized_backward(const std::vector<double>& x, const std::vector<double>& dy, int dim) {
  std::vector<double> dx(x.size());
  for (size_t g = 0; g < x.size(); g += static_cast<size_t>(dim)) {
    double ss = kL2NormEps;
    for (int i = 0; i < dim; ++i) ss += x[g + i] * x[g + i];
    const double n = std::sqrt(ss);
    // d(x_i / n)/dx_j = delta_ij / n - x_i x_j / n³
    for (int j = 0; j < dim; ++j) {
      double acc = dy[g + j] / n;
      for (int i = 0; i < dim; ++i) acc -= dy[g + i] * x[g + i] * x[g + j] / (n * n * n);
      dx[g + j] = acc;
    }
  }
  return dx;
}

// One process, double, from references that share no code with the CP runtime's kernels' chunked
// forms: the layers run forward, then backward in reverse.
StackResult reference(const Row& row, const std::vector<HybridLayer>& layers, const StackData& d) {
  const size_t S = static_cast<size_t>(row.tokens());
  const std::vector<double> none(S * kWidth, 0.0);
  auto gdn_data = [&](const HybridLayer& L, const std::vector<double>& u, const StackData::Gdn& p,
                      const std::vector<double>& dy) {
    testing::GdnData g;
    g.S = row.tokens();
    g.H = L.gdn.heads, g.dk = L.gdn.dk, g.dv = L.gdn.dv, g.gate = L.gdn.gate;
    g.q = g.k = normalized(u, L.gdn.dk);
    g.v = u;
    g.g = p.g, g.beta = p.beta, g.dy = dy;
    return g;
  };
  std::vector<std::vector<double>> inputs, convs;  // per layer: its input h; GDN layers: u = conv(h)
  std::vector<double> h = d.h;
  size_t gl = 0;
  for (const HybridLayer& L : layers) {
    inputs.push_back(h);
    if (L.kind == LayerKind::Attention) {
      h = attention_reference(row, L.attention, AttentionInputs<double>{h.data(), h.data(), h.data()}).o;
      convs.emplace_back();
      continue;
    }
    const StackData::Gdn& p = d.gdn[gl++];
    const auto u = testing::conv_tree_reference(row, h, p.w, p.b, kWidth, L.conv.width, L.conv.silu, none).y;
    h = testing::gdn_tree_reference(row, gdn_data(L, u, p, none), L.gdn.scale, false).y;
    convs.push_back(u);
  }
  StackResult r;
  r.out = h;
  r.grads.resize(d.gdn.size());
  std::vector<double> g = d.dout;
  for (size_t i = layers.size(); i-- > 0;) {
    const HybridLayer& L = layers[i];
    const std::vector<double>& x = inputs[i];
    if (L.kind == LayerKind::Attention) {
      const auto a = attention_reference(row, L.attention,
                                         AttentionInputs<double>{x.data(), x.data(), x.data(), nullptr, g.data()});
      for (size_t e = 0; e < g.size(); ++e) g[e] = a.dq[e] + a.dk[e] + a.dv[e];
      continue;
    }
    const StackData::Gdn& p = d.gdn[--gl];
    const auto gd = testing::gdn_tree_reference(row, gdn_data(L, convs[i], p, g), L.gdn.scale, true);
    std::vector<double> dqk(g.size());
    for (size_t e = 0; e < dqk.size(); ++e) dqk[e] = gd.dq[e] + gd.dk[e];
    std::vector<double> du = normalized_backward(convs[i], dqk, L.gdn.dk);
    for (size_t e = 0; e < du.size(); ++e) du[e] += gd.dv[e];
    const auto c = testing::conv_tree_reference(row, x, p.w, p.b, kWidth, L.conv.width, L.conv.silu, du);
    r.grads[gl] = {c.dw, c.db, gd.dg, gd.dbeta};
    g = c.dx;
  }
  r.dh = g;
  return r;
}

// The stack through HybridStackCP on `comm`'s ranks in precision T; the rank's rows of the input
// ownership (contiguous shards) come back, widened.
template <class T>
StackResult run_stack(Communicator& comm, const Row& row, const std::vector<HybridLayer>& layers,
                      const StackData& d, Layout layout, int chain_mode, testing::Rng& rng, int* exchanges,
                      int* expected_exchanges) {
  const int N = comm.size();
  PlanOptions opt;
  opt.layout = layout;
  opt.chunk_tokens = std::max<int64_t>(1, row.tokens() / 11);
  const Plan plan0 = make_plan(row, N, layers[0].attention, CostModel{}, opt);
  const Plan plan3 = plan_for_ownership(row, plan0, layers[3].attention, CostModel{});
  std::vector<uint8_t> chained(static_cast<size_t>(row.num_segments()), 0);
  for (auto& c : chained) c = chain_mode == 1 ? 1 : chain_mode == 2 ? static_cast<uint8_t>(rng() % 2) : 0;
  const GdnPlan gplan = chain_mode == 3 ? plan_gdn(row, N, layers[1].gdn) : make_gdn_plan(row, N, chained);
  const Ownership input = contiguous_ownership(row.tokens(), N);
  const auto& mine = input[static_cast<size_t>(comm.rank())];

  CpuBackend<T> be;
  HybridStackCP<CpuBackend<T>> stack(layers, row, {plan0, plan3}, gplan, input, comm, be);
  const std::vector<T> h = rows_of<T>(d.h, kWidth, mine), dout = rows_of<T>(d.dout, kWidth, mine);
  std::vector<std::vector<T>> w, b, g, beta;
  size_t gl = 0;
  for (const HybridLayer& L : layers) {
    if (L.kind != LayerKind::Gdn) continue;
    const StackData::Gdn& p = d.gdn[gl++];
    w.emplace_back(p.w.begin(), p.w.end());
    b.emplace_back(p.b.begin(), p.b.end());
    g.push_back(rows_of<T>(p.g, L.gdn.g_width(), mine));
    beta.push_back(rows_of<T>(p.beta, L.gdn.heads, mine));
  }
  std::vector<HybridGdnInputs<std::vector<T>>> params;
  for (size_t i = 0; i < w.size(); ++i) params.push_back({&w[i], &b[i], &g[i], &beta[i]});
  std::vector<T> out(h.size()), dh(h.size());
  std::vector<HybridGdnGrads<std::vector<T>>> grads;
  stack.forward(h, params, out);
  stack.backward(dout, dh, grads);
  *exchanges = stack.exchanges();
  // Activations move where the ownership changes: input -> A -> G -> G -> A -> input.
  const Ownership a = plan_ownership(plan0), gd = gdn_ownership(row, gplan);
  const Ownership* seq[] = {&input, &a, &gd, &gd, &a, &input};
  *expected_exchanges = 0;
  for (int i = 0; i + 1 < 6; ++i) *expected_exchanges += *seq[i] != *seq[i + 1];

  auto widen = [](const std::vector<T>& x) { return std::vector<double>(x.begin(), x.end()); };
  StackResult r{widen(out), widen(dh), {}};
  for (const auto& gr : grads) r.grads.push_back({widen(gr.conv_weight), widen(gr.conv_bias), widen(gr.g), widen(gr.beta)});
  return r;
}

struct Case {
  int segments;
  int64_t max_len;
  int depth;
  int chain_mode;  // 0 none, 1 all, 2 random, 3 planner
  Layout layout;
};

const Case kCases[] = {
    {6, 20, 3, 0, Layout::Searched}, {8, 16, 4, 1, Layout::Zigzag},   {10, 12, 4, 2, Layout::Contiguous},
    {9, 24, 3, 3, Layout::Family},   {12, 4, 6, 2, Layout::Perdoc},   // very short segments: empty shards
};

template <class T>
void check_case(MpiCommunicator& comm, const Case& c, uint64_t salt) {
  TREECP_SEED_TRACE;
  testing::Rng rng = testing::test_rng(salt);
  const Row row = testing::random_tree(rng, {.segments = c.segments, .max_len = c.max_len, .max_depth = c.depth});
  const int64_t window = std::uniform_int_distribution<int64_t>(3, 12)(rng);
  const std::vector<HybridLayer> layers = stack_layers(window, rng() % 2 ? GdnGate::Scalar : GdnGate::PerChannel);
  const StackData d = random_data(row, layers, rng);
  const StackResult ref = reference(row, layers, d);
  testing::Rng plan_rng = rng;  // the same chained set for the CP run and the one-process float run
  int exchanges = 0, expected = 0;
  const StackResult got = run_stack<T>(comm, row, layers, d, c.layout, c.chain_mode, rng, &exchanges, &expected);
  const std::vector<TokenRange> mine = contiguous_ownership(row.tokens(), comm.size())[static_cast<size_t>(comm.rank())];
  const std::string what = "rank " + std::to_string(comm.rank()) + "/" + std::to_string(comm.size()) + " case " +
                           std::to_string(salt) + " window " + std::to_string(window);
  EXPECT_EQ(exchanges, expected) << what;
  EXPECT_LE(exchanges, 4) << what;  // the GDN island moves nothing between its two layers

  // double: within 1e-9 of the reference's scale. float: within 4x what the same stack in float on
  // one process differs from the double reference, plus 1e-5 of the scale.
  StackResult same;
  if constexpr (sizeof(T) == 4) {
    auto self = make_self_communicator();
    int e1 = 0, e2 = 0;
    same = run_stack<float>(*self, row, layers, d, c.layout, c.chain_mode, plan_rng, &e1, &e2);
  }
  auto check = [&](const char* name, const std::vector<double>& got_v, const std::vector<double>& ref_full,
                   const std::vector<double>* same_full, int64_t width, bool per_token) {
    const std::vector<double> want = per_token ? rows_of<double>(ref_full, width, mine) : ref_full;
    const double scale = 1 + max_abs(ref_full);
    if (sizeof(T) == 8) {
      EXPECT_LE(max_error(got_v, want), 1e-9 * scale) << name << " " << what;
    } else {
      const std::vector<double> same_v = per_token ? rows_of<double>(*same_full, width, mine) : *same_full;
      EXPECT_TRUE(testing::within_reference(got_v, same_v, want, 4.0, 1e-5 * scale)) << name << " " << what;
    }
  };
  const bool f = sizeof(T) == 4;
  check("out", got.out, ref.out, f ? &same.out : nullptr, kWidth, true);
  check("dh", got.dh, ref.dh, f ? &same.dh : nullptr, kWidth, true);
  ASSERT_EQ(got.grads.size(), ref.grads.size());
  for (size_t l = 0; l < ref.grads.size(); ++l) {
    const HybridLayer& L = layers[l + 1];
    check("dweight", got.grads[l].w, ref.grads[l].w, f ? &same.grads[l].w : nullptr, 0, false);
    check("dbias", got.grads[l].b, ref.grads[l].b, f ? &same.grads[l].b : nullptr, 0, false);
    check("dg", got.grads[l].g, ref.grads[l].g, f ? &same.grads[l].g : nullptr, L.gdn.g_width(), true);
    check("dbeta", got.grads[l].beta, ref.grads[l].beta, f ? &same.grads[l].beta : nullptr, L.gdn.heads, true);
  }
}

TEST(MpiHybrid, DoubleEqualsOneProcess) {
  MpiCommunicator comm;
  uint64_t salt = 1;
  for (const Case& c : kCases) check_case<double>(comm, c, salt++);
}

TEST(MpiHybrid, FloatWithinOneProcessFloatError) {
  MpiCommunicator comm;
  uint64_t salt = 50;
  for (const Case& c : {kCases[1], kCases[3]}) check_case<float>(comm, c, salt++);
}

// A stack whose attention plans do not share one ownership is refused on every rank.
TEST(MpiHybrid, AttentionPlansMustShareOneOwnership) {
  MpiCommunicator comm;
  const Row row({{-1, 40}, {0, 20}, {0, 30}});
  const std::vector<HybridLayer> layers = stack_layers(5, GdnGate::Scalar);
  PlanOptions zig, cont;
  zig.layout = Layout::Zigzag;
  cont.layout = Layout::Contiguous;
  zig.chunk_tokens = cont.chunk_tokens = 5;
  const Plan a = make_plan(row, comm.size(), layers[0].attention, CostModel{}, zig);
  const Plan b = make_plan(row, comm.size(), layers[3].attention, CostModel{}, cont);
  const GdnPlan g = make_gdn_plan(row, comm.size(), std::vector<uint8_t>(3, 0));
  CpuBackend<double> be;
  if (plan_ownership(a) == plan_ownership(b)) GTEST_SKIP() << "one rank: every ownership is the same";
  try {
    HybridStackCP<CpuBackend<double>> stack(layers, row, {a, b}, g, contiguous_ownership(row.tokens(), comm.size()),
                                            comm, be);
    ADD_FAILURE() << "attention plans with two ownerships were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ownership"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace treecp

int main(int argc, char** argv) {
  return treecp::testing::run_on_all_ranks(argc, argv, [] { return RUN_ALL_TESTS(); });
}
