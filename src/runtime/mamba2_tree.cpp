#include "runtime/mamba2_tree.hpp"

#include "core/error.hpp"

namespace treecp {
namespace {

template <class T>
void check_tree(const Row& row, const Mamba2Params<T>& p) {
  mamba2_check_params(p);
  require(p.tokens == row.tokens(), "mamba2 tree: ", p.tokens, " tokens given for a row of ", row.tokens());
}

}  // namespace

std::vector<std::vector<int32_t>> mamba2_scan_buckets(const Row& row) {
  std::vector<std::vector<int32_t>> buckets(static_cast<size_t>(row.num_segments() ? row.max_depth() : 0));
  for (int32_t s = 0; s < row.num_segments(); ++s) buckets[static_cast<size_t>(row.depth(s) - 1)].push_back(s);
  return buckets;
}

template <class T>
Mamba2TreeSaved<T> mamba2_tree_forward(const Row& row, const Mamba2Params<T>& p, T* y) {
  check_tree(row, p);
  const int64_t ssz = p.state_size(), state = p.heads * ssz;
  Mamba2TreeSaved<T> saved;
  saved.final_state.resize(static_cast<size_t>(row.num_segments()));
  std::vector<T> S;
  for (const std::vector<int32_t>& bucket : mamba2_scan_buckets(row)) {
    for (int32_t s : bucket) {
      const int32_t par = row.parent(s);
      if (par < 0) S.assign(static_cast<size_t>(state), T(0));
      else S = saved.final_state[static_cast<size_t>(par)];
      for (int h = 0; h < p.heads; ++h) mamba2_chunked_forward(p, h, row.start(s), row.end(s), S.data() + h * ssz, y);
      if (!row.is_leaf(s)) saved.final_state[static_cast<size_t>(s)] = S;
    }
  }
  return saved;
}

template <class T>
void mamba2_tree_backward(const Row& row, const Mamba2Params<T>& p, const Mamba2TreeSaved<T>& saved, const T* dy,
                          const Mamba2Grads<T>& grads) {
  check_tree(row, p);
  require(saved.final_state.size() == static_cast<size_t>(row.num_segments()),
          "mamba2 tree backward: saved states are for another row");
  const int64_t ssz = p.state_size(), state = p.heads * ssz;
  const std::vector<T> zero(static_cast<size_t>(state), T(0));
  // grad_final[s]: dL/d(final state of s), summed over its children.
  std::vector<std::vector<T>> grad_final(static_cast<size_t>(row.num_segments()));
  const auto buckets = mamba2_scan_buckets(row);
  std::vector<T> g;
  for (auto b = buckets.rbegin(); b != buckets.rend(); ++b) {
    for (int32_t s : *b) {
      const int32_t par = row.parent(s);
      if (grad_final[static_cast<size_t>(s)].empty()) g = zero;
      else g.swap(grad_final[static_cast<size_t>(s)]);
      grad_final[static_cast<size_t>(s)] = {};
      const T* s_in = par < 0 ? zero.data() : saved.final_state[static_cast<size_t>(par)].data();
      for (int h = 0; h < p.heads; ++h)
        mamba2_chunked_backward(p, h, row.start(s), row.end(s), s_in + h * ssz, dy, g.data() + h * ssz, grads);
      if (par < 0) continue;
      std::vector<T>& acc = grad_final[static_cast<size_t>(par)];
      if (acc.empty()) acc.assign(static_cast<size_t>(state), T(0));
      for (int64_t i = 0; i < state; ++i) acc[i] += g[i];
    }
  }
}

#define TREECP_MAMBA2_TREE_INSTANTIATE(T)                                                                 \
  template Mamba2TreeSaved<T> mamba2_tree_forward<T>(const Row&, const Mamba2Params<T>&, T*);           \
  template void mamba2_tree_backward<T>(const Row&, const Mamba2Params<T>&, const Mamba2TreeSaved<T>&, \
                                        const T*, const Mamba2Grads<T>&);

TREECP_MAMBA2_TREE_INSTANTIATE(float)
TREECP_MAMBA2_TREE_INSTANTIATE(double)

}  // namespace treecp
