// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// The (Dqk, Dv) pairs the CUDA attention kernels are instantiated for. Plain C++ (no CUDA headers), so that the
// kernels, the CUDA backend, the CLI and the Python binding check one table, in builds without CUDA too (a
// CPU-only extension still tells its caller what a GPU build takes).
#pragma once

#include <cstdint>
#include <string>

namespace treecp::cuda {

// (64, 64), (128, 128), MLA's dense form (192, 128) and (256, 256). Which main loop exists at each is in
// attention.hpp's Mainloop comment and docs/kernels.md ("Head dims").
struct AttentionDims {
  int32_t qk, v;
};
inline constexpr AttentionDims kAttentionDims[] = {{64, 64}, {128, 128}, {192, 128}, {256, 256}};

inline constexpr bool attention_dims_supported(int32_t qk, int32_t v) {
  for (const AttentionDims& d : kAttentionDims)
    if (d.qk == qk && d.v == v) return true;
  return false;
}

// "(64, 64), (128, 128), (192, 128), (256, 256)": for refusals, written from kAttentionDims.
inline std::string attention_dims_list() {
  std::string out;
  for (const AttentionDims& d : kAttentionDims)
    out += (out.empty() ? "(" : ", (") + std::to_string(d.qk) + ", " + std::to_string(d.v) + ")";
  return out;
}

}  // namespace treecp::cuda
