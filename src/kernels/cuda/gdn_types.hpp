// Gated DeltaNet / KDA on NVIDIA GPUs: the argument blocks (plain structs, no CUDA header, so the host-side
// emulation of the kernels in tests/test_gdn_cuda_emulated.cpp sees the same types). The calls: gdn.hpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/gdn.hpp"  // GdnGate
#include "kernels/cuda/dtype.hpp"

namespace treecp::cuda {

// Arithmetic of the chunk-parallel products (GdnCudaParams::precision).
enum class GdnPrecision : int32_t { fp32 = 0, bf16_tensor = 1, bf16_tensor_scans = 2 };
inline constexpr GdnPrecision kGdnPrecisions[] = {GdnPrecision::fp32, GdnPrecision::bf16_tensor,
                                                  GdnPrecision::bf16_tensor_scans};
inline bool gdn_precision_known(GdnPrecision p) {
  for (const GdnPrecision q : kGdnPrecisions)
    if (p == q) return true;
  return false;
}
// Its name as the CLI and the Python op spell it ("unknown" outside the three).
inline const char* gdn_precision_name(GdnPrecision p) {
  switch (p) {
    case GdnPrecision::fp32: return "fp32";
    case GdnPrecision::bf16_tensor: return "bf16_tensor";
    case GdnPrecision::bf16_tensor_scans: return "bf16_tensor_scans";
  }
  return "unknown";
}

// Which call a workspace serves (gdn_workspace_bytes): each carves its own arrays (docs/kernels.md, "Workspace").
enum class GdnCallKind : int32_t { forward = 0, summary = 1, backward = 2 };

// One run of consecutive tokens [t0, t1) of every head, as kernels/cpu's gdn_* calls take one, with its
// initial state (slot `in_slot` of GdnCudaParams::state_in, -1 = zero) and where its final state goes
// (slot `out_slot` of state_out, -1 = not written). Runs of one call must not overlap.
struct GdnCudaRun {
  int64_t t0 = 0, t1 = 0;
  int32_t in_slot = -1;
  int32_t out_slot = -1;
};

// Token-major arrays of one rank's tokens, the layouts of GdnParams (q[t][h][d] = q[(t * heads + h) * dk + d]):
//   q, k [S, H, dk]; v [S, H, dv]; g [S, H] (GDN) or [S, H, dk] (KDA), the natural log of the decay; beta [S, H]
// all 16-bit of type `dtype` (bit patterns: bf16 or fp16); states fp32 [slots, H, dk, dv]; y [S, H, dv] of `dtype`
// or fp32 (y_f32). Tokens outside every run are neither read nor written.
struct GdnCudaParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* g = nullptr;
  const void* beta = nullptr;
  int64_t tokens = 0;
  int32_t heads = 0, dk = 0, dv = 0;
  GdnGate gate = GdnGate::Scalar;
  float scale = 1.f;
  void* y = nullptr;  // forward: written where not null
  bool y_f32 = false;  // y (and the backward's dy) in fp32 rather than `dtype`
  // The activations' element type (q, k, v, g, beta, and y / dy unless y_f32). fp16 takes precision fp32 only (the
  // bf16 products' intermediates are not bounded by fp16's range; gdn_check refuses the others by name).
  DType dtype = DType::kBf16;
  const float* state_in = nullptr;  // read by runs with in_slot >= 0
  float* state_out = nullptr;       // forward: written for runs with out_slot >= 0
  // State columns per block of the scans: 0 = the default (32), 16 or 32 (kept selectable so the benchmark measures
  // both: 16 doubles the blocks of a long run, 32 halves the re-reads of each chunk's matrices).
  int32_t scan_columns = 0;
  // The chunk products (prep, scans, gradients) on tensor cores (mma.sync tf32, each operand split in two and three
  // products summed, which keeps fp32-level accuracy); false = register-blocked fp32 FMA. Off by default until
  // measured on a GPU.
  bool tensor_cores = false;
  // The chunk-parallel kernels' products (prep's and the gradients'): fp32 (as tensor_cores says) or bf16_tensor,
  // mma.sync m16n8k16 on operands rounded to bf16 (inputs already are; intermediates such as L⁻¹ diag(β), Kst, D and
  // the chunk-start state are rounded where they enter a product) with fp32 accumulation, as FLA's chunk kernels do.
  // The scans keep fp32 products, except with bf16_tensor_scans: their products too on bf16 mma.sync, fragments
  // rounded from the fp32 operands in shared memory (W, U, R, Qst, C, the state tile; the state itself accumulates in
  // fp32). fp32 by default until measured on a GPU.
  GdnPrecision precision = GdnPrecision::fp32;
  // The forward split as FLA splits it: the scan only carries the state, storing each chunk's start state S0 and
  // D = U - W S0 in the workspace (the backward's saving scan), and a chunk-parallel kernel computes
  // Y = scale (Qst S0 + C D) on the products' arithmetic above. The forward's workspace grows by (dk + 64) dv values a
  // (chunk, head), fp32, or bf16 with a bf16 precision (which rounds them so as product operands anyway): 2.0 GB or
  // 1.0 GB at T = 40,960, H = 32, dk = dv = 128. Off by default until measured.
  bool split_forward = false;
  // The forward split as FLA 0.6's chunk forward (gdn_fla_device.cuh; docs/kernels.md "The FLA-like split forward"):
  // a compact prep (W, U bf16 and the cumulative gate), a scan holding the state in mma.sync fragments (fp32
  // registers) that stores each chunk's start state and v_new = U - W S as bf16, and a chunk-parallel output kernel,
  // every product bf16 mma.sync with fp32 accumulation. Takes the scalar gate, dk and dv 64 or 128, bf16 activations
  // and precision bf16_tensor_scans (whose arithmetic it is); scan_columns 0 (= 32), 16, 32 or 64. gdn_backward
  // then runs the split backward (gdn_fla_bwd_device.cuh: the split's prep and scan again, a chunk-parallel local
  // kernel, a reverse scan holding the state gradient in fragments, chunk-parallel gradients); gdn_summary runs its own
  // kernels. Not together with split_forward. Off by default until measured on a GPU.
  bool fla_split = false;
  // With fla_split: the forward leaves in the workspace what the split backward would otherwise compute again (W, U,
  // the cumulative gate, X = L⁻¹, each chunk's start state and v_new), and the backward reads them there instead of
  // running the split's prep and scan a second time (2.0 ms of its 7.6 at T = 40,960, H = 32, dk = dv = 128). The
  // forward's workspace is then the backward's size (gdn_workspace_bytes of either kind; 3.53 GB at that shape
  // against 1.68) and its prep writes X too. The caller's contract: the backward gets the same inputs, runs, state_in
  // and workspace as the forward, and nothing writes that workspace in between (the backward itself leaves the kept
  // arrays as they are, so a second backward may read them again). The forward's y may be null then.
  bool keep_forward = false;
  // Device scratch of gdn_workspace_bytes() bytes, 256-byte aligned (the chunk-local matrices, and for the
  // backward the chunk-start states and their gradients).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// The backward's extra arrays. Gradients are fp32 in the layouts of their inputs and ADDED into (as
// kernels/cpu's GdnGrads); a null one is not computed.
struct GdnCudaGrads {
  const void* dy = nullptr;            // [S, H, dv], GdnCudaParams::dtype or fp32 as its y_f32
  const float* d_state_out = nullptr;  // dL/d(final state) by out_slot; null or out_slot -1 = zero
  float* d_state_in = nullptr;         // dL/d(initial state), written by in_slot (runs with in_slot >= 0)
  float* dq = nullptr;
  float* dk = nullptr;
  float* dv = nullptr;
  float* dg = nullptr;
  float* dbeta = nullptr;
  bool any() const { return dq || dk || dv || dg || dbeta; }
};

// Whether a forward of p's shape, dtype and precision may run the FLA-like split (GdnCudaParams::fla_split): the
// scalar gate, dk and dv 64 or 128, bf16 activations, precision bf16_tensor_scans, not split_forward, q, k and v 4-byte
// aligned (null counts as aligned: a size query has no pointers), and scan_columns 0, 16, 32 or 64: exactly what
// gdn_check takes with fla_split set. Callers that offer the split as a setting (CudaBackend::set_gdn_fla_split) set
// fla_split only where this holds and run the classic forward elsewhere.
inline bool gdn_fla_split_takes(const GdnCudaParams& p) {
  const auto aligned = [](const void* x) { return reinterpret_cast<uintptr_t>(x) % 4 == 0; };
  return p.gate == GdnGate::Scalar && (p.dk == 64 || p.dk == 128) && (p.dv == 64 || p.dv == 128) &&
         p.dtype == DType::kBf16 && p.precision == GdnPrecision::bf16_tensor_scans && !p.split_forward &&
         (p.scan_columns == 0 || p.scan_columns == 16 || p.scan_columns == 32 || p.scan_columns == 64) &&
         aligned(p.q) && aligned(p.k) && aligned(p.v);
}

}  // namespace treecp::cuda
