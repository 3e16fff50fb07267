// Moving a packed row between layouts: from the data loader's contiguous shards to a plan's
// ownership and back, and gathering a distributed array onto one rank. One all-to-all each; both
// sides enumerate the intersections of (source ranges of the sender) x (destination ranges of the
// receiver) in canonical order, so no index lists travel.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.hpp"
#include "runtime/backend.hpp"
#include "runtime/row_map.hpp"

namespace treecp {

// layout[r] = the sorted canonical ranges rank r holds. Moves rows of `width` elements from `src`
// (laid out by from[me]) into `dst` (laid out by to[me]; allocated here).
template <class Backend>
typename Backend::Buffer redistribute(Communicator& comm, Backend& be, const typename Backend::Buffer& src,
                                      const std::vector<std::vector<TokenRange>>& from,
                                      const std::vector<std::vector<TokenRange>>& to, int64_t width) {
  const int n = comm.size(), me = comm.rank();
  const RowMap src_map(from[static_cast<size_t>(me)]), dst_map(to[static_cast<size_t>(me)]);
  std::vector<RowCopy> pack, unpack;
  std::vector<int64_t> sc(static_cast<size_t>(n)), sd(static_cast<size_t>(n)), rc(static_cast<size_t>(n)),
      rd(static_cast<size_t>(n));
  int64_t send_rows = 0, recv_rows = 0;
  for (int p = 0; p < n; ++p) {
    sd[static_cast<size_t>(p)] = send_rows * width;
    for (const TokenRange& r : intersect(from[static_cast<size_t>(me)], to[static_cast<size_t>(p)])) {
      pack.push_back({src_map.row_of_range(r.begin, r.end), send_rows, r.size()});
      send_rows += r.size();
    }
    sc[static_cast<size_t>(p)] = send_rows * width - sd[static_cast<size_t>(p)];
    rd[static_cast<size_t>(p)] = recv_rows * width;
    for (const TokenRange& r : intersect(from[static_cast<size_t>(p)], to[static_cast<size_t>(me)])) {
      unpack.push_back({recv_rows, dst_map.row_of_range(r.begin, r.end), r.size()});
      recv_rows += r.size();
    }
    rc[static_cast<size_t>(p)] = recv_rows * width - rd[static_cast<size_t>(p)];
  }
  typename Backend::Buffer send = be.alloc(send_rows * width), recv = be.alloc(recv_rows * width);
  be.copy_rows(src, pack, width, send);
  comm.all_to_all_v(be.data(send), sc, sd, be.data(recv), rc, rd, Backend::comm_type);
  typename Backend::Buffer dst = be.alloc(dst_map.rows() * width);
  be.copy_rows(recv, unpack, width, dst);
  return dst;
}

// The data loader's layout: rank r holds one contiguous shard.
inline std::vector<std::vector<TokenRange>> contiguous_layout(int64_t tokens, int ranks) {
  std::vector<std::vector<TokenRange>> out(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    const TokenRange t = contiguous_shard(tokens, r, ranks);
    if (t.size() > 0) out[static_cast<size_t>(r)].push_back(t);
  }
  return out;
}

// Everything on `root`: rank root's layout is the whole row, the others hold nothing.
inline std::vector<std::vector<TokenRange>> gathered_layout(int64_t tokens, int ranks, int root) {
  std::vector<std::vector<TokenRange>> out(static_cast<size_t>(ranks));
  out[static_cast<size_t>(root)].push_back({0, tokens});
  return out;
}

}  // namespace treecp
