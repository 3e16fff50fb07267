// What the runtime's protocol code needs from a Backend (CPU now, CUDA later). The protocol never
// touches tensor elements itself: it moves rows between buffers and calls these kernels, so the same
// protocol runs on host buffers over MPI and on device buffers over NCCL.
//
//   using Real = ...;                      element type of activations (float, double; bf16 on GPU)
//   using Buffer = ...;                    owns `size` elements, movable
//   static constexpr CommType comm_type;   how Real travels through the Communicator
//   Buffer alloc(int64_t n);               zero-filled
//   Real* data(Buffer&); const Real* data(const Buffer&);
//   void zero(Buffer&);
//   void copy_rows(const Buffer& src, const std::vector<RowCopy>&, int64_t width, Buffer& dst);
//   void add_rows(const Buffer& src, const std::vector<RowCopy>&, int64_t width, Buffer& dst);
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
#pragma once

#include <cstdint>

#include "kernels/shapes.hpp"

namespace treecp {

// The attention layer's shape is kernels/shapes.hpp's AttentionShape; this name is kept for code
// written against it before the shapes became one type.
using AttentionDims [[deprecated("use AttentionShape (kernels/shapes.hpp)")]] = AttentionShape;

// Copy `rows` rows of `width` elements from src row `src_row` to dst row `dst_row`.
struct RowCopy {
  int64_t src_row = 0, dst_row = 0, rows = 0;
};

}  // namespace treecp
