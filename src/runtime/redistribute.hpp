// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// Moving a packed row between ownerships (plan/ownership.hpp): from the data loader's contiguous
// shards to a plan's ownership, from one layer kind's ownership to the next's, and gathering a
// distributed array onto one rank. One all-to-all each; both sides enumerate the intersections of
// (source ranges of the sender) x (destination ranges of the receiver) in canonical order, so no index
// lists travel.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.hpp"
#include "runtime/backend.hpp"
#include "runtime/row_map.hpp"

namespace treecp {

namespace detail {

// The move of redistribute() for buffers of any kind the backend copies rows of: `alloc(n)` makes one of n
// elements, which travel as `type`.
template <class Backend, class Buf, class Alloc>
Buf redistribute_as(Communicator& comm, Backend& be, const Buf& src, const Ownership& from, const Ownership& to,
                    int64_t width, CommType type, Alloc alloc) {
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
  Buf send = alloc(send_rows * width), recv = alloc(recv_rows * width);
  be.copy_rows(src, pack, width, send);
  comm.all_to_all_v(be.data(send), sc, sd, be.data(recv), rc, rd, type);
  Buf dst = alloc(dst_map.rows() * width);
  be.copy_rows(recv, unpack, width, dst);
  return dst;
}

}  // namespace detail

// Moves rows of `width` elements from `src` (laid out by from[me]) into a buffer laid out by to[me]
// (allocated here). Every rank calls it with the same ownerships.
template <class Backend>
typename Backend::Buffer redistribute(Communicator& comm, Backend& be, const typename Backend::Buffer& src,
                                      const Ownership& from, const Ownership& to, int64_t width) {
  return detail::redistribute_as(comm, be, src, from, to, width, Backend::comm_type,
                                 [&](int64_t n) { return be.alloc(n); });
}

// The same for gradient buffers (fp32 on a GPU backend whose activations are bf16).
template <class Backend>
typename Backend::Grad redistribute_grad(Communicator& comm, Backend& be, const typename Backend::Grad& src,
                                         const Ownership& from, const Ownership& to, int64_t width) {
  return detail::redistribute_as(comm, be, src, from, to, width, Backend::grad_comm_type,
                                 [&](int64_t n) { return be.alloc_grad(n); });
}

// Every rank's part (laid out by from[rank]) in token order on `root`, an empty buffer elsewhere.
template <class Backend>
typename Backend::Buffer gather_to_root(Communicator& comm, Backend& be, const typename Backend::Buffer& src,
                                        const Ownership& from, int64_t width, int root = 0) {
  int64_t tokens = 0;
  for (const auto& ranges : from) tokens += tokens_of(ranges);
  return redistribute(comm, be, src, from, gathered_ownership(tokens, comm.size(), root), width);
}

}  // namespace treecp
