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
//   void attention_forward(const AttentionDims&, const Buffer& q, int64_t q_rows, const Buffer& k,
//                          const Buffer& v, int64_t kv_rows, const std::vector<Slice>& slices,
//                          Buffer& o, Buffer& lse);   // complete (o, lse) of this stage; slices in buffer coords
//   void merge(Buffer& o_acc, Buffer& lse_acc, const Buffer& o, const Buffer& lse, int64_t rows, int hq, int dv);
//   void sink_forward(const Buffer& o, const Buffer& lse, const Buffer& sink, int64_t rows, int hq, int dv, Buffer& y);
//   void sink_backward(const Buffer& dy, const Buffer& o, const Buffer& lse, const Buffer* sink, int64_t rows,
//                      int hq, int dv, Buffer& d_o, Buffer& dlse, Buffer* dsink);  // dsink +=
//   void attention_backward(const AttentionDims&, const Buffer& q, int64_t q_rows, const Buffer& k,
//                           const Buffer& v, int64_t kv_rows, const Buffer& o, const Buffer& lse,
//                           const Buffer& d_o, const Buffer& dlse, const std::vector<Slice>& slices,
//                           Buffer& dq, Buffer& dk, Buffer& dv);  // accumulate (+=)
//
// Sparse MLA (runtime/sparse_mla_cp.hpp) adds canonical ids and list rows in index buffers:
//   using IndexBuffer = ...;               int64 elements, travelling as CommType::I64
//   IndexBuffer index_from_host(std::vector<int64_t>);  std::vector<int64_t> index_to_host(const IndexBuffer&);
//   int64_t* index_data(IndexBuffer&); const int64_t* index_data(const IndexBuffer&);
//   void indexer_topk(const SparseMlaDims&, const Buffer& qi, const Buffer& w, int64_t q_rows, const Buffer& ki,
//                     const IndexBuffer& key_ids, int64_t k_rows, const std::vector<Slice>& slices,
//                     Buffer& score, IndexBuffer& ids);   // this stage's top-k lists [q_rows, topk]
//   void topk_merge(Buffer& score, IndexBuffer& ids, const Buffer& part_score, const IndexBuffer& part_ids,
//                   int64_t rows, int64_t topk);
//   void sparse_forward(const SparseMlaDims&, const Buffer& q, int64_t q_rows, const Buffer& kv, int64_t kv_rows,
//                       const IndexBuffer& rows, Buffer& o, Buffer& lse);
//   void sparse_backward(const SparseMlaDims&, const Buffer& q, int64_t q_rows, const Buffer& kv, int64_t kv_rows,
//                        const IndexBuffer& rows, const Buffer& o, const Buffer& lse, const Buffer& d_o,
//                        Buffer& dq, Buffer& dkv);   // accumulate (+=)
#pragma once

#include <cmath>
#include <cstdint>

namespace treecp {

struct AttentionDims {
  int hq = 1, hkv = 1, d = 1, dv = 1;
  double scale = 0.0;  // <= 0: 1/sqrt(d)
  double softmax_scale() const { return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(d)); }
};

// Sparse MLA with a learned indexer (absorbed MLA, one shared latent KV head): indexer heads hi of di,
// attention heads h over kv rows of dqk (latent then rope), the value being the first dv columns.
struct SparseMlaDims {
  int hi = 1, di = 1, h = 1, dqk = 1, dv = 1;
  int64_t topk = 1;
  double scale = 0.0;  // <= 0: 1/sqrt(dqk)
  double softmax_scale() const { return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(dqk)); }
};

// Copy `rows` rows of `width` elements from src row `src_row` to dst row `dst_row`.
struct RowCopy {
  int64_t src_row = 0, dst_row = 0, rows = 0;
};

}  // namespace treecp
