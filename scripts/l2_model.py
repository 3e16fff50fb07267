#!/usr/bin/env python3
"""L2 model of the key-major backward's launch (docs/benchmarks-gpu.md, change X): which block order and walk
direction lets the L2 cache serve Q, dO and the dQ additions to blocks that read the same query tiles.

A sketch, not a simulator of the GPU: `slots` blocks run at once, each spends `prologue` steps and then one
step per listed query tile; the next block starts on the first free slot. Every step touches three 32 KiB
chunks (Q, dO, dQ; dQ dirty) of (KV head, query tile) in an LRU of `cap_mb`; a miss reads a chunk from DRAM,
an evicted dirty chunk writes one. Trees are the DESIGN.md presets at S = 40,960 with GQA 32/4 (query tiles
of 8 tokens, KV tiles of 128 keys); varied5k is one draw, not treecp's.

  python3 scripts/l2_model.py fixed5k varied5k dominant art-fixed5k

The last order is change AA's segment order (DeviceTilePlan::bwd_segment_order).
"""
import heapq
import random
import sys
from collections import OrderedDict

S, BN, TQ, HKV = 40960, 128, 8, 4


def families(name, seed=1):
    rnd, out, used = random.Random(seed), [], 0
    while used < S:
        root, kids = {'fixed5k': (1024, [512] * 8), 'dominant': (8192, [2048] * 16), 'art-fixed5k': (5000, [100] * 16),
                      'varied5k': (1024, [min(1536, max(64, round(rnd.gauss(512, 160)))) for _ in range(8)])}[name]
        take, left = [], S - used - root
        for k in kids:
            if left <= 0:
                break
            take.append(min(k, left))
            left -= take[-1]
        out.append((min(root, S - used), take))
        used += min(root, S - used) + sum(take)
    return out


def kv_lists(fams):
    """Per KV tile, its query tiles in ascending order (own segment from the diagonal, then descendants)."""
    segs, pos = [], 0
    for root, kids in fams:
        r = len(segs)
        segs.append((pos, pos + root, -1))
        pos += root
        for k in kids:
            segs.append((pos, pos + k, r))
            pos += k
    children = {}
    for i, (_, _, p) in enumerate(segs):
        if p >= 0:
            children.setdefault(p, []).append(i)
    seg_of = [0] * S
    for i, (a, b, _) in enumerate(segs):
        seg_of[a:b] = [i] * (b - a)
    lists = []
    for kt in range(S // BN):
        qs = set()
        for s in set(seg_of[kt * BN:(kt + 1) * BN]):
            a, b, _ = segs[s]
            qs.update(range(max(a, kt * BN) // TQ, (b - 1) // TQ + 1))
            for c in children.get(s, []):
                qs.update(range(segs[c][0] // TQ, (segs[c][1] - 1) // TQ + 1))
        lists.append(sorted(qs))
    return lists


def run(lists, order, reverse_of, slots=132, cap_mb=50, prologue=3, chunk_kb=32):
    cap, lru, dram = cap_mb * 1024 // chunk_kb, OrderedDict(), 0

    def touch(key, dirty):
        nonlocal dram
        if key in lru:
            lru.move_to_end(key)
            lru[key] = lru[key] or dirty
            return
        dram += chunk_kb
        lru[key] = dirty
        while len(lru) > cap:
            if lru.popitem(last=False)[1]:
                dram += chunk_kb

    heap, nxt, end = [], 0, 0

    def start(slot, now):
        nonlocal nxt
        tile, head = order[nxt]
        walk = lists[tile][::-1] if reverse_of(nxt, now) else lists[tile]
        nxt += 1
        heapq.heappush(heap, (now + prologue, slot, head, walk, 0))

    for slot in range(min(slots, len(order))):
        start(slot, 0)
    while heap:
        t, slot, head, walk, i = heapq.heappop(heap)
        if i < len(walk):
            for kind in ('q', 'o', 'dq'):
                touch((kind, head, walk[i]), kind == 'dq')
            heapq.heappush(heap, (t + 1, slot, head, walk, i + 1))
        else:
            end = max(end, t)
            if nxt < len(order):
                start(slot, t)
    dram += chunk_kb * sum(lru.values())
    return dram / 2**20, end


def segment_of_tiles(fams):
    """The segment holding each KV tile's first key (change AA's grouping)."""
    starts, pos = [], 0
    for root, kids in fams:
        starts.append(pos)
        pos += root
        for k in kids:
            starts.append(pos)
            pos += k
    seg, i = [], 0
    for kt in range(S // BN):
        while i + 1 < len(starts) and starts[i + 1] <= kt * BN:
            i += 1
        seg.append(i)
    return seg


def main(names):
    for name in names:
        fams = families(name)
        lists = kv_lists(fams)
        longest = sorted((t for t in range(len(lists)) if lists[t]), key=lambda t: -len(lists[t]))
        tile_major = [(t, h) for t in longest for h in range(HKV)]
        head_major = [(t, h) for h in range(HKV) for t in longest]
        # change AA: a segment's tiles longest first, cut into chunks of 16 (kSegmentChunk); the chunks by their
        # longest walk, then in the segments' order; each KV head's tiles of a chunk together
        seg = segment_of_tiles(fams)
        gmax = {}
        for t in longest:
            gmax[seg[t]] = max(gmax.get(seg[t], 0), len(lists[t]))
        grouped = sorted(longest, key=lambda t: (-gmax[seg[t]], seg[t], -len(lists[t])))
        by_seg = {}
        for t in grouped:
            by_seg.setdefault(seg[t], []).append(t)
        chunks = [(-len(lists[ts[c]]), rank, ts[c:c + 16]) for rank, ts in enumerate(by_seg.values())
                  for c in range(0, len(ts), 16)]
        chunks.sort(key=lambda c: (c[0], c[1]))
        segment_head = [(t, h) for _, _, ch in chunks for h in range(HKV) for t in ch]
        ideal = sum(len(l) for l in lists) * HKV / 132
        for label, order, rev in (('every walk forward', tile_major, lambda b, now: False),
                                  ('every walk reversed', tile_major, lambda b, now: True),
                                  ('first wave reversed', tile_major, lambda b, now: now == 0),
                                  ('head-major, reversed', head_major, lambda b, now: True),
                                  ('segment order, reversed', segment_head, lambda b, now: True)):
            gb, end = run(lists, order, rev)
            print(f'{name:12s} {label:22s} DRAM {gb:6.1f} GB  makespan {end / ideal:.3f} x ideal')


if __name__ == '__main__':
    main(sys.argv[1:] or ['fixed5k', 'varied5k', 'dominant', 'art-fixed5k'])
