// runtime/: executes plans on one rank, one class per layer kind, generic over a Backend and a
// Communicator; moves activations between ownerships; the one-process references.
//
// What the runtime's protocol code needs from a Backend (cpu_backend.hpp: host vectors; cuda_backend.hpp:
// device memory). The protocol never touches tensor elements itself: it moves rows between buffers and calls
// these operations, so the same protocol runs on host buffers over MPI and on device buffers over NCCL.
// Layer shapes are kernels/shapes.hpp's.
//
// Ordering. A backend executes its operations in the order they are called: on the CPU at once, on a GPU
// enqueued on one compute stream and never waited for by the host. A Communicator's started exchange is
// ordered after the work enqueued before it started and, once wait() has returned, before the work
// enqueued after (on a GPU: events between the compute and communication streams). Hence the one lifetime
// rule the protocol keeps: a buffer an exchange reads or writes is released only after that exchange's
// wait(); every other buffer may be released as soon as its last reader has been called, because later
// work (and any exchange started later) is ordered after that reader.
//
// Buffer kinds (all movable, owning; a default-constructed one is empty):
//   Act   activations: Q, K, V, O, dO, outputs              (CPU: T; GPU: bf16 or fp16)
//   Stat  per-(row, head) statistics: LSE, the sink, dLSE / Dsum  (CPU: T; GPU: fp32)
//   Grad  gradient accumulators: dQ, dK, dV                 (CPU: T; GPU: fp32)
//   Buffer = Act, with alloc / copy_rows / data / comm_type, what runtime/redistribute.hpp needs.
//
//   static constexpr CommType act_comm_type, grad_comm_type;   how Act and Grad travel
//   Act alloc_act(n); Stat alloc_stat(n); Grad alloc_grad(n);  contents unspecified
//   void release(X&) for each kind: gives the memory back (to a pool on the GPU); counted by the meter
//   Elem* data(Act&) (Elem = the activation element), float-or-T* data(Stat& / Grad&), and const forms
//   void zero(Grad&);  int64_t size(const X&) (elements) for each kind
//   void copy_rows(const X& src, const std::vector<RowCopy>&, int64_t width, X& dst)   for Act and Grad
//   int64_t live_bytes(), peak_bytes(); void reset_peak();  what the backend holds now and at most
//   HostGeometry prepare_geometry(slices, q_rows, kv_rows, dims)   host only, thread-safe, static
//   Geometry upload(const HostGeometry&)      what the kernels read (a device tile plan on the GPU)
//   CopyList upload(const std::vector<RowCopy>&)
//   void pack_rows(const Act& src, int64_t src_width, const CopyList&, Act& dst, int64_t dst_width, int64_t dst_col)
//        dst[c.dst_row + i][dst_col, dst_col + src_width) = src[c.src_row + i][0, src_width)
//   void add_rows(const Grad& src, int64_t src_width, int64_t src_col, int64_t cols, const CopyList&, Grad& dst)
//        dst[c.dst_row + i][0, cols) += src[c.src_row + i][src_col, src_col + cols)
//   void attention_forward(dims, const Geometry&, const Act& q, KvView<Elem>, Act& o, Stat& lse)
//        complete (o, lse) of this stage over its keys; every q row written (no key: O = 0, LSE = -inf)
//   void merge_sink_forward(dims, rows, parts of (const Act* o, const Stat* lse), const Stat* sink,
//                           Act& y, Act* o_merged, Stat& lse)      one fused LSE merge (+ sink)
//   const Act& merge_sink_backward(dims, rows, const Act& o, const Stat& lse, const Stat* sink, const Act& dy,
//                                  Act& d_o, Stat& dstat, Stat* dsink)
//        returns the buffer holding dO of the pre-sink output: d_o (allocated by the caller) with a sink, dy
//        itself without one (d_o may then be empty); dsink +=; dstat is the backend's softmax-gradient
//        statistic (CPU: dJ/dLSE; GPU: Dsum = dot(dO, O) - dJ/dLSE)
//   void attention_backward(dims, const Geometry&, const Act& q, KvView<Elem>, const Act& o, const Stat& lse,
//                           const Act& d_o, const Stat& dstat, Grad& dq, DkvView<G>)   all accumulate (+=)
//   Mark mark(); double elapsed_ms(const Mark& a, const Mark& b);  timing that stays in stream order
//        (elapsed_ms may wait for b to complete: call it after forward/backward, never inside)
//
// Sparse MLA (runtime/sparse_mla_cp.hpp) adds index buffers (canonical ids, list rows; int64, travelling as
// CommType::I64) and its kernels; indexer scores are Stat, q/kv/qi/ki/w/o Act, dq/dkv Grad:
//   IndexBuffer index_from_host(std::vector<int64_t>); std::vector<int64_t> index_to_host(const IndexBuffer&)
//   int64_t* index_data(IndexBuffer&), const form
//   void indexer_topk(const SparseMlaDims&, const Act& qi, const Act& w, int64_t q_rows, const Act& ki,
//                     const IndexBuffer& key_ids, int64_t k_rows, const std::vector<Slice>& slices, Stat& score,
//                     IndexBuffer& ids)      this stage's top-k lists [q_rows, topk], best first
//   void topk_merge(Stat& score, IndexBuffer& ids, const Stat& part_score, const IndexBuffer& part_ids,
//                   int64_t rows, int64_t topk)
//   void sparse_forward(const SparseMlaDims&, const Act& q, int64_t q_rows, const Act& kv, int64_t kv_rows,
//                       const IndexBuffer& rows, Act& o, Stat& lse)
//   void sparse_backward(const SparseMlaDims&, const Act& q, int64_t q_rows, const Act& kv, int64_t kv_rows,
//                        const IndexBuffer& rows, const Act& o, const Stat& lse, const Act& d_o, Grad& dq,
//                        Grad& dkv)          accumulate (+=)
//
// Affine-state recurrences (runtime/affine_cp.hpp: GDN/KDA, Mamba-2's summaries). A state holds every
// head's rows x cols block; item i of a maps buffer holds every head's summary (M [rows][rows], then
// E [rows][cols]: S_out = M S_in + E), AffineShape::map_elements() each. States and maps are Grad
// buffers (fp32 on a GPU) and travel as grad_comm_type:
//   void affine_identity(const AffineShape&, Grad& maps, int64_t item)
//   void affine_compose(const AffineShape&, int64_t items, Grad& later, const Grad& earlier)   later = later ∘ earlier
//   void affine_seed(const AffineShape&, Grad& maps, int64_t item, const Grad* state)   (M, E) -> (0, M s + E)
//   void affine_adjoint(const AffineShape&, const Grad& map, const Grad& a, const Grad* g, Grad& maps, int64_t item)
//        a run's gradient map: (Mᵀ, a), or with dL/dS_out g: (0, Mᵀ g + a)
//   void affine_state(const AffineShape&, const Grad& maps, int64_t item, Grad& state)   state = E
// GDN / KDA (runtime/gdn_cp.hpp; kernels/cpu/gdn.hpp), every head of the run of buffer rows [row, row + rows):
//   void gdn_forward(const GdnShape&, const GdnInputs<Act>& in, int64_t row, int64_t rows, Grad& state, Act& y)
//   void gdn_backward(const GdnShape&, const GdnInputs<Act>& in, int64_t row, int64_t rows, const Grad& state_in,
//                     const Act& dy, Grad& dstate, const GdnGradients<Grad>& grads)   dstate: out in, in out; grads +=
//   void gdn_summary(const GdnShape&, const GdnInputs<Act>& in, int64_t row, int64_t rows, Grad& maps, int64_t item)
//   void l2norm_forward(const Act& x, int64_t groups, int dim, Act& y)      the layer's q/k normalisation
//   void l2norm_backward(const Act& x, const Grad& dy, int64_t groups, int dim, Grad& dx)   dx +=
// The short convolution over rows linked by their logical predecessor (runtime/conv_cp.hpp;
// kernels/cpu/conv1d.hpp): x holds the outputs' rows then halo rows, prev[r] is r's predecessor row:
//   void conv1d_forward(const ConvShape&, const Act& x, const std::vector<int64_t>& prev, int64_t out_rows,
//                       const Act& weight, const Act* bias, Act& y)
//   void conv1d_backward(const ConvShape&, const Act& x, const std::vector<int64_t>& prev, int64_t out_rows,
//                        const Act& weight, const Act* bias, const Grad& dy, Grad& dx, Grad& dweight,
//                        Grad* dbias)     accumulate (+=), halo rows of dx included
// (The CPU backend implements all of these; the CUDA backend does attention so far.)
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "kernels/shapes.hpp"

namespace treecp {

// Sparse MLA with a learned indexer (absorbed MLA, one shared latent KV head): indexer heads hi of di,
// attention heads h over kv rows of dqk (latent then rope), the value being the first dv columns.
struct SparseMlaDims {
  int hi = 1, di = 1, h = 1, dqk = 1, dv = 1;
  int64_t topk = 1;
  double scale = 0.0;  // <= 0: 1/sqrt(dqk)
  double softmax_scale() const { return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(dqk)); }
};

// Copy `rows` rows from src row `src_row` to dst row `dst_row`.
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

// The tokens a rank's GDN inputs hold (beta's rows), after checking that every array holds that many rows of
// its width; size_of(buffer) counts a buffer's elements. Shared by the backends' GDN operations.
template <class Buffer, class SizeOf>
int64_t gdn_input_tokens(const GdnShape& sh, const GdnInputs<Buffer>& in, SizeOf size_of) {
  require(in.q && in.k && in.v && in.g && in.beta, "gdn: q, k, v, g and beta must be given");
  const int64_t tokens = sh.heads > 0 ? static_cast<int64_t>(size_of(*in.beta)) / sh.heads : 0;
  const std::pair<const Buffer*, int64_t> arrays[] = {{in.beta, sh.heads}, {in.q, sh.qk_width()}, {in.k, sh.qk_width()},
                                                      {in.v, sh.v_width()}, {in.g, sh.g_width()}};
  const char* names[] = {"beta", "q", "k", "v", "g"};
  for (size_t i = 0; i < 5; ++i)
    require(static_cast<int64_t>(size_of(*arrays[i].first)) == tokens * arrays[i].second, "gdn: ", names[i], " holds ",
            size_of(*arrays[i].first), " elements, expected ", tokens, " tokens x ", arrays[i].second);
  return tokens;
}

// K and V rows of one stage: element (r, h, i) of K at k + r * k_row_stride + h * d + i (V likewise, dv).
// A received wave holds K and V side by side in one buffer (one exchange per wave and direction), so its
// K and V share the row stride Hkv * (d + dv).
template <class E>
struct KvView {
  const E* k = nullptr;
  const E* v = nullptr;
  int64_t k_row_stride = 0, v_row_stride = 0;
  int64_t rows = 0;
};

// The dK and dV accumulators of one stage, laid out like its KvView.
template <class G>
struct DkvView {
  G* dk = nullptr;
  G* dv = nullptr;
  int64_t dk_row_stride = 0, dv_row_stride = 0;
};

}  // namespace treecp
