// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// What the runtime's protocol code needs from a Backend (CPU now, CUDA later). The protocol never
// touches tensor elements itself: it moves rows between buffers and calls these kernels, so the same
// protocol runs on host buffers over MPI and on device buffers over NCCL. Shapes are kernels/shapes.hpp's.
//
//   using Real = ...;                      element type of activations (float, double; bf16 on GPU)
//   using Buffer = ...;                    owns `size` elements, movable
//   static constexpr CommType comm_type;   how Real travels through the Communicator
//   Buffer alloc(int64_t n);               zero-filled
//   Real* data(Buffer&); const Real* data(const Buffer&); int64_t size(const Buffer&);
//   void zero(Buffer&);
//   void copy_rows(const Buffer& src, const std::vector<RowCopy>&, int64_t width, Buffer& dst);
//   void add_rows(const Buffer& src, const std::vector<RowCopy>&, int64_t width, Buffer& dst);
//
// Dense attention (runtime/dense_attention.hpp; kernels/cpu/attention.hpp's contracts):
//   void attention_forward(const AttentionShape&, const Buffer& q, int64_t q_rows, const Buffer& k,
//                          const Buffer& v, int64_t kv_rows, const std::vector<Slice>& slices,
//                          Buffer& o, Buffer& lse);   // complete (o, lse) of this stage; slices in buffer coords
//   void merge(Buffer& o_acc, Buffer& lse_acc, const Buffer& o, const Buffer& lse, int64_t rows, int hq, int dv);
//   void sink_forward(const Buffer& o, const Buffer& lse, const Buffer& sink, int64_t rows, int hq, int dv, Buffer& y);
//   void sink_backward(const Buffer& dy, const Buffer& o, const Buffer& lse, const Buffer* sink, int64_t rows,
//                      int hq, int dv, Buffer& d_o, Buffer& dlse, Buffer* dsink);  // dsink +=
//   void attention_backward(const AttentionShape&, const Buffer& q, int64_t q_rows, const Buffer& k,
//                           const Buffer& v, int64_t kv_rows, const Buffer& o, const Buffer& lse,
//                           const Buffer& d_o, const Buffer& dlse, const std::vector<Slice>& slices,
//                           Buffer& dq, Buffer& dk, Buffer& dv);  // accumulate (+=)
//
// Gated DeltaNet / KDA (runtime/gdn_cp.hpp; kernels/cpu/gdn.hpp's contracts), every head of the run of
// buffer rows [row, row + rows); `in` is the rank's q, k, v, g, beta. A state holds every head's
// dk x dv matrix; item i of a maps buffer holds every head's summary (M [dk][dk], then E [dk][dv]:
// S_out = M S_in + E), GdnShape::map_elements() each:
//   void gdn_forward(const GdnShape&, const GdnInputs<Buffer>& in, int64_t row, int64_t rows, Buffer& state,
//                    Buffer& y);                       // state: in, then out; y written for the run's rows
//   void gdn_backward(const GdnShape&, const GdnInputs<Buffer>& in, int64_t row, int64_t rows,
//                     const Buffer& state_in, const Buffer& dy, Buffer& dstate,
//                     const GdnGradients<Buffer>& grads);  // dstate: dL/dS_out in, dL/dS_in out; grads +=
//   void gdn_summary(const GdnShape&, const GdnInputs<Buffer>& in, int64_t row, int64_t rows, Buffer& maps,
//                    int64_t item);                    // the run's map; the identity when rows == 0
//   void gdn_compose(const GdnShape&, int64_t items, Buffer& later, const Buffer& earlier);  // later ∘= earlier
//   void gdn_seed(const GdnShape&, Buffer& maps, int64_t item, const Buffer* state);  // -> (0, M s + E)
//   void gdn_adjoint(const GdnShape&, const Buffer& map, const Buffer& a, const Buffer* g, Buffer& maps,
//                    int64_t item);   // a run's gradient map: (Mᵀ, a), or with dL/dS_out g: (0, Mᵀ g + a)
//   void gdn_map_state(const GdnShape&, const Buffer& maps, int64_t item, Buffer& state);  // state = E
//   void l2norm_forward(const Buffer& x, int64_t groups, int dim, Buffer& y);   // per dim-vector, q/k of a layer
//   void l2norm_backward(const Buffer& x, const Buffer& dy, int64_t groups, int dim, Buffer& dx);  // dx +=
//
// Short convolution over rows linked by their logical predecessor (runtime/conv_cp.hpp;
// kernels/cpu/conv1d.hpp): x holds the outputs' rows then halo rows, prev[r] is r's predecessor row.
//   void conv1d_forward(const ConvShape&, const Buffer& x, const std::vector<int64_t>& prev, int64_t out_rows,
//                       const Buffer& weight, const Buffer* bias, Buffer& y);
//   void conv1d_backward(const ConvShape&, const Buffer& x, const std::vector<int64_t>& prev, int64_t out_rows,
//                        const Buffer& weight, const Buffer* bias, const Buffer& dy, Buffer& dx,
//                        Buffer& dweight, Buffer* dbias);  // accumulate (+=), halo rows of dx included
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/shapes.hpp"

namespace treecp {

// The attention layer's shape is kernels/shapes.hpp's AttentionShape; this name is kept for code
// written against it before the shapes became one type.
using AttentionDims [[deprecated("use AttentionShape (kernels/shapes.hpp)")]] = AttentionShape;

// Copy `rows` rows of `width` elements from src row `src_row` to dst row `dst_row`.
struct RowCopy {
  int64_t src_row = 0, dst_row = 0, rows = 0;
};

// A rank's GDN/KDA inputs and gradients as buffers (token-major, its rows in its ownership's order).
template <class Buffer>
struct GdnInputs {
  const Buffer *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr;
};
template <class Buffer>
struct GdnGradients {  // a null member is not computed; all null: the state gradient only
  Buffer *dq = nullptr, *dk = nullptr, *dv = nullptr, *dg = nullptr, *dbeta = nullptr;
};

}  // namespace treecp
