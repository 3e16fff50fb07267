#!/usr/bin/env python3
"""The peer for treecp's GDN/KDA CUDA kernels: flash-linear-attention's chunk kernels, timed on this GPU.

Prints one markdown table: chunk GDN and chunk KDA at T tokens, H heads, Dk = Dv = D, bf16 inputs, one
sequence; forward and forward+backward milliseconds (CUDA events, median of --reps after three warm-up calls and --sustain seconds),
or the error FLA raises (its backward refuses some GPU/Triton pairs). Needs torch, triton and fla-core
(on the GPU machine: pip install --no-deps --target DIR fla_core-*.whl einops-*.whl, then PYTHONPATH=DIR).
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_flex import median_ms  # noqa: E402 - the one CUDA-event timer of the Python benchmarks


def inputs(T, H, D, per_channel, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    q = F.normalize(torch.randn(1, T, H, D, device=dev, generator=g), dim=-1).to(bf)
    k = F.normalize(torch.randn(1, T, H, D, device=dev, generator=g), dim=-1).to(bf)
    v = torch.randn(1, T, H, D, device=dev, generator=g).to(bf)
    gshape = (1, T, H, D) if per_channel else (1, T, H)
    # log decays in about [-0.7, -0.01]: the regime of trained GDN/KDA layers
    gate = F.logsigmoid(torch.randn(gshape, device=dev, generator=g) + 3.0).float()
    beta = torch.rand(1, T, H, device=dev, generator=g).to(bf)
    return q, k, v, gate, beta


def measure(name, op, T, H, D, per_channel, reps, sustain_s):
    q, k, v, gate, beta = inputs(T, H, D, per_channel, 0)
    row = {"kernel": name}
    try:
        with torch.no_grad():
            row["fwd"] = median_ms(lambda: op(q, k, v, gate, beta), reps, sustain_s)
    except Exception as e:  # noqa: BLE001 - the peer's refusal is the figure
        row["fwd"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, gate, beta)]
    do = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)

    def step():
        o = op(*leaves)
        o = o[0] if isinstance(o, tuple) else o
        o.backward(do)

    try:
        row["fwdbwd"] = median_ms(step, reps, sustain_s)
    except Exception as e:  # noqa: BLE001
        row["fwdbwd"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=40960)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--d", type=int, default=128)
    # 0: three warm-up calls only (run 118); 0.5 times at sustained clocks like bench_flex.py
    ap.add_argument("--sustain", type=float, default=0.0, help="seconds of back-to-back calls before timing")
    ap.add_argument("--reps", type=int, default=10)
    # Triton compiles each kernel on its first call (minutes on a fresh machine): time only what is asked
    ap.add_argument("--kernels", choices=("both", "gdn", "kda"), default="both")
    a = ap.parse_args()
    import fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda

    T, H, D = a.tokens, a.heads, a.d
    print(f"# FLA {getattr(fla, '__version__', '?')}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"# T {T}, H {H}, Dk = Dv = {D}, bf16, one sequence; median of {a.reps} after 3 warm-up calls and {a.sustain} s of sustained calls\n")
    rows = []
    if a.kernels != "kda":
        rows.append(measure("fla chunk_gated_delta_rule (GDN)",
                            lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b), T, H, D, False, a.reps,
                            a.sustain))
    if a.kernels != "gdn":
        rows.append(measure("fla chunk_kda (KDA)", lambda q, k, v, g, b: chunk_kda(q, k, v, g, b), T, H, D, True,
                            a.reps, a.sustain))
    print("| kernel | forward ms | forward+backward ms |")
    print("|---|---|---|")
    for r in rows:
        f = r["fwd"] if isinstance(r["fwd"], str) else f"{r['fwd']:.3f}"
        fb = r["fwdbwd"] if isinstance(r["fwdbwd"], str) else f"{r['fwdbwd']:.3f}"
        print(f"| {r['kernel']} | {f} | {fb} |")


if __name__ == "__main__":
    main()
