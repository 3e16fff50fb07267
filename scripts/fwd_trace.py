#!/usr/bin/env python3
"""Where the warp-specialised forward's blocks spend their cycles, from bench_attention's phase stamps.

bench_attention writes <preset>_fwdtrace.bin into its --out directory: for every block of the one-block-per-item
forward (the bench's kFwdWsTrace config), kFwdTraceWords = 16 uint64 (src/kernels/cuda/launch.hpp names them:
[0] SM, [1] start, [2] Q ready, [10] first K/V ready, [3] first S ready, [4] last P V retired, [6] steps, [5] / [7]
the warpgroups' O stores done, [11] / [12] %globaltimer at [1] / [5]). This prints, per preset, the mean of each
phase in SM cycles, the gap between consecutive blocks on one SM, the share of SM time outside the steps, and how a
static order (round robin or snake over the launch order, one block per SM) would balance the measured block costs
against a greedy one (the hardware's, or a persistent kernel's counter). Where <preset>_fwdtrace_cold.bin is there
too (the same launch after a second of idle GPU), it prints that one as well.

  python3 scripts/fwd_trace.py DIR [preset ...]     (standard library only)
"""
import array
import heapq
import os
import sys

WORDS = 16


def load(path):
    a = array.array("Q")
    with open(path, "rb") as f:
        a.frombytes(f.read())
    if len(a) % WORDS:
        raise SystemExit(f"{path}: {len(a)} words, not a multiple of {WORDS}")
    return [a[i:i + WORDS] for i in range(0, len(a), WORDS)]


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def makespan_static(costs, sms, snake):
    load_ = [0.0] * sms
    for i, c in enumerate(costs):
        r, b = divmod(i, sms)
        load_[sms - 1 - b if snake and r % 2 else b] += c
    return max(load_)


def makespan_greedy(costs, sms):
    h = [0.0] * sms
    for c in costs:
        heapq.heappush(h, heapq.heappop(h) + c)
    return max(h)


def report(name, blocks):
    blocks = [b for b in blocks if b[1] and b[5]]  # blocks that wrote their stamps
    if not blocks:
        print(f"{name}: no stamped blocks")
        return
    end = lambda b: max(b[5], b[7])
    by_sm = {}
    for b in blocks:
        by_sm.setdefault(b[0], []).append(b)
    gaps, spans = [], []
    for bs in by_sm.values():
        bs.sort(key=lambda b: b[1])
        gaps += [n[1] - end(p) for p, n in zip(bs, bs[1:])]
        spans.append(end(bs[-1]) - bs[0][1])
    steps = [b[6] for b in blocks]
    per_step = [(b[4] - b[3]) / (b[6] - 1) for b in blocks if b[6] > 1]
    overhead = [(b[3] - b[1]) + (end(b) - b[4]) for b in blocks]
    clock = [(b[5] - b[1]) / (b[12] - b[11]) for b in blocks if b[12] > b[11]]  # stamps of run 77 on
    ghz = f", {mean(clock):.2f} GHz" if clock else ""
    sms = len(by_sm)
    share = (sum(overhead) + mean(gaps) * len(blocks)) / sum(spans)
    print(f"{name}: {len(blocks)} blocks on {sms} SMs, {mean(steps):.1f} steps per block{ghz}")
    print(f"  cycles: start -> Q ready {mean([b[2] - b[1] for b in blocks]):.0f}, -> first K/V ready "
          f"{mean([b[10] - b[1] for b in blocks]):.0f}, -> first S ready {mean([b[3] - b[1] for b in blocks]):.0f}; "
          f"producer issues Q at {mean([b[8] - b[1] for b in blocks]):.0f}")
    print(f"  cycles per step {mean(per_step):.0f}; epilogue {mean([end(b) - b[4] for b in blocks]):.0f}; "
          f"gap to the next block {mean(gaps):.0f}")
    print(f"  outside the steps: {mean(overhead) + mean(gaps):.0f} cycles per block "
          f"({(mean(overhead) + mean(gaps)) / mean(per_step):.1f} steps), {100 * share:.1f}% of SM time")
    costs = [float(end(b) - b[1]) for b in blocks]  # whole blocks, in launch order (the file's)
    ideal = sum(costs) / sms
    print(f"  makespan of the measured block costs over {sms} SMs, / ideal: greedy {makespan_greedy(costs, sms) / ideal:.4f}, "
          f"snake {makespan_static(costs, sms, True) / ideal:.4f}, round robin {makespan_static(costs, sms, False) / ideal:.4f}")


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    d = sys.argv[1]
    names = sys.argv[2:] or ["fixed5k", "varied5k", "dominant", "art-fixed5k"]
    for name in names:
        path = os.path.join(d, f"{name}_fwdtrace.bin")
        if os.path.exists(path):
            report(f"{name} (sustained)", load(path))
        else:
            print(f"{name}: {path} not found")
        cold = os.path.join(d, f"{name}_fwdtrace_cold.bin")
        if os.path.exists(cold):
            report(f"{name} (after 1 s idle)", load(cold))


if __name__ == "__main__":
    main()
