// tree/: packed prefix-tree rows: segments, positions, visibility as slices, workload presets, accounting.
//
// A packed prefix-tree row: segments in DFS preorder, each with a parent (or none) and a length.
// Token ids are physical positions in the packed row; logical positions count from the root along
// the token's root-to-leaf path (rotary embeddings and sliding windows use them).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace treecp {

struct Segment {
  int32_t parent = -1;  // index of the parent segment, -1 for a root
  int64_t length = 0;   // tokens
};

class Row {
 public:
  static constexpr int64_t kMaxTokens = 2147483647;  // 2^31 - 1: token ids fit int32 in kernels
  // Most slices a row's visibility may need (row_slices, 48 bytes each: 192 MiB before the planner
  // cuts them into chunks): a row needing more is refused when it is built.
  static constexpr int64_t kMaxSlices = int64_t{1} << 22;

  Row() = default;
  // Validates and indexes the segments in time linear in their count; throws treecp::Error naming
  // the segment and the rule.
  explicit Row(std::vector<Segment> segments);

  int32_t num_segments() const { return static_cast<int32_t>(segments_.size()); }
  int64_t tokens() const { return tokens_; }
  const std::vector<Segment>& segments() const { return segments_; }

  int32_t parent(int32_t s) const { return segments_[s].parent; }
  int64_t length(int32_t s) const { return segments_[s].length; }
  int64_t start(int32_t s) const { return start_[s]; }  // first physical token
  int64_t end(int32_t s) const { return start_[s] + segments_[s].length; }
  int64_t logical_start(int32_t s) const { return logical_start_[s]; }
  int32_t depth(int32_t s) const { return depth_[s]; }  // segments on the root path, root = 1
  int32_t root(int32_t s) const { return root_[s]; }
  // One past the last segment of s's subtree (descendants follow s contiguously).
  int32_t subtree_end(int32_t s) const { return subtree_end_[s]; }
  // Physical token interval [start(s), subtree_token_end(s)) of s and all its descendants.
  int64_t subtree_token_end(int32_t s) const;
  bool is_leaf(int32_t s) const { return subtree_end_[s] == s + 1; }
  bool is_ancestor_or_self(int32_t a, int32_t s) const { return a <= s && s < subtree_end_[a]; }
  // s starts where its parent ends in the packed row: the two are one run of keys for every query
  // below them (row_slices gives such a run one slice).
  bool continues_parent(int32_t s) const {
    const int32_t p = segments_[s].parent;
    return p != -1 && start_[s] == start_[p] + segments_[p].length;
  }
  // Slices of row_slices(*this) without a window (a window only drops some); <= kMaxSlices.
  int64_t slice_count() const { return slice_count_; }
  // Segments from the root down to s, inclusive.
  std::vector<int32_t> ancestor_chain(int32_t s) const;

  // Physical position -> segment (binary search), offset, logical position.
  int32_t segment_of(int64_t pos) const;
  int64_t logical(int64_t pos) const;

  // Trajectories are root-to-leaf paths (one per leaf); families are roots.
  std::vector<int32_t> leaves() const;
  std::vector<int32_t> roots() const;
  int64_t trajectory_length(int32_t leaf) const { return logical_start_[leaf] + length(leaf); }
  int32_t max_depth() const;

  // Query token i sees key token j (DESIGN.md "Visibility"); window <= 0 means no window.
  bool visible(int64_t i, int64_t j, int64_t window = 0) const;

 private:
  std::vector<Segment> segments_;
  std::vector<int64_t> start_;
  std::vector<int64_t> logical_start_;
  std::vector<int32_t> depth_;
  std::vector<int32_t> root_;
  std::vector<int32_t> subtree_end_;
  int64_t tokens_ = 0;
  int64_t slice_count_ = 0;
};

// JSON row format: {"segments":[{"parent":-1,"length":1024},{"parent":0,"length":512}]}.
// Throws treecp::Error with one line naming the segment and the rule broken.
Row row_from_json(std::string_view text);
Row load_row(const std::string& path);
std::string row_to_json(const Row& row);

}  // namespace treecp
