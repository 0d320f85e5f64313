#!/usr/bin/env python3
"""The oracle's regret offline: which rule picks the faster SM90 GEMM kernel (decode or prefill)
at every point of a report, from quantities the device can compute from the plan's per-expert
row counts and constants `moekit tune` measures on uniform routing.

Runs on any machine (no GPU): the per-expert row counts of every report point come from
`moekit bench --expert-counts` (the bench's own router logits, routed on the CPU; the report's
active_experts / max_expert_rows check them), the times from the report JSON (data/report/), the
tuning points from its "tuning" table.

    bench/regret_study.py [--moekit build/moekit] [--report data/report/nvidia_h100_80gb_hbm3.json]
    bench/regret_study.py --bench FILE.json ...   (rows of `moekit bench --json` with both kernels:
                                                    the measured regret of the layer's path, per
                                                    routing, and which rows the device chose)

The rules, per (shape, format) entry of the table:
  T only        the table's crossover (the layer's rule before the device choice)
  T only, tol   the crossover with the tolerance (oracle/tuning.h kCrossoverTolerance), under
                uniform routing and, where the table has them, Zipf points too
  device        T only, tol outside the band (ended where the entry's points show a clear
                winner, kClearWin); inside it the prefill kernel iff
                streams >= theta x active: streams = sum_e ceil(c_e / 8), the decode kernel's
                weight streams, active = the experts with rows, theta the entry's stream ratio
                (oracle/tuning.h stream_ratio_from_points, from the uniform tuning points).
Prints the worst regret of each rule and the points over the target.
"""

import argparse
import collections
import json
import math
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 0.03
DECODE_ROWS = 8          # rows per decode chunk (oracle/kernel_choice.h kDecodeRows)
# oracle/kernel_choice.h decode_chunk_rows: 16-row chunks from 6 rows per expert on average (8 with
# fewer than 32 experts), 24-row chunks from 16; at most 256 experts.
CHUNK16_MIN_ROWS, CHUNK16_MIN_ROWS_FEW, MANY_EXPERTS, CHUNK24_MIN_ROWS, CHUNK_MAX_EXPERTS = 6, 8, 32, 16, 256


def decode_rows(experts, routed_rows):
    if experts > CHUNK_MAX_EXPERTS:
        return DECODE_ROWS
    if routed_rows >= CHUNK24_MIN_ROWS * experts:
        return 24
    min16 = CHUNK16_MIN_ROWS if experts >= MANY_EXPERTS else CHUNK16_MIN_ROWS_FEW
    return 16 if routed_rows >= min16 * experts else DECODE_ROWS
SLAB_ROWS = 32           # oracle/tuning.h kSlabRows
TOLERANCE = 0.025        # oracle/tuning.h kCrossoverTolerance
BAND_BELOW, BAND_ABOVE = 4, 2  # oracle/tuning.h kBandBelow / kBandAbove
CHOICE_COST_US = 3.0     # oracle/tuning.h kChoiceCostUs
STREAM_WEIGHT = {8: 1.0, 16: 1.1, 24: 1.2}  # oracle/kernel_choice.h stream_weight
BAND_MIN = 9             # oracle/tuning.h kBandMinTokens: at most 8 rows per expert below
CLEAR_WIN = 1.3          # oracle/tuning.h kClearWin: a point with a clear winner ends the band


def features(counts):
    """counts: every expert's rows (len = E, sum = tokens x k)."""
    rows = decode_rows(len(counts), sum(counts))
    slabs = sum(-(-c // SLAB_ROWS) for c in counts)
    streams = sum(-(-c // rows) for c in counts) * STREAM_WEIGHT[rows]
    return slabs, streams


def band(frm, points=()):
    """oracle/tuning.cpp entry_band: crossover_band, ended on each side at a point of the entry's
    (uniform) points where one kernel took CLEAR_WIN x the other's time."""
    lo, hi = max(BAND_MIN, -(-frm // BAND_BELOW)), frm * BAND_ABOVE
    if hi <= lo:
        return lo, hi
    for p in points:
        d, q = p.get("decode_us", 0), p.get("prefill_us", 0)
        if d <= 0 or q <= 0:
            continue
        if frm <= p["tokens"] < hi and d >= CLEAR_WIN * q:
            hi = p["tokens"]
        if lo <= p["tokens"] < frm and q >= CLEAR_WIN * d:
            lo = p["tokens"] + 1
    return lo, hi


def crossover(points, tol):
    """oracle/tuning.cpp crossover_from_points: the smallest measured count from which the prefill
    kernel is within tol of the decode kernel at every larger count (-1: none), under uniform
    routing and, at points that have them (tables since 2026-11-24), under Zipf routing."""
    frm = -1
    for p in sorted(points, key=lambda p: -p["tokens"]):
        if p["prefill_us"] > p["decode_us"] * (1 + tol):
            break
        zd, zp = p.get("zipf_decode_us", 0), p.get("zipf_prefill_us", 0)
        if zd > 0 and zp > zd * (1 + tol):
            break
        frm = p["tokens"]
    return frm


SLOPES = [round(-0.6 + 0.02 * i, 2) for i in range(41)]  # oracle/tuning.h kSlopeMin..kSlopeMax


def stream_ratio(points, frm):
    """oracle/tuning.cpp stream_ratio_from_points: over the points of the entry's band with counts,
    uniform and Zipf (zipf_slabs / zipf_streams), the threshold a + b log2(T / frm) in weighted
    streams per slab whose choices have the smallest worst regret (chosen + CHOICE_COST_US over the
    faster), a halfway between neighbouring cases' intercepts, the flatter b of equal fits; (0, 0):
    none, or the token-count rule is no worse."""
    if frm <= 0:
        return 0.0, 0.0
    lo, hi = band(frm, points)
    cases = []
    for p in points:
        if not lo <= p["tokens"] < hi:
            continue
        x = math.log2(p["tokens"] / frm)
        for st, sl, d, q in ((p.get("streams", 0), p.get("slabs", 0), p["decode_us"], p["prefill_us"]),
                             (p.get("zipf_streams", 0), p.get("zipf_slabs", 0), p.get("zipf_decode_us", 0),
                              p.get("zipf_prefill_us", 0))):
            if st > 0 and sl > 0 and d > 0 and q > 0:
                cases.append((st / sl, x, d, q, p["tokens"] >= frm))
    if not cases:
        return 0.0, 0.0
    by_tokens = max((q if bt else d) / min(d, q) - 1 for r, x, d, q, bt in cases)
    best, best_worst = (0.0, 0.0), float("inf")
    for b in SLOPES:
        vs = sorted({r - b * x for r, x, d, q, bt in cases})
        for a in [vs[0] - 0.01 * abs(vs[0])] + [0.5 * (u + v) for u, v in zip(vs, vs[1:])] + [vs[-1] + 0.01 * abs(vs[-1])]:
            worst = max(((q if r >= a + b * x else d) + CHOICE_COST_US) / min(d, q) - 1 for r, x, d, q, bt in cases)
            if worst < best_worst - 1e-12 or (abs(worst - best_worst) <= 1e-12 and abs(b) < abs(best[1]) - 1e-12):
                best, best_worst = (a, b), worst
    return (0.0, 0.0) if by_tokens <= best_worst or best[0] <= 0 else best


def ratio_at(e, T):
    """kernel_choice.h stream_ratio_at."""
    a, b = e["theta"]
    if a <= 0:
        return 0.0
    return max(0.001, a + b * math.log2(T / e["from_tol"])) if b else a


def pick(rule, e, T, slabs, streams):
    """True: the prefill kernel."""
    if rule == "T only":
        return e["prefill_from"] >= 0 and T >= e["prefill_from"]
    frm = e["from_tol"]
    if rule == "T only, tol" or e["theta"][0] <= 0 or frm < 0:
        return frm >= 0 and T >= frm
    lo, hi = band(frm, e["points"])
    if lo <= T < hi:
        return streams >= ratio_at(e, T) * slabs
    return T >= frm


def expert_counts(moekit, rows, extra_tokens=()):
    """(shape, routing, tokens) -> the per-expert rows of the bench's routing (its default seed and
    Zipf exponent), from `moekit bench --expert-counts` (CPU)."""
    counts = {}
    for s in sorted({r["shape"] for r in rows}):
        toks = sorted({r["tokens"] for r in rows if r["shape"] == s} | set(extra_tokens))
        out = subprocess.run([moekit, "bench", "--expert-counts", "--shape", s, "--routing", "uniform,zipf",
                              "--tokens", ",".join(map(str, toks))], check=True, capture_output=True, text=True)
        for line in out.stdout.splitlines():
            j = json.loads(line)
            counts[(s, j["routing"], j["tokens"])] = j["counts"]
    return counts


def check_counts(rows, counts):
    """The rows' active experts and largest expert (the GPU's routing) against the CPU's counts."""
    def summary(c):
        return sum(1 for x in c if x), max(c)
    bad = [r for r in rows if summary(counts[(r["shape"], r["routing"], r["tokens"])])
           != (r["active_experts"], r["max_expert_rows"])]
    print(f"counts: {len(rows) - len(bad)} of {len(rows)} points match the rows' active experts and largest "
          f"expert")
    for r in bad:
        act, mx = summary(counts[(r["shape"], r["routing"], r["tokens"])])
        print(f"  differs: {r['shape']} {r['routing']} {r['tokens']} (row: {r['active_experts']} active, "
              f"{r['max_expert_rows']} rows at most; CPU: {act}, {mx})")


def measured(files, moekit):
    """The regret of the layer's path in bench rows: gemm_us over the faster kernel alone."""
    rows = []
    for f in files:
        j = json.load(open(f))
        rows += j if isinstance(j, list) else j.get("bench", [])
    rows = [r for r in rows if r.get("decode_us", 0) > 0 and r.get("prefill_us", 0) > 0 and r.get("gemm_us", 0) > 0]
    if not rows:
        print("no rows with both kernels' times")
        return 1
    if os.path.exists(moekit):
        check_counts(rows, expert_counts(moekit, rows))
    over = 0
    for routing in sorted({r["routing"] for r in rows}):
        sel = [r for r in rows if r["routing"] == routing]
        g = [(r["gemm_us"] / min(r["decode_us"], r["prefill_us"]) - 1, r) for r in sel]
        worst, wr = max(g, key=lambda x: x[0])
        bad = [(x, r) for x, r in g if x > TARGET]
        over += len(bad)
        dev = sum(1 for r in sel if r.get("kernel_choice") == "device")
        print(f"{routing}: {len(sel)} points ({dev} chosen on the device), worst regret {100 * worst:.1f}% "
              f"({wr['shape']} {wr['format']} {wr['tokens']}), {len(bad)} over {100 * TARGET:.0f}%")
        for x, r in sorted(bad, key=lambda b: -b[0]):
            print(f"    {r['shape']} {r['format']} {r['tokens']}: {100 * x:.1f}% ({r['kernel']}, "
                  f"{r.get('kernel_choice', 'tokens')}; decode {r['decode_us']:.1f} prefill {r['prefill_us']:.1f} "
                  f"path {r['gemm_us']:.1f} us)")
    # What the device choice costs: the layer's path over the chosen kernel alone.
    dead = sorted(r["gemm_us"] - (r["prefill_us"] if r["kernel"] == "prefill" else r["decode_us"])
                  for r in rows if r.get("kernel_choice") == "device")
    if dead:
        print(f"device choice: the path over the chosen kernel alone, median {dead[len(dead) // 2]:.1f} us, "
              f"largest {dead[-1]:.1f} us ({len(dead)} points)")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moekit", default=os.path.join(REPO, "build", "moekit"))
    ap.add_argument("--report", default=os.path.join(REPO, "data", "report", "nvidia_h100_80gb_hbm3.json"))
    ap.add_argument("--bench", nargs="+", help="bench JSON files: the measured regret of the layer's path")
    ap.add_argument("--dead-us", type=float, default=0.0,
                    help="what the launches of the kernel not chosen (and the choice kernel) add to the device "
                         "rule's path in the band, in us (default 0; the GPU step measures it)")
    a = ap.parse_args()
    if a.bench:
        return measured(a.bench, a.moekit)
    rep = json.load(open(a.report))
    rows = rep["bench"]
    shapes = sorted({r["shape"] for r in rows})
    tune_tokens = sorted({p["tokens"] for e in rep["tuning"]["entries"] for p in e["points"]})
    counts = expert_counts(a.moekit, rows, tune_tokens)
    check_counts(rows, counts)

    entries = {}
    for e in rep["tuning"]["entries"]:
        pts = []
        for p in e["points"]:
            sl, st = features(counts[(e["label"], "uniform", p["tokens"])])
            zsl, zst = features(counts[(e["label"], "zipf", p["tokens"])])
            pts.append(dict(p, slabs=sl, streams=st, zipf_slabs=zsl, zipf_streams=zst))
        frm = crossover(pts, TOLERANCE)
        entries[(e["label"], e["format"])] = dict(prefill_from=e["prefill_from"], from_tol=frm,
                                                  theta=stream_ratio(pts, frm), points=pts)

    rules = ["T only", "T only, tol", "device"]
    worst = {rl: collections.defaultdict(lambda: (0.0, None)) for rl in rules}
    over = {rl: [] for rl in rules}
    for r in rows:
        e = entries[(r["shape"], r["format"])]
        act, st = features(counts[(r["shape"], r["routing"], r["tokens"])])
        best = min(r["decode_us"], r["prefill_us"])
        lo, hi = band(e["from_tol"], e["points"])
        for rl in rules:
            t = r["prefill_us"] if pick(rl, e, r["tokens"], act, st) else r["decode_us"]
            if rl == "device" and e["theta"][0] > 0 and lo <= r["tokens"] < hi:
                t += a.dead_us
            g = t / best - 1
            key = r["routing"]
            if g > worst[rl][key][0]:
                worst[rl][key] = (g, f"{r['shape']} {r['format']} {r['tokens']}")
            if g > TARGET:
                over[rl].append(f"{r['shape']} {r['format']} {r['routing']} {r['tokens']}: {100 * g:.1f}%")
    print(f"\n{len(rows)} points; the target: {100 * TARGET:.0f}%")
    for rl in rules:
        w = "; ".join(f"{k} {100 * v[0]:.1f}% ({v[1]})" for k, v in sorted(worst[rl].items()))
        print(f"{rl:12s} worst: {w}; {len(over[rl])} points over")
        for o in over[rl]:
            print(f"    {o}")
    print("\nentry                       crossover  tol   theta  slope")
    for (s, f), e in sorted(entries.items()):
        print(f"{s:16s} {f:6s} {e['prefill_from']:9d} {e['from_tol']:5d} {e['theta'][0]:7.3f} {e['theta'][1]:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
