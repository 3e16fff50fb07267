// GPU slice attention against a double-precision brute-force oracle on random trees: tile lists,
// forward (O, LSE), backward (dQ, dK, dV), the stage form merged with the fused merge + sink kernel,
// GQA, head dims 64 and 128, sliding windows, single-token segments and rows with no visible key; bf16 and fp16
// operands (fp16 also at the ends of its range: values near 60000, logits far beyond it). CudaAttentionDims: the
// (Dqk, Dv) pairs (192, 128) and (256, 256) on every main loop they have, and the wgmma backward at head dim 64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>

#include "core/error.hpp"
#include "cuda_test_util.hpp"
#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/visibility.hpp"
#include "tree/presets.hpp"
#include "tree/slice.hpp"

namespace treecp::cuda::test {

// tests/cuda/wgmma_variants.cu: the wgmma kernels' variants, launched directly
int fwd_wgmma_variant_count();
void launch_fwd_wgmma_variant(const detail::FwdArgs& a, int head_dim, int variant);
int bwd_wgmma_variant_count();
void launch_bwd_wgmma_variant(const detail::BwdArgs& a, int variant);

namespace {

constexpr double kTol = 1e-2;  // bf16 storage: relative error (norm-wise) of every output
// The same bound for fp16 operands: kTol is 2.56 unit roundoffs of bf16 (8 significant bits: 2^-8); fp16 has 11
// (2^-11), and its kernels round the same quantities (P, dS, O, the merge's outputs) to it.
constexpr double kUnitRoundoffBf16 = 0x1p-8, kUnitRoundoffF16 = 0x1p-11;
double tol(DType t) { return t == DType::kF16 ? kTol / kUnitRoundoffBf16 * kUnitRoundoffF16 : kTol; }

// The error of the oracle's own O rounded to bf16. An fp16 O has 3 more significand bits, so it must come out well
// below this (about an eighth of it from fp16's rounding); a path that went through bf16 anywhere in P, V or O could
// not. The check that the fp16 kernels are fp16 throughout.
double bf16_storage_error(const std::vector<double>& exact) {
  std::vector<double> rounded(exact.size());
  for (size_t i = 0; i < exact.size(); ++i) rounded[i] = from_bf16(to_bf16(static_cast<float>(exact[i])));
  return rel_error(rounded, exact);
}
void expect_fp16_o(DType dtype, const std::vector<double>& o, const std::vector<double>& exact, const std::string& what) {
  if (dtype != DType::kF16) return;
  EXPECT_LT(rel_error(o, exact), 0.5 * bf16_storage_error(exact)) << what << ": fp16 O no better than bf16 rounding";
}

// Forward params over contiguous [rows, heads, d] buffers (q and o with hq heads, k and v with hkv).
AttentionForwardParams contiguous_forward(DType dtype, const void* q, const void* k, const void* v, void* o, float* lse,
                                          int hq, int hkv, int d, double scale) {
  AttentionForwardParams fp;
  fp.dtype = dtype;
  fp.q = q;
  fp.k = k;
  fp.v = v;
  fp.o = o;
  fp.lse = lse;
  fp.q_row_stride = fp.o_row_stride = int64_t{hq} * d;
  fp.k_row_stride = fp.v_row_stride = int64_t{hkv} * d;
  fp.q_head_stride = fp.k_head_stride = fp.v_head_stride = fp.o_head_stride = d;
  fp.lse_row_stride = hq;
  fp.lse_head_stride = 1;
  fp.hq = hq;
  fp.hkv = hkv;
  fp.head_dim = d;
  fp.scale = static_cast<float>(scale);
  return fp;
}

// Every forward path (main loop, rows per warp, with a workspace): the default with and without a workspace
// (persistent where the warp-specialised kernel applies, and one block per tile), wgmma, mma.sync with 16 and 32
// rows per warp.
using Mainloop = AttentionForwardParams::Mainloop;
constexpr std::tuple<Mainloop, int, bool> kForwardPaths[] = {{Mainloop::kDefault, 0, true},
                                                             {Mainloop::kDefault, 0, false},
                                                             {Mainloop::kWgmma, 0, false},
                                                             {Mainloop::kMmaSync, 16, false},
                                                             {Mainloop::kMmaSync, 32, false}};
using ForwardPath = std::tuple<Mainloop, int, bool>;

// The forward of `fp` on one path, into o and lse poisoned first (NaN shows what it leaves unwritten); returns the
// path's description.
std::string run_forward_path(AttentionForwardParams fp, const ForwardPath& path, DeviceBuffer<unsigned char>& workspace,
                             DeviceBuffer<uint16_t>& o, DeviceBuffer<float>& lse, const DeviceTilePlan& plan) {
  const auto& [mainloop, rows_per_warp, with_workspace] = path;
  o.poison();
  lse.poison();
  fp.mainloop = mainloop;
  fp.rows_per_warp = static_cast<int8_t>(rows_per_warp);
  fp.workspace = with_workspace ? workspace.ptr : nullptr;
  fp.workspace_bytes = with_workspace ? workspace.n : 0;
  attention_forward(fp, plan);
  check_cuda(cudaDeviceSynchronize(), "forward");
  return "mainloop " + std::to_string(static_cast<int>(mainloop)) + " rows_per_warp " + std::to_string(rows_per_warp) +
         " workspace " + std::to_string(with_workspace);
}

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device"

// The key-major segment order: a permutation of the tiles in groups of at most kSegmentChunk tiles of one
// segment (a tile's segment: the last slice key start at or before its first key, found here by a scan of the
// slices), each group's bounds held at every position of it and its tiles longest walk first; the groups by
// their first tile's walk, descending; a segment's groups in order (their tiles longest first throughout), all
// of kSegmentChunk tiles but its last.
void check_segment_order(const TilePlan& plan, const TileLists& l) {
  const size_t n = static_cast<size_t>(l.num_major);
  ASSERT_EQ(l.segment_order.size(), n);
  ASSERT_EQ(l.segment_first.size(), n);
  ASSERT_EQ(l.segment_end.size(), n);
  std::vector<int64_t> seg(n, -1), walk(n, 0);
  std::map<int64_t, int64_t> seg_tiles;
  for (size_t t = 0; t < n; ++t) {
    for (const DeviceSlice& s : plan.slices)
      if (s.k0 <= l.major_start[t]) seg[t] = std::max<int64_t>(seg[t], s.k0);
    for (int32_t e = l.offsets[t]; e < l.offsets[t + 1]; ++e) walk[t] += l.entries[e].tile_end - l.entries[e].tile_begin;
    ++seg_tiles[seg[t]];
  }
  std::vector<int32_t> sorted = l.segment_order;
  std::sort(sorted.begin(), sorted.end());
  for (size_t t = 0; t < n; ++t) ASSERT_EQ(sorted[t], static_cast<int32_t>(t));
  ASSERT_EQ(l.segment_of.size(), n);  // one rank per segment
  for (size_t a = 0; a < n; ++a)
    for (size_t b = a + 1; b < n; ++b) ASSERT_EQ(seg[a] == seg[b], l.segment_of[a] == l.segment_of[b]);
  std::map<int64_t, std::vector<size_t>> groups_of;  // segment -> its groups' sizes, in order
  std::map<int64_t, int64_t> last_walk;               // segment -> walk of its last tile seen
  int64_t prev_first = INT64_MAX;
  for (size_t i = 0; i < n;) {
    const size_t first = l.segment_first[i], end = l.segment_end[i];
    ASSERT_EQ(first, i);
    ASSERT_LT(first, end);
    ASSERT_LE(end, n);
    ASSERT_LE(end - first, static_cast<size_t>(kSegmentChunk));
    const int64_t s = seg[l.segment_order[first]];
    ASSERT_LE(walk[l.segment_order[first]], prev_first) << "groups by their first tile's walk";
    prev_first = walk[l.segment_order[first]];
    for (size_t x = first; x < end; ++x) {
      ASSERT_EQ(l.segment_first[x], static_cast<int32_t>(first));
      ASSERT_EQ(l.segment_end[x], static_cast<int32_t>(end));
      ASSERT_EQ(seg[l.segment_order[x]], s);
      if (last_walk.count(s)) {
        ASSERT_LE(walk[l.segment_order[x]], last_walk[s]) << "segment " << s << " longest first";
      }
      last_walk[s] = walk[l.segment_order[x]];
    }
    groups_of[s].push_back(end - first);
    i = end;
  }
  for (const auto& [s, sizes] : groups_of) {
    int64_t total = 0;
    for (size_t g = 0; g < sizes.size(); ++g) {
      if (g + 1 < sizes.size()) {
        ASSERT_EQ(sizes[g], static_cast<size_t>(kSegmentChunk)) << "segment " << s;
      }
      total += static_cast<int64_t>(sizes[g]);
    }
    ASSERT_EQ(total, seg_tiles[s]) << "segment " << s;
  }
}

// The key-major upper_live ranges against brute-force visibility: a query tile whose tokens see a key of the upper
// half of the KV tile (from major_start + kBwdBlockKeys / 2) lies inside its entry's range, and for an entry of at
// most one slice (whose seen query tiles are consecutive) every tile inside the range sees one.
void check_upper_live(const TilePlan& plan, const TileLists& l, const Row& row, int64_t window) {
  ASSERT_EQ(l.upper_live.size(), 2 * l.entries.size());
  const int64_t tq = l.minor_tile_rows;
  for (int32_t t = 0; t < l.num_major; ++t) {
    const int64_t ka = l.major_start[t] + kBwdBlockKeys / 2, kb = l.major_start[t + 1];
    for (int32_t i = l.offsets[t]; i < l.offsets[t + 1]; ++i) {
      const TileEntry& e = l.entries[i];
      const int32_t lo = l.upper_live[2 * i], hi = l.upper_live[2 * i + 1];
      for (int32_t qt = e.tile_begin; qt < e.tile_end; ++qt) {
        bool sees = false;
        for (int64_t q = qt * tq; q < (qt + 1) * tq && q < plan.q_rows && !sees; ++q)
          for (int64_t k = ka; k < kb && !sees; ++k) sees = row.visible(q, k, window);
        const bool inside = qt >= lo && qt < hi;
        if (sees) {
          ASSERT_TRUE(inside) << "KV tile " << t << " query tile " << qt << " sees the upper half outside [" << lo << ", "
                              << hi << ")";
        }
        if (inside && e.mask_count <= 1) {
          ASSERT_TRUE(sees) << "KV tile " << t << " query tile " << qt << " inside [" << lo << ", " << hi
                            << ") sees nothing of the upper half";
        }
      }
    }
  }
}

// Every visible pair lies in exactly one listed tile; a full tile holds only visible pairs and a
// partial tile's slices reproduce visibility exactly. Checked for both lists (host only).
void check_lists(const TilePlan& plan, const TileLists& l, bool q_major, const Row& row, int64_t window) {
  const int64_t tq = q_major ? l.major_tile_rows : l.minor_tile_rows;
  std::set<std::pair<int64_t, int64_t>> seen;
  int64_t covered = 0, full_tiles = 0;
  for (int32_t mt = 0; mt < l.num_major; ++mt)
    for (int32_t e = l.offsets[mt]; e < l.offsets[mt + 1]; ++e) {
      const TileEntry& en = l.entries[e];
      ASSERT_LT(en.tile_begin, en.tile_end);
      for (int32_t tile = en.tile_begin; tile < en.tile_end; ++tile) {
        const int64_t qt = q_major ? mt : tile, kt = q_major ? tile : mt;
        ASSERT_TRUE(seen.insert({qt, kt}).second) << "tile listed twice";
        // key tiles have their own starts in both kinds of list
        const std::vector<int32_t>& starts = q_major ? l.minor_start : l.major_start;
        const int64_t ka = starts[kt], ke = starts[kt + 1];
        int64_t pairs = 0;
        for (int64_t i = qt * tq; i < (qt + 1) * tq && i < plan.q_rows; ++i)
          for (int64_t j = ka; j < ke && j < plan.kv_rows; ++j) {
            const bool v = row.visible(i, j, window);
            pairs += v;
            if (en.mask_count == 0) {
              ASSERT_TRUE(v) << "full tile holds an invisible pair " << i << "," << j;
            } else {
              bool any = false;
              for (int c = 0; c < en.mask_count; ++c) {
                const DeviceSlice& s = plan.slices[l.mask_index[en.mask_begin + c]];
                any |= i >= s.q0 && i < s.q1 && j >= s.k0 && j < s.k1 && i - j >= s.dmin && i - j < s.dmax;
              }
              ASSERT_EQ(any, v) << "pair " << i << "," << j;
            }
          }
        if (en.mask_count == 0) {
          ASSERT_EQ(pairs, tq * (ke - ka));
          ++full_tiles;
        }
        ASSERT_GT(pairs, 0) << "listed tile without work";
        covered += pairs;
      }
    }
  EXPECT_EQ(covered, plan.visible_pairs);
  EXPECT_EQ(full_tiles, l.full_tiles);
  std::vector<int32_t> order = l.order;
  std::sort(order.begin(), order.end());
  for (int32_t t = 0; t < l.num_major; ++t) ASSERT_EQ(order[t], t);
  // the key tiles (major in a key-major list, minor in a query-major one): a partition of [0, kv_rows) into
  // pieces of at most the tile size that starts a new tile at every slice key boundary at least a quarter
  // tile past the current start
  const std::vector<int32_t>& starts = q_major ? l.minor_start : l.major_start;
  const int32_t rows = q_major ? l.minor_tile_rows : l.major_tile_rows;
  EXPECT_TRUE((q_major ? l.major_start : l.minor_start).empty());
  ASSERT_FALSE(starts.empty());
  if (!q_major) {
    ASSERT_EQ(starts.size(), static_cast<size_t>(l.num_major) + 1);
  }
  ASSERT_EQ(starts.front(), 0);
  ASSERT_EQ(starts.back(), plan.kv_rows);
  if (!q_major) {
    check_segment_order(plan, l);
    check_upper_live(plan, l, row, window);
  }
  for (size_t t = 0; t + 1 < starts.size(); ++t) {
    const int32_t ka = starts[t], ke = starts[t + 1];
    ASSERT_LT(ka, ke);
    ASSERT_LE(ke - ka, rows);
    for (const DeviceSlice& s : plan.slices)
      for (const int32_t cut : {s.k0, s.k1})
        ASSERT_FALSE(cut >= ka + rows / kKeyTileMinFraction && cut < ke)
            << "tile [" << ka << ", " << ke << ") crosses key boundary " << cut;
  }
}

TEST(CudaTilePlan, ListsMatchVisibility) {
  TREECP_SEED_TRACE;
  std::mt19937_64 rng = treecp::testing::test_rng(1);
  for (int trial = 0; trial < 6; ++trial) {
    const Row row = random_row(rng, 10 + trial * 3, 70);
    const int64_t window = trial % 2 ? 1 + static_cast<int64_t>(rng() % 90) : 0;
    for (int group : {1, 3, 8}) {
      const TilePlan plan = build_tile_plan(row_slices(row, window), row.tokens(), row.tokens(), group);
      int64_t pairs = 0;
      for (int64_t i = 0; i < row.tokens(); ++i)
        for (int64_t j = 0; j < row.tokens(); ++j) pairs += row.visible(i, j, window);
      ASSERT_EQ(plan.visible_pairs, pairs);
      check_lists(plan, plan.fwd, true, row, window);
      check_lists(plan, plan.bwd, false, row, window);
    }
  }
}

// The segment order's rule on the presets the benchmark measures both orders on (docs/benchmarks-gpu.md,
// change AA), at GQA 32/4 on 132 SMs, where the default order's first wave holds 33 tiles: art-fixed5k's holds
// 5-6 tiles of each of its six prefixes (the segment order: 16 of one), fixed5k's about 4 of each of eight roots
// (the segment order: 8), dominant's 33 of its one root (already 8 or more). Counted from the lists, then the rule.
TEST(CudaTilePlan, SegmentOrderRule) {
  for (const auto& [name, expect] :
       std::vector<std::pair<std::string, bool>>{{"art-fixed5k", true}, {"dominant", false}, {"fixed5k", true}}) {
    const Row row = make_preset(name, 1, 0);
    const TilePlan plan = build_tile_plan(row_slices(row), row.tokens(), row.tokens(), 8);
    const SegmentOrderRule rule = SegmentOrderRule::of(plan.bwd);
    // the rule's inputs, recounted: distinct segments (by a scan of the slices) among the default order's
    // first 33 tiles
    std::set<int32_t> firsts;
    for (int32_t i = 0; i < 33; ++i) {
      int32_t seg = -1;
      for (const DeviceSlice& s : plan.slices)
        if (s.k0 <= plan.bwd.major_start[plan.bwd.order[i]]) seg = std::max(seg, s.k0);
      firsts.insert(seg);
    }
    EXPECT_EQ(rule.order_segments[32], static_cast<int32_t>(firsts.size())) << name;
    EXPECT_EQ(rule.first_segment_tiles, plan.bwd.segment_end[0]) << name;
    EXPECT_EQ(rule.pays(4, 132), expect) << name << ": " << firsts.size() << " segments in the first wave, "
                                         << rule.first_segment_tiles << " tiles in the first segment";
    EXPECT_FALSE(rule.pays(0, 132)) << name;
  }
}

TEST(CudaTilePlan, RejectsSlicesOutsideBuffers) {
  const std::vector<Slice> s{make_slice(0, 10, 0, 10, 0, 10)};
  EXPECT_THROW(build_tile_plan(s, 5, 10, 1), Error);
  EXPECT_THROW(build_tile_plan(s, 10, 10, 0), Error);
}

// The kernels' visibility bits (kernels/cuda/visibility.hpp: one column run per row or key, spread to the
// accumulator layout) against the per-element test, on random slices with and without windows, tile ends and GQA
// groups; host code, so it runs where no GPU does. Element 4 nb + 2 h + c is column base + 8 nb + c of row pair h.
namespace {
DeviceSlice random_slice(std::mt19937& g) {
  DeviceSlice s{};
  s.q0 = static_cast<int32_t>(g() % 300);
  s.q1 = s.q0 + static_cast<int32_t>(g() % 120);
  s.k0 = static_cast<int32_t>(g() % 400);
  s.k1 = s.k0 + static_cast<int32_t>(g() % 120);
  s.dmin = static_cast<int32_t>(g() % 240) - 120;
  s.dmax = s.dmin + static_cast<int32_t>(g() % 200);
  return s;
}
bool in_slice(const DeviceSlice& s, int q, int k) {
  return q >= s.q0 && q < s.q1 && k >= s.k0 && k < s.k1 && q - k >= s.dmin && q - k < s.dmax;
}
}  // namespace

TEST(CudaVisibility, ForwardKeyRunsMatchElementTests) {
  using namespace treecp::cuda::detail;
  std::mt19937 g(11);
  for (int it = 0; it < 200000; ++it) {
    const int lane = static_cast<int>(g() % 32), k0 = static_cast<int>(g() % 400);
    const int k_end = k0 + 1 + static_cast<int>(g() % 80);  // a tile may be shorter than 64 keys, or end past them
    const int kbase = k0 + 2 * (lane % 4);
    const int tok[2] = {static_cast<int>(g() % 420), static_cast<int>(g() % 420)};
    const int n = 1 + static_cast<int>(g() % 3);
    std::vector<DeviceSlice> sl;
    for (int j = 0; j < n; ++j) sl.push_back(random_slice(g));
    uint32_t want = 0, got = 0, want_full = 0;
    for (int h = 0; h < 2; ++h) {
      for (int nb = 0; nb < 8; ++nb)
        for (int c = 0; c < 2; ++c) {
          const int k = kbase + 8 * nb + c;
          if (k < k_end) want_full |= 1u << (4 * nb + 2 * h + c);
          for (const DeviceSlice& s : sl)
            if (k < k_end && in_slice(s, tok[h], k)) want |= 1u << (4 * nb + 2 * h + c);
        }
      for (const DeviceSlice& s : sl) {
        if (tok[h] < s.q0 || tok[h] >= s.q1) continue;
        const ColumnRun r = slice_key_run(s, tok[h], k_end);
        got |= spread_bit_pairs(run_bits16(kbase, r.lo, r.hi)) << (2 * h);
      }
    }
    const uint32_t row = spread_bit_pairs(run_bits16(kbase, kbase, k_end));
    ASSERT_EQ(got, want) << "iteration " << it;
    ASSERT_EQ(row | (row << 2), want_full) << "iteration " << it;
  }
}

TEST(CudaVisibility, BackwardRowRunsMatchElementTests) {
  using namespace treecp::cuda::detail;
  std::mt19937 g(12);
  const int groups[] = {1, 2, 3, 4, 8, 16, 32, 64};
  for (int it = 0; it < 200000; ++it) {
    const int G = groups[g() % 8], lane = static_cast<int>(g() % 32), t0 = static_cast<int>(g() % 300);
    const int valid_rows = g() % 4 == 0 ? static_cast<int>(g() % 65) : (64 / G) * G;  // padding rows past them
    const int key_lo = static_cast<int>(g() % 400), rbase = 2 * (lane % 4);
    const int n = 1 + static_cast<int>(g() % 3);
    std::vector<DeviceSlice> sl;
    for (int j = 0; j < n; ++j) sl.push_back(random_slice(g));
    uint32_t want = 0, got = 0, want_full = 0;
    for (int h = 0; h < 2; ++h) {
      const int key = key_lo + 8 * h;
      for (int nb = 0; nb < 8; ++nb)
        for (int c = 0; c < 2; ++c) {
          const int r = rbase + 8 * nb + c;
          if (r >= valid_rows) continue;
          want_full |= 1u << (4 * nb + 2 * h + c);
          for (const DeviceSlice& s : sl)
            if (in_slice(s, t0 + r / G, key)) want |= 1u << (4 * nb + 2 * h + c);
        }
      for (const DeviceSlice& s : sl) {
        if (key < s.k0 || key >= s.k1) continue;
        const ColumnRun r = slice_row_run(s, key, t0, G, valid_rows, 64);
        got |= spread_bit_pairs(run_bits16(rbase, r.lo, r.hi)) << (2 * h);
      }
    }
    const uint32_t row = spread_bit_pairs(run_bits16(rbase, 0, valid_rows));
    ASSERT_EQ(got, want) << "iteration " << it << " G " << G;
    ASSERT_EQ(row | (row << 2), want_full) << "iteration " << it;
  }
}

// Argument checks run on the host before any launch, so they are tested without a GPU: a bad pointer
// or stride is refused with an error that names it, and nothing is launched.
TEST(CudaArguments, BackwardNamesMisalignedOrMissingTensors) {
  DeviceTilePlan plan;  // never uploaded: only its sizes are read before the launch
  plan.q_rows = 16;
  plan.kv_rows = 16;
  plan.group = 2;
  auto fake = [](uintptr_t a) { return reinterpret_cast<void*>(a); };
  AttentionBackwardParams p;
  p.q = p.k = p.v = p.o = p.d_o = fake(0x10000);
  p.lse = static_cast<const float*>(fake(0x20000));
  p.dsum = p.dq = p.dk = p.dv = static_cast<float*>(fake(0x30000));
  p.q_row_stride = p.o_row_stride = 4 * 64;
  p.k_row_stride = p.v_row_stride = 2 * 64;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = 64;
  p.dq_row_stride = p.dk_row_stride = 64;
  p.dq_head_stride = p.dk_head_stride = 64;
  p.hq = 4;
  p.hkv = 2;
  p.head_dim = 64;
  p.scale = 0.125f;
  auto message = [&](const AttentionBackwardParams& bad) -> std::string {
    try {
      attention_backward(bad, plan);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  AttentionBackwardParams bad = p;
  bad.o = fake(0x10008);  // the Dsum kernel reads O 16 bytes at a time
  EXPECT_NE(message(bad).find("o must be 16-byte aligned"), std::string::npos) << message(bad);
  bad = p;
  bad.o = nullptr;
  EXPECT_NE(message(bad).find("o is required"), std::string::npos) << message(bad);
  bad = p;
  bad.d_o = fake(0x10004);
  EXPECT_NE(message(bad).find("d_o must be 16-byte aligned"), std::string::npos) << message(bad);
  bad = p;
  bad.hq = 6;  // the plan was built for group 2
  EXPECT_NE(message(bad).find("group"), std::string::npos) << message(bad);
  bad = p;
  bad.dtype = static_cast<DType>(7);  // neither bf16 nor fp16
  EXPECT_NE(message(bad).find("dtype must be kBf16 or kF16, got 7"), std::string::npos) << message(bad);
  {
    AttentionForwardParams f;
    f.dtype = static_cast<DType>(7);
    f.hq = 4;
    f.hkv = 2;
    f.head_dim = 64;
    f.scale = 0.125f;
    try {
      attention_forward(f, plan);
      ADD_FAILURE() << "an unknown dtype was accepted by attention_forward";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("attention_forward: dtype must be kBf16 or kF16"), std::string::npos)
          << e.what();
    }
    MergeSinkForwardParams mp;
    mp.dtype = static_cast<DType>(7);
    mp.num_parts = 1;
    mp.o_parts[0] = fake(0x10000);
    mp.lse_parts[0] = static_cast<const float*>(fake(0x20000));
    mp.y = fake(0x30000);
    mp.lse = static_cast<float*>(fake(0x40000));
    mp.rows = 4;
    mp.heads = 2;
    mp.head_dim = 64;
    try {
      merge_sink_forward(mp);
      ADD_FAILURE() << "an unknown dtype was accepted by merge_sink_forward";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("merge_sink_forward: dtype must be kBf16 or kF16"), std::string::npos)
          << e.what();
    }
  }
  // the warp-specialised backward: head dim 128 only, and a group dividing 64
  bad = p;
  bad.dsum_ready = true;  // nothing is launched before the main-loop checks
  bad.mainloop = AttentionBackwardParams::Mainloop::kWgmmaWs;
  EXPECT_NE(message(bad).find("kWgmmaWs at head_dim 128"), std::string::npos) << message(bad);
  DeviceTilePlan plan3;
  plan3.q_rows = plan3.kv_rows = 16;
  plan3.group = 3;
  bad.hq = 6;
  bad.head_dim = 128;
  bad.q_head_stride = bad.k_head_stride = bad.v_head_stride = bad.o_head_stride = 128;
  bad.q_row_stride = bad.o_row_stride = 6 * 128;
  bad.k_row_stride = bad.v_row_stride = 2 * 128;
  try {
    attention_backward(bad, plan3);
    ADD_FAILURE() << "a group of 3 was accepted by kWgmmaWs";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("kWgmmaWs needs a group dividing 64, got 3"), std::string::npos) << e.what();
  }
}

// Head-dim pairs outside kAttentionDims, and the main loops a pair lacks, are refused by name before any launch.
TEST(CudaArguments, HeadDimPairsOutsideTheKernelsAreRefused) {
  DeviceTilePlan plan;  // never uploaded: only its sizes are read before the launch
  plan.q_rows = 16;
  plan.kv_rows = 16;
  plan.group = 2;
  auto fake = [](uintptr_t a) { return reinterpret_cast<void*>(a); };
  auto forward_error = [&](int d, int dv, Mainloop mainloop, int rows_per_warp) -> std::string {
    AttentionForwardParams f = contiguous_forward(DType::kBf16, fake(0x10000), fake(0x10000), fake(0x10000),
                                                  fake(0x20000), static_cast<float*>(fake(0x30000)), 4, 2, d, 0.1);
    f.value_dim = static_cast<int16_t>(dv);
    f.v_row_stride = 2 * dv;
    f.v_head_stride = f.o_head_stride = dv;
    f.o_row_stride = 4 * dv;
    f.mainloop = mainloop;
    f.rows_per_warp = static_cast<int8_t>(rows_per_warp);
    try {
      attention_forward(f, plan);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  const std::string pairs = "must be one of (64, 64), (128, 128), (192, 128), (256, 256)";
  for (const auto& [d, dv] : {std::pair{96, 96}, std::pair{192, 192}, std::pair{128, 64}, std::pair{256, 128},
                              std::pair{64, 128}}) {
    const std::string what = forward_error(d, dv, Mainloop::kDefault, 0);
    EXPECT_NE(what.find("attention_forward: (head_dim, value_dim) " + pairs), std::string::npos) << what;
    EXPECT_NE(what.find("got (" + std::to_string(d) + ", " + std::to_string(dv) + ")"), std::string::npos) << what;
  }
  // value_dim 0 is head_dim: (192, 0) is (192, 192)
  EXPECT_NE(forward_error(192, 0, Mainloop::kDefault, 0).find("got (192, 192)"), std::string::npos)
      << forward_error(192, 0, Mainloop::kDefault, 0);
  // (256, 256) has the 16-rows-per-warp mma.sync forward only
  const std::string rows = forward_error(256, 256, Mainloop::kMmaSync, 32);
  EXPECT_NE(rows.find("rows_per_warp must be 0 or 16 at (256, 256), got 32"), std::string::npos) << rows;
  // the warp-specialised forward is head dim 128's
  const std::string ws = forward_error(192, 128, Mainloop::kWgmmaWs, 0);
  EXPECT_NE(ws.find("kWgmmaWs needs head_dim 128"), std::string::npos) << ws;

  AttentionBackwardParams b;
  b.q = b.k = b.v = b.o = b.d_o = fake(0x10000);
  b.lse = static_cast<const float*>(fake(0x20000));
  b.dsum = b.dq = b.dk = b.dv = static_cast<float*>(fake(0x30000));
  b.dsum_ready = true;  // nothing is launched before the main-loop checks
  b.hq = 4;
  b.hkv = 2;
  b.scale = 0.1f;
  auto backward_error = [&](int d, int dv, Mainloop mainloop, int32_t dv_row_stride = 0) -> std::string {
    AttentionBackwardParams bad = b;
    bad.head_dim = d;
    bad.value_dim = static_cast<int16_t>(dv);
    bad.q_row_stride = bad.dq_row_stride = 4 * d;
    bad.k_row_stride = bad.dk_row_stride = 2 * d;
    bad.q_head_stride = bad.k_head_stride = bad.dq_head_stride = bad.dk_head_stride = d;
    bad.v_row_stride = 2 * dv;
    bad.o_row_stride = 4 * dv;
    bad.v_head_stride = bad.o_head_stride = dv;
    bad.dv_row_stride = dv_row_stride;
    bad.mainloop = mainloop;
    try {
      attention_backward(bad, plan);
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  const std::string bad_pair = backward_error(192, 192, Mainloop::kDefault);
  EXPECT_NE(bad_pair.find("attention_backward: (head_dim, value_dim) " + pairs), std::string::npos) << bad_pair;
  for (const auto& [d, dv] : {std::pair{192, 128}, std::pair{256, 256}}) {
    const std::string what = backward_error(d, dv, Mainloop::kWgmma);
    EXPECT_NE(what.find("kWgmma at (64, 64) / (128, 128)"), std::string::npos) << what;
    EXPECT_NE(what.find("(head_dim, value_dim) (" + std::to_string(d) + ", " + std::to_string(dv) + ")"),
              std::string::npos)
        << what;
  }
  // at Dv = D the kernels address dV with dK's strides: other strides for dv are refused, not ignored
  const std::string strides = backward_error(64, 64, Mainloop::kMmaSync, 2 * 64 + 8);
  EXPECT_NE(strides.find("dv takes dk's strides"), std::string::npos) << strides;
  const std::string odd = backward_error(192, 128, Mainloop::kMmaSync, 2 * 128 + 1);
  EXPECT_NE(odd.find("fp32 gradient strides must be even"), std::string::npos) << odd;
}

// The library holds the warp-specialised forward in the dispatch's two configs only; any other (the bench's) is
// refused by name before anything is launched, not run as some other kernel.
TEST(CudaArguments, ForwardWsConfigOutsideTheLibraryIsRefused) {
  const detail::FwdArgs a{};
  for (const detail::FwdWsConfig& c : {detail::FwdWsConfig{.o_by_tma = false}, detail::FwdWsConfig{.trace = true},
                                       detail::FwdWsConfig{.persistent = true}}) {
    try {
      detail::launch_fwd_ws_d128(a, nullptr, c);
      ADD_FAILURE() << "a config outside the library was launched";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("only FwdWsConfig::kDefault and kPersistent"), std::string::npos) << what;
    }
  }
}

struct Config {
  int hq, hkv, d;
  int64_t window;
  // Q and K's standard deviation: 6 makes scores' spread ~36 (natural units), so later key tiles often pass the first
  // one's max by more than the held-offset softmax's limit (2^16, 11 natural units; 2^15 for fp16) and its fallback
  // runs
  double qk_stddev = 1.0;
  DType dtype = DType::kBf16;
};

class CudaAttention : public ::testing::TestWithParam<Config> {};

// Full self-attention of a random tree: forward against the oracle, then backward.
TEST_P(CudaAttention, ForwardBackwardRandomTree) {
  REQUIRE_GPU();
  const Config c = GetParam();
  TREECP_SEED_TRACE;
  std::mt19937_64 rng = treecp::testing::test_rng(2);
  const Row row = random_row(rng, 14, 60);
  const int64_t S = row.tokens();
  const Dims m{S, S, c.hq, c.hkv, c.d};
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const auto vis = [&](int64_t i, int64_t j) { return row.visible(i, j, c.window); };
  Tensor q = random_tensor(S * c.hq * c.d, rng, c.qk_stddev, c.dtype),
         k = random_tensor(S * c.hkv * c.d, rng, c.qk_stddev, c.dtype), v = random_tensor(S * c.hkv * c.d, rng, 1.0, c.dtype),
         g = random_tensor(S * c.hq * c.d, rng, 1.0, c.dtype);
  const double tl = tol(c.dtype);
  const OracleForward ref = oracle_forward(m, q.val, k.val, v.val, scale, vis);

  const TilePlan plan = build_tile_plan(row_slices(row, c.window), S, S, c.hq / c.hkv);
  const DeviceTilePlan dplan(plan);
  DeviceBuffer<uint16_t> dq_in(q.bits), dk_in(k.bits), dv_in(v.bits), dg(g.bits), o(S * c.hq * c.d);
  DeviceBuffer<float> lse(S * c.hq), dsum(S * c.hq), dq(S * c.hq * c.d), dk(S * c.hkv * c.d), dv(S * c.hkv * c.d);
  const AttentionForwardParams fp = contiguous_forward(c.dtype, dq_in.ptr, dk_in.ptr, dv_in.ptr, o.ptr, lse.ptr, c.hq,
                                                       c.hkv, c.d, scale);
  // every barrier variant of the wgmma forward, launched directly (bf16 only: the variants are the measured
  // alternatives, wgmma_variants.cu instantiates them for bf16)
  const detail::FwdArgs fargs{fp, dplan.fwd, dplan.slices, static_cast<int32_t>(S), static_cast<int32_t>(S),
                              c.hq / c.hkv};
  for (int variant = 0; c.dtype == DType::kBf16 && variant < fwd_wgmma_variant_count(); ++variant) {
    o.poison();
    lse.poison();
    launch_fwd_wgmma_variant(fargs, c.d, variant);
    check_cuda(cudaDeviceSynchronize(), "forward variant");
    EXPECT_LT(rel_error(bf16_to_double(o.download()), ref.o), kTol) << "barrier variant " << variant;
    EXPECT_LT(rel_error(lse.download(), ref.lse), 1e-3) << "barrier variant " << variant;
  }
  // every forward path; the last one feeds the backward
  DeviceBuffer<unsigned char> workspace(attention_forward_workspace_bytes());
  for (const ForwardPath& path : kForwardPaths) {
    const std::string what = run_forward_path(fp, path, workspace, o, lse, dplan);
    const std::vector<double> od = elem_to_double(o.download(), c.dtype);
    EXPECT_LT(rel_error(od, ref.o), tl) << what;
    expect_fp16_o(c.dtype, od, ref.o, what);
    EXPECT_LT(rel_error(lse.download(), ref.lse), 1e-3) << what;
  }
  if (c.d == 128) {  // a workspace too small for the persistent kernel is an error, not a silent fallback
    AttentionForwardParams small = fp;
    small.mainloop = Mainloop::kDefault;
    small.workspace = workspace.ptr;
    small.workspace_bytes = 4;
    try {
      attention_forward(small, dplan);
      ADD_FAILURE() << "a 4-byte workspace was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("workspace_bytes must be at least"), std::string::npos) << e.what();
    }
  }

  AttentionBackwardParams bp;
  bp.dtype = c.dtype;
  bp.q = dq_in.ptr;
  bp.k = dk_in.ptr;
  bp.v = dv_in.ptr;
  bp.o = o.ptr;
  bp.d_o = dg.ptr;
  bp.lse = lse.ptr;
  bp.dsum = dsum.ptr;
  bp.dq = dq.ptr;
  bp.dk = dk.ptr;
  bp.dv = dv.ptr;
  bp.q_row_stride = bp.o_row_stride = bp.dq_row_stride = int64_t{c.hq} * c.d;
  bp.k_row_stride = bp.v_row_stride = bp.dk_row_stride = int64_t{c.hkv} * c.d;
  bp.q_head_stride = bp.k_head_stride = bp.v_head_stride = bp.o_head_stride = bp.dq_head_stride = bp.dk_head_stride = c.d;
  bp.lse_row_stride = c.hq;
  bp.lse_head_stride = 1;
  bp.hq = c.hq;
  bp.hkv = c.hkv;
  bp.head_dim = c.d;
  bp.scale = static_cast<float>(scale);
  const OracleBackward rb = oracle_backward(m, q.val, k.val, v.val, g.val, scale, ref, nullptr, vis);
  // every backward path: mma.sync, and wgmma where it exists (head dim 128), the warp-specialised kernel
  // where it applies (G dividing 64), and the default
  std::vector<Mainloop> bwd_variants{Mainloop::kMmaSync, Mainloop::kDefault};
  if (c.d == 128) bwd_variants.push_back(Mainloop::kWgmma);
  if (c.d == 128 && 64 % (c.hq / c.hkv) == 0) bwd_variants.push_back(Mainloop::kWgmmaWs);
  for (const Mainloop mainloop : bwd_variants) {
    dq.zero();
    dk.zero();
    dv.zero();
    bp.mainloop = mainloop;
    attention_backward(bp, dplan);
    check_cuda(cudaDeviceSynchronize(), "backward");
    EXPECT_LT(rel_error(dq.download(), rb.dq), tl) << "mainloop " << static_cast<int>(mainloop);
    EXPECT_LT(rel_error(dk.download(), rb.dk), tl) << "mainloop " << static_cast<int>(mainloop);
    EXPECT_LT(rel_error(dv.download(), rb.dv), tl) << "mainloop " << static_cast<int>(mainloop);
  }
  if (c.d == 128) {
    // wgmma and the default with a dQ buffer that is only 8-byte aligned (the float2 reductions' minimum)
    DeviceBuffer<float> dq_off(S * c.hq * c.d + 2);
    for (const Mainloop mainloop : {Mainloop::kWgmma, Mainloop::kDefault}) {
      dq_off.zero();
      dk.zero();
      dv.zero();
      bp.mainloop = mainloop;
      bp.dq = dq_off.ptr + 2;
      attention_backward(bp, dplan);
      check_cuda(cudaDeviceSynchronize(), "backward");
      const std::vector<float> all = dq_off.download();
      const int ml = static_cast<int>(mainloop);
      EXPECT_LT(rel_error(std::vector<float>(all.begin() + 2, all.end()), rb.dq), tl) << "dQ 8-byte aligned " << ml;
      EXPECT_LT(rel_error(dk.download(), rb.dk), tl) << "dQ 8-byte aligned " << ml;
      EXPECT_LT(rel_error(dv.download(), rb.dv), tl) << "dQ 8-byte aligned " << ml;
    }
    // every overlap variant of the wgmma backward (Dsum is ready from the calls above)
    bp.dq = dq.ptr;
    bp.dsum_ready = true;
    const detail::BwdArgs args{bp, dplan.bwd, dplan.slices, static_cast<int32_t>(S), static_cast<int32_t>(S),
                               c.hq / c.hkv};
    for (int variant = 0; c.dtype == DType::kBf16 && variant < bwd_wgmma_variant_count(); ++variant) {
      dq.zero();
      dk.zero();
      dv.zero();
      launch_bwd_wgmma_variant(args, variant);
      check_cuda(cudaDeviceSynchronize(), "backward variant");
      EXPECT_LT(rel_error(dq.download(), rb.dq), kTol) << "overlap variant " << variant;
      EXPECT_LT(rel_error(dk.download(), rb.dk), kTol) << "overlap variant " << variant;
      EXPECT_LT(rel_error(dv.download(), rb.dv), kTol) << "overlap variant " << variant;
    }
  }
}

// Stage form: the KV rows are cut into chunks held in separate buffers; each stage attends the whole
// query buffer to one chunk (rows that see nothing there get LSE = -inf, O = 0), the fused merge +
// sink combines them, and the backward runs per stage from the merged LSE and the sink-aware Dsum.
// A stage without keys (a CP wave that fetched nothing for this rank): every row gets O = 0 and
// LSE = -inf on every forward path, with K and V null.
TEST(CudaAttentionNoKeys, ZeroOutputAndMinusInfinityLse) {
  REQUIRE_GPU();
  for (DType dtype : {DType::kBf16, DType::kF16})
  for (int d : {64, 128}) {
    const int hq = 8, hkv = 2;
    const int64_t S = 37;
    const DeviceTilePlan dplan(build_tile_plan({}, S, 0, hq / hkv));
    std::mt19937_64 rng = treecp::testing::test_rng(4);
    Tensor q = random_tensor(S * hq * d, rng, 1.0, dtype);
    DeviceBuffer<uint16_t> dq_in(q.bits), o(S * hq * d);
    DeviceBuffer<float> lse(S * hq);
    DeviceBuffer<unsigned char> workspace(attention_forward_workspace_bytes());
    AttentionForwardParams fp = contiguous_forward(dtype, dq_in.ptr, nullptr, nullptr, o.ptr, lse.ptr, hq, hkv, d, 0.1);
    for (Mainloop mainloop : {Mainloop::kDefault, Mainloop::kMmaSync}) {
      for (bool with_workspace : {false, true}) {
        const std::string what = std::string(dtype_name(dtype)) + " d " + std::to_string(d) + " mainloop " + std::to_string(static_cast<int>(mainloop)) +
                                 " workspace " + std::to_string(with_workspace);
        o.poison();
        lse.poison();
        fp.mainloop = mainloop;
        fp.workspace = with_workspace ? workspace.ptr : nullptr;
        fp.workspace_bytes = with_workspace ? workspace.n : 0;
        attention_forward(fp, dplan);
        check_cuda(cudaDeviceSynchronize(), "forward without keys");
        for (uint16_t bits : o.download()) ASSERT_EQ(elem_value(bits, dtype), 0.0) << what;
        for (float l : lse.download()) ASSERT_TRUE(std::isinf(l) && l < 0) << what << ": lse " << l;
      }
    }
  }
}

// fp16 at the ends of its range (largest finite value 65504): V near +-60000 gives O near +-60000 and never inf (O is
// a convex combination of V's rows, accumulated in fp32 and normalised before the store); logits far past 65504 (Q
// and K of standard deviation 64 at D = 128: raw scores around 46,000, many above 65,504) are fine because scores,
// softmax and LSE are fp32. Every forward path against the oracle, with the bound of the random-tree tests.
TEST(CudaAttentionFp16, LargeValuesAndLogits) {
  REQUIRE_GPU();
  TREECP_SEED_TRACE;
  std::mt19937_64 rng = treecp::testing::test_rng(5);
  const Row row = random_row(rng, 12, 50);
  const int64_t S = row.tokens();
  const int hq = 8, hkv = 2, d = 128;
  const Dims m{S, S, hq, hkv, d};
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const auto vis = [&](int64_t i, int64_t j) { return row.visible(i, j, 0); };
  const TilePlan plan = build_tile_plan(row_slices(row, 0), S, S, hq / hkv);
  const DeviceTilePlan dplan(plan);
  DeviceBuffer<unsigned char> workspace(attention_forward_workspace_bytes());
  for (const bool large_v : {true, false}) {
    const double qk_stddev = large_v ? 1.0 : 64.0;
    Tensor q = random_tensor(S * hq * d, rng, qk_stddev, DType::kF16), k = random_tensor(S * hkv * d, rng, qk_stddev, DType::kF16);
    Tensor v = random_tensor(S * hkv * d, rng, 1.0, DType::kF16);
    if (large_v) {
      std::uniform_real_distribution<float> mag(59000.f, 60000.f);
      for (size_t i = 0; i < v.bits.size(); ++i) {
        v.bits[i] = to_elem((rng() & 1) ? mag(rng) : -mag(rng), DType::kF16);
        v.val[i] = elem_value(v.bits[i], DType::kF16);
      }
    }
    double max_score = 0;  // the case's point: raw scores beyond fp16's range
    for (int64_t i = 0; i < S && !large_v; ++i)
      for (int64_t j = 0; j < S; ++j) {
        if (!vis(i, j)) continue;
        double dot = 0;
        for (int x = 0; x < d; ++x) dot += q.val[(i * hq) * d + x] * k.val[(j * hkv) * d + x];
        max_score = std::max(max_score, std::fabs(dot));
      }
    if (!large_v) {
      EXPECT_GT(max_score, 65504.0);
    }
    const OracleForward ref = oracle_forward(m, q.val, k.val, v.val, scale, vis);
    DeviceBuffer<uint16_t> dq_in(q.bits), dk_in(k.bits), dv_in(v.bits), o(S * hq * d);
    DeviceBuffer<float> lse(S * hq);
    const AttentionForwardParams fp =
        contiguous_forward(DType::kF16, dq_in.ptr, dk_in.ptr, dv_in.ptr, o.ptr, lse.ptr, hq, hkv, d, scale);
    for (const ForwardPath& path : kForwardPaths) {
      const std::string what =
          std::string(large_v ? "V near 60000, " : "logits past 65504, ") + run_forward_path(fp, path, workspace, o, lse, dplan);
      const std::vector<double> od = elem_to_double(o.download(), DType::kF16);
      for (double x : od) ASSERT_TRUE(std::isfinite(x)) << what << ": O " << x;
      EXPECT_LT(rel_error(od, ref.o), tol(DType::kF16)) << what;
      expect_fp16_o(DType::kF16, od, ref.o, what);
      EXPECT_LT(rel_error(lse.download(), ref.lse), 1e-3) << what;
    }
  }
}

TEST_P(CudaAttention, StagesMergeSink) {
  REQUIRE_GPU();
  const Config c = GetParam();
  TREECP_SEED_TRACE;
  std::mt19937_64 rng = treecp::testing::test_rng(3);
  const Row row = random_row(rng, 12, 50);
  const int64_t S = row.tokens();
  const Dims m{S, S, c.hq, c.hkv, c.d};
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const auto vis = [&](int64_t i, int64_t j) { return row.visible(i, j, c.window); };
  Tensor q = random_tensor(S * c.hq * c.d, rng, c.qk_stddev, c.dtype),
         k = random_tensor(S * c.hkv * c.d, rng, c.qk_stddev, c.dtype), v = random_tensor(S * c.hkv * c.d, rng, 1.0, c.dtype),
         g = random_tensor(S * c.hq * c.d, rng, 1.0, c.dtype);
  const double tl = tol(c.dtype);
  std::vector<double> sink(c.hq);
  std::normal_distribution<double> nd(1.0, 1.0);
  for (auto& a : sink) a = static_cast<float>(nd(rng));
  const OracleForward ref = oracle_forward(m, q.val, k.val, v.val, scale, vis);

  const std::vector<int64_t> bounds{0, S / 3, (2 * S) / 3 + 1, S};
  const int stages = 3;
  const std::vector<Slice> cut = split_slices(row_slices(row, c.window), bounds);
  const int64_t qsize = S * c.hq * c.d;
  DeviceBuffer<uint16_t> dq_in(q.bits), dg(g.bits), y(qsize), d_o(qsize);
  DeviceBuffer<float> lse(S * c.hq), dsum(S * c.hq), dq(qsize), sink_d(c.hq), dsink(c.hq);
  sink_d.upload(std::vector<float>(sink.begin(), sink.end()));
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> kc, vc, oc;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> lc, dkc, dvc;
  std::vector<DeviceTilePlan> plans;
  for (int s = 0; s < stages; ++s) {
    const int64_t c0 = bounds[s], c1 = bounds[s + 1], n = c1 - c0;
    std::vector<Slice> mine;
    for (const Slice& sl : cut)
      if (sl.k_begin >= c0 && sl.k_end <= c1)
        mine.push_back(Slice{sl.q_begin, sl.q_end, sl.k_begin - c0, sl.k_end - c0, sl.diag_min + c0, sl.diag_max + c0});
    plans.emplace_back(build_tile_plan(mine, S, n, c.hq / c.hkv));
    const auto part = [&](const std::vector<uint16_t>& t) {
      return std::vector<uint16_t>(t.begin() + c0 * c.hkv * c.d, t.begin() + c1 * c.hkv * c.d);
    };
    kc.push_back(std::make_unique<DeviceBuffer<uint16_t>>(part(k.bits)));
    vc.push_back(std::make_unique<DeviceBuffer<uint16_t>>(part(v.bits)));
    oc.push_back(std::make_unique<DeviceBuffer<uint16_t>>(qsize));
    lc.push_back(std::make_unique<DeviceBuffer<float>>(S * c.hq));
    dkc.push_back(std::make_unique<DeviceBuffer<float>>(n * c.hkv * c.d));
    dvc.push_back(std::make_unique<DeviceBuffer<float>>(n * c.hkv * c.d));
    oc.back()->poison();
    lc.back()->poison();
    dkc.back()->zero();
    dvc.back()->zero();
    const AttentionForwardParams fp = contiguous_forward(c.dtype, dq_in.ptr, kc.back()->ptr, vc.back()->ptr,
                                                         oc.back()->ptr, lc.back()->ptr, c.hq, c.hkv, c.d, scale);
    // every forward variant on this stage against the stage's own oracle: the rows that see none of its keys
    // get LSE = -inf and O = 0 exactly (exp2_poly turns masked scores into tiny values, not zeros)
    const auto vis_s = [&](int64_t i, int64_t j) { return j >= c0 && j < c1 && vis(i, j); };
    const OracleForward ref_s = oracle_forward(m, q.val, k.val, v.val, scale, vis_s);
    const detail::FwdArgs fargs{fp, plans.back().fwd, plans.back().slices, static_cast<int32_t>(S),
                                static_cast<int32_t>(n), c.hq / c.hkv};
    for (int variant = 0; c.dtype == DType::kBf16 && variant < fwd_wgmma_variant_count(); ++variant) {
      oc.back()->poison();
      lc.back()->poison();
      launch_fwd_wgmma_variant(fargs, c.d, variant);
      check_cuda(cudaDeviceSynchronize(), "stage forward variant");
      const auto l = lc.back()->download();
      const auto o = bf16_to_double(oc.back()->download());
      EXPECT_LT(rel_error(o, ref_s.o), kTol) << "stage " << s << " variant " << variant;
      EXPECT_LT(rel_error(l, ref_s.lse), 1e-3) << "stage " << s << " variant " << variant;
      for (int64_t i = 0; i < S * c.hq; ++i)
        if (ref_s.lse[i] == -INFINITY) {
          ASSERT_EQ(l[i], -INFINITY) << "stage " << s << " variant " << variant << " row " << i;
          for (int d = 0; d < c.d; ++d) ASSERT_EQ(o[i * c.d + d], 0.0) << "stage " << s << " variant " << variant;
        }
    }
    oc.back()->poison();
    lc.back()->poison();
    attention_forward(fp, plans.back());
    if (c.dtype == DType::kF16) {  // the stage on the library's default path (the variants above are bf16's)
      check_cuda(cudaDeviceSynchronize(), "stage forward");
      const auto l = lc.back()->download();
      const auto o = elem_to_double(oc.back()->download(), c.dtype);
      EXPECT_LT(rel_error(o, ref_s.o), tl) << "stage " << s;
      EXPECT_LT(rel_error(l, ref_s.lse), 1e-3) << "stage " << s;
      for (int64_t i = 0; i < S * c.hq; ++i)
        if (ref_s.lse[i] == -INFINITY) {
          ASSERT_EQ(l[i], -INFINITY) << "stage " << s << " row " << i;
          for (int d = 0; d < c.d; ++d) ASSERT_EQ(o[i * c.d + d], 0.0) << "stage " << s;
        }
    }
  }
  MergeSinkForwardParams mp;
  mp.dtype = c.dtype;
  mp.num_parts = stages;
  for (int s = 0; s < stages; ++s) {
    mp.o_parts[s] = oc[s]->ptr;
    mp.lse_parts[s] = lc[s]->ptr;
  }
  mp.sink = sink_d.ptr;
  mp.y = y.ptr;
  mp.lse = lse.ptr;
  mp.rows = S;
  mp.heads = c.hq;
  mp.head_dim = c.d;
  y.poison();
  merge_sink_forward(mp);
  check_cuda(cudaDeviceSynchronize(), "stages forward");
  std::vector<double> y_ref(qsize);
  for (int64_t i = 0; i < S; ++i)
    for (int h = 0; h < c.hq; ++h) {
      const double l = ref.lse[i * c.hq + h];
      const double w = l == -INFINITY ? 0.0 : 1.0 / (1.0 + std::exp(sink[h] - l));
      for (int d = 0; d < c.d; ++d) y_ref[(i * c.hq + h) * c.d + d] = w * ref.o[(i * c.hq + h) * c.d + d];
    }
  const std::vector<double> yd = elem_to_double(y.download(), c.dtype);
  EXPECT_LT(rel_error(yd, y_ref), tl);
  expect_fp16_o(c.dtype, yd, y_ref, "merged y");
  EXPECT_LT(rel_error(lse.download(), ref.lse), 1e-3);
  // some stage must have had rows with no visible key (its LSE = -inf, O = 0 exactly)
  int64_t empty_rows = 0;
  for (int s = 0; s < stages; ++s) {
    const auto l = lc[s]->download();
    const auto o = oc[s]->download();
    for (int64_t i = 0; i < S * c.hq; ++i)
      if (l[i] == -INFINITY) {
        ++empty_rows;
        for (int d = 0; d < c.d; ++d) ASSERT_EQ(o[i * c.d + d], 0) << "stage " << s << " row " << i;
      }
  }
  EXPECT_GT(empty_rows, 0);

  MergeSinkBackwardParams mb;
  mb.dtype = c.dtype;
  mb.num_parts = stages;
  for (int s = 0; s < stages; ++s) {
    mb.o_parts[s] = oc[s]->ptr;
    mb.lse_parts[s] = lc[s]->ptr;
  }
  mb.sink = sink_d.ptr;
  mb.g = dg.ptr;
  mb.d_o = d_o.ptr;
  mb.dsum = dsum.ptr;
  mb.d_sink = dsink.ptr;
  mb.rows = S;
  mb.heads = c.hq;
  mb.head_dim = c.d;
  dsink.zero();
  dq.zero();
  merge_sink_backward(mb);
  for (int s = 0; s < stages; ++s) {
    AttentionBackwardParams bp;
    bp.dtype = c.dtype;
    bp.q = dq_in.ptr;
    bp.k = kc[s]->ptr;
    bp.v = vc[s]->ptr;
    bp.d_o = d_o.ptr;
    bp.lse = lse.ptr;
    bp.dsum = dsum.ptr;
    bp.dsum_ready = true;
    bp.dq = dq.ptr;
    bp.dk = dkc[s]->ptr;
    bp.dv = dvc[s]->ptr;
    bp.q_row_stride = bp.o_row_stride = bp.dq_row_stride = int64_t{c.hq} * c.d;
    bp.k_row_stride = bp.v_row_stride = bp.dk_row_stride = int64_t{c.hkv} * c.d;
    bp.q_head_stride = bp.k_head_stride = bp.v_head_stride = bp.o_head_stride = bp.dq_head_stride =
        bp.dk_head_stride = c.d;
    bp.lse_row_stride = c.hq;
    bp.lse_head_stride = 1;
    bp.hq = c.hq;
    bp.hkv = c.hkv;
    bp.head_dim = c.d;
    bp.scale = static_cast<float>(scale);
    attention_backward(bp, plans[s]);
  }
  check_cuda(cudaDeviceSynchronize(), "stages backward");
  const OracleBackward rb = oracle_backward(m, q.val, k.val, v.val, g.val, scale, ref, &sink, vis);
  std::vector<float> dk_all, dv_all;
  for (int s = 0; s < stages; ++s) {
    const auto a = dkc[s]->download(), b = dvc[s]->download();
    dk_all.insert(dk_all.end(), a.begin(), a.end());
    dv_all.insert(dv_all.end(), b.begin(), b.end());
  }
  EXPECT_LT(rel_error(dq.download(), rb.dq), tl);
  EXPECT_LT(rel_error(dk_all, rb.dk), tl);
  EXPECT_LT(rel_error(dv_all, rb.dv), tl);
  EXPECT_LT(rel_error(dsink.download(), rb.dsink), tl);
}

// ---- (Dqk, Dv) = (192, 128) and (256, 256) on every main loop they have, and the wgmma backward at head dim 64,
// on random trees with GQA groups and windows, against the double oracle with the bounds of CudaAttention.
struct DimsConfig {
  int hq, hkv, d, dv;
  int64_t window;
  DType dtype = DType::kBf16;
};

class CudaAttentionDims : public ::testing::TestWithParam<DimsConfig> {};

TEST_P(CudaAttentionDims, ForwardBackwardRandomTree) {
  REQUIRE_GPU();
  const DimsConfig c = GetParam();
  TREECP_SEED_TRACE;
  std::mt19937_64 rng = treecp::testing::test_rng(7);
  const Row row = random_row(rng, 14, 60);
  const int64_t S = row.tokens();
  const Dims m{S, S, c.hq, c.hkv, c.d, c.dv};
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const auto vis = [&](int64_t i, int64_t j) { return row.visible(i, j, c.window); };
  Tensor q = random_tensor(S * c.hq * c.d, rng, 1.0, c.dtype), k = random_tensor(S * c.hkv * c.d, rng, 1.0, c.dtype),
         v = random_tensor(S * c.hkv * c.dv, rng, 1.0, c.dtype), g = random_tensor(S * c.hq * c.dv, rng, 1.0, c.dtype);
  const double tl = tol(c.dtype);
  const OracleForward ref = oracle_forward(m, q.val, k.val, v.val, scale, vis);

  const TilePlan plan = build_tile_plan(row_slices(row, c.window), S, S, c.hq / c.hkv);
  const DeviceTilePlan dplan(plan);
  DeviceBuffer<uint16_t> dq_in(q.bits), dk_in(k.bits), dv_in(v.bits), dg(g.bits), o(S * c.hq * c.dv);
  DeviceBuffer<float> lse(S * c.hq), dsum(S * c.hq), dq(S * c.hq * c.d), dk(S * c.hkv * c.d), dv(S * c.hkv * c.dv);
  AttentionForwardParams fp = contiguous_forward(c.dtype, dq_in.ptr, dk_in.ptr, dv_in.ptr, o.ptr, lse.ptr, c.hq, c.hkv,
                                                 c.d, scale);
  fp.value_dim = static_cast<int16_t>(c.dv);
  fp.v_row_stride = int64_t{c.hkv} * c.dv;
  fp.o_row_stride = int64_t{c.hq} * c.dv;
  fp.v_head_stride = fp.o_head_stride = c.dv;
  // every forward path of the pair: the default with and without a workspace, wgmma, mma.sync at 16 rows per warp and,
  // except at Dv = 256, 32
  std::vector<ForwardPath> paths(std::begin(kForwardPaths), std::end(kForwardPaths));
  if (c.dv == 256) paths.pop_back();
  DeviceBuffer<unsigned char> workspace(attention_forward_workspace_bytes());
  for (const ForwardPath& path : paths) {
    const std::string what = run_forward_path(fp, path, workspace, o, lse, dplan);
    const std::vector<uint16_t> o_bits = o.download();
    const std::vector<float> lse_first = lse.download();
    const std::vector<double> od = elem_to_double(o_bits, c.dtype);
    EXPECT_LT(rel_error(od, ref.o), tl) << what;
    expect_fp16_o(c.dtype, od, ref.o, what);
    EXPECT_LT(rel_error(lse_first, ref.lse), 1e-3) << what;
    // A second call over outputs poisoned again gives the same bits: nothing is left unwritten or raced (the Python
    // test comparing calls bit for bit fails at (192, 128) with G = 2, run 143).
    run_forward_path(fp, path, workspace, o, lse, dplan);
    EXPECT_TRUE(o.download() == o_bits) << what << ": O differs between two calls";
    const std::vector<float> lse_second = lse.download();
    EXPECT_EQ(0, std::memcmp(lse_second.data(), lse_first.data(), lse_first.size() * sizeof(float)))
        << what << ": LSE differs between two calls";
  }

  AttentionBackwardParams bp;
  bp.dtype = c.dtype;
  bp.q = dq_in.ptr;
  bp.k = dk_in.ptr;
  bp.v = dv_in.ptr;
  bp.o = o.ptr;  // from the last forward path
  bp.d_o = dg.ptr;
  bp.lse = lse.ptr;
  bp.dsum = dsum.ptr;
  bp.dq = dq.ptr;
  bp.dk = dk.ptr;
  bp.dv = dv.ptr;
  bp.q_row_stride = bp.dq_row_stride = int64_t{c.hq} * c.d;
  bp.k_row_stride = bp.dk_row_stride = int64_t{c.hkv} * c.d;
  bp.q_head_stride = bp.k_head_stride = bp.dq_head_stride = bp.dk_head_stride = c.d;
  bp.v_row_stride = int64_t{c.hkv} * c.dv;
  bp.o_row_stride = int64_t{c.hq} * c.dv;
  bp.v_head_stride = bp.o_head_stride = c.dv;
  if (c.dv != c.d) {
    bp.dv_row_stride = c.hkv * c.dv;
    bp.dv_head_stride = c.dv;
  }
  bp.lse_row_stride = c.hq;
  bp.lse_head_stride = 1;
  bp.hq = c.hq;
  bp.hkv = c.hkv;
  bp.head_dim = c.d;
  bp.value_dim = static_cast<int16_t>(c.dv);
  bp.scale = static_cast<float>(scale);
  const OracleBackward rb = oracle_backward(m, q.val, k.val, v.val, g.val, scale, ref, nullptr, vis);
  std::vector<Mainloop> bwd_paths{Mainloop::kMmaSync, Mainloop::kDefault};
  if (c.d == 64) bwd_paths.push_back(Mainloop::kWgmma);  // the wgmma backward at 64
  for (const Mainloop mainloop : bwd_paths) {
    dq.zero();
    dk.zero();
    dv.zero();
    bp.mainloop = mainloop;
    attention_backward(bp, dplan);
    check_cuda(cudaDeviceSynchronize(), "backward");
    EXPECT_LT(rel_error(dq.download(), rb.dq), tl) << "mainloop " << static_cast<int>(mainloop);
    EXPECT_LT(rel_error(dk.download(), rb.dk), tl) << "mainloop " << static_cast<int>(mainloop);
    EXPECT_LT(rel_error(dv.download(), rb.dv), tl) << "mainloop " << static_cast<int>(mainloop);
  }
  if (c.d == 64) {
    // the wgmma backward at 64 with a dQ buffer only 8-byte aligned (its float2 reductions' minimum), Dsum ready
    DeviceBuffer<float> dq_off(S * c.hq * c.d + 2);
    dq_off.zero();
    dk.zero();
    dv.zero();
    AttentionBackwardParams off = bp;
    off.mainloop = Mainloop::kWgmma;
    off.dq = dq_off.ptr + 2;
    off.dsum_ready = true;
    attention_backward(off, dplan);
    check_cuda(cudaDeviceSynchronize(), "backward");
    const std::vector<float> all = dq_off.download();
    EXPECT_LT(rel_error(std::vector<float>(all.begin() + 2, all.end()), rb.dq), tl) << "wgmma, dQ 8-byte aligned";
    EXPECT_LT(rel_error(dk.download(), rb.dk), tl) << "wgmma, dQ 8-byte aligned";
    EXPECT_LT(rel_error(dv.download(), rb.dv), tl) << "wgmma, dQ 8-byte aligned";
  }
  if (c.dv != c.d) {
    // dv_row_stride / dv_head_stride 0: dV laid out with dK's strides (Dqk columns a head, the first Dv of them dV's)
    DeviceBuffer<float> dv_wide(S * c.hkv * c.d);
    dq.zero();
    dk.zero();
    dv_wide.zero();
    AttentionBackwardParams wide = bp;
    wide.mainloop = Mainloop::kMmaSync;
    wide.dv = dv_wide.ptr;
    wide.dv_row_stride = wide.dv_head_stride = 0;
    attention_backward(wide, dplan);
    check_cuda(cudaDeviceSynchronize(), "backward");
    const std::vector<float> w = dv_wide.download();
    std::vector<float> packed(static_cast<size_t>(S * c.hkv * c.dv));
    bool rest_zero = true;
    for (int64_t r = 0; r < S * c.hkv; ++r)
      for (int j = 0; j < c.d; ++j) {
        if (j < c.dv) packed[static_cast<size_t>(r * c.dv + j)] = w[static_cast<size_t>(r * c.d + j)];
        else rest_zero = rest_zero && w[static_cast<size_t>(r * c.d + j)] == 0.f;
      }
    EXPECT_LT(rel_error(packed, rb.dv), tl) << "dV with dK's strides";
    EXPECT_TRUE(rest_zero) << "dV with dK's strides: columns past Dv written";
    EXPECT_LT(rel_error(dk.download(), rb.dk), tl) << "dV with dK's strides";
  }
}

// A stage without keys at the new pairs: O = 0 and LSE = -inf on every forward main loop, K and V null.
TEST(CudaAttentionDimsNoKeys, Dim192x128AndDim256ZeroOutputAndMinusInfinityLse) {
  REQUIRE_GPU();
  for (DType dtype : {DType::kBf16, DType::kF16})
    for (const auto& [d, dv] : {std::pair{192, 128}, std::pair{256, 256}}) {
      const int hq = 8, hkv = 2;
      const int64_t S = 37;
      const DeviceTilePlan dplan(build_tile_plan({}, S, 0, hq / hkv));
      std::mt19937_64 rng = treecp::testing::test_rng(5);
      Tensor q = random_tensor(S * hq * d, rng, 1.0, dtype);
      DeviceBuffer<uint16_t> dq_in(q.bits), o(S * hq * dv);
      DeviceBuffer<float> lse(S * hq);
      AttentionForwardParams fp = contiguous_forward(dtype, dq_in.ptr, nullptr, nullptr, o.ptr, lse.ptr, hq, hkv, d, 0.1);
      fp.value_dim = static_cast<int16_t>(dv);
      fp.v_row_stride = hkv * dv;
      fp.o_row_stride = hq * dv;
      fp.v_head_stride = fp.o_head_stride = dv;
      for (Mainloop mainloop : {Mainloop::kDefault, Mainloop::kMmaSync, Mainloop::kWgmma}) {
        const std::string what = std::string(dtype_name(dtype)) + " (" + std::to_string(d) + ", " + std::to_string(dv) +
                                 ") mainloop " + std::to_string(static_cast<int>(mainloop));
        o.poison();
        lse.poison();
        fp.mainloop = mainloop;
        attention_forward(fp, dplan);
        check_cuda(cudaDeviceSynchronize(), "forward without keys");
        for (uint16_t bits : o.download()) ASSERT_EQ(elem_value(bits, dtype), 0.0) << what;
        for (float l : lse.download()) ASSERT_TRUE(std::isinf(l) && l < 0) << what << ": lse " << l;
      }
    }
}

INSTANTIATE_TEST_SUITE_P(HeadDims, CudaAttentionDims,
                         ::testing::Values(DimsConfig{8, 2, 192, 128, 0}, DimsConfig{4, 4, 192, 128, 37},
                                           DimsConfig{4, 2, 192, 128, 0}, DimsConfig{4, 2, 192, 128, 0, DType::kF16},
                                           DimsConfig{4, 2, 256, 256, 0},
                                           DimsConfig{6, 2, 192, 128, 100}, DimsConfig{16, 2, 192, 128, 0},
                                           DimsConfig{8, 1, 192, 128, 5, DType::kF16},
                                           DimsConfig{8, 2, 256, 256, 0}, DimsConfig{4, 4, 256, 256, 37},
                                           DimsConfig{6, 2, 256, 256, 100}, DimsConfig{8, 2, 256, 256, 0, DType::kF16},
                                           DimsConfig{4, 4, 64, 64, 0}, DimsConfig{8, 1, 64, 64, 37},
                                           DimsConfig{6, 2, 64, 64, 100}, DimsConfig{32, 4, 64, 64, 0},
                                           DimsConfig{8, 2, 64, 64, 0, DType::kF16}),
                         [](const ::testing::TestParamInfo<DimsConfig>& i) {
                           const DimsConfig& c = i.param;
                           const std::string dims = c.d == 64 ? "WgmmaBwd64"
                                                    : c.d == c.dv ? "Dim" + std::to_string(c.d)
                                                                  : "Dim" + std::to_string(c.d) + "x" + std::to_string(c.dv);
                           return dims + "_hq" + std::to_string(c.hq) + "_hkv" + std::to_string(c.hkv) + "_w" +
                                  std::to_string(c.window) + (c.dtype == DType::kF16 ? "_fp16" : "");
                         });

INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttention,
                         ::testing::Values(Config{4, 4, 64, 0}, Config{8, 2, 128, 0}, Config{8, 1, 64, 37},
                                           Config{32, 4, 128, 0}, Config{6, 2, 128, 100}, Config{3, 3, 128, 5},
                                           Config{8, 2, 128, 0, 6.0},
                                           // fp16: both head dims, the warp-specialised paths (G 4 and 1,
                                           // persistent with the held offset), wgmma where G does not divide
                                           // their tiles (6 / 2: G 3), windows, and the held offset's fallback
                                           Config{4, 4, 64, 0, 1.0, DType::kF16}, Config{8, 2, 128, 0, 1.0, DType::kF16},
                                           Config{8, 1, 64, 37, 1.0, DType::kF16}, Config{6, 2, 128, 100, 1.0, DType::kF16},
                                           Config{3, 3, 128, 5, 1.0, DType::kF16}, Config{8, 2, 128, 0, 6.0, DType::kF16}),
                         [](const ::testing::TestParamInfo<Config>& i) {
                           return "hq" + std::to_string(i.param.hq) + "_hkv" + std::to_string(i.param.hkv) + "_d" +
                                  std::to_string(i.param.d) + "_w" + std::to_string(i.param.window) +
                                  (i.param.qk_stddev != 1.0 ? "_sharp" : "") +
                                  (i.param.dtype == DType::kF16 ? "_fp16" : "");
                         });

}  // namespace
}  // namespace treecp::cuda::test
