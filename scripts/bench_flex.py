#!/usr/bin/env python3
"""The FlexAttention peer of bench/cuda/bench_attention: the same rows (JSON written by the bench or by
`treecp tree generate`), the same shape (Hq=32, Hkv=4, D=128, bf16), the equivalent block mask, and
torch.compile'd flex_attention. Prints one table with treecp's numbers from the same run when
--treecp points at the bench's treecp_results.json.

Visibility (DESIGN.md): query i sees key j iff seg(j) is an ancestor-or-self of seg(i) and j <= i;
segments are in DFS preorder, so "a is an ancestor-or-self of s" is a <= s < subtree_end(a).

Usage: bench_flex.py --rows DIR [--presets a,b] [--treecp DIR/treecp_results.json] [--reps N] [--no-sdpa]

Also times torch SDPA (cuDNN and FA2 backends) on the gathered-paths formulation: each segment's queries
against its ancestors' tokens then its own, lower-right causal, one batched call per (own, ancestor)
length pair, gathers and the scatter-add of dK/dV included.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

HQ, HKV, D = 32, 4, 128


def row_arrays(segments):
    """Per-token segment id and per-segment subtree end (DFS preorder)."""
    n = len(segments)
    sub_end = list(range(1, n + 1))
    for s in range(n - 1, -1, -1):
        p = segments[s]["parent"]
        if p >= 0:
            sub_end[p] = max(sub_end[p], sub_end[s])
    seg_of = []
    for s, seg in enumerate(segments):
        seg_of.extend([s] * seg["length"])
    return seg_of, sub_end


def visible_pairs(segments):
    """A = sum over segments of len*(len+1)/2 + len * (tokens of its strict ancestors)."""
    anc = [0] * len(segments)
    total = 0
    for s, seg in enumerate(segments):
        p = seg["parent"]
        anc[s] = 0 if p < 0 else anc[p] + segments[p]["length"]
        n = seg["length"]
        total += n * (n + 1) // 2 + n * anc[s]
    return total


def path_groups(segments, dev):
    """The gathered-paths formulation: segment s's queries attend to its ancestors' tokens then its own,
    lower-right causal. Segments with the same (own length, ancestor length) form one batched call;
    returns [(L, A, q_index [B, L], kv_index [B, A + L])]."""
    starts, t = [], 0
    for seg in segments:
        starts.append(t)
        t += seg["length"]
    groups = {}
    for s, seg in enumerate(segments):
        chain, p = [], seg["parent"]
        while p >= 0:
            chain.append(p)
            p = segments[p]["parent"]
        anc = [i for a in reversed(chain) for i in range(starts[a], starts[a] + segments[a]["length"])]
        own = list(range(starts[s], starts[s] + seg["length"]))
        groups.setdefault((len(own), len(anc)), []).append((own, anc + own))
    out = []
    for (L, A), members in sorted(groups.items()):
        qi = torch.tensor([m[0] for m in members], dtype=torch.long, device=dev)
        ki = torch.tensor([m[1] for m in members], dtype=torch.long, device=dev)
        out.append((L, A, qi, ki))
    return out


def gathered_sdpa(q, k, v, groups, backend, form):
    """q [1, HQ, S, D], k/v [1, HKV, S, D]: one SDPA call per group on gathered rows; returns the outputs.
    form: "bias" (torch's lower-right CausalBias, GQA in the kernel), "mask" (a boolean mask, GQA in the
    kernel) or "expand" (a boolean mask, KV heads repeated to HQ)."""
    outs = []
    with sdpa_kernel(backend):
        for L, A, qi, ki in groups:
            B = qi.shape[0]
            qg = q[0][:, qi.reshape(-1)].reshape(HQ, B, L, D).transpose(0, 1)
            kg = k[0][:, ki.reshape(-1)].reshape(HKV, B, A + L, D).transpose(0, 1)
            vg = v[0][:, ki.reshape(-1)].reshape(HKV, B, A + L, D).transpose(0, 1)
            if form == "bias":
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=causal_lower_right(L, A + L), enable_gqa=True)
            else:
                mask = torch.ones(L, A + L, dtype=torch.bool, device=q.device).tril(diagonal=A)
                if form == "expand":
                    kg, vg = kg.repeat_interleave(HQ // HKV, dim=1), vg.repeat_interleave(HQ // HKV, dim=1)
                    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask)
                else:
                    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, enable_gqa=True)
            outs.append(o)
    return outs


def median_ms(fn, reps, sustain_s=0.5):
    # back-to-back calls for sustain_s first: the GPU's clock settles under load (an idle H200 runs the first
    # milliseconds 3-11% faster), and bench_attention times treecp after the same half second
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < sustain_s:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", required=True)
    ap.add_argument("--presets", default="fixed5k,varied5k,dominant,art-fixed5k")
    ap.add_argument("--treecp", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-sdpa", dest="sdpa", action="store_false",
                    help="skip torch SDPA (cuDNN, FA2) on gathered root-to-segment paths")
    args = ap.parse_args()
    dev = torch.device("cuda")
    # One compiled graph per (shape, grad mode): six presets of two lengths, forward and forward+backward,
    # pass dynamo's default limit of 8 recompilations, after which flex_attention silently falls back to the
    # unfused path (and runs out of memory on these rows).
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    flex = torch.compile(flex_attention, dynamic=False)
    treecp = {}
    if args.treecp and os.path.exists(args.treecp):
        for r in json.load(open(args.treecp)):
            treecp[r["preset"]] = r
    rows = []
    for name in args.presets.split(","):
        segments = json.load(open(os.path.join(args.rows, name + ".json")))["segments"]
        seg_of, sub_end = row_arrays(segments)
        S = len(seg_of)
        pairs = visible_pairs(segments)
        seg_t = torch.tensor(seg_of, dtype=torch.int32, device=dev)
        end_t = torch.tensor(sub_end, dtype=torch.int32, device=dev)

        def mask_mod(b, h, q_idx, kv_idx):
            sq, sk = seg_t[q_idx], seg_t[kv_idx]
            return (kv_idx <= q_idx) & (sk <= sq) & (sq < end_t[sk])

        # per-new-tree block-mask build (median of 5 after one warm-up)
        create_block_mask(mask_mod, None, None, S, S, device=dev)
        torch.cuda.synchronize()
        build = []
        for _ in range(5):
            t0 = time.perf_counter()
            bm = create_block_mask(mask_mod, None, None, S, S, device=dev)
            torch.cuda.synchronize()
            build.append((time.perf_counter() - t0) * 1e3)
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, HQ, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
        k = torch.randn(1, HKV, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
        v = torch.randn(1, HKV, S, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
        do = torch.randn(1, HQ, S, D, device=dev, dtype=torch.bfloat16, generator=g)

        def fwd():
            with torch.no_grad():
                return flex(q, k, v, block_mask=bm, enable_gqa=True)

        def fwdbwd():
            out = flex(q, k, v, block_mask=bm, enable_gqa=True)
            q.grad = k.grad = v.grad = None
            out.backward(do)

        fwd_ms = median_ms(fwd, args.reps)
        fb_ms = median_ms(fwdbwd, args.reps)
        flop = 4.0 * pairs * D * HQ
        rows.append((name, S, pairs, statistics.median(build), fwd_ms, flop / fwd_ms / 1e9, fb_ms,
                     3.5 * flop / fb_ms / 1e9))
        print(f"{name}: flex done", flush=True)
        # torch SDPA on gathered root-to-segment paths (DESIGN.md's other anchor), cuDNN and FA2 backends
        if args.sdpa:
            groups = path_groups(segments, dev)
            for label, backend in (("SDPA cuDNN, gathered paths", SDPBackend.CUDNN_ATTENTION),
                                   ("SDPA FA2, gathered paths", SDPBackend.FLASH_ATTENTION)):
                for form in ("bias", "mask", "expand"):  # the first form the backend accepts
                    try:
                        def sfwd():
                            with torch.no_grad():
                                return gathered_sdpa(q, k, v, groups, backend, form)

                        def sfb():
                            outs = gathered_sdpa(q, k, v, groups, backend, form)
                            q.grad = k.grad = v.grad = None
                            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

                        s_fwd = median_ms(sfwd, args.reps)
                        s_fb = median_ms(sfb, args.reps)
                        rows.append((name, S, pairs, float("nan"), s_fwd, flop / s_fwd / 1e9, s_fb,
                                     3.5 * flop / s_fb / 1e9, f"{label}, {form}", len(groups)))
                        break
                    except Exception as e:  # a form or backend that refuses these shapes is reported, not fatal
                        print(f"{name}: {label}, {form}: not run ({type(e).__name__}: {str(e)[:160]})", flush=True)
            print(f"{name}: sdpa done ({len(groups)} shape groups)", flush=True)
        del q, k, v, do, bm
        torch.cuda.empty_cache()

    print(f"\nSame run, {torch.cuda.get_device_name()}, torch {torch.__version__}; Hq={HQ} Hkv={HKV} D={D} bf16; "
          "TFLOP/s on visible pairs (fwd 4*A*D*Hq, fwd+bwd 3.5x)")
    print("| preset | tokens | visible pairs | impl | per-tree setup ms | fwd ms | fwd TFLOP/s | fwd+bwd ms | "
          "fwd+bwd TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        name, S, pairs, build_ms, fwd_ms, fwd_tf, fb_ms, fb_tf = row[:8]
        if len(row) > 8:
            print(f"| {name} | {S} | {pairs} | {row[8]} ({row[9]} calls) | - | {fwd_ms:.3f} | {fwd_tf:.1f} | "
                  f"{fb_ms:.3f} | {fb_tf:.1f} |")
            continue
        t = treecp.get(name)
        if t:
            if t["pairs"] != pairs:
                print(f"WARNING: {name}: treecp counts {t['pairs']} visible pairs, this script {pairs}")
            flop = 4.0 * t["pairs"] * D * HQ
            print(f"| {name} | {S} | {pairs} | treecp | {t['setup_ms']:.3f} | {t['fwd_ms']:.3f} | "
                  f"{flop / t['fwd_ms'] / 1e9:.1f} | {t['fwdbwd_ms']:.3f} | {3.5 * flop / t['fwdbwd_ms'] / 1e9:.1f} |")
        print(f"| {name} | {S} | {pairs} | FlexAttention | {build_ms:.2f} | {fwd_ms:.3f} | {fwd_tf:.1f} | "
              f"{fb_ms:.3f} | {fb_tf:.1f} |")


if __name__ == "__main__":
    main()
