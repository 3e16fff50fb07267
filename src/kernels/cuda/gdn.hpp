// Gated DeltaNet (GDN) and KDA chunk kernels on NVIDIA GPUs: the CUDA side of kernels/cpu/gdn.hpp for one
// rank's token-major arrays and a list of runs (gdn_types.hpp). bf16 inputs, fp32 states and accumulation,
// chunks of 64 tokens in the UT/WY form; the design is in docs/kernels.md ("Gated DeltaNet and KDA").
// Every call is enqueued on `stream`, never waits on the host, and throws treecp::Error on bad arguments
// (naming the one at fault) or a failed launch.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "kernels/cuda/gdn_types.hpp"

namespace treecp::cuda {

// Workspace bytes the call `kind` needs for these runs, exactly what it carves: the forward's with fla_split are the
// split's compact arrays (1.68 GB at T = 40,960, H = 32, dk = dv = 128, against the classic forward's 5.0 GB), the
// summary's the classic prep's (it runs those kernels whatever fla_split says).
size_t gdn_workspace_bytes(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, GdnCallKind kind);
// backward: gdn_backward's; else enough for both gdn_forward and gdn_summary on p (the larger of the two).
size_t gdn_workspace_bytes(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, bool backward);

// y for every run's tokens and each run's final state (state_out, by out_slot).
void gdn_forward(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, cudaStream_t stream = nullptr);

// Each run's summary S_out = M S_in + E, by out_slot: M [slots, H, dk, dk], E [slots, H, dk, dv] (fp32).
void gdn_summary(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, float* M, float* E,
                 cudaStream_t stream = nullptr);

// Gradients of every run from its initial state (state_in by in_slot), dy and dL/d(final state); p.y unused.
void gdn_backward(const GdnCudaParams& p, const std::vector<GdnCudaRun>& runs, const GdnCudaGrads& grads,
                  cudaStream_t stream = nullptr);

// Summary algebra on `count` blocks (e.g. slots x heads) of M [dk, dk] and E [dk, dv], fp32, contiguous:
// (M, E) = (MB MA, MB EA + EB): A runs first; M may alias MB and E may alias EB (as gdn_compose on the CPU).
void gdn_compose(int64_t count, int dk, int dv, const float* MB, const float* EB, const float* MA, const float* EA,
                 float* M, float* E, cudaStream_t stream = nullptr);
// out = M s + E (out may alias E, not s).
void gdn_apply(int64_t count, int dk, int dv, const float* M, const float* E, const float* s, float* out,
               cudaStream_t stream = nullptr);
// out = Mᵀ ds + a: the state gradient through a run (out may alias a, not M or ds).
void gdn_apply_transposed(int64_t count, int dk, int dv, const float* M, const float* a, const float* ds, float* out,
                          cudaStream_t stream = nullptr);

}  // namespace treecp::cuda
