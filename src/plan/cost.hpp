// plan/: pure data between the row and the runtime: ownership, the dense, GDN/KDA, Mamba-2 and sparse MLA
// planners, their cost models, and the Plans they produce (no tensor values).
//
// The cost model of DESIGN.md "Schedule model": coefficients (a JSON file), the one stage-cost and
// transfer-cost function, and the forward/backward schedule simulator. The planner, the plan
// simulator and every report call these; no other file prices a stage.
//
//   stage ms    = launch + computed pairs / pair throughput + merge x query tokens (remote stages)
//                 + ranges x range cost + underfill x max(0, 1 - pairs / underfill pairs)
//   computed pairs = the visible pairs, or with a kernel tile set, every tile the slices touch in full
//   transfer ms = latency(src, dst) + max(bytes / link bandwidth,
//                                         bytes out of src / rank bandwidth, bytes into dst / rank bandwidth)
// docs/costs.md says where the default numbers come from.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/json.hpp"
#include "kernels/shapes.hpp"

namespace treecp {

struct Link {
  double latency_ms = 0.0;
  double bandwidth_bytes_per_ms = 1.0;
};

// A link in a coefficient file: {"latency_ms": ..., "bandwidth_bytes_per_ms": ...}; `what` names it in
// errors. Shared by every cost model (dense attention here, GDN in plan/gdn_plan.hpp).
Link link_from_json(const json::Value& v, const std::string& what);
json::Value to_json(const Link& l);

struct LinkOverride {
  int src = 0, dst = 0;
  Link link;
};

// Whose tiles a stage's pair term counts (the kernel computes every tile a slice touches in full):
// none (exact pairs), the CPU kernel's (kernels/cpu/tiles.hpp) or the CUDA forward kernel's
// (kernels/cuda/tiles.hpp). JSON: "exact", "cpu", "cuda".
enum class KernelTiles { Exact, Cpu, Cuda };
const char* kernel_tiles_name(KernelTiles t);

// A kernel's tile in tokens at `group` query heads per KV head (queries x keys); {0, 0} for Exact.
struct TileTokens {
  int64_t query = 0, key = 0;
};
TileTokens tile_tokens(KernelTiles t, int64_t group);

// The coefficients: no layer shape (the planner takes the layer's AttentionShape, kernels/shapes.hpp).
struct CostModel {
  // Wire precision of what a wave moves; bytes per token = hkv x (d + dv) x these.
  int64_t kv_bytes_per_element = 2;   // bf16 K and V on the wire
  int64_t dkv_bytes_per_element = 4;  // fp32 dK and dV returned to their owner
  // Attention pair throughput: local (owned KV) and remote (received KV) stages, forward and backward.
  double local_forward_pairs_per_ms = 2.16e7;
  double remote_forward_pairs_per_ms = 2.03e7;
  double local_backward_pairs_per_ms = 8.33e6;
  double remote_backward_pairs_per_ms = 7.69e6;
  // Tiles the pair term counts (tile_padded_area at tile_tokens(kernel_tiles, hq / hkv)); exact pairs by
  // default until a GPU calibration sets "cuda".
  KernelTiles kernel_tiles = KernelTiles::Exact;
  double stage_launch_ms = 0.02;             // per non-empty stage
  double merge_ms_per_query_token = 1.0e-5;  // per query token a remote stage merges (fwd O/LSE, bwd dQ)
  double range_ms = 0.002;                   // per gathered/scattered range of a stage
  int64_t underfill_pairs = 2162688;         // pairs that fill the GPU once (132 SMs x 128 x 128 tiles)
  double underfill_ms = 0.1;                 // cost of a stage far below underfill_pairs
  // Token-local work per owned token: the attention operation's own passes over Q, O, LSE by default;
  // projections and MLP when the modelled layer includes them (docs/costs.md).
  double token_local_forward_ms_per_token = 8.0e-6;
  double token_local_backward_ms_per_token = 1.6e-5;
  // Links: ranks [k * ranks_per_node, (k + 1) * ranks_per_node) share a node; overrides win.
  int ranks_per_node = 8;
  Link intra_node{0.015, 2.727e8};
  Link inter_node{0.025, 5.0e7};
  double rank_bandwidth_bytes_per_ms = 1.997e8;  // what one rank sends (or receives) at once, all peers
  std::vector<LinkOverride> links;
  // Memory bound per rank: owned activations plus the largest wave's receive buffer.
  int64_t activation_bytes_per_token = 34944;
  int64_t memory_limit_bytes_per_rank = 34359738368;  // 32 GiB; <= 0 = unbounded

  Link link(int src, int dst) const;
  // Bytes one token's K and V (dK and dV) take on the wire at the layer's shape.
  int64_t kv_bytes_per_token(const AttentionShape& s) const { return (s.k_width() + s.v_width()) * kv_bytes_per_element; }
  int64_t dkv_bytes_per_token(const AttentionShape& s) const {
    return (s.k_width() + s.v_width()) * dkv_bytes_per_element;
  }
};

// Reads a coefficient file; keys not present keep their defaults, unknown keys are refused.
CostModel costs_from_json(const json::Value& v);
CostModel load_costs(const std::string& path);
json::Value to_json(const CostModel& c);

enum class Pass { Forward, Backward };

// What one stage of one rank does.
struct StageLoad {
  int64_t pairs = 0;
  int64_t query_tokens = 0;   // tokens of the owned query chunks the stage touches
  int64_t ranges = 0;         // received ranges (remote stages) or owned ranges (local stage)
  int64_t compute_pairs = 0;  // pairs the tiled kernel computes (tile_padded_area); 0 means = pairs
};

// THE stage cost. An empty stage (no pairs) costs nothing.
double stage_ms(const CostModel& c, const StageLoad& s, bool remote, Pass pass);

// Its pair term: `pairs` at the throughput of the stage kind and pass.
double pairs_ms(const CostModel& c, double pairs, bool remote, Pass pass);
// The token-local work of `tokens` owned tokens in one pass.
double token_local_ms(const CostModel& c, double tokens, Pass pass);
// What `pairs` owned pairs and `tokens` owned tokens cost one rank, forward + backward, without
// launches, merges, ranges, tile padding or communication: the weight by which the balancing layouts
// rank chunks, and, spread evenly over cp ranks, a lower bound on any plan's makespan.
double own_work_ms(const CostModel& c, double pairs, double tokens);

// Per rank: the local stage and one StageLoad per wave, with the tokens it owns.
struct RankLoad {
  StageLoad local;
  std::vector<StageLoad> waves;
  int64_t owned_tokens = 0;
};

// KV tokens moved in one wave: tokens[src * cp + dst].
using WaveTraffic = std::vector<int64_t>;

struct Prediction {
  std::vector<double> forward_ms, backward_ms;  // per rank, token-local work included
  double makespan_ms = 0.0;                     // slowest rank's forward + backward
  int slowest_rank = 0;
};

// Link table for one rank count, so that the simulator does not rebuild it per call.
class Links {
 public:
  Links(const CostModel& c, int cp);
  const Link& at(int src, int dst) const { return table_[static_cast<size_t>(src) * cp_ + dst]; }
  int cp() const { return cp_; }

 private:
  int cp_;
  std::vector<Link> table_;
};

// Time until `rank`'s part of one wave has landed: inbound, the KV it fetches (traffic[src * cp + rank]);
// otherwise the mirror, the dK/dV it returns to those owners.
double exchange_ms(const CostModel& c, const Links& links, const WaveTraffic& traffic, int rank,
                   int64_t bytes_per_token, bool inbound);

// DESIGN.md's simulator over every rank, for a layer of `shape`. loads.size() == cp; waves[w] holds
// wave w's traffic.
// The totals of simulate_timeline's timeline, computed by the same code without recording it.
// With `refetch_backward` the backward fetches each wave's KV again, one wave ahead (Plan::refetch_backward).
Prediction simulate(const CostModel& c, const Links& links, const AttentionShape& shape,
                    const std::vector<RankLoad>& loads, const std::vector<WaveTraffic>& waves,
                    bool refetch_backward = false);

// One interval of the simulated schedule. A rank's compute spans (token-local work, stages, waits)
// follow one another without overlap; its transfers overlap the compute (that is the point of waves),
// and its dK/dV returns may overlap one another.
enum class SpanKind {
  TokenLocal,   // per-owned-token work: before the stages in forward, after the returns in backward
  LocalStage,   // owned queries x owned keys
  RemoteStage,  // owned queries x one wave's received keys
  Wait,         // compute idle: the wave's KV has not landed; backward, also dK/dV still returning
  Fetch,        // one wave's KV landing on this rank (the backward's too when it fetches again)
  Return,       // backward: one wave's dK/dV going back to their owners
};
bool is_transfer(SpanKind kind);

struct ScheduleSpan {
  SpanKind kind = SpanKind::LocalStage;
  Pass pass = Pass::Forward;
  int rank = 0;
  int wave = -1;  // 0-based wave of a remote stage, fetch, return or the wait before them; -1 otherwise
  double begin_ms = 0.0, end_ms = 0.0;  // from the start of the rank's forward; backward follows its forward
};

struct Timeline {
  Prediction prediction;            // bit-identical to simulate() on the same inputs
  std::vector<ScheduleSpan> spans;  // rank by rank, each rank's spans in the order the simulator meets them
};

// The simulator's schedule span by span: rank r's forward runs over [0, forward_ms[r]] and its
// backward over [forward_ms[r], forward_ms[r] + backward_ms[r]]. Empty stages and transfers are left out.
Timeline simulate_timeline(const CostModel& c, const Links& links, const AttentionShape& shape,
                           const std::vector<RankLoad>& loads, const std::vector<WaveTraffic>& waves,
                           bool refetch_backward = false);

}  // namespace treecp
