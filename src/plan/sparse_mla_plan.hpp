// plan/: pure data between the row and the runtime: ownership, the dense, GDN/KDA, Mamba-2 and sparse MLA
// planners, their cost models, and the Plans they produce (no tensor values).
//
// Planning sparse MLA with a learned indexer (ART §07): two kinds of work priced separately, as the
// article insists. The indexer scores every visible (query, key) pair and runs through the dense
// plan's stages and waves (its pairs are the plan's visible pairs); the sparse attention computes
// about k pairs per query (min(k, visible keys) exactly), in one call over a combined KV buffer, and
// returns dKV of the rows it read from other ranks. The KV rows the sparse call needs arrive either
// with the indexer's waves (every fetched row travels, overlapped with the indexer) or after the
// indexer, only the selected rows (requested by id from their owners); the planner takes the mode that
// moves fewer bytes unless told otherwise.
//
// Selected rows depend on the data; a plan is made before any value exists, so it prices them by an
// upper bound that holds for every input: from owner p, rank r needs at most
// min(tokens r would fetch from p, sum over r's queries of min(k, keys of p the query sees)).
// Every price goes through plan/cost.hpp's stage and transfer functions (no second formula).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "plan/cost.hpp"
#include "plan/plan.hpp"
#include "plan/planner.hpp"

namespace treecp {

class Row;

// Where the sparse call's remote KV rows come from.
enum class KvFetch { Waves, Selected };
const char* kv_fetch_name(KvFetch f);  // "waves", "selected"

struct SparseMlaShape {
  int64_t hi = 32, di = 128;            // indexer heads, indexer head dim
  int64_t h = 64, dqk = 576, dv = 512;  // attention heads, latent + rope dim, value dim (article's GLM)
  int64_t bytes_per_element = 2;        // ki and kv rows on the wire (bf16)
  int64_t dkv_bytes_per_element = 4;    // dKV returned to the owner in fp32
  int64_t id_bytes = 8;                 // one canonical id (int64)
  int64_t ki_bytes_per_token() const { return di * bytes_per_element; }
  int64_t kv_bytes_per_token() const { return dqk * bytes_per_element; }
  int64_t dkv_bytes_per_token() const { return dqk * dkv_bytes_per_element; }
  // FLOPs of one (query, key) pair: indexer 2 Hi Di; sparse forward 2 H (Dqk + Dv), backward
  // 2 H (3 Dqk + 2 Dv) (scores, dP, dQ, dKV).
  double indexer_flops_per_pair() const { return 2.0 * static_cast<double>(hi * di); }
  double sparse_forward_flops_per_pair() const { return 2.0 * static_cast<double>(h * (dqk + dv)); }
  double sparse_backward_flops_per_pair() const { return 2.0 * static_cast<double>(h * (3 * dqk + 2 * dv)); }
};

struct SparseMlaCosts {
  SparseMlaShape shape;
  // The indexer's stages through the dense schedule: pair rates count (query, key) pairs over all Hi
  // heads, top-k selection included. Its links, rank bandwidth and memory terms also price the
  // selected-row exchange; its backward and token-local terms are not used (no gradient reaches the
  // indexer; token-local work is the sparse model's).
  CostModel indexer = default_indexer();
  // The one sparse call, priced as one local stage: pairs are (query, selected key) pairs over all H
  // heads; only the local pair rates, launch, range, underfill and token-local terms are read.
  CostModel sparse = default_sparse();

  static CostModel default_indexer();
  static CostModel default_sparse();
};

// JSON: {"note", "shape": {hi, di, h, dqk, dv, bytes_per_element, dkv_bytes_per_element},
// "indexer": {dense cost keys}, "sparse": {dense cost keys}}; missing keys keep their defaults,
// unknown keys (and a "shape" inside indexer or sparse) are refused.
SparseMlaCosts sparse_mla_costs_from_json(const json::Value& v);
SparseMlaCosts load_sparse_mla_costs(const std::string& path);
json::Value to_json(const SparseMlaCosts& c);

// What one rank does and moves under a plan, for one fetch mode.
struct SparseMlaRankCost {
  int64_t owned_tokens = 0;
  int64_t indexer_pairs = 0;   // visible pairs of the owned queries (the indexer's work)
  int64_t sparse_pairs = 0;    // sum over owned queries of min(k, visible keys) (the sparse call's work)
  int64_t wave_rows = 0;       // KV rows received in the indexer's waves
  int64_t selected_rows = 0;   // remote rows the sparse call reads, upper bound
  double indexer_ms = 0.0;     // the staged indexer with its waves
  double fetch_ms = 0.0;       // after the indexer: ids to the owners, and with Selected the rows back
  double sparse_forward_ms = 0.0, sparse_backward_ms = 0.0;  // token-local work included
  double return_ms = 0.0;      // dKV of the remote rows back to their owners
  double forward_ms = 0.0, backward_ms = 0.0;
  int64_t bytes_sent = 0, bytes_received = 0;  // to and from other ranks, forward and backward
};

struct SparseMlaPrediction {
  KvFetch fetch = KvFetch::Waves;
  bool full_index = true;  // false: ids reused from another layer (IndexShare), no indexer
  std::vector<SparseMlaRankCost> ranks;
  double makespan_ms = 0.0;  // slowest rank's forward + backward
  int slowest_rank = 0;
  int64_t bytes_moved = 0;   // sum over ranks of bytes sent
};

// Prices a plan (ownership and waves from make_plan, visibility in its slices) for sparse MLA.
SparseMlaPrediction price_sparse_mla(const Plan& plan, const SparseMlaCosts& costs, int64_t topk, KvFetch fetch,
                                     bool full_index = true);

struct SparseMlaPlanOptions {
  PlanOptions plan;            // layout ("searched" = the best of every layout), chunk, waves, budget
  int64_t window = 0;          // the layer's sliding window (0 = none)
  int64_t topk = 2048;
  std::string fetch = "auto";  // auto (fewer bytes) | waves | selected
  bool full_index = true;      // false: the layer reuses ids (IndexShare)
};

struct SparseMlaPlan {
  Plan plan;            // ownership and the indexer's waves: a dense plan, validated like one
  KvFetch fetch = KvFetch::Waves;
  int64_t topk = 0;
  SparseMlaPrediction prediction;  // of `fetch`
  SparseMlaPrediction other;       // the other fetch mode on the same plan, for reports
};

// Plans a row for sparse MLA: each candidate layout's dense plan (searched under a model whose
// token-local term carries the row's average sparse work per token) priced by price_sparse_mla, the
// fastest kept; with "searched" every layout is a candidate.
SparseMlaPlan make_sparse_mla_plan(const Row& row, int cp, const SparseMlaCosts& costs,
                                   const SparseMlaPlanOptions& options);

// Per query of the row: min(k, visible keys) (tree and window) from the row's slices, O(S x depth).
std::vector<int64_t> sparse_pairs_per_query(const Row& row, int64_t window, int64_t topk);

}  // namespace treecp
