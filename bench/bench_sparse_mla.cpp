// Times the CPU sparse MLA kernels on one core at the article's GLM shape (Hi 32, Di 128, H 64, Dqk 576,
// Dv 512, k 2,048) on a 40,960-token preset row, and reports the bytes CP moves at 2-8 ranks.
//   1. check: float against double on a small row of the same shape (ids agreement, output error);
//   2. the indexer over the whole row in one stage (scores + top-k), timed in full;
//   3. the merge of two stages' top-k lists per query, and the sparse attention forward and backward over
//      every `stride`-th query's list (the work per query is independent, so the whole row's time is the
//      sample's scaled by selected pairs; both printed);
//   4. per rank count: the planner's bytes (an upper bound for every input) for KV in the waves and for
//      selected rows only, and the bytes the runtime moves for this selection (its own layout function
//      on the indexer's ids).
// Times are this thread's CPU time (the machine is shared). FLOPs from one formula (SparseMlaShape):
// indexer 2 Hi Di per pair, sparse 2 H (Dqk + Dv) forward and 2 H (3 Dqk + 2 Dv) backward per
// (query, selected key).
// Usage: bench_sparse_mla [preset] [stride] [max_cp] [all|sparse]   (defaults: art-fixed5k 32 8 all);
// `sparse` skips 2 and 4 and selects only the sampled queries' keys (the indexer on their rows alone).
#include <algorithm>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "core/random.hpp"
#include "kernels/cpu/sparse_mla.hpp"
#include "plan/sparse_mla_plan.hpp"
#include "runtime/row_map.hpp"
#include "runtime/sparse_mla_cp.hpp"
#include "tree/accounting.hpp"
#include "tree/presets.hpp"
#include "tree/row.hpp"
#include "tree/slice.hpp"

namespace {

using namespace treecp;
using namespace treecp::cpu;

// This thread's CPU time: on a shared machine the wall clock also counts the time other processes hold
// the core; the CPU time counts only the work (it still pays for caches the neighbours share).
double cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e3 + static_cast<double>(t.tv_nsec) * 1e-6;
}

template <class T>
std::vector<T> uniform(uint64_t seed, size_t n, double scale) {
  std::vector<T> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = static_cast<T>(scale * uniform_at(seed, i));
  return x;
}

struct Shape {
  int hi = 32, di = 128, h = 64, dqk = 576, dv = 512;
  int64_t topk = 2048;
};

// Inputs of one layer on `row` (deterministic in the seed), as T.
template <class T>
struct Layer {
  std::vector<T> qi, ki, w, q, kv, dout;
  Layer(const Shape& s, int64_t S, int64_t q_rows) {
    qi = uniform<T>(1, static_cast<size_t>(S * s.hi * s.di), 1.0);
    ki = uniform<T>(2, static_cast<size_t>(S * s.di), 1.0);
    w = uniform<T>(3, static_cast<size_t>(S * s.hi), 1.0);
    q = uniform<T>(4, static_cast<size_t>(q_rows * s.h * s.dqk), 1.0);
    kv = uniform<T>(5, static_cast<size_t>(S * s.dqk), 1.0);
    dout = uniform<T>(6, static_cast<size_t>(q_rows * s.h * s.dv), 1.0);
  }
};

// 1. float against double on a small row of the same shape
void check(const Shape& s, const Row& row) {
  const int64_t S = row.tokens();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const Layer<T> l(s, S, S);
    SparseMlaProblem<T> p;
    p.hi = s.hi, p.di = s.di, p.h = s.h, p.dqk = s.dqk, p.dv = s.dv, p.topk = s.topk;
    p.qi = l.qi.data(), p.ki = l.ki.data(), p.w = l.w.data(), p.q = l.q.data(), p.kv = l.kv.data(), p.dout = l.dout.data();
    return sparse_mla_reference(row, p);
  };
  const auto f = run(float{});
  const auto d = run(double{});
  int64_t same = 0, valid = 0;
  for (size_t i = 0; i < d.ids.size(); ++i) {
    valid += d.ids[i] >= 0;
    same += d.ids[i] >= 0 && d.ids[i] == f.ids[i];
  }
  auto err = [](const auto& a, const auto& b) {
    double e = 0, m = 1e-300;
    for (size_t i = 0; i < b.size(); ++i) {
      m = std::max(m, std::abs(static_cast<double>(b[i])));
      e = std::max(e, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    }
    return e / m;
  };
  std::printf("check (%lld tokens, float vs double): ids equal at %.4f%% of %lld entries; o %.2e, dq %.2e, dkv %.2e "
              "relative (where the ids agree the lists are the same; elsewhere near-ties differ)\n",
              static_cast<long long>(S), 100.0 * static_cast<double>(same) / static_cast<double>(valid),
              static_cast<long long>(valid), err(f.o, d.o), err(f.dq, d.dq), err(f.dkv, d.dkv));
}

}  // namespace

int main(int argc, char** argv) {
  const std::string preset = argc > 1 ? argv[1] : "art-fixed5k";
  const int64_t stride = argc > 2 ? std::atoll(argv[2]) : 32;
  const int max_cp = argc > 3 ? std::atoi(argv[3]) : 8;
  const bool sparse_only = argc > 4 && std::string(argv[4]) == "sparse";
  const Shape s;
  const SparseMlaShape flops{s.hi, s.di, s.h, s.dqk, s.dv};
  const Row row = make_preset(preset, 1);
  const int64_t S = row.tokens();
  std::printf("preset %s: %lld tokens, Hi %d, Di %d, H %d, Dqk %d, Dv %d, k %lld, float, one thread\n", preset.c_str(),
              static_cast<long long>(S), s.hi, s.di, s.h, s.dqk, s.dv, static_cast<long long>(s.topk));
  check(s, scale_row(make_preset(preset, 1), 40));

  // 2. the indexer, whole row, one stage (with `sparse`: on the sampled query rows only)
  std::vector<int64_t> sample;
  for (int64_t q = 0; q < S; q += stride) sample.push_back(q);
  std::vector<Slice> slices = row_slices(row, 0);
  if (sparse_only) {
    std::vector<Slice> rows_only;
    for (const Slice& sl : slices) {
      for (int64_t q : sample) {
        const Slice piece = cut_slice(sl, q, q + 1, 0, S);
        if (!piece.empty()) rows_only.push_back(piece);
      }
    }
    slices = rows_only;
  }
  int64_t pairs = 0;
  for (const Slice& sl : slices) pairs += sl.area();
  std::vector<int64_t> ids(static_cast<size_t>(S * s.topk));
  std::vector<float> score(ids.size());
  {
    const Layer<float> l(s, S, 0);
    std::vector<int64_t> key_ids(static_cast<size_t>(S));
    std::iota(key_ids.begin(), key_ids.end(), int64_t{0});
    IndexerArgs<float> a;
    a.shape = IndexerShape{S, S, s.hi, s.di, s.topk};
    a.qi = dense_view<const float>(l.qi.data(), s.hi, s.di);
    a.w = dense_view<const float>(l.w.data(), s.hi, 1);
    a.ki = l.ki.data();
    a.ki_row_stride = s.di;
    a.key_ids = key_ids.data();
    a.score = score.data();
    a.ids = ids.data();
    const double t0 = cpu_ms();
    indexer_topk(a, slices);
    const double ms = cpu_ms() - t0;
    std::printf("indexer%s: %lld visible pairs, %.1f ms, %.1f GFLOP/s (scores and top-k together)\n",
                sparse_only ? " (sampled query rows)" : "", static_cast<long long>(pairs), ms,
                static_cast<double>(pairs) * flops.indexer_flops_per_pair() / ms / 1e6);
  }

  // 3. sparse attention over every stride-th query
  const auto n = static_cast<int64_t>(sample.size());
  std::vector<int64_t> rows(static_cast<size_t>(n * s.topk));
  int64_t sample_pairs = 0, all_pairs = 0;
  for (int64_t x : sparse_pairs_per_query(row, 0, s.topk)) all_pairs += x;
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(ids.begin() + sample[static_cast<size_t>(i)] * s.topk, s.topk, rows.begin() + i * s.topk);
    for (int64_t e = 0; e < s.topk; ++e) sample_pairs += rows[static_cast<size_t>(i * s.topk + e)] >= 0;
  }
  {
    // The merge of two stages' lists, per query: the sample's lists against copies with other ids.
    std::vector<float> acc_s(static_cast<size_t>(n * s.topk)), part_s(acc_s.size());
    std::vector<int64_t> acc_i(acc_s.size()), part_i(acc_s.size());
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t e = 0; e < s.topk; ++e) {
        const size_t from = static_cast<size_t>(sample[static_cast<size_t>(i)] * s.topk + e), to = static_cast<size_t>(i * s.topk + e);
        acc_s[to] = part_s[to] = score[from];
        acc_i[to] = ids[from];
        part_i[to] = ids[from] < 0 ? -1 : ids[from] + S;
      }
    }
    const double t0 = cpu_ms();
    topk_merge(TopkMergeArgs<float>{n, s.topk, acc_s.data(), acc_i.data(), part_s.data(), part_i.data()});
    const double ms = cpu_ms() - t0;
    std::printf("top-k merge of two stages' lists: %.4f ms per query\n", ms / static_cast<double>(n));
  }
  {
    const Layer<float> l(s, S, n);
    const SparseShape sh{n, S, s.h, s.dqk, s.dv, s.topk};
    std::vector<float> o(static_cast<size_t>(n * s.h * s.dv)), lse(static_cast<size_t>(n * s.h)), dq(l.q.size()),
        dkv(l.kv.size());
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.dqk));
    SparseForwardArgs<float> f{sh, dense_view<const float>(l.q.data(), s.h, s.dqk), l.kv.data(), s.dqk, rows.data(),
                               dense_view(o.data(), s.h, s.dv), dense_view(lse.data(), s.h, 1), scale};
    double t0 = cpu_ms();
    sparse_attention_forward(f);
    const double fwd = cpu_ms() - t0;
    SparseBackwardArgs<float> b{sh, f.q, l.kv.data(), s.dqk, rows.data(), dense_view<const float>(o.data(), s.h, s.dv),
                                dense_view<const float>(lse.data(), s.h, 1),
                                dense_view<const float>(l.dout.data(), s.h, s.dv), dense_view(dq.data(), s.h, s.dqk),
                                dkv.data(), s.dqk, scale};
    t0 = cpu_ms();
    sparse_attention_backward(b);
    const double bwd = cpu_ms() - t0;
    const double scale_up = static_cast<double>(all_pairs) / static_cast<double>(sample_pairs);
    std::printf("sparse: %lld of %lld queries (every %lld-th), %lld of %lld selected pairs; forward %.1f ms (%.1f GFLOP/s), "
                "backward %.1f ms (%.1f GFLOP/s); whole row by selected pairs: forward %.0f ms, backward %.0f ms\n",
                static_cast<long long>(n), static_cast<long long>(S), static_cast<long long>(stride),
                static_cast<long long>(sample_pairs), static_cast<long long>(all_pairs), fwd,
                static_cast<double>(sample_pairs) * flops.sparse_forward_flops_per_pair() / fwd / 1e6, bwd,
                static_cast<double>(sample_pairs) * flops.sparse_backward_flops_per_pair() / bwd / 1e6, fwd * scale_up,
                bwd * scale_up);
  }

  if (sparse_only) return 0;
  // 4. bytes at CP 2..max_cp: the planner's bound, and this selection through the runtime's layout
  std::printf("\n| CP | layout | waves | KV in waves: bound / this selection (MB) | selected rows only: bound / this "
              "selection (MB) | auto picks | remote rows read (this selection / bound) | plan ms |\n|---|---|---|---|---|---|---|---|\n");
  for (int cp = 2; cp <= max_cp; ++cp) {
    const SparseMlaCosts costs;  // H200 defaults: bf16 ki, kv, fp32 dKV, at the GLM shape above
    SparseMlaPlanOptions o;
    o.topk = s.topk;
    const double t0 = cpu_ms();
    const SparseMlaPlan p = make_sparse_mla_plan(row, cp, costs, o);
    const double plan_ms = cpu_ms() - t0;
    const SparseMlaPrediction& waves = p.fetch == KvFetch::Waves ? p.prediction : p.other;
    const SparseMlaPrediction& sel = p.fetch == KvFetch::Waves ? p.other : p.prediction;
    const SparseMlaShape& sh = costs.shape;
    int64_t remote = 0, bound = 0, wave_rows = 0;
    for (int r = 0; r < cp; ++r) {
      const auto& owned = p.plan.ranks[static_cast<size_t>(r)].owned;
      const CombinedLayout lay = combine_selected(rows_of<int64_t>(ids, s.topk, owned), RowMap(owned), p.plan, r);
      remote += lay.rows - lay.owned_rows;
      bound += waves.ranks[static_cast<size_t>(r)].selected_rows;
      wave_rows += waves.ranks[static_cast<size_t>(r)].wave_rows;
    }
    // What both modes move besides the rows: ids to the owners, one count per peer, dKV back; then
    // the waves carry ki (and kv), or the owners send the selected rows.
    const int64_t common = remote * (sh.id_bytes + sh.dkv_bytes_per_token()) + int64_t{cp} * (cp - 1) * sh.id_bytes;
    const int64_t in_waves = common + wave_rows * (sh.ki_bytes_per_token() + sh.kv_bytes_per_token());
    const int64_t selected = common + wave_rows * sh.ki_bytes_per_token() + remote * sh.kv_bytes_per_token();
    std::printf("| %d | %s | %d | %.1f / %.1f | %.1f / %.1f | %s | %lld / %lld | %.1f |\n", cp, layout_name(p.plan.layout),
                p.plan.num_waves, static_cast<double>(waves.bytes_moved) / 1e6, static_cast<double>(in_waves) / 1e6,
                static_cast<double>(sel.bytes_moved) / 1e6, static_cast<double>(selected) / 1e6, kv_fetch_name(p.fetch),
                static_cast<long long>(remote), static_cast<long long>(bound), plan_ms);
  }
  return 0;
}
