"""Times treecp.torch.attention (forward, forward + backward through autograd) on the rows of
bench_attention_cpu (Hq 8, Hkv 2, D = Dv = 64, one process, one core), best of N, to show what the
Python layer adds over the C++ runtime: tensor copies in and out, the checks, and the backward's
second forward (the backward op takes tensors only).

    python bench/bench_python_ops.py [reps]      # after pip install . (torch needed)
"""

import sys
import time

import torch

import treecp
import treecp.torch as tt


def best_ms(fn, reps):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.set_num_threads(1)
    rows = [("root 1,024 + 6 x 512", treecp.Row.from_segments([-1] + [0] * 6, [1024] + [512] * 6), None),
            ("same, window 512", treecp.Row.from_segments([-1] + [0] * 6, [1024] + [512] * 6), 512),
            ("causal 4,096", treecp.Row.from_segments([-1], [4096]), None)]
    print(f"treecp.torch.attention, one process, torch {torch.__version__}, Hq 8, Hkv 2, D = Dv = 64, best of {reps}")
    print(f"| row | dtype | fwd ms | fwd+bwd ms |")
    print(f"|---|---|---|---|")
    for name, row, window in rows:
        key = tt.plan(row, window=window)
        for dtype in (torch.float32, torch.float64):
            g = torch.Generator().manual_seed(0)
            q = torch.randn(row.tokens, 8, 64, dtype=dtype, generator=g).requires_grad_()
            k = torch.randn(row.tokens, 2, 64, dtype=dtype, generator=g).requires_grad_()
            v = torch.randn(row.tokens, 2, 64, dtype=dtype, generator=g).requires_grad_()
            dy = torch.randn(row.tokens, 8, 64, dtype=dtype, generator=g)

            def fwd():
                with torch.no_grad():
                    tt.attention(q, k, v, key)

            def fwd_bwd():
                o, _ = tt.attention(q, k, v, key)
                torch.autograd.grad(o, (q, k, v), dy)

            print(f"| {name} | {str(dtype)[6:]} | {best_ms(fwd, reps):.1f} | {best_ms(fwd_bwd, reps):.1f} |")


if __name__ == "__main__":
    main()
