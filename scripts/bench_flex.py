#!/usr/bin/env python3
"""The FlexAttention peer of bench/cuda/bench_attention: the same rows (JSON written by the bench or by
`treecp tree generate`), the same shape (Hq=32, Hkv=4, D=128, bf16), the equivalent block mask, and
torch.compile'd flex_attention. Prints one table with treecp's numbers from the same run when
--treecp points at the bench's treecp_results.json.

Visibility (DESIGN.md): query i sees key j iff seg(j) is an ancestor-or-self of seg(i) and j <= i;
segments are in DFS preorder, so "a is an ancestor-or-self of s" is a <= s < subtree_end(a).

Usage: bench_flex.py --rows DIR [--presets a,b] [--treecp DIR/treecp_results.json] [--reps N]
"""
import argparse
import json
import os
import statistics
import time

import torch
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


def median_ms(fn, reps):
    for _ in range(3):
        fn()
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
    args = ap.parse_args()
    dev = torch.device("cuda")
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
        del q, k, v, do, bm
        torch.cuda.empty_cache()

    print(f"\nSame run, {torch.cuda.get_device_name()}, torch {torch.__version__}; Hq={HQ} Hkv={HKV} D={D} bf16; "
          "TFLOP/s on visible pairs (fwd 4*A*D*Hq, fwd+bwd 3.5x)")
    print("| preset | tokens | visible pairs | impl | per-tree setup ms | fwd ms | fwd TFLOP/s | fwd+bwd ms | "
          "fwd+bwd TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, S, pairs, build_ms, fwd_ms, fwd_tf, fb_ms, fb_tf in rows:
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
