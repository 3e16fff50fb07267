// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// Causal depthwise conv1d (the short convolution of GDN/KDA layers) over a packed prefix-tree row
// whose tokens are spread over ranks by any Ownership (plan/ownership.hpp; a rank's buffers hold its
// tokens in that order), generic over a Backend (runtime/backend.hpp) and a Communicator. Each rank
// needs the K-1 inputs preceding each of its tokens along the token's logical path: its HALO. A
// child's halo is its parent's tail (wherever the parent lives), and a very short shard's halo may
// come from several earlier ranks. One all-to-all brings the halo; the backward returns the halo's
// input gradients to their owners, who add them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "plan/ownership.hpp"
#include "runtime/backend.hpp"
#include "tree/row.hpp"

namespace treecp {

// Rank `rank`'s conv geometry: owned rows first, then halo rows (sorted by token id).
struct ConvHalo {
  int64_t owned_rows = 0;
  std::vector<int64_t> halo_tokens;             // physical ids of the halo rows
  std::vector<int64_t> prev;                    // per buffer row: row of the logical predecessor, or -1
  std::vector<std::vector<int64_t>> send_rows;  // per peer: owned rows it needs from this rank
  std::vector<std::vector<int64_t>> recv_rows;  // per peer: halo rows it fills
};
ConvHalo make_conv_halo(const Row& row, const Ownership& layout, int rank, int width);

template <class Backend>
class ConvCP {
 public:
  using Buffer = typename Backend::Buffer;

  // Checks the shape and the ownership against the row and the communicator on every rank, and agrees
  // on the verdict before any data moves.
  ConvCP(const Ownership& layout, const Row& row, const ConvShape& shape, Communicator& comm, Backend& backend)
      : shape_(shape), comm_(comm), be_(backend) {
    std::string problem;
    try {
      shape.validate();
      require(static_cast<int>(layout.size()) == comm.size(), "conv1d: layout is for ", layout.size(),
              " ranks, communicator has ", comm.size());
      validate_ownership(layout, row.tokens());
      halo_ = make_conv_halo(row, layout, comm.rank(), shape.width);
    } catch (const Error& e) {
      problem = e.what();
    }
    if (!comm.all_ok(problem.empty())) fail(problem.empty() ? "conv1d layout refused on another rank" : problem);
  }

  int64_t owned_rows() const { return halo_.owned_rows; }

  // x [owned, C], weight [C, K], bias [C] or null -> y [owned, C]. weight and bias must outlive backward().
  void forward(const Buffer& x, const Buffer& weight, const Buffer* bias, Buffer& y) {
    const int64_t C = shape_.channels, rows = halo_.owned_rows + static_cast<int64_t>(halo_.halo_tokens.size());
    weight_ = &weight;
    bias_ = bias;
    x_ = be_.alloc(rows * C);
    be_.copy_rows(x, {{0, 0, halo_.owned_rows}}, C, x_);
    // The halo: owned rows other ranks need go out, the rows this rank needs come in, in token order.
    exchange(x_, halo_.send_rows, x_, halo_.recv_rows, false);
    be_.conv1d_forward(shape_, x_, halo_.prev, halo_.owned_rows, weight, bias, y);
  }

  // dy [owned, C] -> dx [owned, C] (overwritten, with the halo gradients other ranks return), dweight
  // [C, K] and dbias [C] (overwritten; the full gradient, summed over the ranks, on every rank: the
  // weights are replicated).
  void backward(const Buffer& dy, Buffer& dx, Buffer& dweight, Buffer* dbias) {
    require(weight_ != nullptr, "conv1d: backward() called before forward()");
    const int64_t C = shape_.channels;
    Buffer dx_all = be_.alloc(be_.size(x_));
    be_.zero(dweight);
    if (dbias) be_.zero(*dbias);
    be_.conv1d_backward(shape_, x_, halo_.prev, halo_.owned_rows, *weight_, bias_, dy, dx_all, dweight, dbias);
    // The halo rows' gradients go back along the forward's routes (the mirror exchange) and are added.
    exchange(dx_all, halo_.recv_rows, dx_all, halo_.send_rows, true);
    be_.copy_rows(dx_all, {{0, 0, halo_.owned_rows}}, C, dx);
    comm_.all_reduce_sum(be_.data(dweight), be_.size(dweight), Backend::comm_type);
    if (dbias) comm_.all_reduce_sum(be_.data(*dbias), be_.size(*dbias), Backend::comm_type);
  }

 private:
  // One all-to-all of C-wide rows: rows send_rows[p] of src go to peer p, the rows from peer p land in
  // (or, with add, are added into) rows recv_rows[p] of dst.
  void exchange(const Buffer& src, const std::vector<std::vector<int64_t>>& send_rows, Buffer& dst,
                const std::vector<std::vector<int64_t>>& recv_rows, bool add) {
    const int n = comm_.size();
    const int64_t C = shape_.channels;
    std::vector<int64_t> sc(static_cast<size_t>(n)), sd(sc), rc(sc), rd(sc);
    std::vector<RowCopy> pack, unpack;
    int64_t sent = 0, received = 0;
    for (int p = 0; p < n; ++p) {
      sd[static_cast<size_t>(p)] = sent * C;
      for (int64_t r : send_rows[static_cast<size_t>(p)]) pack.push_back({r, sent++, 1});
      sc[static_cast<size_t>(p)] = sent * C - sd[static_cast<size_t>(p)];
      rd[static_cast<size_t>(p)] = received * C;
      for (int64_t r : recv_rows[static_cast<size_t>(p)]) unpack.push_back({received++, r, 1});
      rc[static_cast<size_t>(p)] = received * C - rd[static_cast<size_t>(p)];
    }
    Buffer send = be_.alloc(sent * C), recv = be_.alloc(received * C);
    be_.copy_rows(src, pack, C, send);
    comm_.all_to_all_v(be_.data(send), sc, sd, be_.data(recv), rc, rd, Backend::comm_type);
    if (add) {
      be_.add_rows(recv, unpack, C, dst);
    } else {
      be_.copy_rows(recv, unpack, C, dst);
    }
  }

  ConvShape shape_;
  Communicator& comm_;
  Backend& be_;
  ConvHalo halo_;
  const Buffer* weight_ = nullptr;
  const Buffer* bias_ = nullptr;
  Buffer x_;  // the owned rows, then the halo rows (kept for the backward)
};

}  // namespace treecp
