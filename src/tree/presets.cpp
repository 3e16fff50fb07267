#include "tree/presets.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>

#include "core/error.hpp"

namespace treecp {

namespace {

constexpr int64_t kBase = 40960;       // base tokens per rank of most presets
constexpr int64_t kLongBase = 98304;   // longchain
constexpr int64_t kArtLongBase = 147456;

// Appends segments in DFS preorder until `capacity` tokens; the segment that overflows is clipped
// and every later add is refused.
class RowBuilder {
 public:
  explicit RowBuilder(int64_t capacity) : capacity_(capacity) {}
  bool full() const { return used_ >= capacity_; }
  // Returns the new segment's index, or -1 when the row is already full.
  int32_t add(int32_t parent, int64_t length) {
    if (full()) return -1;
    length = std::min(length, capacity_ - used_);
    segments_.push_back({parent, length});
    used_ += length;
    return static_cast<int32_t>(segments_.size()) - 1;
  }
  int64_t used() const { return used_; }
  void raise_capacity(int64_t capacity) { capacity_ = capacity; }
  Row build() { return Row(std::move(segments_)); }

 private:
  int64_t capacity_;
  int64_t used_ = 0;
  std::vector<Segment> segments_;
};

// A family: a root and children drawn by `child_len`, added while the row has room.
void add_flat_family(RowBuilder& b, int64_t root_len, int children, const std::function<int64_t()>& child_len) {
  const int32_t root = b.add(-1, root_len);
  if (root < 0) return;
  for (int c = 0; c < children; ++c) {
    if (b.add(root, child_len()) < 0) return;
  }
}

void add_deep_subtree(RowBuilder& b, PresetRng& rng, int32_t node, int depth, int max_depth) {
  if (depth >= max_depth) return;
  const int64_t children = rng.uniform_int(2, 3);
  for (int64_t c = 0; c < children; ++c) {
    const int32_t child = b.add(node, rng.clipped_normal(384, 128, 16, 1024));
    if (child < 0) return;
    add_deep_subtree(b, rng, child, depth + 1, max_depth);
  }
}

}  // namespace

PresetRng::PresetRng(uint64_t seed) {
  // splitmix64 expands the seed into xoshiro256** state (both fully specified, platform independent)
  uint64_t x = seed;
  for (auto& s : state_) {
    x += 0x9E3779B97F4A7C15ULL;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    s = z ^ (z >> 31);
  }
}

uint64_t PresetRng::next() {
  auto rotl = [](uint64_t v, int k) { return (v << k) | (v >> (64 - k)); };
  const uint64_t result = rotl(state_[1] * 5, 7) * 9;
  const uint64_t t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotl(state_[3], 45);
  return result;
}

double PresetRng::normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  // Box-Muller on two uniforms in (0, 1]
  const double u1 = (static_cast<double>(next() >> 11) + 1.0) * 0x1.0p-53;
  const double u2 = static_cast<double>(next() >> 11) * 0x1.0p-53;
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double theta = 2.0 * M_PI * u2;
  spare_ = r * std::sin(theta);
  has_spare_ = true;
  return r * std::cos(theta);
}

int64_t PresetRng::clipped_normal(double mean, double stddev, int64_t lo, int64_t hi) {
  const auto v = static_cast<int64_t>(std::llround(mean + stddev * normal()));
  return std::clamp(v, lo, hi);
}

int64_t PresetRng::uniform_int(int64_t lo, int64_t hi) {
  const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
  return lo + static_cast<int64_t>(next() % span);
}

const std::vector<PresetInfo>& presets() {
  static const std::vector<PresetInfo> list = {
      {"fixed5k", "root 1,024 + 8 completions of 512", kBase},
      {"varied5k", "root 1,024 + 8 completions of round(N(512,160)) in [64,1536]", kBase},
      {"dominant", "root 8,192 + 16 completions of 2,048", kBase},
      {"longchain", "root 2,048 + 4 completions of (S-2,048)/4, one family", kLongBase},
      {"deep", "root 2,048, 2-3 children per node to depth 4, lengths round(N(384,128)) in [16,1024]", kBase},
      {"art-fixed5k", "prefix 5,000 + 16 branches of 100", kBase},
      {"art-varied5k", "prefix N(5000,512)+-1024 + 16 branches N(100,32)+-64", kBase},
      {"art-dominant", "per 40,960 tokens one N(14745,1024)+-2048 + 16 x N(921,256)+-512 family, rest N(512,64)+-128 + 4 x N(64,16)+-32", kBase},
      {"art-long8k", "prefix 8,192 + 16 branches N(8192,512)+-1024", kArtLongBase},
      {"art-manysmall", "prefix N(64,7)+-13 + 4 branches N(16,5)+-10", kBase},
  };
  return list;
}

const PresetInfo& preset_info(const std::string& name) {
  for (const auto& p : presets()) {
    if (p.name == name) return p;
  }
  std::string known;
  for (const auto& p : presets()) known += (known.empty() ? "" : ", ") + p.name;
  fail("unknown preset '", name, "' (known: ", known, ")");
}

Row make_preset(const std::string& name, int cp, uint64_t seed) {
  const PresetInfo& info = preset_info(name);
  require(cp >= 1, "--cp must be >= 1, got ", cp);
  const int64_t total = info.base_tokens_per_rank * cp;
  require(total <= Row::kMaxTokens, "preset ", name, " at cp ", cp, " exceeds 2^31-1 tokens");
  RowBuilder b(total);
  PresetRng rng(seed);
  // "N(mu, sigma) +-delta": a rounded normal draw clipped to [mu - delta, mu + delta]
  auto art = [&rng](double mu, double sigma, int64_t delta) {
    const auto m = static_cast<int64_t>(mu);
    return rng.clipped_normal(mu, sigma, m - delta, m + delta);
  };

  if (name == "fixed5k") {
    while (!b.full()) add_flat_family(b, 1024, 8, [] { return int64_t{512}; });
  } else if (name == "varied5k") {
    while (!b.full()) add_flat_family(b, 1024, 8, [&] { return rng.clipped_normal(512, 160, 64, 1536); });
  } else if (name == "dominant") {
    while (!b.full()) add_flat_family(b, 8192, 16, [] { return int64_t{2048}; });
  } else if (name == "longchain") {
    add_flat_family(b, 2048, 4, [&] { return (total - 2048) / 4; });
  } else if (name == "deep") {
    while (!b.full()) {
      const int32_t root = b.add(-1, 2048);
      add_deep_subtree(b, rng, root, 1, 4);
    }
  } else if (name == "art-fixed5k") {
    while (!b.full()) add_flat_family(b, 5000, 16, [] { return int64_t{100}; });
  } else if (name == "art-varied5k") {
    while (!b.full()) add_flat_family(b, art(5000, 512, 1024), 16, [&] { return art(100, 32, 64); });
  } else if (name == "art-dominant") {
    for (int block = 1; block <= cp; ++block) {
      b.raise_capacity(kBase * block);
      add_flat_family(b, art(14745, 1024, 2048), 16, [&] { return art(921, 256, 512); });
      while (!b.full()) add_flat_family(b, art(512, 64, 128), 4, [&] { return art(64, 16, 32); });
    }
  } else if (name == "art-long8k") {
    while (!b.full()) add_flat_family(b, 8192, 16, [&] { return art(8192, 512, 1024); });
  } else if (name == "art-manysmall") {
    while (!b.full()) add_flat_family(b, art(64, 7, 13), 4, [&] { return art(16, 5, 10); });
  }
  return b.build();
}

Row scale_row(const Row& row, int64_t divisor) {
  require(divisor >= 1, "scale divisor must be >= 1, got ", divisor);
  std::vector<Segment> segs = row.segments();
  for (Segment& s : segs) s.length = std::max<int64_t>(1, s.length / divisor);
  return Row(std::move(segs));
}

}  // namespace treecp
