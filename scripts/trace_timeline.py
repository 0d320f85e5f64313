#!/usr/bin/env python3
"""Timeline of the fused GEMM kernel from `moekit bench --trace --trace-file F` task records.

Each record is one task: when the producer issued its first stage, and when consumer warp 0 of its
CTA found that stage in shared memory and finished its stores. A task's bytes are spread evenly over that span (the copies run a
few stages ahead of it, so the consumed rate lags the memory rate by about one stage).

Usage: trace_timeline.py FILE.csv [--task-bytes B0,B1] [--bucket US]
  --task-bytes  weight and scale bytes of one task of phase 0 and of phase 1 (default 1: the
                rates are then in tasks per us)
"""
import argparse
import collections
import csv
import statistics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--task-bytes", default="1,1")
    ap.add_argument("--bucket", type=float, default=2.0)
    a = ap.parse_args()
    tb = [float(x) for x in a.task_bytes.split(",")]
    rec, issued = [], []
    with open(a.csv) as f:
        for r in csv.DictReader(f):
            rec.append((int(r["cta"]), int(r["phase"]), float(r["start_us"]), float(r["end_us"])))
            issued.append(float(r["issued_us"]))
    if not rec:
        print("no task records")
        return
    end = max(e for _, _, _, e in rec)
    nb = int(end / a.bucket) + 1
    rate = [0.0] * nb
    busy = [0.0] * nb
    for _, ph, s, e in rec:
        span = max(e - s, 1e-3)
        for b in range(int(s / a.bucket), int(e / a.bucket) + 1):
            lo, hi = max(s, b * a.bucket), min(e, (b + 1) * a.bucket)
            if hi > lo:
                rate[b] += tb[ph] * (hi - lo) / span
                busy[b] += (hi - lo) / a.bucket
    unit = "TB/s" if tb != [1.0, 1.0] else "tasks/us"
    scale = 1e-6 if unit == "TB/s" else 1.0  # bytes per us -> TB/s
    print(f"{'t_us':>7} {'busy CTAs':>10} {unit:>9}")
    for b in range(nb):
        print(f"{b * a.bucket:7.1f} {busy[b]:10.1f} {rate[b] / a.bucket * scale:9.3f}")
    ctas = sorted({c for c, _, _, _ in rec})
    last_end = {c: max(e for cc, _, _, e in rec if cc == c) for c in ctas}
    last_start = max(s for _, _, s, _ in rec)
    ends = sorted(last_end.values())
    total = sum(tb[ph] for _, ph, _, _ in rec)
    after = sum(tb[ph] * max(0.0, e - max(s, last_start)) / max(e - s, 1e-3) for _, ph, s, e in rec)
    print(f"tasks {len(rec)}, CTAs {len(ctas)}; first data {min(s for _, _, s, _ in rec):.2f} us")
    print(f"CTA ends: first {ends[0]:.2f}, median {ends[len(ends) // 2]:.2f}, last {ends[-1]:.2f} us")
    print(f"last task started at {last_start:.2f} us; work consumed after it: {100 * after / total:.1f}%")
    lat = sorted(s - i for (_, _, s, _), i in zip(rec, issued))
    print(f"first stage issued -> ready: median {lat[len(lat) // 2]:.2f}, p90 {lat[int(0.9 * len(lat))]:.2f} us")
    # Per CTA, consumer warp 0's idle time between one task's stores and the next task's data.
    per_cta = collections.defaultdict(list)
    for c, ph, s, e in rec:
        per_cta[c].append((s, e, ph))
    gaps = collections.defaultdict(list)
    for v in per_cta.values():
        v.sort()
        for (s0, e0, p0), (s1, _, p1) in zip(v, v[1:]):
            gaps[(p0, p1)].append(s1 - e0)
    for k in sorted(gaps):
        g = gaps[k]
        print(f"gap phase {k[0]} -> {k[1]}: {len(g)} gaps, median {statistics.median(g):.2f}, "
              f"mean {statistics.mean(g):.2f} us")
    for ph in sorted({ph for _, ph, _, _ in rec}):
        d = sorted(e - s for _, p, s, e in rec if p == ph)
        print(f"phase {ph} task span: median {d[len(d) // 2]:.2f} us")


if __name__ == "__main__":
    main()
