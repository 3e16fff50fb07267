// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// Sparse multi-head latent attention with a learned indexer on the CPU (ART §07; DESIGN.md "Algebra to
// keep exact"), float and double (double is the oracle). The CUDA backend will implement the same contracts.
//
// Indexer: score(q, j) = sum_h w[q,h] * relu(qi[q,h] . ki[j]) over the keys j a stage's slices give q.
// Each query keeps its top-k keys: higher score first, equal scores to the smaller canonical id; a
// query with fewer than k keys keeps all of them. A stage returns its own list per query; lists of
// stages over disjoint key sets merge into the list of their union (topk_merge), so the result never
// depends on how keys were split into stages or in which order the stages ran. A pair's score is
// computed by the same arithmetic wherever its key sits in a buffer, so a staged run selects exactly
// the ids of a single pass.
//
// Sparse attention (absorbed MLA, one shared latent KV head): q [rows, H, Dqk], kv [kv_rows, Dqk]
// (latent then rope part), the value of a key is the first Dv columns of its kv row:
//   o[q,h] = sum_{j in list(q)} softmax_j(scale q[q,h] . kv[j]) kv[j, :Dv],   LSE natural log.
// list(q) holds kv buffer rows (-1 = no entry, anywhere in the list); a query with an empty list has
// O = 0 and LSE = -inf. Backward takes the complete O and LSE and accumulates dq and dkv (the value
// gradient lands in the first Dv columns of dkv, the score gradient in all Dqk).
//
// Layouts (elements; last dimension contiguous): qi [q_rows, Hi, Di], w [q_rows, Hi], ki [k_rows, Di],
// top-k lists [q_rows, k] (score, id), q/dq [q_rows, H, Dqk], o/do [q_rows, H, Dv], lse [q_rows, H],
// kv/dkv [kv_rows, Dqk]. Memory is O(rows x k) for the lists and O(k x Dqk) scratch, never O(S^2).
// One thread; AVX2 + FMA copies of the loops are chosen at run time as for attention.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/cpu/attention.hpp"
#include "tree/slice.hpp"

namespace treecp {
class Row;
}

namespace treecp::cpu {

// ---- indexer: one stage's top-k list per query

struct IndexerShape {
  int64_t q_rows = 0;  // rows of qi, w and of the output lists
  int64_t k_rows = 0;  // rows of ki
  int hi = 0, di = 0;  // indexer heads, indexer head dim
  int64_t topk = 0;    // k
  // Throws treecp::Error naming the field when a size is out of range.
  void validate() const;
};

template <class T>
struct IndexerArgs {
  IndexerShape shape;
  HeadView<const T> qi;              // [q_rows, hi, di]
  HeadView<const T> w;               // [q_rows, hi] (a HeadView with dim 1)
  const T* ki = nullptr;             // [k_rows, di], rows ki_row_stride apart
  int64_t ki_row_stride = 0;
  const int64_t* key_ids = nullptr;  // [k_rows] canonical id of each key row (>= 0): output ids and tie rule
  T* score = nullptr;                // [q_rows, topk] written: best first, -inf after the last entry
  int64_t* ids = nullptr;            // [q_rows, topk] written: canonical ids, -1 after the last entry
};

// The stage's top-k list of every query row over the keys of `slices` (buffer coordinates; slices must
// not overlap). Rows no slice touches get an empty list. Throws on a NaN score (overflowing inputs).
template <class T>
void indexer_topk(const IndexerArgs<T>& args, const std::vector<Slice>& slices);

template <class T>
struct TopkMergeArgs {
  int64_t rows = 0, topk = 0;
  T* score = nullptr;                  // [rows, topk] the running lists, replaced by the merged ones
  int64_t* ids = nullptr;
  const T* part_score = nullptr;       // [rows, topk] a stage's lists over keys disjoint from the running ones
  const int64_t* part_ids = nullptr;
};

// The top-k of the union of each row's two lists, in the same order (score descending, id ascending).
template <class T>
void topk_merge(const TopkMergeArgs<T>& args);

// ---- sparse attention over a per-query list of KV buffer rows

struct SparseShape {
  int64_t q_rows = 0;    // rows of q, o, lse and of the lists
  int64_t kv_rows = 0;   // rows of the KV buffer
  int h = 0, dqk = 0, dv = 0;  // heads, query/key dim (latent + rope), value dim (<= dqk)
  int64_t topk = 0;      // entries per list
  void validate() const;
};

template <class T>
struct SparseForwardArgs {
  SparseShape shape;
  HeadView<const T> q;              // [q_rows, h, dqk]
  const T* kv = nullptr;            // [kv_rows, dqk], rows kv_row_stride apart
  int64_t kv_row_stride = 0;
  const int64_t* rows = nullptr;    // [q_rows, topk] kv buffer rows, -1 = none; distinct within a list
  HeadView<T> o;                    // [q_rows, h, dv] written
  HeadView<T> lse;                  // [q_rows, h] written (dim 1)
  T scale = 0;
};

template <class T>
void sparse_attention_forward(const SparseForwardArgs<T>& args);

template <class T>
struct SparseBackwardArgs {
  SparseShape shape;
  HeadView<const T> q;
  const T* kv = nullptr;
  int64_t kv_row_stride = 0;
  const int64_t* rows = nullptr;
  HeadView<const T> o, lse;         // the complete forward output and LSE
  HeadView<const T> dout;           // dJ/dO [q_rows, h, dv]
  HeadView<T> dq;                   // [q_rows, h, dqk] accumulated (+=)
  T* dkv = nullptr;                 // [kv_rows, dqk] accumulated (+=), rows dkv_row_stride apart
  int64_t dkv_row_stride = 0;
  T scale = 0;
};

template <class T>
void sparse_attention_backward(const SparseBackwardArgs<T>& args);

// ---- selected ids handed over by another layer (IndexShare)

// Checks the lists of canonical queries [q_begin, q_end) (row-major [q_end - q_begin, topk]): every
// entry is -1 or the id of a key the query sees (tree and window), with no id twice in one list.
// Throws treecp::Error naming the query, the entry and the rule.
void check_selected_ids(const Row& row, int64_t window, int64_t topk, int64_t q_begin, int64_t q_end,
                        const int64_t* ids);

// ---- whole-row convenience: the CLI and the oracle for the CP runtime

template <class T>
struct SparseMlaProblem {
  int hi = 0, di = 0;                 // indexer heads and head dim (unused with ids)
  int h = 0, dqk = 0, dv = 0;
  int64_t topk = 0;
  int64_t window = 0;                 // sliding window on logical positions, 0 = none
  T scale = 0;                        // 0 means 1/sqrt(dqk)
  const T* qi = nullptr;              // [S, hi, di]
  const T* ki = nullptr;              // [S, di]
  const T* w = nullptr;               // [S, hi]
  const int64_t* ids = nullptr;       // [S, topk] canonical ids to reuse (IndexShare): the indexer is skipped
  const T* q = nullptr;               // [S, h, dqk]
  const T* kv = nullptr;              // [S, dqk]
  const T* dout = nullptr;            // [S, h, dv] or nullptr (forward only)
};

template <class T>
struct SparseMlaResult {
  std::vector<int64_t> ids;   // [S, topk] selected canonical ids, best first, -1 after the last
  std::vector<T> score;       // [S, topk] their indexer scores (empty when ids were given)
  std::vector<T> o, lse;      // [S, h, dv], [S, h]
  std::vector<T> dq, dkv;     // with dout: [S, h, dqk], [S, dqk]
};

// Whole-row run in one process: the indexer over row_slices(row, window) in one stage (or the given
// ids, checked), then one sparse attention call over the whole row's KV.
template <class T>
SparseMlaResult<T> sparse_mla_reference(const Row& row, const SparseMlaProblem<T>& problem);

}  // namespace treecp::cpu
