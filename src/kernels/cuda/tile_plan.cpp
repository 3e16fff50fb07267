// Tile lists from slices: one pass over each slice's tiles (counting sort into per-major-tile
// buckets), then a small sort inside each bucket to merge the slices that share a tile.
#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <utility>

#include "core/error.hpp"
#include "kernels/cuda/attention.hpp"

namespace treecp::cuda {
namespace {

// Minor tiles [begin, end) of one slice inside one major tile, all full or all partial.
struct RawRun {
  int32_t begin, end;
  int32_t slice;
  int32_t full;
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Floor division by a positive tile size, a shift when the size is a power of two (all of them except
// query tiles of 128 / G tokens when G is not): 64-bit divisions were most of the tile-list build.
struct TileDiv {
  int64_t d;
  int shift;  // -1: not a power of two
  explicit TileDiv(int64_t size)
      : d(size), shift(std::has_single_bit(static_cast<uint64_t>(size)) ? std::countr_zero(static_cast<uint64_t>(size)) : -1) {}
  int64_t floor(int64_t a) const { return shift >= 0 ? a >> shift : floor_div(a, d); }  // >> of a negative floors
  int64_t ceil(int64_t a) const { return -floor(-a); }
};

// Key tiles given by their starts (the last entry is kv_rows), with a per-key lookup of the tile holding each
// key: both list builds ask which tile holds a key, the query-major one several times per (slice, query tile).
struct KeyTiles {
  const std::vector<int32_t>* starts = nullptr;
  std::vector<int32_t> tile_of;  // [kv_rows]
  int64_t num = 0;
  void build(const std::vector<int32_t>& s) {
    starts = &s;
    num = static_cast<int64_t>(s.size()) - 1;
    tile_of.resize(s.back());
    for (int64_t t = 0; t < num; ++t) std::fill(tile_of.begin() + s[t], tile_of.begin() + s[t + 1], static_cast<int32_t>(t));
  }
  int64_t kv_rows() const { return (*starts)[num]; }
  // the tile holding key k, for 0 <= k < kv_rows
  int64_t containing(int64_t k) const { return tile_of[k]; }
  // tiles whose start is >= k: the first of them (num if none)
  int64_t starting_from(int64_t k) const {
    if (k <= 0) return 0;
    if (k >= kv_rows()) return num;
    const int64_t t = tile_of[k];
    return (*starts)[t] == k ? t : t + 1;
  }
  // the first tile whose start is > k
  int64_t starting_after(int64_t k) const { return k < 0 ? 0 : k >= kv_rows() ? num : tile_of[k] + 1; }
  // the number of tiles that end at or before k
  int64_t ending_by(int64_t k) const { return k <= 0 ? 0 : k >= kv_rows() ? num : tile_of[k]; }
};

// Calls fn(major, begin, end, full) for the minor-tile runs of slice `s` in each major tile it
// touches: a partial head, a full middle and a partial tail (each possibly empty). O(major tiles).
// q_major: major = query tiles of `major_rows` tokens, minor = key tiles; else the reverse.
// Key tiles are `keys` (kv_tile_starts, with an O(1) lookup of the tile holding a key): the major tiles of a
// key-major list, the minor ones of a query-major list.
template <class Fn>
void for_each_run(const DeviceSlice& s, bool q_major, int64_t major_rows, const TileDiv& div_major,
                  const TileDiv& div_minor, int64_t q_rows, int64_t kv_rows, const KeyTiles& keys, Fn&& fn) {
  auto emit = [&](int64_t major, int64_t a, int64_t fa, int64_t fb, int64_t b) {
    if (a < fa) fn(major, a, fa, false);
    if (fa < fb) fn(major, fa, fb, true);
    if (fb < b) fn(major, fb, b, false);
  };
  if (q_major) {
    const int64_t tq = major_rows;
    // the slice's own key bounds in tiles, once; the band's per query tile (an ancestor's band never binds,
    // so most of these repeat: the last answer is kept)
    const int64_t from_k0 = keys.starting_from(s.k0), by_k1 = keys.ending_by(std::min<int64_t>(s.k1, kv_rows));
    int64_t klo_at = -1, a = 0, khi_at = -1, b = 0;
    for (int64_t qt = div_major.floor(s.q0); qt * tq < s.q1; ++qt) {
      const int64_t qa = qt * tq, qe = qa + tq;
      const int64_t q0 = std::max<int64_t>(s.q0, qa), q1 = std::min<int64_t>(s.q1, qe);
      // keys seen by some row of [q0, q1): a contiguous range, and every key tile in it has work
      const int64_t klo = std::max<int64_t>(s.k0, q0 - s.dmax + 1), khi = std::min<int64_t>(s.k1 - 1, q1 - 1 - s.dmin);
      if (klo > khi) continue;
      if (klo != klo_at) klo_at = klo, a = keys.containing(klo);
      if (khi != khi_at) khi_at = khi, b = keys.containing(khi) + 1;
      int64_t fa = b, fb = b;
      if (qa >= s.q0 && qe <= s.q1 && qe <= q_rows) {
        // key tile [ka, ke) is full iff inside [k0, min(k1, kv_rows)) and both band edges clear it:
        // qa - (ke - 1) >= dmin and (qe - 1) - ka < dmax
        const int64_t lo = std::max({a, from_k0, keys.starting_after(qe - 1 - s.dmax)});
        const int64_t hi = std::min({b, by_k1, keys.ending_by(qa - s.dmin + 1)});
        if (lo < hi) fa = lo, fb = hi;
      }
      emit(qt, a, fa, fb, b);
    }
  } else {
    const TileDiv& tq = div_minor;
    const std::vector<int32_t>& starts = *keys.starts;
    for (int64_t kt = keys.containing(s.k0); kt < keys.num && starts[kt] < s.k1; ++kt) {
      const int64_t ka = starts[kt], ke = starts[kt + 1];
      const int64_t k0 = std::max<int64_t>(s.k0, ka), k1 = std::min<int64_t>(s.k1, ke);
      const int64_t qlo = std::max<int64_t>(s.q0, k0 + s.dmin), qhi = std::min<int64_t>(s.q1 - 1, k1 - 1 + s.dmax - 1);
      if (qlo > qhi) continue;
      const int64_t a = tq.floor(qlo), b = tq.floor(qhi) + 1;
      int64_t fa = b, fb = b;
      if (ka >= s.k0 && ke <= s.k1 && ke <= kv_rows) {
        // query tile qt is full iff inside [q0, min(q1, q_rows)) and qt tq - (ke - 1) >= dmin and
        // (qt+1) tq - 1 - ka < dmax
        const int64_t lo = std::max({a, tq.ceil(s.q0), tq.ceil(s.dmin + ke - 1)});
        const int64_t hi = std::min({b, tq.floor(std::min<int64_t>(s.q1, q_rows)), tq.floor(s.dmax + ka)});
        if (lo < hi) fa = lo, fb = hi;
      }
      emit(kt, a, fa, fb, b);
    }
  }
}

// Key tile starts: at most `rows` keys per tile; a new tile starts at the first slice key boundary at
// least a quarter tile (kKeyTileMinFraction) past the current start, else after `rows` keys. Ends with kv_rows.
std::vector<int32_t> kv_tile_starts(const std::vector<DeviceSlice>& slices, int64_t rows, int64_t kv_rows) {
  thread_local std::vector<int32_t> cuts;
  cuts.clear();
  for (const DeviceSlice& s : slices) {
    cuts.push_back(s.k0);
    cuts.push_back(s.k1);
  }
  std::sort(cuts.begin(), cuts.end());
  std::vector<int32_t> starts{0};
  for (int64_t pos = 0; pos < kv_rows;) {
    int64_t end = std::min(pos + rows, kv_rows);
    const auto it = std::lower_bound(cuts.begin(), cuts.end(), static_cast<int32_t>(pos + rows / kKeyTileMinFraction));
    if (it != cuts.end() && *it < end) end = *it;
    starts.push_back(static_cast<int32_t>(end));
    pos = end;
  }
  return starts;
}

// Key-major lists: TileLists::segment_order and its group bounds. A tile's segment is the last slice key start
// at or before its first key (tiles start at those boundaries: kv_tile_starts); a group is a chunk of at most
// kSegmentChunk tiles of one segment. O(slices log slices + tiles log tiles).
void segment_order(const std::vector<DeviceSlice>& slices, const std::vector<int64_t>& work, TileLists& out) {
  const int64_t num_major = out.num_major;
  thread_local std::vector<int32_t> starts;
  starts.clear();
  for (const DeviceSlice& s : slices) starts.push_back(s.k0);
  std::sort(starts.begin(), starts.end());
  starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
  // segment + 1 of each tile (0: before every slice's keys), and the longest walk of each segment
  thread_local std::vector<int32_t> seg;
  thread_local std::vector<int64_t> seg_work;
  seg.assign(static_cast<size_t>(num_major), 0);
  seg_work.assign(starts.size() + 1, 0);
  for (int64_t t = 0; t < num_major; ++t) {
    seg[t] = static_cast<int32_t>(std::upper_bound(starts.begin(), starts.end(), out.major_start[t]) - starts.begin());
    seg_work[seg[t]] = std::max(seg_work[seg[t]], work[t]);
  }
  out.segment_order.resize(static_cast<size_t>(num_major));
  for (int64_t t = 0; t < num_major; ++t) out.segment_order[t] = static_cast<int32_t>(t);
  std::sort(out.segment_order.begin(), out.segment_order.end(), [&](int32_t a, int32_t b) {
    if (seg_work[seg[a]] != seg_work[seg[b]]) return seg_work[seg[a]] > seg_work[seg[b]];
    if (seg[a] != seg[b]) return seg[a] < seg[b];
    if (work[a] != work[b]) return work[a] > work[b];
    return a < b;
  });
  // Chunks of at most kSegmentChunk consecutive tiles of one segment, longest chunk (by its first tile) first,
  // then in the segments' order: a long segment's tiles do not all wait for the same part of the launch.
  struct Chunk {
    int64_t first_work;
    int32_t rank, begin, end;  // segment rank, then [begin, end) in the segment-sorted order
  };
  thread_local std::vector<Chunk> chunks;
  chunks.clear();
  out.segment_of.resize(static_cast<size_t>(num_major));
  for (int32_t i = 0, rank = 0; i < num_major; ++rank) {
    int32_t j = i + 1;
    while (j < num_major && seg[out.segment_order[j]] == seg[out.segment_order[i]]) ++j;
    for (int32_t x = i; x < j; ++x) out.segment_of[out.segment_order[x]] = rank;
    for (int32_t c = i; c < j; c += kSegmentChunk)
      chunks.push_back(Chunk{work[out.segment_order[c]], rank, c, std::min(j, c + kSegmentChunk)});
    i = j;
  }
  std::stable_sort(chunks.begin(), chunks.end(), [](const Chunk& a, const Chunk& b) {
    return a.first_work != b.first_work ? a.first_work > b.first_work : a.rank < b.rank;
  });
  thread_local std::vector<int32_t> sorted;
  sorted = out.segment_order;
  out.segment_first.resize(static_cast<size_t>(num_major));
  out.segment_end.resize(static_cast<size_t>(num_major));
  int32_t at = 0;
  for (const Chunk& c : chunks) {
    const int32_t first = at;
    for (int32_t x = c.begin; x < c.end; ++x) out.segment_order[at++] = sorted[x];
    for (int32_t x = first; x < at; ++x) {
      out.segment_first[x] = first;
      out.segment_end[x] = at;
    }
  }
}

// Key-major lists: TileLists::upper_live. Per slice, the queries that see a key of [kc, kd) are
// [max(q0, kc + dmin), min(q1, kd - 1 + dmax)); an entry's range is the hull of its slices' ranges in query tiles,
// clipped to its run. O(entries x their slices).
void upper_half_live(const std::vector<DeviceSlice>& slices, TileLists& out) {
  const int32_t half = kBwdBlockKeys / 2, tq = out.minor_tile_rows;
  out.upper_live.assign(2 * out.entries.size(), 0);
  for (int32_t t = 0; t < out.num_major; ++t) {
    const int32_t ka = out.major_start[t] + half, kb = out.major_start[t + 1];
    for (int32_t i = out.offsets[t]; i < out.offsets[t + 1]; ++i) {
      const TileEntry& e = out.entries[i];
      int32_t lo = e.tile_end, hi = e.tile_begin;  // empty
      if (ka < kb && e.mask_count == 0) {
        lo = e.tile_begin;
        hi = e.tile_end;
      } else if (ka < kb) {
        for (int32_t j = 0; j < e.mask_count; ++j) {
          const DeviceSlice& sl = slices[out.mask_index[e.mask_begin + j]];
          const int32_t kc = std::max(ka, sl.k0), kd = std::min(kb, sl.k1);
          if (kc >= kd) continue;
          const int32_t qlo = std::max(sl.q0, kc + sl.dmin), qhi = std::min(sl.q1, kd - 1 + sl.dmax);
          if (qlo >= qhi) continue;
          lo = std::min(lo, qlo / tq);
          hi = std::max(hi, (qhi - 1) / tq + 1);
        }
        lo = std::max(lo, e.tile_begin);
        hi = std::min(hi, e.tile_end);
      }
      out.upper_live[2 * i] = lo;
      out.upper_live[2 * i + 1] = hi;
    }
  }
}

TileLists build_lists(const std::vector<DeviceSlice>& slices, bool q_major, int64_t major_rows, int64_t minor_rows,
                      int64_t q_rows, int64_t kv_rows) {
  TileLists out;
  out.major_tile_rows = static_cast<int32_t>(major_rows);
  out.minor_tile_rows = static_cast<int32_t>(minor_rows);
  // the key tiles: major in a key-major list, minor in a query-major one
  std::vector<int32_t>& key_starts = q_major ? out.minor_start : out.major_start;
  key_starts = kv_tile_starts(slices, q_major ? minor_rows : major_rows, kv_rows);
  thread_local KeyTiles keys;
  keys.build(key_starts);
  const int64_t num_major = q_major ? ceil_div(q_rows, major_rows) : static_cast<int64_t>(key_starts.size()) - 1;
  out.num_major = static_cast<int32_t>(num_major);
  // one pass over the slices' runs, then a counting sort into per-major-tile buckets
  const TileDiv div_major(major_rows), div_minor(minor_rows);
  std::vector<int32_t> count(num_major + 1, 0);
  // scratch kept per thread across builds: a new tree then reuses warm memory instead of fresh pages
  thread_local std::vector<std::pair<int32_t, RawRun>> found;
  thread_local std::vector<RawRun> raw;
  found.clear();
  for (size_t i = 0; i < slices.size(); ++i)
    for_each_run(slices[i], q_major, major_rows, div_major, div_minor, q_rows, kv_rows, keys,
                 [&](int64_t mt, int64_t b, int64_t e, bool f) {
                   ++count[mt + 1];
                   found.push_back({static_cast<int32_t>(mt),
                                    RawRun{static_cast<int32_t>(b), static_cast<int32_t>(e), static_cast<int32_t>(i), f}});
                 });
  for (int64_t t = 0; t < num_major; ++t) count[t + 1] += count[t];
  raw.resize(count[num_major]);
  std::vector<int32_t> fill(count.begin(), count.end() - 1);
  for (const auto& [mt, run] : found) raw[fill[mt]++] = run;  // stable: slice order inside each bucket

  // Per major tile, sweep the run boundaries: each elementary interval becomes one run whose test is
  // the set of slices covering it (full when that set is one slice that fills its tiles). The sweep
  // keeps the covering runs in a small set ordered by slice (a slice has at most one run covering a
  // point), so a key tile read by hundreds of completions costs O(R log R), not R per interval.
  out.offsets.assign(num_major + 1, 0);
  out.entries.reserve(raw.size());
  out.mask_index.reserve(raw.size());
  std::vector<int64_t> work(num_major, 0);
  using Cover = std::pair<int32_t, int32_t>;  // (slice, full)
  std::vector<Cover> active;                  // the runs covering the sweep's position, ordered by slice
  std::vector<int32_t> active_end;            // their ends
  std::vector<int32_t> by_begin;              // the tile's runs (indices into raw) by their starts
  for (int64_t t = 0; t < num_major; ++t) {
    const size_t entries_before = out.entries.size();
    // One elementary interval [x, y) of major tile t, covered by the runs of cover[0, n) (slice order).
    auto emit = [&](int32_t x, int32_t y, const Cover* cover, size_t n) {
      const bool full = n == 1 && cover[0].second;  // slices are disjoint: a full run has no other contributor
      TileEntry* prev = out.entries.size() > entries_before ? &out.entries.back() : nullptr;
      // adjacent runs with the same test merge (full runs of any slices: "every pair visible")
      const bool same_as_prev =
          prev && prev->tile_end == x && (prev->mask_count == 0) == full &&
          (full || (static_cast<size_t>(prev->mask_count) == n &&
                    std::equal(cover, cover + n, out.mask_index.begin() + prev->mask_begin,
                               [](const Cover& a, int32_t b) { return a.first == b; })));
      if (same_as_prev) {
        prev->tile_end = y;
      } else if (full) {
        out.entries.push_back(TileEntry{x, y, 0, 0});
      } else {
        out.entries.push_back(TileEntry{x, y, static_cast<int32_t>(out.mask_index.size()), static_cast<int32_t>(n)});
        for (size_t i = 0; i < n; ++i) out.mask_index.push_back(cover[i].first);
      }
      work[t] += y - x;
      (full ? out.full_tiles : out.partial_tiles) += y - x;
    };
    // Most tiles' runs, in slice order, already ascend without overlapping (on art-fixed5k 2,455 of 2,560 query
    // tiles, though only 101 of 341 key tiles): each run is then an elementary interval of its own, and the sweep
    // would emit exactly these intervals.
    bool disjoint = true;
    for (int32_t i = count[t] + 1; i < count[t + 1] && disjoint; ++i) disjoint = raw[i].begin >= raw[i - 1].end;
    if (disjoint) {
      for (int32_t i = count[t]; i < count[t + 1]; ++i) {
        const Cover one{raw[i].slice, raw[i].full};
        emit(raw[i].begin, raw[i].end, &one, 1);
      }
      out.offsets[t + 1] = static_cast<int32_t>(out.entries.size());
      continue;
    }
    // Otherwise sweep the runs by their starts: at each boundary x the runs ending there leave, those starting
    // there join (slice order), and the covering set holds until the nearest end or next start.
    by_begin.clear();
    for (int32_t i = count[t]; i < count[t + 1]; ++i) by_begin.push_back(i);
    std::sort(by_begin.begin(), by_begin.end(), [&](int32_t a, int32_t b) { return raw[a].begin < raw[b].begin; });
    active.clear();
    active_end.clear();
    size_t next = 0;
    for (int32_t x = raw[by_begin[0]].begin;;) {
      for (size_t j = 0; j < active.size();) {
        if (active_end[j] == x) {
          active.erase(active.begin() + static_cast<std::ptrdiff_t>(j));
          active_end.erase(active_end.begin() + static_cast<std::ptrdiff_t>(j));
        } else {
          ++j;
        }
      }
      for (; next < by_begin.size() && raw[by_begin[next]].begin == x; ++next) {
        const RawRun& r = raw[by_begin[next]];
        const auto it = std::lower_bound(active.begin(), active.end(), Cover{r.slice, r.full});
        active_end.insert(active_end.begin() + (it - active.begin()), r.end);
        active.insert(it, Cover{r.slice, r.full});
      }
      int32_t y = next < by_begin.size() ? raw[by_begin[next]].begin : std::numeric_limits<int32_t>::max();
      for (const int32_t e : active_end) y = std::min(y, e);
      if (y == std::numeric_limits<int32_t>::max()) break;  // nothing covers x and no run starts later
      if (!active.empty()) emit(x, y, active.data(), active.size());
      x = y;
    }
    out.offsets[t + 1] = static_cast<int32_t>(out.entries.size());
  }

  // Longest first: counting sort of the major tiles by visited tiles, descending.
  int64_t max_work = 0;
  for (int64_t t = 0; t < num_major; ++t) max_work = std::max(max_work, work[t]);
  std::vector<int32_t> bucket(static_cast<size_t>(max_work) + 2, 0);
  for (int64_t t = 0; t < num_major; ++t) ++bucket[max_work - work[t] + 1];
  for (int64_t b = 0; b <= max_work; ++b) bucket[b + 1] += bucket[b];
  out.order.resize(num_major);
  for (int64_t t = 0; t < num_major; ++t) out.order[bucket[max_work - work[t]]++] = static_cast<int32_t>(t);
  if (!q_major) {
    segment_order(slices, work, out);
    upper_half_live(slices, out);
  }
  return out;
}

}  // namespace

TilePlan build_tile_plan(const std::vector<Slice>& slices, int64_t q_rows, int64_t kv_rows, int32_t group) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max() / 2;
  require(q_rows >= 0 && q_rows <= kMax, "build_tile_plan: q_rows must be in [0, 2^30], got ", q_rows);
  require(kv_rows >= 0 && kv_rows <= kMax, "build_tile_plan: kv_rows must be in [0, 2^30], got ", kv_rows);
  require(group >= 1 && group <= kBwdBlockRows,
          "build_tile_plan: group (Hq/Hkv) must be in [1, ", kBwdBlockRows, "], got ", group);
  TilePlan plan;
  plan.q_rows = q_rows;
  plan.kv_rows = kv_rows;
  plan.group = group;
  plan.slices.reserve(slices.size());
  for (const Slice& s : slices) {
    if (s.empty()) continue;
    if (!(s.q_begin >= 0 && s.q_end <= q_rows && s.k_begin >= 0 && s.k_end <= kv_rows))  // the message only on failure
      fail("build_tile_plan: slice ", to_string(s), " leaves the buffers (q_rows ", q_rows, ", kv_rows ", kv_rows, ")");
    // The band is clipped to the rectangle, so it fits int32 like the rows.
    const Slice t = make_slice(s.q_begin, s.q_end, s.k_begin, s.k_end, s.diag_min, s.diag_max);
    if (t.empty()) continue;
    plan.slices.push_back(DeviceSlice{static_cast<int32_t>(t.q_begin), static_cast<int32_t>(t.q_end),
                                      static_cast<int32_t>(t.k_begin), static_cast<int32_t>(t.k_end),
                                      static_cast<int32_t>(t.diag_min), static_cast<int32_t>(t.diag_max), 0, 0});
    plan.visible_pairs += t.area();
  }
  const int64_t fwd_q_tokens = std::max<int64_t>(1, kFwdBlockRows / group);
  const int64_t bwd_q_tokens = std::max<int64_t>(1, kBwdBlockRows / group);
  plan.fwd = build_lists(plan.slices, true, fwd_q_tokens, kFwdBlockKeys, q_rows, kv_rows);
  plan.bwd = build_lists(plan.slices, false, kBwdBlockKeys, bwd_q_tokens, q_rows, kv_rows);
  return plan;
}

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail(what, ": ", cudaGetErrorString(status));
}

namespace {
size_t align_up(size_t n) { return (n + 255) / 256 * 256; }
}  // namespace

void DeviceTilePlan::upload(const TilePlan& plan, cudaStream_t stream) {
  q_rows = plan.q_rows;
  kv_rows = plan.kv_rows;
  group = plan.group;
  // One staging buffer and one copy: per-array copies would each pay a launch of their own.
  struct Part {
    const void* src;
    size_t bytes;
    size_t at;
  };
  std::vector<Part> parts;
  size_t total = 0;
  auto add = [&](const void* src, size_t bytes) {
    parts.push_back(Part{src, bytes, total});
    total += align_up(std::max<size_t>(bytes, 1));
    return parts.size() - 1;
  };
  auto add_lists = [&](const TileLists& l, size_t idx[10]) {
    idx[0] = add(l.offsets.data(), l.offsets.size() * sizeof(int32_t));
    idx[1] = add(l.entries.data(), l.entries.size() * sizeof(TileEntry));
    idx[2] = add(l.order.data(), l.order.size() * sizeof(int32_t));
    idx[3] = add(l.mask_index.data(), l.mask_index.size() * sizeof(int32_t));
    idx[4] = add(l.major_start.data(), l.major_start.size() * sizeof(int32_t));
    idx[5] = add(l.minor_start.data(), l.minor_start.size() * sizeof(int32_t));
    idx[6] = add(l.segment_order.data(), l.segment_order.size() * sizeof(int32_t));
    idx[7] = add(l.segment_first.data(), l.segment_first.size() * sizeof(int32_t));
    idx[8] = add(l.segment_end.data(), l.segment_end.size() * sizeof(int32_t));
    idx[9] = add(l.upper_live.data(), l.upper_live.size() * sizeof(int32_t));
  };
  size_t fi[10], bi[10];
  add_lists(plan.fwd, fi);
  add_lists(plan.bwd, bi);
  const size_t si = add(plan.slices.data(), plan.slices.size() * sizeof(DeviceSlice));
  staging_.resize(total);
  for (const Part& p : parts)
    if (p.bytes) std::memcpy(staging_.data() + p.at, p.src, p.bytes);
  if (total > capacity_) {
    release();
    check_cuda(cudaMalloc(&block_, total), "DeviceTilePlan: cudaMalloc");
    capacity_ = total;
  }
  // From pageable memory the call returns once staging_ has been read, so no host wait is needed: kernels
  // enqueued earlier on `stream` still read the old plan, later ones the new (the runtime uploads the next
  // row's plans while the current row runs).
  check_cuda(cudaMemcpyAsync(block_, staging_.data(), total, cudaMemcpyHostToDevice, stream), "DeviceTilePlan: copy");
  auto* base = static_cast<unsigned char*>(block_);
  auto fill = [&](Lists& d, const TileLists& l, const size_t idx[10]) {
    auto opt = [&](const std::vector<int32_t>& v, size_t i) {
      return v.empty() ? nullptr : reinterpret_cast<const int32_t*>(base + parts[i].at);
    };
    d.offsets = reinterpret_cast<const int32_t*>(base + parts[idx[0]].at);
    d.entries = reinterpret_cast<const TileEntry*>(base + parts[idx[1]].at);
    d.order = reinterpret_cast<const int32_t*>(base + parts[idx[2]].at);
    d.mask_index = reinterpret_cast<const int32_t*>(base + parts[idx[3]].at);
    d.major_start = opt(l.major_start, idx[4]);
    d.minor_start = opt(l.minor_start, idx[5]);
    d.segment_order = opt(l.segment_order, idx[6]);
    d.segment_first = opt(l.segment_first, idx[7]);
    d.segment_end = opt(l.segment_end, idx[8]);
    d.upper_live = reinterpret_cast<const int2*>(opt(l.upper_live, idx[9]));
    d.num_major = l.num_major;
    d.major_tile_rows = l.major_tile_rows;
    d.minor_tile_rows = l.minor_tile_rows;
  };
  fill(fwd, plan.fwd, fi);
  fill(bwd, plan.bwd, bi);
  slices = reinterpret_cast<const DeviceSlice*>(base + parts[si].at);
  bwd_segments_ = SegmentOrderRule::of(plan.bwd);
}

SegmentOrderRule SegmentOrderRule::of(const TileLists& b) {
  SegmentOrderRule r;
  r.order_segments.resize(b.order.size());
  if (b.segment_of.size() != b.order.size()) return r;  // not key-major lists
  std::vector<char> seen(b.order.size(), 0);
  int32_t distinct = 0;
  for (size_t i = 0; i < b.order.size(); ++i) {
    const int32_t s = b.segment_of[b.order[i]];
    if (!seen[s]) seen[s] = 1, ++distinct;
    r.order_segments[i] = distinct;
  }
  r.first_segment_tiles = b.segment_end.empty() ? 0 : b.segment_end[0];
  return r;
}

bool SegmentOrderRule::pays(int32_t hkv, int32_t sms) const {
  if (hkv < 1 || sms < 1 || first_segment_tiles == 0) return false;
  const auto n = std::min<int64_t>(order_segments.size(), (int64_t{sms} + hkv - 1) / hkv);
  if (n <= 0) return false;
  // the default's first wave: n tiles (each with its hkv heads) over their distinct segments
  const double in_step_default = static_cast<double>(n) / order_segments[n - 1];
  // the segment order's: the first segment's tiles for one head, as many as fit in the wave
  const double in_step_segment = static_cast<double>(std::min<int64_t>(first_segment_tiles, sms));
  return in_step_default < kFewBlocks && in_step_segment > in_step_default;
}

void DeviceTilePlan::release() {
  if (block_) cudaFree(block_);
  block_ = nullptr;
  capacity_ = 0;
}

DeviceTilePlan::~DeviceTilePlan() { release(); }

DeviceTilePlan::DeviceTilePlan(DeviceTilePlan&& other) noexcept { *this = std::move(other); }

DeviceTilePlan& DeviceTilePlan::operator=(DeviceTilePlan&& other) noexcept {
  if (this != &other) {
    release();
    fwd = other.fwd;
    bwd = other.bwd;
    slices = other.slices;
    q_rows = other.q_rows;
    kv_rows = other.kv_rows;
    group = other.group;
    bwd_segments_ = std::move(other.bwd_segments_);
    block_ = other.block_;
    capacity_ = other.capacity_;
    staging_ = std::move(other.staging_);
    other.block_ = nullptr;
    other.capacity_ = 0;
  }
  return *this;
}

}  // namespace treecp::cuda
