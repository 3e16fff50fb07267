// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// GDN / KDA context parallelism over a packed prefix-tree row: executes a GdnPlan (plan/gdn_plan.hpp) on
// one rank, generic over a Backend (runtime/backend.hpp: gdn_forward / gdn_backward / gdn_summary) and a
// Communicator, like dense attention. The protocol is the affine-state one of runtime/affine_cp.hpp with
// the state S a dk x dv matrix per head: parent states travel to the segments that start from them,
// chained segments run an exclusive prefix scan of their runs' summaries (M, E) along the chain in
// ceil(log2 runs) rounds (the pieces may visit the ranks in any order: zigzag layouts), and the
// backward mirrors both.
//
// Every rank holds the tokens of gdn_rank_ranges(row, plan, rank) (gdn_ownership), laid out in that
// order, and every rank constructs the same GdnCP from the same row and plan.
#pragma once

#include "comm/communicator.hpp"
#include "core/error.hpp"
#include "kernels/shapes.hpp"
#include "plan/gdn_plan.hpp"
#include "runtime/affine_cp.hpp"
#include "runtime/backend.hpp"
#include "tree/row.hpp"

namespace treecp {

template <class Backend>
class GdnCP {
 public:
  using Act = typename Backend::Act;
  using Grad = typename Backend::Grad;
  using Buffer = Act;

  // Checks the shape, and the plan against the row and the communicator, on every rank, and agrees on
  // the verdict before any data moves.
  GdnCP(const GdnPlan& plan, const Row& row, const GdnShape& shape, Communicator& comm, Backend& backend)
      : shape_(shape), be_(backend), cp_(plan, row, shape.affine(), comm, backend, "gdn", [&] { shape.validate(); }) {}

  int64_t owned_rows() const { return cp_.owned_rows(); }
  const RowMap& owned() const { return cp_.owned(); }

  // q, k [owned, H, dk], v [owned, H, dv], g [owned, H] (GDN) or [owned, H, dk] (KDA), beta [owned, H]
  // -> y [owned, H, dv]. The inputs must outlive backward().
  void forward(const Act& q, const Act& k, const Act& v, const Act& g, const Act& beta, Act& y) {
    in_ = GdnInputs<Act>{&q, &k, &v, &g, &beta};
    cp_.forward(Rec{shape_, in_, tokens(beta)}, y);
  }

  // dy [owned, H, dv] -> dq, dk, dv, dg, dbeta over the owned rows (overwritten).
  void backward(const Act& dy, Grad& dq, Grad& dk, Grad& dv, Grad& dg, Grad& dbeta) {
    require(in_.q != nullptr, "gdn: backward() called before forward()");
    for (Grad* b : {&dq, &dk, &dv, &dg, &dbeta}) be_.zero(*b);
    cp_.backward(Rec{shape_, in_, tokens(*in_.beta)}, dy, GdnGradients<Grad>{&dq, &dk, &dv, &dg, &dbeta});
  }

 private:
  // The Backend's GDN/KDA operations as the affine protocol's recurrence.
  struct Rec {
    using Grads = GdnGradients<Grad>;
    static constexpr const char* name = "gdn";
    const GdnShape& shape;
    const GdnInputs<Act>& in;
    int64_t rows;

    int64_t tokens() const { return rows; }
    void forward(Backend& be, int64_t row, int64_t n, Grad& state, Act& y) const {
      be.gdn_forward(shape, in, row, n, state, y);
    }
    void summary(Backend& be, int64_t row, int64_t n, Grad& maps, int64_t item) const {
      be.gdn_summary(shape, in, row, n, maps, item);
    }
    void backward(Backend& be, int64_t row, int64_t n, const Grad& state_in, const Act& dy, Grad& dstate,
                  const Grads& grads) const {
      be.gdn_backward(shape, in, row, n, state_in, dy, dstate, grads);
    }
  };

  int64_t tokens(const Act& beta) const { return shape_.heads > 0 ? be_.size(beta) / shape_.heads : 0; }

  GdnShape shape_;
  Backend& be_;
  AffineCP<Backend> cp_;
  GdnInputs<Act> in_;
};

}  // namespace treecp
