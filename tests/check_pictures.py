#!/usr/bin/env python3
"""Reads treecp's pictures and traces back with independent parsers (Python's XML and JSON) and checks
what they claim against the plan and the row they were drawn from.

  check_pictures.py plan SVG PLAN_JSON ROW_JSON...  plan pictures (`treecp plan --svg`), one triple each
  check_pictures.py scaling SVG EXPECTED_JSON       weak-scaling curves; EXPECTED: [{preset, method, points: [[cp, ms]...]}]
  check_pictures.py trace TRACE_JSON RANKS          a Chrome trace (`treecp run --trace`)
  check_pictures.py run-trace TREECP RANKS          runs `treecp run --trace` itself, then checks the trace
  check_pictures.py render SVG...                   renders with rsvg-convert; each PNG has its SVG's size

Exits 0 when every check holds; otherwise prints what failed and exits 1.
"""
import bisect
import json
import os
import struct
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"
PX_TOL = 0.02  # the writer rounds pixel coordinates to 0.01


class Failed(Exception):
    pass


def check(cond, *what):
    if not cond:
        raise Failed(" ".join(str(w) for w in what))


def by_class(root, cls, tag=None):
    return [e for e in root.iter() if e.get("class") == cls and (tag is None or e.tag == SVG + tag)]


def close(a, b, rel=1e-6, abs_=1e-9):
    return abs(a - b) <= abs_ + rel * max(abs(a), abs(b))


# ---- the row and the plan, from their own JSON


def row_geometry(row):
    segs = row["segments"]
    start, depth, pos = [], [], 0
    for s in segs:
        start.append(pos)
        pos += s["length"]
        depth.append(1 if s["parent"] < 0 else depth[s["parent"]] + 1)
    return start, depth, pos


def owner_of(plan):
    bounds, owners = plan["chunk_bounds"], plan["chunk_owner"]

    def owners_in(b, e):
        out = set()
        c = bisect.bisect_right(bounds, b) - 1
        while c < len(owners) and bounds[c] < e:
            out.add(owners[c])
            c += 1
        return out

    return owners_in


def check_plan(svg_path, plan_path, row_path):
    root = ET.parse(svg_path).getroot()
    plan = json.load(open(plan_path))
    row = json.load(open(row_path))
    start, depth, S = row_geometry(row)
    owners_in = owner_of(plan)
    cp = plan["cp"]
    check(plan["tokens"] == S, "plan and row disagree on tokens")

    # The ownership strip tiles [0, S) with maximal one-owner runs, in physical order.
    tree = by_class(root, "tree", "g")
    check(len(tree) == 1, "one tree group expected, found", len(tree))
    tree = tree[0]
    check(int(tree.get("data-tokens")) == S, "tree data-tokens", tree.get("data-tokens"), "!= row tokens", S)
    check(int(tree.get("data-depths")) == max(depth), "tree depths", tree.get("data-depths"), "!= row depth", max(depth))
    owned = sorted(by_class(tree, "owned", "rect"), key=lambda e: int(e.get("data-begin")))
    check(owned, "no ownership runs")
    at, last = 0, None
    for e in owned:
        b, en, o = int(e.get("data-begin")), int(e.get("data-end")), int(e.get("data-owner"))
        check(b == at and en > b, "ownership runs do not tile the row at token", at)
        check(owners_in(b, en) == {o}, "run [", b, en, ") drawn as rank", o, "but owned by", owners_in(b, en))
        check(o != last, "two neighbouring runs of rank", o, "are not merged")
        at, last = en, o
    check(at == S, "ownership runs end at", at, "not", S)
    x0 = float(owned[0].get("x"))
    x1 = float(owned[-1].get("x")) + float(owned[-1].get("width"))
    scale = (x1 - x0) / S

    def check_x(e, b, en):
        check(abs(float(e.get("x")) - (x0 + b * scale)) <= PX_TOL, "rect of [", b, en, ") at x", e.get("x"))
        check(abs(float(e.get("width")) - (en - b) * scale) <= PX_TOL + 1e-9, "rect of [", b, en, ") width", e.get("width"))

    for e in owned:
        check_x(e, int(e.get("data-begin")), int(e.get("data-end")))

    # One row per depth: pieces inside their segment, at its depth, in their owner's colour; pieces and
    # aggregated columns together account for every token of that depth exactly once.
    rows = by_class(tree, "tree-row", "g")
    check(sorted(int(r.get("data-depth")) for r in rows) == list(range(1, max(depth) + 1)), "tree rows by depth")
    colour_of = {int(e.get("data-owner")): e.get("fill") for e in owned}
    for r in rows:
        d = int(r.get("data-depth"))
        want = sum(row["segments"][s]["length"] for s in range(len(depth)) if depth[s] == d)
        got, prev_end = 0, -1
        pieces = sorted(by_class(r, "piece", "rect"), key=lambda e: int(e.get("data-begin")))
        for e in pieces:
            s, b, en, o = (int(e.get(k)) for k in ("data-segment", "data-begin", "data-end", "data-owner"))
            check(depth[s] == d, "segment", s, "drawn at depth", d, "has depth", depth[s])
            check(start[s] <= b < en <= start[s] + row["segments"][s]["length"], "piece [", b, en, ") outside segment", s)
            check(owners_in(b, en) == {o}, "piece [", b, en, ") drawn as rank", o, "owned by", owners_in(b, en))
            check(b >= prev_end, "pieces overlap at token", b)
            check(o not in colour_of or e.get("fill") == colour_of[o], "piece of rank", o, "in another colour")
            check_x(e, b, en)
            prev_end = en
            got += en - b
        for e in by_class(r, "bin", "rect"):
            t, b, en = int(e.get("data-tokens")), int(e.get("data-begin")), int(e.get("data-end"))
            check(0 < t <= en - b, "column with", t, "tokens over [", b, en, ")")
            o = int(e.get("data-owner"))
            check(o in owners_in(b, en), "column [", b, en, ") drawn as rank", o, "owned by", owners_in(b, en))
            got += t
        check(got == want, "depth", d, "draws", got, "tokens, the row has", want)

    # The schedule: one compute lane and at least one transfer lane per rank.
    sched = by_class(root, "schedule", "g")
    check(len(sched) == 1, "one schedule group expected")
    sched = sched[0]
    check(int(sched.get("data-ranks")) == cp, "schedule ranks", sched.get("data-ranks"), "!= cp", cp)
    makespan = float(sched.get("data-makespan-ms"))
    want_makespan = max(r["predicted_forward_ms"] + r["predicted_backward_ms"] for r in plan["ranks"])
    check(close(makespan, want_makespan), "makespan", makespan, "!= plan's", want_makespan)
    line = by_class(root, "makespan", "line")
    check(len(line) == 1 and float(line[0].get("data-ms")) == makespan, "one makespan line at the makespan")
    lanes = by_class(sched, "lane", "g")
    compute = {}
    transfer = {}
    for lane in lanes:
        r = int(lane.get("data-rank"))
        check(0 <= r < cp, "lane of rank", r)
        if lane.get("data-lane") == "compute":
            check(r not in compute, "two compute lanes for rank", r)
            compute[r] = lane
        else:
            check(lane.get("data-lane") == "transfer", "unknown lane", lane.get("data-lane"))
            transfer.setdefault(r, []).append(lane)
    check(sorted(compute) == list(range(cp)) and sorted(transfer) == list(range(cp)), "a compute and a transfer lane per rank")

    def spans(lane):
        out = []
        for e in by_class(lane, "span", "rect"):
            out.append((float(e.get("data-begin-ms")), float(e.get("data-end-ms")), e.get("data-kind"), e))
        return sorted(out, key=lambda s: (s[0], s[1]))

    first = spans(compute[0])[0]
    t0 = float(first[3].get("x"))
    tscale = (float(line[0].get("x1")) - t0) / makespan

    def check_t(e, b, en):
        check(abs(float(e.get("x")) - (t0 + b * tscale)) <= PX_TOL, "span", b, en, "at x", e.get("x"))
        check(abs(float(e.get("width")) - (en - b) * tscale) <= PX_TOL + 1e-9, "span", b, en, "width", e.get("width"))

    for r in range(cp):
        rp = plan["ranks"][r]
        fwd = float(compute[r].get("data-forward-ms"))
        check(close(fwd, rp["predicted_forward_ms"]), "rank", r, "forward", fwd, "!= plan's", rp["predicted_forward_ms"])
        check(close(float(compute[r].get("data-total-ms")), rp["predicted_forward_ms"] + rp["predicted_backward_ms"]),
              "rank", r, "total differs from the plan's")
        # Compute: gapless and ordered from 0 to the makespan (idle is drawn, never left blank).
        at = 0.0
        seen = {}
        for b, en, kind, e in spans(compute[r]):
            check(b == at, "rank", r, "compute lane: span at", b, "after", at, "(a gap or an overlap)")
            check(en > b, "rank", r, "empty span at", b)
            check(kind in ("token-local", "local", "remote", "wait", "idle"), "rank", r, "compute lane has a", kind)
            if kind != "idle":
                passname = e.get("data-pass")
                check(en <= fwd if passname == "forward" else b >= fwd, "rank", r, kind, "span", b, en, "on the wrong side of the forward's end", fwd)
                seen.setdefault((kind, passname), []).append(int(e.get("data-wave")))
            check_t(e, b, en)
            at = en
        check(at == makespan, "rank", r, "compute lane ends at", at, "not the makespan", makespan)
        # Stages drawn are the plan's non-empty stages, in both passes.
        stages = rp["stages"]
        for p in ("forward", "backward"):
            check((stages[0]["pairs"] > 0) == (("local", p) in seen), "rank", r, p, "local stage")
            waves = sorted(w for w in seen.get(("remote", p), []))
            want = [w - 1 for w in range(1, len(stages)) if stages[w]["pairs"] > 0]
            check(waves == want, "rank", r, p, "remote stages", waves, "!= plan's", want)
        # Transfers: every row ordered without overlap, inside the makespan; a KV fetch for every wave
        # that brings this rank data.
        fetched = []
        for lane in transfer[r]:
            prev = 0.0
            for b, en, kind, e in spans(lane):
                check(kind in ("fetch", "return"), "rank", r, "transfer lane has a", kind)
                check(0 <= b < en <= makespan, "rank", r, kind, b, en, "outside [0, makespan]")
                check(b >= prev, "rank", r, "transfer row overlaps at", b)
                check_t(e, b, en)
                prev = en
                if kind == "fetch":
                    fetched.append(int(e.get("data-wave")))
        want = [w - 1 for w in range(1, len(stages)) if any(stages[w]["recv"][p] for p in range(cp))]
        check(sorted(fetched) == want, "rank", r, "fetches", sorted(fetched), "!= plan's waves with data", want)


def check_scaling(svg_path, expected_path):
    root = ET.parse(svg_path).getroot()
    expected = json.load(open(expected_path))
    presets = []
    for s in expected:
        if s["preset"] not in presets:
            presets.append(s["preset"])
    panels = by_class(root, "panel", "g")
    check([p.get("data-preset") for p in panels] == presets, "panels", [p.get("data-preset") for p in panels], "!= presets", presets)
    for panel in panels:
        want = {s["method"]: s["points"] for s in expected if s["preset"] == panel.get("data-preset")}
        series = by_class(panel, "series", "g")
        check(sorted(s.get("data-method") for s in series) == sorted(want), "panel", panel.get("data-preset"), "methods")
        points = []
        for s in series:
            circles = [c for c in s.iter(SVG + "circle")]
            got = [[int(c.get("data-cp")), float(c.get("data-ms"))] for c in circles]
            pts = want[s.get("data-method")]
            check(len(got) == len(pts) and all(g[0] == p[0] and close(g[1], p[1]) for g, p in zip(got, pts)),
                  "series", s.get("data-method"), "points", got, "!=", pts)
            poly = s.find(SVG + "polyline")
            xy = [tuple(map(float, p.split(","))) for p in poly.get("points").split()]
            check(len(xy) == len(circles), "polyline and markers differ")
            for (x, y), c in zip(xy, circles):
                check(abs(x - float(c.get("cx"))) < 1e-9 and abs(y - float(c.get("cy"))) < 1e-9, "polyline misses a marker")
            for c in circles:
                points.append((int(c.get("data-cp")), float(c.get("data-ms")), float(c.get("cx")), float(c.get("cy"))))
        # One x per CP, increasing with CP; y linear in ms, higher ms drawn higher.
        xs = {}
        for cp, _, x, _ in points:
            check(abs(xs.setdefault(cp, x) - x) <= PX_TOL, "cp", cp, "drawn at two x positions")
        order = sorted(xs)
        check(all(xs[a] < xs[b] for a, b in zip(order, order[1:])), "x does not increase with cp")
        lo, hi = min(points, key=lambda p: p[1]), max(points, key=lambda p: p[1])
        if hi[1] > lo[1]:
            slope = (hi[3] - lo[3]) / (hi[1] - lo[1])
            check(slope < 0, "a longer time is not drawn higher")
            for _, ms, _, y in points:
                check(abs(y - (lo[3] + (ms - lo[1]) * slope)) <= 2 * PX_TOL, "y is not linear in ms at", ms)


def check_trace(trace_path, ranks):
    doc = json.load(open(trace_path))
    events = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    check(sorted(procs) == list(range(ranks)), "processes", sorted(procs), "!= ranks", ranks)
    for pid, name in procs.items():
        check(name == "rank %d" % pid, "process", pid, "named", name)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    check(spans, "no spans")
    by_thread = {}
    for e in spans:
        check((e["pid"], e["tid"]) in threads, "span", e["name"], "on an unnamed thread")
        check(e["dur"] >= 0 and e["ts"] >= 0, "span", e["name"], "has a negative time")
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    # On one thread, spans nest or follow one another (what a viewer stacks).
    for key, evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            end = e["ts"] + e["dur"]
            while stack and stack[-1] <= e["ts"] + 1e-6:
                stack.pop()
            check(not stack or end <= stack[-1] + 1e-6, "thread", key, "span", e["name"], "overlaps without nesting")
            stack.append(end)
    for r in range(ranks):
        for track in ("measured", "predicted"):
            names = [e["name"] for (pid, tid), evs in by_thread.items() if pid == r and threads[(pid, tid)].startswith(track) for e in evs]
            check("forward" in names and "backward" in names, "rank", r, track, "has no forward/backward spans:", names)
        pf = [e for e in spans if e["pid"] == r and threads[(r, e["tid"])] == "predicted" and e["name"] in ("forward", "backward")]
        pf.sort(key=lambda e: e["ts"])
        check(len(pf) == 2 and abs(pf[0]["ts"] + pf[0]["dur"] - pf[1]["ts"]) <= 1e-6 * max(1, pf[1]["ts"]),
              "rank", r, "predicted backward does not follow its forward")


def run_trace(treecp, ranks):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        out = subprocess.run([treecp, "run", "--ranks", str(ranks), "--preset", "varied5k", "--scale", "64",
                              "--layout", "zigzag", "--trace", path, "--json"], capture_output=True, text=True)
        check(out.returncode == 0, "treecp run failed:", out.stdout[-2000:], out.stderr[-2000:])
        report = json.loads(out.stdout)
        check(report["trace"] == path, "the report does not name the trace")
        check_trace(path, ranks)
        # The predicted spans are the plan's: each rank's predicted forward lasts its predicted forward ms.
        doc = json.load(open(path))
        threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
                   if e.get("ph") == "M" and e["name"] == "thread_name"}
        for r, rank in enumerate(report["per_rank"]):
            fwd = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e["pid"] == r and e["name"] == "forward"
                   and threads[(r, e["tid"])] == "predicted"]
            check(len(fwd) == 1 and close(fwd[0]["dur"] / 1000.0, rank["predicted_forward_ms"], rel=1e-6, abs_=1e-9),
                  "rank", r, "predicted forward", fwd, "!=", rank["predicted_forward_ms"])
            # The runtime's stages are measured too, each inside its pass.
            measured = {e["name"]: e for e in doc["traceEvents"] if e.get("ph") == "X" and e["pid"] == r
                        and threads[(r, e["tid"])] == "measured"}
            for stage, passname in (("fwd local", "forward"), ("bwd local", "backward")):
                check(stage in measured, "rank", r, "has no measured", stage, "span")
                st, p = measured[stage], measured[passname]
                check(p["ts"] <= st["ts"] and st["ts"] + st["dur"] <= p["ts"] + p["dur"] + 1e-6,
                      "rank", r, stage, "is not inside its measured", passname)


def render(svg_path):
    root = ET.parse(svg_path).getroot()
    with tempfile.TemporaryDirectory() as d:
        png = os.path.join(d, "out.png")
        out = subprocess.run(["rsvg-convert", "-o", png, svg_path], capture_output=True, text=True)
        check(out.returncode == 0 and not out.stderr.strip(), "rsvg-convert failed:", out.stderr)
        head = open(png, "rb").read(24)
        check(head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG")
        w, h = struct.unpack(">II", head[16:24])
        check((w, h) == (round(float(root.get("width"))), round(float(root.get("height")))),
              "PNG is", w, "x", h, "the SVG", root.get("width"), "x", root.get("height"))


def main(argv):
    try:
        mode = argv[1]
        if mode == "plan":
            check(len(argv) > 2 and (len(argv) - 2) % 3 == 0, "plan: give SVG PLAN_JSON ROW_JSON triples")
            for i in range(2, len(argv), 3):
                try:
                    check_plan(argv[i], argv[i + 1], argv[i + 2])
                except Failed as e:
                    raise Failed(argv[i] + ": " + str(e))
        elif mode == "scaling":
            check_scaling(argv[2], argv[3])
        elif mode == "trace":
            check_trace(argv[2], int(argv[3]))
        elif mode == "run-trace":
            run_trace(argv[2], int(argv[3]))
        elif mode == "render":
            for svg in argv[2:]:
                try:
                    render(svg)
                except Failed as e:
                    raise Failed(svg + ": " + str(e))
        else:
            raise Failed("unknown mode " + mode)
    except Failed as e:
        print("check_pictures:", mode, "failed:", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
