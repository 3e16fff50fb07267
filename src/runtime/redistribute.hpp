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

// Whether every token `to` gives a rank is one `from` gave the same rank: then no row changes rank, and every rank
// (all deciding alike from the same ownerships) skips the all-to-all.
inline bool stays_on_its_rank(const Ownership& from, const Ownership& to) {
  for (size_t p = 0; p < from.size(); ++p)
    for (size_t q = 0; q < to.size(); ++q)
      if (p != q && !intersect(from[p], to[q]).empty()) return false;
  return true;
}

// The move of redistribute() for buffers of any kind the backend copies rows of: `alloc(n)` makes one of n
// elements, which travel as `type`; the rows land in *into where given (of exactly the destination's size), else in a
// buffer allocated here, which is returned (an empty one with `into`).
template <class Backend, class Buf, class Alloc>
Buf redistribute_as(Communicator& comm, Backend& be, const Buf& src, const Ownership& from, const Ownership& to,
                    int64_t width, CommType type, Alloc alloc, Buf* into = nullptr) {
  const int n = comm.size(), me = comm.rank();
  const RowMap src_map(from[static_cast<size_t>(me)]), dst_map(to[static_cast<size_t>(me)]);
  require(!into || be.size(*into) == dst_map.rows() * width, "redistribute: the destination holds ",
          into ? be.size(*into) : 0, " elements, the move lands ", dst_map.rows() * width);
  Buf made;
  auto destination = [&]() -> Buf& {
    if (!into) made = alloc(dst_map.rows() * width);
    return into ? *into : made;
  };
  if (stays_on_its_rank(from, to)) {  // one copy of the rows into their new order, not three and a collective
    std::vector<RowCopy> rows;
    for (const TokenRange& r : intersect(from[static_cast<size_t>(me)], to[static_cast<size_t>(me)]))
      rows.push_back({src_map.row_of_range(r.begin, r.end), dst_map.row_of_range(r.begin, r.end), r.size()});
    be.copy_rows(src, rows, width, destination());
    return made;
  }
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
  be.copy_rows(recv, unpack, width, destination());
  return made;
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

// Both moves into a buffer the caller holds (a view of a framework's tensor, say) of exactly to[me]'s rows: no
// buffer in between and no copy out of it.
template <class Backend>
void redistribute_into(Communicator& comm, Backend& be, const typename Backend::Buffer& src, const Ownership& from,
                       const Ownership& to, int64_t width, typename Backend::Buffer& dst) {
  detail::redistribute_as(comm, be, src, from, to, width, Backend::comm_type, [&](int64_t n) { return be.alloc(n); },
                          &dst);
}
template <class Backend>
void redistribute_grad_into(Communicator& comm, Backend& be, const typename Backend::Grad& src, const Ownership& from,
                            const Ownership& to, int64_t width, typename Backend::Grad& dst) {
  detail::redistribute_as(comm, be, src, from, to, width, Backend::grad_comm_type,
                          [&](int64_t n) { return be.alloc_grad(n); }, &dst);
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
