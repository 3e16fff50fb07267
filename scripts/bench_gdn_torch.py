"""Times treecp.torch.gated_delta_rule on one GPU through the Python package: the forward, and forward + backward
through autograd, on a row of one causal document of T tokens (H heads, K = V = D, bf16 in), per path:
"classic" (precision bf16_tensor_scans, the classic chunk kernels) and "fla split" (fla_split=True: the FLA-like
split; its backward runs the forward again for the states and keeps the split's arrays for the backward within the
call, CudaBackend::set_gdn_keep_forward), and the split with keep_for_backward=True (the forward keeps its run for
the backward, which then does not run it again). Median of `--reps` timed calls after three warm-ups, CUDA events around each,
the gradients of every input through autograd. What the C++ bench (bench_gdn_cuda) does not show: the package's
copies in and out, its checks, the plan's redistribution, and the backward's second forward.

    python scripts/bench_gdn_torch.py [--tokens 40960] [--heads 32] [--dim 128] [--reps 10]
"""

import argparse
import os
import sys

import torch

import treecp
import treecp.torch as tt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_flex import median_ms  # noqa: E402 - the one CUDA-event timer of the Python benchmarks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=40960)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    t, h, d = a.tokens, a.heads, a.dim
    if not torch.cuda.is_available() or not treecp._core.has_cuda_backend:
        raise SystemExit("bench_gdn_torch: needs a GPU and a treecp built with its CUDA backend")
    gen = torch.Generator(device="cuda").manual_seed(0)
    unit = (3.0 / d) ** 0.5  # |q|^2, |k|^2 about 1, as bench_gdn_cuda's inputs

    def uniform(shape, lo, hi):
        return (torch.rand(shape, generator=gen, device="cuda") * (hi - lo) + lo).to(torch.bfloat16)

    q, k = (uniform((t, h, d), -unit, unit) for _ in range(2))
    v = uniform((t, h, d), -1.0, 1.0)
    g = uniform((t, h), -0.5, 0.0)  # log-decay in [-0.5, 0)
    beta = uniform((t, h), 0.05, 0.95)
    dy = uniform((t, h, d), -1.0, 1.0)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    key = tt.plan(treecp.Row.from_segments([-1], [t]))
    print(f"treecp.torch.gated_delta_rule on {torch.cuda.get_device_name()}, torch {torch.__version__}: T {t}, H {h}, "
          f"K = V = {d}, bf16, one rank; median of {a.reps} after three warm-ups")
    print("| path | forward ms | fwd+bwd ms | bwd / fwd |")
    print("|---|---|---|---|")
    for name, split, keep in (("classic, bf16_tensor_scans", False, False), ("fla split", True, False),
                              ("fla split, keep_for_backward", True, True)):
        def fwd():
            with torch.no_grad():
                tt.gated_delta_rule(*leaves, key, precision="bf16_tensor_scans", fla_split=split)

        def fwd_bwd():
            y = tt.gated_delta_rule(*leaves, key, precision="bf16_tensor_scans", fla_split=split,
                                    keep_for_backward=keep)
            torch.autograd.grad(y, leaves, dy)

        f, fb = median_ms(fwd, a.reps, 0.0), median_ms(fwd_bwd, a.reps, 0.0)
        print(f"| {name} | {f:.3f} | {fb:.3f} | {(fb - f) / f:.2f} |")


if __name__ == "__main__":
    main()
