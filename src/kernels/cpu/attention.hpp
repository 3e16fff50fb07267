// kernels/: the local math of every layer kind: its contracts (shapes.hpp, slice.hpp) and their CPU
// (cpu/) and CUDA (cuda/) implementations. Knows no rows, plans or ranks.
//
// Attention algebra on the CPU (ART §02–§04, §06; DESIGN.md "Algebra to keep exact"): slice attention
// forward with LSE, the stable merge of partial (O, LSE) and its backward, the learned sink applied once
// to the composed output, and the staged backward that uses the complete O and LSE. Templated over float
// and double (double is the oracle). The CUDA backend implements the same contracts.
//
// Coordinates. Kernels take slices in BUFFER coordinates: a slice's q rows index the Q/O/LSE buffers,
// its k rows index the K/V buffers, and its band (diag_min <= q - k < diag_max) is in those coordinates.
// A single-process run passes the whole row as both buffers, so buffer rows are canonical token ids
// (runtime/reference.hpp does that for a whole row). A stage (owned query rows against a buffer of
// fetched KV rows) is the same call with other buffers; runtime/row_map.hpp's to_buffer() translates
// canonical-id slices into such a stage's buffer coordinates.
//
// Layouts (elements; the last dimension is contiguous, the others may be strided):
//   Q [q_rows, Hq, D]   K [kv_rows, Hkv, D]   V [kv_rows, Hkv, Dv]   O, dO [q_rows, Hq, Dv]
//   LSE, dLSE [q_rows, Hq] (a HeadView with dim 1)   sink [Hq]
// GQA: query head h reads KV head h / (Hq / Hkv).
// LSE is the natural log of the softmax denominator over the keys of the call. A row with no key has
// LSE = -inf and O = 0; every function here keeps that rule and never produces NaN from it.
//
// Composing stages (what the CP runtime does per query owner):
//   forward:  per stage attention_forward -> (o_r, L_r); merge_forward -> (o, L); sink_forward once -> y.
//   backward: sink_backward(dy) -> dO, dLSE (without a sink: dO = dy, dLSE = 0); then per stage
//             attention_backward with the COMPLETE o, L and that dO, dLSE: dQ adds into the owner's rows,
//             dK/dV into the stage's KV buffer (returned to the key owners and added there).
//   Equivalent: merge_backward gives each stage its own (dO_r, dLSE_r); attention_backward with the
//   stage's own (o_r, L_r) and those adjoints yields the same contributions.
//
// Speed: slices are processed as tiles of (query, head) rows against 64-key blocks with small
// register-tiled GEMMs and a vector exp; on x86-64 an AVX2 + FMA copy is chosen at run time
// (TREECP_CPU_ISA=baseline forces the SSE2 copy). Memory is O(tile), never O(S^2). One thread.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/shapes.hpp"
#include "kernels/slice.hpp"

namespace treecp::cpu {

// Rows of a [rows, heads, dim] tensor: element (r, h, i) lives at data[r*row_stride + h*head_stride + i].
template <class P>
struct HeadView {
  P* data = nullptr;
  int64_t row_stride = 0;
  int64_t head_stride = 0;

  P* at(int64_t r, int64_t h) const { return data + r * row_stride + h * head_stride; }
};

// A C-order [rows, heads, dim] tensor.
template <class P>
HeadView<P> dense_view(P* data, int heads, int dim) {
  return HeadView<P>{data, static_cast<int64_t>(heads) * dim, dim};
}

// Throws unless every slice lies inside [0, q_rows) x [0, kv_rows). Slices of one call must not
// overlap (each visible pair at most once); that is the caller's contract and is not checked here.
void validate_slices(int64_t q_rows, int64_t kv_rows, const std::vector<Slice>& slices);

template <class T>
struct AttnForwardArgs {
  AttentionShape shape;  // heads, head dims, softmax scale (its window is already in the slices)
  int64_t q_rows = 0;    // rows of the Q, O, LSE buffers
  int64_t kv_rows = 0;   // rows of the K, V buffers
  HeadView<const T> q, k, v;
  HeadView<T> o;    // written for every q row: rows that no slice touches get O = 0
  HeadView<T> lse;  // written for every q row: LSE = -inf where no key is visible
};

// O and LSE of the query rows over the union of the slices' pairs (this stage's keys only).
template <class T>
void attention_forward(const AttnForwardArgs<T>& args, const std::vector<Slice>& slices);

template <class T>
struct AttnBackwardArgs {
  AttentionShape shape;
  int64_t q_rows = 0, kv_rows = 0;
  HeadView<const T> q, k, v;
  // The COMPLETE output and LSE of each query (over all its keys, every stage, before any sink):
  // probabilities are exp(s - lse), and D = dot(dO, O) - dLSE couples keys of all stages.
  HeadView<const T> o, lse;
  HeadView<const T> dout;  // dJ/dO (with a sink: the output of sink_backward)
  HeadView<const T> dlse;  // dJ/dLSE (with a sink: from sink_backward); data == nullptr means zero
  // Accumulated (+=): contributions of several stages (and of several calls) add.
  HeadView<T> dq, dk, dv;
};

// dQ, dK, dV contributions of the slices' pairs, given the complete O and LSE.
template <class T>
void attention_backward(const AttnBackwardArgs<T>& args, const std::vector<Slice>& slices);

// ---- merge of partial results of one query row set, computed over disjoint key sets

template <class T>
struct MergeArgs {
  int64_t rows = 0;
  int heads = 0, dv = 0;
  int parts = 0;
  const HeadView<const T>* o_parts = nullptr;    // parts entries, each [rows, heads, dv]
  const HeadView<const T>* lse_parts = nullptr;  // parts entries, each [rows, heads]
  HeadView<T> o, lse;                            // merged result (may not alias a part)
};

// L = logaddexp over parts of L_r; o = sum_r exp(L_r - L) o_r, evaluated with the maximum subtracted;
// all parts -inf gives L = -inf, o = 0.
template <class T>
void merge_forward(const MergeArgs<T>& args);

template <class T>
struct MergeBackwardArgs {
  MergeArgs<T> fwd;             // the parts and the merged o, lse of merge_forward
  HeadView<const T> dout;       // g = dJ/do of the merged output
  HeadView<const T> dlse;       // dJ/dL of the merged LSE; data == nullptr means zero
  const HeadView<T>* dout_parts = nullptr;  // fwd.parts entries, written: w_r g
  const HeadView<T>* dlse_parts = nullptr;  // fwd.parts entries, written: w_r (dot(g, o_r - o) + dJ/dL)
};

// w_r = exp(L_r - L); rows with L = -inf give zero gradients.
template <class T>
void merge_backward(const MergeBackwardArgs<T>& args);

// ---- learned sink per query head: a logit with zero value, applied once to the composed output

template <class T>
struct SinkArgs {
  int64_t rows = 0;
  int hq = 0, dv = 0;
  const T* sink = nullptr;  // [hq] logits; -inf means no sink for that head
  HeadView<const T> o, lse;  // complete token-only output and LSE
  HeadView<T> y;             // y = w o, w = exp(L - logaddexp(L, a)); may alias o's storage
};

template <class T>
void sink_forward(const SinkArgs<T>& args);

template <class T>
struct SinkBackwardArgs {
  SinkArgs<T> fwd;          // y is not read
  HeadView<const T> dy;     // g = dJ/dy
  HeadView<T> dout;         // written: dJ/do = w g
  HeadView<T> dlse;         // written: dJ/dL = w (1 - w) dot(g, o)
  T* dsink = nullptr;       // [hq], accumulated (+=): dJ/da = -w (1 - w) dot(g, o) summed over rows
};

template <class T>
void sink_backward(const SinkBackwardArgs<T>& args);

}  // namespace treecp::cpu
