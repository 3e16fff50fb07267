#include "kernels/cpu/sparse_mla.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.hpp"
#include "kernels/cpu/tile.hpp"
#include "tree/row.hpp"

namespace treecp::cpu {
namespace {

// (query, head) rows of an indexer block: 256 of them (8 queries at Hi = 32) against a 64-key block keep
// the packed qi rows (256 x Di) and the head scores (256 x 64) in L2.
constexpr int64_t kIndexerRows = 256;
constexpr int64_t kIndexerKeys = 64;
// Keys per block of the GEMMs that sum over a query's list (P^T V, dS^T KV): 128 packed rows of Dqk = 576
// floats are 288 KiB, so a block of B stays in L2 while every row tile of the output passes over it.
constexpr int64_t kListBlockKeys = 128;

// The order of top-k lists: the higher score first, equal scores to the smaller canonical id.
template <class T>
struct Candidate {
  T score;
  int64_t id;
};
template <class T>
inline bool ranks_before(const Candidate<T>& a, const Candidate<T>& b) {
  return a.score > b.score || (a.score == b.score && a.id < b.id);
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

template <class T>
void write_list(std::vector<Candidate<T>>& c, int64_t k, T* score, int64_t* ids) {
  const int64_t n = std::min<int64_t>(k, static_cast<int64_t>(c.size()));
  if (static_cast<int64_t>(c.size()) > k) {
    std::nth_element(c.begin(), c.begin() + k, c.end(), ranks_before<T>);
  }
  std::sort(c.begin(), c.begin() + n, ranks_before<T>);
  for (int64_t e = 0; e < n; ++e) {
    score[e] = c[static_cast<size_t>(e)].score;
    ids[e] = c[static_cast<size_t>(e)].id;
  }
  std::fill(score + n, score + k, kNegInf<T>);
  std::fill(ids + n, ids + k, int64_t{-1});
}

template <class T>
struct IndexerWork {
  int64_t block_q = 0;  // queries per block
  int64_t width = 0;    // key block width, padded to whole vectors
  std::vector<T> qp;    // [block_q * hi, di] the block's qi rows
  std::vector<T> kt;    // [di, width] a key block, keys contiguous
  std::vector<T> s;     // [block_q * hi, width] head scores
  std::vector<T> acc;   // [width] one query's weighted sum
  std::vector<std::vector<Candidate<T>>> cand;  // per query of the block

  explicit IndexerWork(const IndexerShape& sh) {
    block_q = std::max<int64_t>(1, kIndexerRows / sh.hi);
    width = round_up(kIndexerKeys, kVecLen<T>);
    qp.resize(static_cast<size_t>(block_q * sh.hi * sh.di));
    kt.resize(static_cast<size_t>(sh.di * width));
    s.resize(static_cast<size_t>(block_q * sh.hi * width));
    acc.resize(static_cast<size_t>(width));
    cand.resize(static_cast<size_t>(block_q));
  }
};

// acc[j] += wv * relu(s[j]) for j < n, n a whole number of vectors: every key takes the same vector
// path wherever it sits in a block, so a pair's score does not depend on the buffer layout.
template <class T>
TREECP_TILE_INLINE void add_weighted_relu(T* __restrict acc, const T* __restrict s, T wv, int64_t n) {
  constexpr int W = kVecLen<T>;
  const Vec<T> zero{};
  const Vec<T> wvec = zero + wv;
  for (int64_t j = 0; j < n; j += W) {
    Vec<T> x, a;
    std::memcpy(&x, s + j, sizeof x);
    std::memcpy(&a, acc + j, sizeof a);
    x = x > zero ? x : zero;
    a += wvec * x;
    std::memcpy(acc + j, &a, sizeof a);
  }
}

// The candidates of queries [qb, qe) against one slice: per 64-key block, head scores S = QI KI^T for
// the block's rows that see a key of the block, then sum_h w relu(S) per query over its keys.
template <class Isa, class T>
TREECP_TILE_INLINE void indexer_slice(const IndexerArgs<T>& a, const Slice& s, int64_t qb, int64_t qe,
                                      IndexerWork<T>& w) {
  const int hi = a.shape.hi, di = a.shape.di;
  const int64_t k_lo = s.key_begin(qb), k_hi = s.key_end(qe - 1);
  for (int64_t kb = k_lo; kb < k_hi; kb += kIndexerKeys) {
    const int64_t ke = std::min(kb + kIndexerKeys, k_hi), nk = ke - kb;
    const int64_t nkp = round_up(nk, kVecLen<T>);
    // Queries of the block with a key in [kb, ke): q >= kb + diag_min and q < ke + diag_max - 1.
    const int64_t qa = std::max(qb, kb + s.diag_min), qz = std::min(qe, ke + s.diag_max - 1);
    if (qz <= qa) continue;
    // kt[d][j] = ki[kb + j][d]; padding keys are zero and never read back
    for (int64_t j = 0; j < nk; ++j) {
      const T* row = a.ki + (kb + j) * a.ki_row_stride;
      for (int d = 0; d < di; ++d) w.kt[static_cast<size_t>(d * nkp + j)] = row[d];
    }
    for (int d = 0; d < di; ++d) std::fill_n(w.kt.data() + d * nkp + nk, nkp - nk, T(0));
    const int64_t r0 = (qa - qb) * hi, r1 = (qz - qb) * hi;
    std::fill(w.s.data() + r0 * nkp, w.s.data() + r1 * nkp, T(0));
    gemm_acc<Isa>(r1 - r0, nkp, di, w.qp.data() + r0 * di, di, 1, w.kt.data(), nkp, w.s.data() + r0 * nkp, nkp);
    for (int64_t q = qa; q < qz; ++q) {
      const int64_t j0 = std::max(kb, s.key_begin(q)) - kb, j1 = std::min(ke, s.key_end(q)) - kb;
      if (j0 >= j1) continue;
      std::fill_n(w.acc.data(), nkp, T(0));
      for (int h = 0; h < hi; ++h) {
        add_weighted_relu(w.acc.data(), w.s.data() + ((q - qb) * hi + h) * nkp, *a.w.at(q, h), nkp);
      }
      auto& c = w.cand[static_cast<size_t>(q - qb)];
      for (int64_t j = j0; j < j1; ++j) {
        const T v = w.acc[static_cast<size_t>(j)];
        require(!std::isnan(v), "indexer: the score of query row ", q, " and key row ", kb + j,
                " is NaN (the inputs overflow)");
        c.push_back({v, a.key_ids[kb + j]});
      }
    }
  }
}

// Sweeps the query rows: between consecutive slice boundaries the set of covering slices is fixed;
// each block of queries collects its candidates from all of them, then keeps its top k.
template <class Isa, class T>
TREECP_TILE_INLINE void indexer_run(const IndexerArgs<T>& a, const std::vector<Slice>& slices) {
  const IndexerShape& sh = a.shape;
  IndexerWork<T> w(sh);
  std::vector<size_t> order;
  std::vector<int64_t> cuts;
  for (size_t i = 0; i < slices.size(); ++i) {
    if (slices[i].empty()) continue;
    order.push_back(i);
    cuts.push_back(slices[i].q_begin);
    cuts.push_back(slices[i].q_end);
  }
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return slices[x].q_begin < slices[y].q_begin; });
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  std::vector<size_t> active;
  size_t next = 0;
  for (size_t c = 0; c + 1 < cuts.size(); ++c) {
    const int64_t lo = cuts[c], hi = cuts[c + 1];
    active.erase(std::remove_if(active.begin(), active.end(), [&](size_t i) { return slices[i].q_end <= lo; }),
                 active.end());
    while (next < order.size() && slices[order[next]].q_begin <= lo) active.push_back(order[next++]);
    if (active.empty()) continue;
    for (int64_t qb = lo; qb < hi; qb += w.block_q) {
      const int64_t qe = std::min(qb + w.block_q, hi);
      for (int64_t q = qb; q < qe; ++q) {
        for (int h = 0; h < sh.hi; ++h) {
          std::copy_n(a.qi.at(q, h), sh.di, w.qp.data() + ((q - qb) * sh.hi + h) * sh.di);
        }
        w.cand[static_cast<size_t>(q - qb)].clear();
      }
      for (size_t i : active) indexer_slice<Isa>(a, slices[i], qb, qe, w);
      for (int64_t q = qb; q < qe; ++q) {
        write_list(w.cand[static_cast<size_t>(q - qb)], sh.topk, a.score + q * sh.topk, a.ids + q * sh.topk);
      }
    }
  }
}

template <class T>
struct SparseWork {
  std::vector<int64_t> list;  // the query's valid rows
  std::vector<T> kvp;         // [topk, dqk] its kv rows, packed
  std::vector<T> qt;          // [dqk, h] q transposed
  std::vector<T> dot_t;       // [dv, h] dO transposed
  std::vector<T> st;          // [topk, h] scores, then probabilities
  std::vector<T> dpt;         // [topk, h] dP, then dS
  std::vector<T> oacc;        // [h, dv]
  std::vector<T> dkvp;        // [topk, dqk]
  std::vector<T> m, l, delta; // [h]

  explicit SparseWork(const SparseShape& sh) {
    const auto k = static_cast<size_t>(sh.topk);
    list.reserve(k);
    kvp.resize(k * sh.dqk);
    qt.resize(static_cast<size_t>(sh.dqk) * sh.h);
    dot_t.resize(static_cast<size_t>(sh.dv) * sh.h);
    st.resize(k * sh.h);
    dpt.resize(k * sh.h);
    oacc.resize(static_cast<size_t>(sh.h) * sh.dv);
    dkvp.resize(k * sh.dqk);
    m.resize(static_cast<size_t>(sh.h));
    l.resize(static_cast<size_t>(sh.h));
    delta.resize(static_cast<size_t>(sh.h));
  }
};

// Packs the valid rows of query q's list and their kv rows; returns how many there are.
template <class T>
int64_t pack_list(const SparseShape& sh, const int64_t* rows, const T* kv, int64_t kv_stride, int64_t q,
                  SparseWork<T>& w) {
  w.list.clear();
  for (int64_t e = 0; e < sh.topk; ++e) {
    const int64_t r = rows[q * sh.topk + e];
    if (r >= 0) w.list.push_back(r);
  }
  const auto n = static_cast<int64_t>(w.list.size());
  for (int64_t j = 0; j < n; ++j) std::copy_n(kv + w.list[static_cast<size_t>(j)] * kv_stride, sh.dqk, w.kvp.data() + j * sh.dqk);
  return n;
}

// xt[i][hh] = x.at(q, hh)[i] for i < dim: heads become the contiguous dimension of a GEMM operand.
template <class T>
void pack_heads_transposed(const HeadView<const T>& x, int64_t q, int heads, int dim, T* xt) {
  for (int hh = 0; hh < heads; ++hh) {
    const T* row = x.at(q, hh);
    for (int i = 0; i < dim; ++i) xt[static_cast<size_t>(i) * heads + hh] = row[i];
  }
}

// st[j][hh] = kv[list[j]] . q[hh] (unscaled), from the packed rows.
template <class Isa, class T>
TREECP_TILE_INLINE void list_scores(const SparseShape& sh, int64_t n, SparseWork<T>& w) {
  std::fill_n(w.st.data(), n * sh.h, T(0));
  gemm_acc<Isa>(n, sh.h, sh.dqk, w.kvp.data(), sh.dqk, 1, w.qt.data(), sh.h, w.st.data(), sh.h);
}

// C[h][x] += sum_j A[j][h] B[j][x] over a list of n keys (A [n, H] heads contiguous, B the packed rows),
// in blocks of kListBlockKeys keys.
template <class Isa, class T>
TREECP_TILE_INLINE void list_gemm(int H, int N, int64_t n, const T* A, const T* B, int64_t ldb, T* C, int64_t ldc) {
  for (int64_t j = 0; j < n; j += kListBlockKeys) {
    gemm_acc<Isa>(H, N, std::min(kListBlockKeys, n - j), A + j * H, 1, H, B + j * ldb, ldb, C, ldc);
  }
}

template <class Isa, class T>
TREECP_TILE_INLINE void sparse_forward_run(const SparseForwardArgs<T>& a) {
  const SparseShape& sh = a.shape;
  SparseWork<T> w(sh);
  const int H = sh.h;
  for (int64_t q = 0; q < sh.q_rows; ++q) {
    const int64_t n = pack_list(sh, a.rows, a.kv, a.kv_row_stride, q, w);
    if (n == 0) {
      for (int hh = 0; hh < H; ++hh) {
        std::fill_n(a.o.at(q, hh), sh.dv, T(0));
        *a.lse.at(q, hh) = kNegInf<T>;
      }
      continue;
    }
    pack_heads_transposed(a.q, q, H, sh.dqk, w.qt.data());
    list_scores<Isa>(sh, n, w);
    // softmax over the list per head: st holds [j][hh], heads contiguous
    std::fill(w.m.begin(), w.m.end(), kNegInf<T>);
    for (int64_t j = 0; j < n; ++j) {
      T* sr = w.st.data() + j * H;
      for (int hh = 0; hh < H; ++hh) {
        sr[hh] *= a.scale;
        w.m[static_cast<size_t>(hh)] = std::max(w.m[static_cast<size_t>(hh)], sr[hh]);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      T* sr = w.st.data() + j * H;
      for (int hh = 0; hh < H; ++hh) sr[hh] -= w.m[static_cast<size_t>(hh)];
    }
    exp_inplace<Isa>(w.st.data(), n * H);
    std::fill(w.l.begin(), w.l.end(), T(0));
    for (int64_t j = 0; j < n; ++j) {
      const T* pr = w.st.data() + j * H;
      for (int hh = 0; hh < H; ++hh) w.l[static_cast<size_t>(hh)] += pr[hh];
    }
    // O = P^T V with V the first dv columns of the packed rows
    std::fill(w.oacc.begin(), w.oacc.end(), T(0));
    list_gemm<Isa>(H, sh.dv, n, w.st.data(), w.kvp.data(), sh.dqk, w.oacc.data(), sh.dv);
    for (int hh = 0; hh < H; ++hh) {
      const T inv = T(1) / w.l[static_cast<size_t>(hh)];
      T* o = a.o.at(q, hh);
      const T* acc = w.oacc.data() + static_cast<size_t>(hh) * sh.dv;
      for (int i = 0; i < sh.dv; ++i) o[i] = acc[i] * inv;
      *a.lse.at(q, hh) = w.m[static_cast<size_t>(hh)] + std::log(w.l[static_cast<size_t>(hh)]);
    }
  }
}

// Per query with P = exp(scale S - LSE), dP = dO V^T, dS = P (dP - dot(dO, O)) scale:
// dQ += dS KV, dKV[rows] += dS^T Q + (first dv columns) P^T dO.
template <class Isa, class T>
TREECP_TILE_INLINE void sparse_backward_run(const SparseBackwardArgs<T>& a) {
  const SparseShape& sh = a.shape;
  SparseWork<T> w(sh);
  const int H = sh.h;
  for (int64_t q = 0; q < sh.q_rows; ++q) {
    const int64_t n = pack_list(sh, a.rows, a.kv, a.kv_row_stride, q, w);
    if (n == 0) continue;
    pack_heads_transposed(a.q, q, H, sh.dqk, w.qt.data());
    pack_heads_transposed(a.dout, q, H, sh.dv, w.dot_t.data());
    list_scores<Isa>(sh, n, w);
    for (int hh = 0; hh < H; ++hh) {
      w.m[static_cast<size_t>(hh)] = *a.lse.at(q, hh);  // an LSE of -inf with keys is inconsistent: no gradient
      w.delta[static_cast<size_t>(hh)] = dot(a.dout.at(q, hh), a.o.at(q, hh), sh.dv);
    }
    for (int64_t j = 0; j < n; ++j) {
      T* sr = w.st.data() + j * H;
      for (int hh = 0; hh < H; ++hh) {
        const T lse = w.m[static_cast<size_t>(hh)];
        sr[hh] = lse == kNegInf<T> ? kNegInf<T> : sr[hh] * a.scale - lse;
      }
    }
    exp_inplace<Isa>(w.st.data(), n * H);
    std::fill_n(w.dpt.data(), n * H, T(0));
    gemm_acc<Isa>(n, H, sh.dv, w.kvp.data(), sh.dqk, 1, w.dot_t.data(), H, w.dpt.data(), H);
    for (int64_t j = 0; j < n; ++j) {
      const T* pr = w.st.data() + j * H;
      T* dr = w.dpt.data() + j * H;
      for (int hh = 0; hh < H; ++hh) dr[hh] = pr[hh] * (dr[hh] - w.delta[static_cast<size_t>(hh)]) * a.scale;
    }
    list_gemm<Isa>(H, sh.dqk, n, w.dpt.data(), w.kvp.data(), sh.dqk, a.dq.at(q, 0), a.dq.head_stride);
    std::fill_n(w.dkvp.data(), n * sh.dqk, T(0));
    gemm_acc<Isa>(n, sh.dqk, H, w.dpt.data(), H, 1, a.q.at(q, 0), a.q.head_stride, w.dkvp.data(), sh.dqk);
    gemm_acc<Isa>(n, sh.dv, H, w.st.data(), H, 1, a.dout.at(q, 0), a.dout.head_stride, w.dkvp.data(), sh.dqk);
    for (int64_t j = 0; j < n; ++j) {
      axpy(a.dkv + w.list[static_cast<size_t>(j)] * a.dkv_row_stride, T(1), w.dkvp.data() + j * sh.dqk, sh.dqk);
    }
  }
}

#if TREECP_X86_DISPATCH
template <class T>
__attribute__((target("avx2,fma"))) void indexer_avx2(const IndexerArgs<T>& a, const std::vector<Slice>& s) {
  indexer_run<IsaAvx2>(a, s);
}
template <class T>
__attribute__((target("avx2,fma"))) void sparse_forward_avx2(const SparseForwardArgs<T>& a) {
  sparse_forward_run<IsaAvx2>(a);
}
template <class T>
__attribute__((target("avx2,fma"))) void sparse_backward_avx2(const SparseBackwardArgs<T>& a) {
  sparse_backward_run<IsaAvx2>(a);
}
#endif
template <class T>
void indexer_baseline(const IndexerArgs<T>& a, const std::vector<Slice>& s) {
  indexer_run<IsaBaseline>(a, s);
}
template <class T>
void sparse_forward_baseline(const SparseForwardArgs<T>& a) {
  sparse_forward_run<IsaBaseline>(a);
}
template <class T>
void sparse_backward_baseline(const SparseBackwardArgs<T>& a) {
  sparse_backward_run<IsaBaseline>(a);
}

void require_ptr(const void* p, int64_t rows, const char* what, const char* name) {
  require(rows == 0 || p != nullptr, what, ": ", name, " is null");
}

// The list entries: -1 or a row of the KV buffer.
void check_rows(const SparseShape& sh, const int64_t* rows, const char* what) {
  for (int64_t i = 0; i < sh.q_rows * sh.topk; ++i) {
    require(rows[i] >= -1 && rows[i] < sh.kv_rows, what, ": list entry ", i % sh.topk, " of query row ", i / sh.topk,
            " is ", rows[i], ", expected -1 or a row in [0, ", sh.kv_rows, ")");
  }
}

template <class Args>
void check_sparse_args(const Args& a, const char* what) {
  a.shape.validate();
  require(std::isfinite(a.scale) && a.scale > 0, what, ": scale must be finite and > 0");
  require_ptr(a.q.data, a.shape.q_rows, what, "q");
  require_ptr(a.kv, a.shape.kv_rows, what, "kv");
  require_ptr(a.rows, a.shape.q_rows, what, "rows");
  require(a.kv_row_stride >= a.shape.dqk, what, ": kv row stride ", a.kv_row_stride, " is below dqk ", a.shape.dqk);
  check_rows(a.shape, a.rows, what);
}

}  // namespace

void IndexerShape::validate() const {
  require(q_rows >= 0 && k_rows >= 0, "indexer: q_rows and k_rows must be >= 0");
  require(hi > 0, "indexer: hi must be > 0, got ", hi);
  require(di > 0, "indexer: di must be > 0, got ", di);
  require(topk >= 1, "indexer: topk must be >= 1, got ", topk);
}

void SparseShape::validate() const {
  require(q_rows >= 0 && kv_rows >= 0, "sparse attention: q_rows and kv_rows must be >= 0");
  require(h > 0, "sparse attention: h must be > 0, got ", h);
  require(dqk > 0, "sparse attention: dqk must be > 0, got ", dqk);
  require(dv > 0 && dv <= dqk, "sparse attention: dv must be in [1, dqk = ", dqk, "], got ", dv);
  require(topk >= 1, "sparse attention: topk must be >= 1, got ", topk);
}

template <class T>
void indexer_topk(const IndexerArgs<T>& a, const std::vector<Slice>& slices) {
  const IndexerShape& sh = a.shape;
  sh.validate();
  require_ptr(a.qi.data, sh.q_rows, "indexer", "qi");
  require_ptr(a.w.data, sh.q_rows, "indexer", "w");
  require_ptr(a.ki, sh.k_rows, "indexer", "ki");
  require_ptr(a.key_ids, sh.k_rows, "indexer", "key_ids");
  require_ptr(a.score, sh.q_rows, "indexer", "score");
  require_ptr(a.ids, sh.q_rows, "indexer", "ids");
  require(sh.k_rows == 0 || a.ki_row_stride >= sh.di, "indexer: ki row stride ", a.ki_row_stride, " is below di ", sh.di);
  for (size_t i = 0; i < slices.size(); ++i) {
    const Slice& s = slices[i];
    if (s.empty()) continue;
    require(s.q_begin >= 0 && s.q_end <= sh.q_rows && s.k_begin >= 0 && s.k_end <= sh.k_rows, "indexer: slice ", i,
            " ", to_string(s), " outside the buffers q[0,", sh.q_rows, ") k[0,", sh.k_rows, ")");
  }
  for (int64_t j = 0; j < sh.k_rows; ++j) {
    require(a.key_ids[j] >= 0, "indexer: key_ids[", j, "] = ", a.key_ids[j], " is not a token id");
  }
  std::fill_n(a.score, sh.q_rows * sh.topk, kNegInf<T>);
  std::fill_n(a.ids, sh.q_rows * sh.topk, int64_t{-1});
#if TREECP_X86_DISPATCH
  if (use_avx2()) return indexer_avx2(a, slices);
#endif
  indexer_baseline(a, slices);
}

template <class T>
void topk_merge(const TopkMergeArgs<T>& a) {
  require(a.rows >= 0 && a.topk >= 1, "topk_merge: rows >= 0 and topk >= 1 expected");
  require(a.rows == 0 || (a.score && a.ids && a.part_score && a.part_ids), "topk_merge: a list is null");
  const auto k = static_cast<size_t>(a.topk);
  std::vector<Candidate<T>> out(k);
  for (int64_t r = 0; r < a.rows; ++r) {
    T* s = a.score + r * a.topk;
    int64_t* id = a.ids + r * a.topk;
    const T* ps = a.part_score + r * a.topk;
    const int64_t* pid = a.part_ids + r * a.topk;
    size_t i = 0, j = 0, n = 0;
    // Valid entries (id >= 0) come first in each list, best first.
    while (n < k) {
      const bool has_a = i < k && id[i] >= 0, has_b = j < k && pid[j] >= 0;
      if (!has_a && !has_b) break;
      const Candidate<T> ca{has_a ? s[i] : T(0), has_a ? id[i] : 0}, cb{has_b ? ps[j] : T(0), has_b ? pid[j] : 0};
      if (has_a && (!has_b || ranks_before(ca, cb))) {
        out[n++] = ca;
        ++i;
      } else {
        out[n++] = cb;
        ++j;
      }
    }
    for (size_t e = 0; e < k; ++e) {
      s[e] = e < n ? out[e].score : kNegInf<T>;
      id[e] = e < n ? out[e].id : -1;
    }
  }
}

template <class T>
void sparse_attention_forward(const SparseForwardArgs<T>& a) {
  check_sparse_args(a, "sparse_attention_forward");
  require_ptr(a.o.data, a.shape.q_rows, "sparse_attention_forward", "o");
  require_ptr(a.lse.data, a.shape.q_rows, "sparse_attention_forward", "lse");
#if TREECP_X86_DISPATCH
  if (use_avx2()) return sparse_forward_avx2(a);
#endif
  sparse_forward_baseline(a);
}

template <class T>
void sparse_attention_backward(const SparseBackwardArgs<T>& a) {
  const char* what = "sparse_attention_backward";
  check_sparse_args(a, what);
  require_ptr(a.o.data, a.shape.q_rows, what, "o");
  require_ptr(a.lse.data, a.shape.q_rows, what, "lse");
  require_ptr(a.dout.data, a.shape.q_rows, what, "dout");
  require_ptr(a.dq.data, a.shape.q_rows, what, "dq");
  require_ptr(a.dkv, a.shape.kv_rows, what, "dkv");
  require(a.dkv_row_stride >= a.shape.dqk, what, ": dkv row stride ", a.dkv_row_stride, " is below dqk ", a.shape.dqk);
#if TREECP_X86_DISPATCH
  if (use_avx2()) return sparse_backward_avx2(a);
#endif
  sparse_backward_baseline(a);
}

void check_selected_ids(const Row& row, int64_t window, int64_t topk, int64_t q_begin, int64_t q_end,
                        const int64_t* ids) {
  const int64_t S = row.tokens();
  require(topk >= 1, "ids: topk must be >= 1, got ", topk);
  require(0 <= q_begin && q_begin <= q_end && q_end <= S, "ids: queries [", q_begin, ", ", q_end,
          ") outside the row of ", S, " tokens");
  require(q_end == q_begin || ids != nullptr, "ids: the lists are null");
  std::vector<int64_t> seen;
  for (int64_t q = q_begin; q < q_end; ++q) {
    seen.clear();
    for (int64_t e = 0; e < topk; ++e) {
      const int64_t j = ids[(q - q_begin) * topk + e];
      if (j == -1) continue;
      require(j >= 0 && j < S, "ids: query ", q, ", entry ", e, ": ", j, " is not a token id (expected -1 or [0, ", S,
              "))");
      require(row.visible(q, j, window), "ids: query ", q, ", entry ", e, ": key ", j, " is not visible to the query",
              window > 0 ? " (tree and window)" : " (tree)");
      seen.push_back(j);
    }
    std::sort(seen.begin(), seen.end());
    const auto dup = std::adjacent_find(seen.begin(), seen.end());
    require(dup == seen.end(), "ids: query ", q, " lists key ", dup == seen.end() ? 0 : *dup, " twice");
  }
}

template <class T>
SparseMlaResult<T> sparse_mla_reference(const Row& row, const SparseMlaProblem<T>& p) {
  const int64_t S = row.tokens();
  require(p.window >= 0, "sparse mla: window must be >= 0 (0 = none), got ", p.window);
  const SparseShape sh{S, S, p.h, p.dqk, p.dv, p.topk};
  sh.validate();
  require(S == 0 || (p.q && p.kv), "sparse mla: q and kv are required");
  SparseMlaResult<T> res;
  const auto n_list = static_cast<size_t>(S * p.topk);
  if (p.ids) {
    check_selected_ids(row, p.window, p.topk, 0, S, p.ids);
    res.ids.assign(p.ids, p.ids + n_list);
  } else {
    require(S == 0 || (p.qi && p.ki && p.w), "sparse mla: qi, ki and w are required without ids");
    res.ids.resize(n_list);
    res.score.resize(n_list);
    std::vector<int64_t> key_ids(static_cast<size_t>(S));
    std::iota(key_ids.begin(), key_ids.end(), int64_t{0});
    IndexerArgs<T> ia;
    ia.shape = IndexerShape{S, S, p.hi, p.di, p.topk};
    ia.qi = dense_view(p.qi, p.hi, p.di);
    ia.w = dense_view(p.w, p.hi, 1);
    ia.ki = p.ki;
    ia.ki_row_stride = p.di;
    ia.key_ids = key_ids.data();
    ia.score = res.score.data();
    ia.ids = res.ids.data();
    indexer_topk(ia, row_slices(row, p.window));
  }
  const T scale = p.scale == T(0) ? T(1) / std::sqrt(static_cast<T>(p.dqk)) : p.scale;
  res.o.assign(static_cast<size_t>(S * p.h * p.dv), T(0));
  res.lse.assign(static_cast<size_t>(S * p.h), T(0));
  SparseForwardArgs<T> fa;
  fa.shape = sh;
  fa.q = dense_view(p.q, p.h, p.dqk);
  fa.kv = p.kv;
  fa.kv_row_stride = p.dqk;
  fa.rows = res.ids.data();  // the whole row is the KV buffer: canonical ids are its rows
  fa.o = dense_view(res.o.data(), p.h, p.dv);
  fa.lse = dense_view(res.lse.data(), p.h, 1);
  fa.scale = scale;
  sparse_attention_forward(fa);
  if (!p.dout) return res;
  res.dq.assign(static_cast<size_t>(S * p.h * p.dqk), T(0));
  res.dkv.assign(static_cast<size_t>(S * p.dqk), T(0));
  SparseBackwardArgs<T> ba;
  ba.shape = sh;
  ba.q = fa.q;
  ba.kv = p.kv;
  ba.kv_row_stride = p.dqk;
  ba.rows = res.ids.data();
  ba.o = dense_view<const T>(res.o.data(), p.h, p.dv);
  ba.lse = dense_view<const T>(res.lse.data(), p.h, 1);
  ba.dout = dense_view(p.dout, p.h, p.dv);
  ba.dq = dense_view(res.dq.data(), p.h, p.dqk);
  ba.dkv = res.dkv.data();
  ba.dkv_row_stride = p.dqk;
  ba.scale = scale;
  sparse_attention_backward(ba);
  return res;
}

#define TREECP_INSTANTIATE(T)                                                                 \
  template void indexer_topk<T>(const IndexerArgs<T>&, const std::vector<Slice>&);           \
  template void topk_merge<T>(const TopkMergeArgs<T>&);                                      \
  template void sparse_attention_forward<T>(const SparseForwardArgs<T>&);                    \
  template void sparse_attention_backward<T>(const SparseBackwardArgs<T>&);                  \
  template SparseMlaResult<T> sparse_mla_reference<T>(const Row&, const SparseMlaProblem<T>&);

TREECP_INSTANTIATE(float)
TREECP_INSTANTIATE(double)
#undef TREECP_INSTANTIATE

}  // namespace treecp::cpu
