#include "tree/row.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "core/json.hpp"

namespace treecp {

Row::Row(std::vector<Segment> segments) : segments_(std::move(segments)) {
  const auto n = segments_.size();
  require(n > 0, "row: empty row (no segments)");
  require(n <= static_cast<size_t>(INT32_MAX), "row: more than 2^31-1 segments");
  start_.resize(n);
  logical_start_.resize(n);
  depth_.resize(n);
  root_.resize(n);
  subtree_end_.resize(n);

  // The stack holds the current root-to-segment path (path[d - 1] has depth d); a DFS preorder row
  // only ever attaches a new segment to a segment on that path, found by its depth in O(1).
  std::vector<int32_t> path;
  // Runs of contiguous ancestors above each segment: its slices without a window are one per run
  // plus its own (row_slices).
  std::vector<int32_t> key_runs(n);
  int64_t pos = 0;
  for (int32_t s = 0; s < static_cast<int32_t>(n); ++s) {
    const Segment& seg = segments_[s];
    require(seg.length > 0, "segment ", s, ": length must be positive, got ", seg.length);
    require(seg.parent != s, "segment ", s, ": a segment cannot be its own parent");
    require(seg.parent >= -1, "segment ", s, ": parent must be -1 (root) or an earlier segment, got ",
            seg.parent);
    require(seg.parent < s, "segment ", s, ": parent ", seg.parent, " is not an earlier segment");
    require(seg.length <= kMaxTokens - pos, "segment ", s, ": row exceeds 2^31-1 tokens");
    const size_t keep = seg.parent == -1 ? 0 : static_cast<size_t>(depth_[seg.parent]);
    require(seg.parent == -1 || (keep <= path.size() && path[keep - 1] == seg.parent), "segment ", s,
            ": not in DFS preorder: parent ", seg.parent, "'s subtree was already closed by segment ",
            path.empty() ? -1 : path.back(), " (descendants must follow their ancestor contiguously)");
    for (size_t i = keep; i < path.size(); ++i) subtree_end_[path[i]] = s;
    path.resize(keep);
    start_[s] = pos;
    if (seg.parent == -1) {
      depth_[s] = 1;
      root_[s] = s;
      logical_start_[s] = 0;
      key_runs[s] = 0;
    } else {
      depth_[s] = depth_[seg.parent] + 1;
      root_[s] = root_[seg.parent];
      logical_start_[s] = logical_start_[seg.parent] + segments_[seg.parent].length;
      key_runs[s] = key_runs[seg.parent] + (continues_parent(seg.parent) ? 0 : 1);
    }
    slice_count_ += key_runs[s] + 1;
    require(slice_count_ <= kMaxSlices, "segment ", s, ": the row's visibility needs more than ", kMaxSlices,
            " slices, the most a row may have (Row::kMaxSlices); each ancestor that does not continue its parent "
            "in the packed row adds a slice to every segment below it");
    path.push_back(s);
    pos += seg.length;
  }
  for (int32_t p : path) subtree_end_[p] = static_cast<int32_t>(n);
  tokens_ = pos;
}

int64_t Row::subtree_token_end(int32_t s) const {
  const int32_t e = subtree_end_[s];
  return e == num_segments() ? tokens_ : start_[e];
}

std::vector<int32_t> Row::ancestor_chain(int32_t s) const {
  std::vector<int32_t> chain;
  for (int32_t a = s; a != -1; a = segments_[a].parent) chain.push_back(a);
  std::reverse(chain.begin(), chain.end());
  return chain;
}

int32_t Row::segment_of(int64_t pos) const {
  require(pos >= 0 && pos < tokens_, "token position ", pos, " outside the row [0, ", tokens_, ")");
  auto it = std::upper_bound(start_.begin(), start_.end(), pos);
  return static_cast<int32_t>(it - start_.begin()) - 1;
}

int64_t Row::logical(int64_t pos) const {
  const int32_t s = segment_of(pos);
  return logical_start_[s] + (pos - start_[s]);
}

std::vector<int32_t> Row::leaves() const {
  std::vector<int32_t> out;
  for (int32_t s = 0; s < num_segments(); ++s) {
    if (is_leaf(s)) out.push_back(s);
  }
  return out;
}

std::vector<int32_t> Row::roots() const {
  std::vector<int32_t> out;
  for (int32_t s = 0; s < num_segments(); ++s) {
    if (segments_[s].parent == -1) out.push_back(s);
  }
  return out;
}

int32_t Row::max_depth() const { return *std::max_element(depth_.begin(), depth_.end()); }

bool Row::visible(int64_t i, int64_t j, int64_t window) const {
  const int32_t si = segment_of(i), sj = segment_of(j);
  if (!is_ancestor_or_self(sj, si)) return false;
  if (si == sj && j > i) return false;
  if (window > 0 && logical(i) - logical(j) >= window) return false;
  return true;
}

Row row_from_json(std::string_view text) {
  std::vector<Segment> segments;
  const auto segment = [&](size_t i, const json::Value& s) {
    require(s.is_object(), "segment ", i, ": must be an object {\"parent\":P,\"length\":L}");
    for (const auto& [key, value] : s.as_object()) {
      require(key == "parent" || key == "length", "segment ", i, ": unknown key \"", printable(key),
              "\" (expected \"parent\" and \"length\")");
    }
    const json::Value* p = s.find("parent");
    const json::Value* l = s.find("length");
    require(p != nullptr, "segment ", i, ": missing key \"parent\"");
    require(l != nullptr, "segment ", i, ": missing key \"length\"");
    require(p->is_int(), "segment ", i, ": \"parent\" must be an integer");
    require(l->is_int(), "segment ", i, ": \"length\" must be an integer");
    const int64_t parent = p->as_int();
    require(parent >= -1 && parent <= INT32_MAX, "segment ", i, ": parent ", parent,
            " must be -1 (root) or an earlier segment");
    segments.push_back({static_cast<int32_t>(parent), l->as_int()});
  };
  // Segments are checked as they are parsed: a million of them never exist as JSON values at once.
  const json::Value doc = json::parse_streaming(text, "segments", segment);
  require(doc.is_object(), "row: the document must be an object {\"segments\": [...]}");
  for (const auto& [key, value] : doc.as_object()) {
    require(key == "segments", "row: unknown key \"", printable(key), "\" (expected only \"segments\")");
  }
  const json::Value* segs = doc.find("segments");
  require(segs != nullptr, "row: missing key \"segments\"");
  require(segs->is_array(), "row: \"segments\" must be an array");
  require(!segments.empty(), "row: empty row (no segments)");
  return Row(std::move(segments));
}

Row load_row(const std::string& path) {
  const std::string text = json::read_file(path);
  try {
    return row_from_json(text);
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
}

std::string row_to_json(const Row& row) {
  std::string out = "{\"segments\":[";
  for (int32_t s = 0; s < row.num_segments(); ++s) {
    if (s) out += ",\n  ";
    out += "{\"parent\":" + std::to_string(row.parent(s)) + ",\"length\":" + std::to_string(row.length(s)) + "}";
  }
  out += "]}\n";
  return out;
}

}  // namespace treecp
