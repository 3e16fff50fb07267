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
  using Act = typename Backend::Act;
  using Grad = typename Backend::Grad;
  using Buffer = Act;

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

  ConvCP(const ConvCP&) = delete;
  ConvCP& operator=(const ConvCP&) = delete;
  ~ConvCP() { be_.release(x_); }

  int64_t owned_rows() const { return halo_.owned_rows; }

  // x [owned, C], weight [C, K], bias [C] or null -> y [owned, C]. weight and bias must outlive backward().
  void forward(const Act& x, const Act& weight, const Act* bias, Act& y) {
    const int64_t C = shape_.channels, rows = halo_.owned_rows + static_cast<int64_t>(halo_.halo_tokens.size());
    weight_ = &weight;
    bias_ = bias;
    be_.release(x_);
    x_ = be_.alloc_act(rows * C);
    be_.copy_rows(x, {{0, 0, halo_.owned_rows}}, C, x_);
    // The halo: owned rows other ranks need go out, the rows this rank needs come in, in token order.
    const Routes r = routes(halo_.send_rows, halo_.recv_rows);
    Act send = be_.alloc_act(r.sent * C), recv = be_.alloc_act(r.received * C);
    be_.copy_rows(x_, r.pack, C, send);
    comm_.all_to_all_v(be_.data(send), r.sc, r.sd, be_.data(recv), r.rc, r.rd, Backend::act_comm_type);
    be_.copy_rows(recv, r.unpack, C, x_);
    be_.release(send);
    be_.release(recv);
    be_.conv1d_forward(shape_, x_, halo_.prev, halo_.owned_rows, weight, bias, y);
  }

  // dy [owned, C] -> dx [owned, C] (overwritten, with the halo gradients other ranks return), dweight
  // [C, K] and dbias [C] (overwritten; the full gradient, summed over the ranks, on every rank: the
  // weights are replicated).
  void backward(const Grad& dy, Grad& dx, Grad& dweight, Grad* dbias) {
    require(weight_ != nullptr, "conv1d: backward() called before forward()");
    const int64_t C = shape_.channels;
    Grad dx_all = be_.alloc_grad(be_.size(x_));
    be_.zero(dx_all);
    be_.zero(dweight);
    if (dbias) be_.zero(*dbias);
    be_.conv1d_backward(shape_, x_, halo_.prev, halo_.owned_rows, *weight_, bias_, dy, dx_all, dweight, dbias);
    // The halo rows' gradients go back along the forward's routes (the mirror exchange) and are added.
    const Routes r = routes(halo_.recv_rows, halo_.send_rows);
    Grad send = be_.alloc_grad(r.sent * C), recv = be_.alloc_grad(r.received * C);
    be_.copy_rows(dx_all, r.pack, C, send);
    comm_.all_to_all_v(be_.data(send), r.sc, r.sd, be_.data(recv), r.rc, r.rd, Backend::grad_comm_type);
    be_.add_rows(recv, C, 0, C, be_.upload(r.unpack), dx_all);
    be_.copy_rows(dx_all, {{0, 0, halo_.owned_rows}}, C, dx);
    be_.release(send);
    be_.release(recv);
    be_.release(dx_all);
    comm_.all_reduce_sum(be_.data(dweight), be_.size(dweight), Backend::grad_comm_type);
    if (dbias) comm_.all_reduce_sum(be_.data(*dbias), be_.size(*dbias), Backend::grad_comm_type);
  }

 private:
  // One all-to-all of C-wide rows: rows send_rows[p] of the source go to peer p (packed in that order),
  // the rows from peer p land in rows recv_rows[p] of the destination.
  struct Routes {
    std::vector<int64_t> sc, sd, rc, rd;  // element counts and offsets per peer
    std::vector<RowCopy> pack, unpack;
    int64_t sent = 0, received = 0;       // rows
  };
  Routes routes(const std::vector<std::vector<int64_t>>& send_rows, const std::vector<std::vector<int64_t>>& recv_rows) const {
    const int n = comm_.size();
    const int64_t C = shape_.channels;
    Routes r;
    r.sc.assign(static_cast<size_t>(n), 0);
    r.sd = r.rc = r.rd = r.sc;
    for (int p = 0; p < n; ++p) {
      r.sd[static_cast<size_t>(p)] = r.sent * C;
      for (int64_t row : send_rows[static_cast<size_t>(p)]) r.pack.push_back({row, r.sent++, 1});
      r.sc[static_cast<size_t>(p)] = r.sent * C - r.sd[static_cast<size_t>(p)];
      r.rd[static_cast<size_t>(p)] = r.received * C;
      for (int64_t row : recv_rows[static_cast<size_t>(p)]) r.unpack.push_back({r.received++, row, 1});
      r.rc[static_cast<size_t>(p)] = r.received * C - r.rd[static_cast<size_t>(p)];
    }
    return r;
  }

  ConvShape shape_;
  Communicator& comm_;
  Backend& be_;
  ConvHalo halo_;
  const Act* weight_ = nullptr;
  const Act* bias_ = nullptr;
  Act x_;  // the owned rows, then the halo rows (kept for the backward)
};

}  // namespace treecp
