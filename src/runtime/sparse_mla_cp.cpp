#include "runtime/sparse_mla_cp.hpp"

#include <algorithm>

#include "plan/work.hpp"

namespace treecp {

CombinedLayout combine_selected(const std::vector<int64_t>& ids, const RowMap& owned, const Plan& plan, int me) {
  const int cp = plan.cp;
  CombinedLayout out;
  out.owned_rows = owned.rows();
  out.need.resize(static_cast<size_t>(cp));
  out.offset.assign(static_cast<size_t>(cp), 0);
  std::vector<int32_t> owner(ids.size(), -1);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0) continue;
    require(ids[i] < plan.tokens, "sparse mla: selected id ", ids[i], " outside the row of ", plan.tokens, " tokens");
    owner[i] = plan.chunk_owner[static_cast<size_t>(chunk_of(plan.chunk_bounds, ids[i]))];
    if (owner[i] != me) out.need[static_cast<size_t>(owner[i])].push_back(ids[i]);
  }
  int64_t at = out.owned_rows;
  for (int p = 0; p < cp; ++p) {
    std::vector<int64_t>& n = out.need[static_cast<size_t>(p)];
    std::sort(n.begin(), n.end());
    n.erase(std::unique(n.begin(), n.end()), n.end());
    out.offset[static_cast<size_t>(p)] = at;
    at += static_cast<int64_t>(n.size());
  }
  out.rows = at;
  out.list_rows.resize(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0) {
      out.list_rows[i] = -1;
    } else if (owner[i] == me) {
      out.list_rows[i] = owned.row_of(ids[i]);
    } else {
      const std::vector<int64_t>& n = out.need[static_cast<size_t>(owner[i])];
      out.list_rows[i] = out.offset[static_cast<size_t>(owner[i])] + (std::lower_bound(n.begin(), n.end(), ids[i]) - n.begin());
    }
  }
  return out;
}

std::vector<RowCopy> id_runs(const std::vector<int64_t>& ids, const RowMap& map, int64_t first, bool to_map) {
  std::vector<RowCopy> out;
  int64_t last = -2;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t r = map.row_of(ids[i]), b = first + static_cast<int64_t>(i);
    if (!out.empty() && i > 0 && ids[i] == ids[i - 1] + 1 && r == last + 1) {
      ++out.back().rows;
    } else {
      out.push_back(to_map ? RowCopy{b, r, 1} : RowCopy{r, b, 1});
    }
    last = r;
  }
  return out;
}

std::vector<std::vector<RowCopy>> wave_copies(const CombinedLayout& layout, const std::vector<const RowMap*>& fetched) {
  struct Held {
    int64_t begin, end, row;
    size_t wave;
  };
  std::vector<Held> held;
  for (size_t w = 0; w < fetched.size(); ++w) {
    const RowMap& m = *fetched[w];
    for (size_t i = 0; i < m.ranges().size(); ++i) held.push_back({m.ranges()[i].begin, m.ranges()[i].end, m.offset(i), w});
  }
  std::sort(held.begin(), held.end(), [](const Held& a, const Held& b) { return a.begin < b.begin; });
  std::vector<std::vector<RowCopy>> out(fetched.size());
  for (size_t p = 0; p < layout.need.size(); ++p) {
    const std::vector<int64_t>& ids = layout.need[p];
    for (size_t i = 0; i < ids.size(); ++i) {
      const auto it = std::upper_bound(held.begin(), held.end(), ids[i], [](int64_t id, const Held& h) { return id < h.begin; });
      require(it != held.begin() && ids[i] < (it - 1)->end, "sparse mla: selected key ", ids[i],
              " arrived in no wave (the plan does not fetch it)");
      const Held& h = *(it - 1);
      const int64_t src = h.row + ids[i] - h.begin, dst = layout.offset[p] + static_cast<int64_t>(i);
      std::vector<RowCopy>& c = out[h.wave];
      if (!c.empty() && c.back().src_row + c.back().rows == src && c.back().dst_row + c.back().rows == dst) {
        ++c.back().rows;
      } else {
        c.push_back({src, dst, 1});
      }
    }
  }
  return out;
}

}  // namespace treecp
