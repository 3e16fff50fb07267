#include "tree/accounting.hpp"

#include "tree/row.hpp"
#include "tree/slice.hpp"

namespace treecp {

int64_t causal_pairs(int64_t n, int64_t window) {
  if (n <= 0) return 0;
  if (window <= 0 || window >= n) return n * (n + 1) / 2;
  // rows 0..W-1 see i+1 keys, the remaining n-W rows see W keys
  return window * (window + 1) / 2 + (n - window) * window;
}

RowStats row_stats(const Row& row, int64_t window) {
  RowStats st;
  st.window = window > 0 ? window : 0;
  st.physical_tokens = row.tokens();
  st.segments = row.num_segments();
  st.depth = row.max_depth();
  st.families = static_cast<int64_t>(row.roots().size());
  for (int32_t leaf : row.leaves()) {
    const int64_t len = row.trajectory_length(leaf);
    ++st.trajectories;
    st.flattened_tokens += len;
    st.flattened_visible_pairs += causal_pairs(len, window);
  }
  for (const Slice& s : row_slices(row, window)) {
    st.visible_pairs += s.area();
    ++st.slices;
  }
  return st;
}

json::Value to_json(const RowStats& st) {
  json::Value v = json::Value::object();
  v.set("physical_tokens", st.physical_tokens);
  v.set("flattened_tokens", st.flattened_tokens);
  v.set("trajectories", st.trajectories);
  v.set("visible_pairs", st.visible_pairs);
  v.set("flattened_visible_pairs", st.flattened_visible_pairs);
  v.set("depth", static_cast<int64_t>(st.depth));
  v.set("families", st.families);
  v.set("segments", st.segments);
  v.set("slices", st.slices);
  v.set("window", st.window);
  v.set("storage_saving", st.flattened_tokens > 0
                              ? 1.0 - static_cast<double>(st.physical_tokens) / static_cast<double>(st.flattened_tokens)
                              : 0.0);
  v.set("pair_saving", st.flattened_visible_pairs > 0
                           ? 1.0 - static_cast<double>(st.visible_pairs) / static_cast<double>(st.flattened_visible_pairs)
                           : 0.0);
  return v;
}

}  // namespace treecp
