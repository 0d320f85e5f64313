#!/usr/bin/env python3
"""The performance report: docs/REPORT.md and its plots, made from the JSON of a GPU run.

Regenerate it (one command, from the repository root; the project's Python environment brings
matplotlib):

    "$(scripts/python_env.sh)" scripts/report.py

It reads every data/report/*.json (one per GPU model, written on the GPU machine by
scripts/report_gpu.sh: `moekit bench` rows of every preset, format and routing, the peers' rows,
the tuning table of `moekit tune`) and writes docs/REPORT.md and docs/report/*.png. Any part
may be missing (a preset, a format, a routing, the peers, the time split, the tuning): what is
there is reported and what is not is named.

    scripts/report.py [JSON ...] [--md docs/REPORT.md] [--plots docs/report]
    scripts/report.py collect DIR -o FILE   (on the GPU machine: DIR's pieces into one JSON;
                                             needs no matplotlib)
"""

import argparse
import glob
import json
import math
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = ["gpt-oss-120b", "gpt-oss-20b", "deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b",
           "deepseek-v4-pro", "deepseek-v4-flash", "deepseek-v4.1-flash"]
FORMATS = ["mxfp4", "nvfp4", "mxfp8", "bf16"]
ROUTINGS = ["uniform", "zipf"]
PARTS = ["routing", "permute", "gemm1", "gemm2", "finalize"]
SPLIT_TOKENS = [1, 64, 1024, 8192]
REGRET_TARGET = 3.0  # percent


def slug(s):
    return re.sub(r"[^a-z0-9]+", "_", s.lower()).strip("_")


def num(v):
    """A finite float, or None."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def pos(v):
    f = num(v)
    return f if f is not None and f > 0 else None


def order(values, known):
    return [v for v in known if v in values] + sorted(v for v in values if v not in known)


# ---- collect (GPU machine) ---------------------------------------------------------------------

def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"report: skipping {path}: {e}", file=sys.stderr)
        return None


def collect(directory, out):
    """bench_*.json (moekit bench --json), peers_*.json (bench/peers.py --json), tuning.json
    (moekit tune --out) and versions.json under DIR into one report JSON."""
    rep = {"schema": 1, "bench": [], "peers": [], "peer_status": [], "tuning": {"entries": []}, "versions": {}}
    for p in sorted(glob.glob(os.path.join(directory, "bench_*.json"))):
        rows = load_json(p)
        if isinstance(rows, list):
            rep["bench"] += [r for r in rows if isinstance(r, dict)]
    for p in sorted(glob.glob(os.path.join(directory, "peers_*.json"))):
        d = load_json(p)
        if isinstance(d, dict):
            rep["peers"] += [r for r in d.get("rows", []) if isinstance(r, dict)]
            for s in d.get("status", []):
                if isinstance(s, dict) and s not in rep["peer_status"]:
                    rep["peer_status"].append(s)
    t = load_json(os.path.join(directory, "tuning.json")) if os.path.exists(os.path.join(directory, "tuning.json")) else None
    if isinstance(t, dict):
        rep["tuning"] = t
    v = load_json(os.path.join(directory, "versions.json")) if os.path.exists(os.path.join(directory, "versions.json")) else None
    if isinstance(v, dict):
        rep["versions"] = v
    gpus = sorted({r.get("device", "") for r in rep["bench"]} - {""})
    rep["gpu"] = gpus[0] if gpus else rep["versions"].get("gpu", "unknown GPU")
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rep, f, indent=1)
        f.write("\n")
    os.replace(tmp, out)
    print(f"report: {len(rep['bench'])} bench rows, {len(rep['peers'])} peer rows, "
          f"{len(rep['tuning'].get('entries', []))} tuning entries -> {out}")


# ---- the numbers -------------------------------------------------------------------------------

def regret_pct(r):
    """The oracle's kernel against the faster of the two measured kernels, in percent."""
    g, d, p = pos(r.get("gemm_us")), pos(r.get("decode_us")), pos(r.get("prefill_us"))
    if g is None or d is None or p is None:
        return None
    return max(0.0, 100.0 * (g / min(d, p) - 1.0))


def roofline_pct(r):
    """The two GEMMs' time against max(weight bytes at the measured copy rate, FLOPs at the
    measured bf16 rate)."""
    g = pos(r.get("gemm_us"))
    if g is None:
        return None
    floors = []
    b, c = pos(r.get("gemm_bytes")), pos(r.get("copy_tbps"))
    if b and c:
        floors.append(b / (c * 1e12) * 1e6)
    f, t = pos(r.get("flops")), pos(r.get("bf16_tflops"))
    if f and t:
        floors.append(f / (t * 1e12) * 1e6)
    return 100.0 * max(floors) / g if floors else None


def pct_bf16(r):
    t, b = pos(r.get("tflops")), pos(r.get("bf16_tflops"))
    return 100.0 * t / b if t and b else None


def split_of(r):
    v = [num(r.get(p + "_us")) for p in PARTS]
    return None if any(x is None for x in v) else [max(0.0, x) for x in v]


def peer_series(rep, preset_dims):
    """{(peer, weights, scope): {(routing, tokens): us}} for the preset's E,k,H,I."""
    out = {}
    for r in rep.get("peers", []):
        if (r.get("E"), r.get("k"), r.get("H"), r.get("I")) != preset_dims:
            continue
        us, T = pos(r.get("us")), r.get("tokens")
        if us is None or not isinstance(T, int):
            continue
        key = (str(r.get("peer", "?")), str(r.get("weights", "?")), str(r.get("scope", "gemms")))
        out.setdefault(key, {})[(r.get("routing", "uniform"), T)] = us
    return out


def peer_label(key):
    peer, weights, scope = key
    return f"{peer} {weights}" + (" (GEMMs only)" if scope == "gemms" else "")


def moekit_time(r, scope):
    return pos(r.get("gemm_us")) if scope == "gemms" else pos(r.get("layer_us"))


def fmt(v, spec="{:.1f}"):
    return "—" if v is None else spec.format(v)


# ---- plots ---------------------------------------------------------------------------------------

COLORS = {"mxfp4": "#1f77b4", "nvfp4": "#2ca02c", "mxfp8": "#ff7f0e", "bf16": "#d62728"}
PEER_COLORS = ["#000000", "#7f7f7f", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
PART_COLORS = {"routing": "#8dd3c7", "permute": "#ffffb3", "gemm1": "#80b1d3", "gemm2": "#fb8072", "finalize": "#bebada"}


def series_labels(fig):
    labels = []
    for ax in fig.axes:
        for h in ax.get_legend_handles_labels()[1]:
            if h not in labels:
                labels.append(h)
    return labels


def log2_tokens(ax):
    """A log-2 token axis labelled 1, 4, 16, ... rather than 2^0, 2^2, 2^4."""
    from matplotlib.ticker import FuncFormatter
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("tokens")


def save(fig, path, manifest):
    fig.savefig(path, dpi=110, bbox_inches="tight")
    manifest[path] = series_labels(fig)
    import matplotlib.pyplot as plt
    plt.close(fig)


def plot_time(plt, rows, peers, title, path, manifest):
    routings = order({r["routing"] for r in rows} | {k[0] for s in peers.values() for k in s}, ROUTINGS)
    fig, axes = plt.subplots(1, max(1, len(routings)), figsize=(6.2 * max(1, len(routings)), 4.4), squeeze=False)
    for ax, routing in zip(axes[0], routings):
        for f in order({r["format"] for r in rows}, FORMATS):
            pts = sorted((r["tokens"], pos(r.get("layer_us"))) for r in rows
                         if r["format"] == f and r["routing"] == routing and r["tokens"] > 0)
            pts = [(t, u) for t, u in pts if u]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3.5, color=COLORS.get(f), label=f"moekit {f}")
        for i, (key, s) in enumerate(sorted(peers.items())):
            pts = sorted((T, us) for (rt, T), us in s.items() if rt == routing and T > 0)
            if pts:
                ax.plot(*zip(*pts), marker="s", ms=3.5, ls="--", color=PEER_COLORS[i % len(PEER_COLORS)],
                        label=peer_label(key))
        log2_tokens(ax)
        ax.set_yscale("log")
        ax.set_ylabel("time (us)")
        ax.set_title(f"{routing} routing")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{title}: the layer (moekit) and the peers, time vs tokens")
    save(fig, path, manifest)


def plot_roofline(plt, rows, title, path, manifest):
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for f in order({r["format"] for r in rows}, FORMATS):
        for routing, ls in (("uniform", "-"), ("zipf", ":")):
            pts = sorted((r["tokens"], roofline_pct(r)) for r in rows
                         if r["format"] == f and r["routing"] == routing and r["tokens"] > 0)
            pts = [(t, p) for t, p in pts if p is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3.5, ls=ls, color=COLORS.get(f), label=f"{f} {routing}")
    log2_tokens(ax)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("% of roofline")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"{title}: the two GEMMs against max(bytes at copy rate, FLOPs at bf16 rate)", fontsize=9)
    save(fig, path, manifest)


def plot_split(plt, rows, title, path, manifest):
    counts = [T for T in SPLIT_TOKENS if any(r["tokens"] == T and split_of(r) for r in rows)]
    counts += sorted({r["tokens"] for r in rows if split_of(r)} - set(SPLIT_TOKENS))
    formats = order({r["format"] for r in rows}, FORMATS)
    fig, axes = plt.subplots(1, max(1, len(counts)), figsize=(2.6 * max(1, len(counts)) + 1.5, 4.2), squeeze=False,
                             sharey=True)
    for ax, T in zip(axes[0], counts):
        for i, f in enumerate(formats):
            r = next((r for r in rows if r["tokens"] == T and r["format"] == f and split_of(r)), None)
            if r is None:
                continue
            parts = split_of(r)
            total = sum(parts) or 1.0
            bottom = 0.0
            for p, v in zip(PARTS, parts):
                ax.bar(i, 100.0 * v / total, bottom=bottom, color=PART_COLORS[p], edgecolor="white", lw=0.5,
                       label=p if (ax is axes[0][0] and i == 0) else None)
                bottom += 100.0 * v / total
            ax.text(i, 101, f"{total:.0f}" if total >= 10 else f"{total:.1f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(formats)))
        ax.set_xticklabels(formats, fontsize=8, rotation=30)
        ax.set_title(f"{T} token{'s' if T != 1 else ''}", fontsize=9)
        ax.set_ylim(0, 112)
    axes[0][0].set_ylabel("% of the layer's time (total in us above)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="center right", fontsize=8)
        fig.subplots_adjust(right=0.86)
    fig.suptitle(f"{title}: the layer's time split (uniform routing)")
    save(fig, path, manifest)


# ---- the markdown --------------------------------------------------------------------------------

def table(rows, peers, routing):
    peer_keys = sorted(peers)
    head = ["format", "tokens", "kernel", "layer us", "GEMMs us", "TB/s", "% copy", "TFLOP/s", "% bf16", "regret %"]
    head += ["x " + peer_label(k) for k in peer_keys]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    sel = [r for r in rows if r["routing"] == routing]
    for f in order({r["format"] for r in sel}, FORMATS):
        for r in sorted((r for r in sel if r["format"] == f), key=lambda r: r["tokens"]):
            cells = [f, str(r["tokens"]), r.get("kernel") or "—", fmt(pos(r.get("layer_us"))),
                     fmt(pos(r.get("gemm_us"))), fmt(pos(r.get("tbps")), "{:.2f}"), fmt(pos(r.get("pct_copy"))),
                     fmt(pos(r.get("tflops"))), fmt(pct_bf16(r)), fmt(regret_pct(r))]
            for k in peer_keys:
                us, mine = peers[k].get((routing, r["tokens"])), moekit_time(r, k[2])
                cells.append(fmt(us / mine if us and mine else None, "{:.2f}"))
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def median(v):
    v = sorted(x for x in v if x is not None)
    return v[len(v) // 2] if v else None


def gpu_section(rep, plots_dir, md_dir, plt, manifest):
    gpu = rep.get("gpu") or "unknown GPU"
    gslug = slug(gpu)
    # (`bench --hash` rows time DeepSeek-V4's hash router, not a preset's layer: not in the report)
    rows = [r for r in rep.get("bench", []) if isinstance(r.get("tokens"), int) and r.get("shape") and r.get("format")
            and r.get("router", "score") == "score"]
    for r in rows:
        r.setdefault("routing", "uniform")
    L = [f"## {gpu}", ""]
    if rep.get("synthetic"):
        L += ["**Synthetic numbers (a test of the generator), not measurements.**", ""]
    stamps = {}
    for key in ("driver", "cuda", "commit", "date"):
        stamps[key] = sorted({str(r.get(key)) for r in rows if r.get(key)})
    copy = median(pos(r.get("copy_tbps")) for r in rows)
    bf16 = median(pos(r.get("bf16_tflops")) for r in rows)
    L += ["| what | value |", "|---|---|", f"| GPU | {gpu} |"]
    for key, name in (("driver", "NVIDIA driver"), ("cuda", "CUDA"), ("commit", "moekit commit"), ("date", "date (UTC)")):
        v = stamps[key]
        if key == "date" and v:
            v = [v[0] + " to " + v[-1]] if len(v) > 1 else v
        L.append(f"| {name} | {', '.join(v) if v else '—'} |")
    for k, v in sorted(rep.get("versions", {}).items()):
        if k != "gpu":
            L.append(f"| {k} | {v} |")
    L.append(f"| copy bandwidth (measured, read + write) | {fmt(copy, '{:.2f}')} TB/s |")
    L.append(f"| bf16 dense GEMM (cuBLAS 8192^3, measured) | {fmt(bf16, '{:.0f}')} TFLOP/s |")
    L.append("")

    # The peers: which ran, which did not and why.
    status = rep.get("peer_status", [])
    if status:
        L += ["Peers in the same run:", ""]
        for s in status:
            what = f"- **{s.get('peer', '?')}**"
            if s.get("weights"):
                what += f" ({s['weights']} weights)"
            if s.get("status") == "ran":
                what += f": ran{', ' + s['version'] if s.get('version') else ''}"
                if s.get("scope") == "gemms":
                    what += "; times only its two grouped GEMMs (no routing, activation or finalize), so its ratio is to moekit's GEMMs"
                elif s.get("scope"):
                    what += "; times its whole fused layer from top-k ids, so its ratio is to moekit's layer"
            else:
                what += f": skipped ({s.get('reason', 'no reason given')})"
            L.append(what)
        L.append("")
    else:
        L += ["Peers: none in this run.", ""]

    # The oracle's regret, everywhere, per routing.
    reg = [(regret_pct(r), r) for r in rows]
    reg = [(g, r) for g, r in reg if g is not None]
    L += ["### The oracle's regret", ""]
    if reg:
        L += [f"At each measured point `moekit bench` times both SM90 GEMM kernels (decode and prefill) on the "
              f"same routing; the regret is the oracle's kernel over the faster one. Target: <= {REGRET_TARGET:.0f}% "
              f"everywhere. A skewed load moves the crossover (the decode kernel re-reads a busy expert's weights for "
              f"every chunk of 8, 16 or 24 of its rows): `moekit tune` times both kernels under uniform and Zipf routing and the "
              f"crossover must hold under both.", ""]
        dev = [r for _, r in reg if r.get("kernel_choice") == "device"]
        if dev:
            L += [f"In a band of token counts around the crossover the layer picks the kernel on the device from the "
                  f"plan's per-expert row counts (oracle/kernel_choice.h: the prefill kernel iff the decode kernel's "
                  f"weight streams w(R) x sum ceil(c/R), R its chunk rows (8, 16 or 24; w = 1, 1.1, 1.2), >= the "
                  f"tuned stream ratio x the 32-row slabs sum ceil(c/32)); there "
                  f"both kernels are launched and the one not chosen returns at once, and the regret is that path's "
                  f"time over the faster kernel alone: {len(dev)} of {len(reg)} points.", ""]
        for routing in order({r["routing"] for _, r in reg}, ROUTINGS):
            sel = [(g, r) for g, r in reg if r["routing"] == routing]
            worst, wr = max(sel, key=lambda x: x[0])
            over = [r for g, r in sel if g > REGRET_TARGET]
            line = (f"- {routing} routing: worst of {len(sel)} points **{worst:.1f}%** ({wr['shape']} {wr['format']}, "
                    f"{wr['tokens']} tokens); {len(over)} point{'s' if len(over) != 1 else ''} over the target")
            if over:
                line += " (" + ", ".join(f"{r['shape']} {r['format']} {r['tokens']}" for r in over[:8])
                line += ", ..." if len(over) > 8 else ""
                line += ")"
            L.append(line + ".")
        L += ["", "| preset | " + " | ".join(FORMATS) + " |", "|---|" + "---|" * len(FORMATS)]
        for p in order({r["shape"] for _, r in reg}, PRESETS):
            cells = []
            for f in FORMATS:
                parts = []
                for routing in ROUTINGS:
                    v = [g for g, r in reg if r["shape"] == p and r["format"] == f and r["routing"] == routing]
                    parts.append(f"{max(v):.1f}" if v else "—")
                cells.append(" / ".join(parts))
            L.append(f"| {p} | " + " | ".join(cells) + " |")
        L += ["", "Cells: the worst regret in %, uniform / zipf routing.", ""]
    else:
        L += ["Not measured in this run (no row has both kernels' times).", ""]
    entries = [e for e in rep.get("tuning", {}).get("entries", []) if e.get("gpu") in (gpu, None)]
    if entries:
        L += ["The crossover that `moekit tune` measured (data/tuning/), the prefill kernel from this many tokens "
              "(— : the decode kernel at every measured count):", "",
              "| preset | " + " | ".join(FORMATS) + " |", "|---|" + "---|" * len(FORMATS)]
        labels = order({e.get("label", "?") for e in entries}, PRESETS)
        for p in labels:
            cells = []
            for f in FORMATS:
                e = next((e for e in entries if e.get("label") == p and e.get("format") == f), None)
                cells.append("—" if e is None or e.get("prefill_from", -1) < 0 else str(e["prefill_from"]))
            L.append(f"| {p} | " + " | ".join(cells) + " |")
        L.append("")

    presets = order({r["shape"] for r in rows}, PRESETS)
    missing = [p for p in PRESETS if p not in presets]
    if missing:
        L += [f"Not in this run: {', '.join(missing)}.", ""]
    for p in presets:
        pr = [r for r in rows if r["shape"] == p]
        # One backend per preset: the oracle's crossover backend (sm90) where it ran, else the
        # one with the most rows (other backends in the same file, e.g. a forced kernel, stay out).
        backends = sorted({r.get("backend", "?") for r in pr}, key=lambda b: (b != "sm90", -sum(
            1 for r in pr if r.get("backend", "?") == b), b))
        pr = [r for r in pr if r.get("backend", "?") == backends[0]]
        r0 = pr[0]
        dims = (r0.get("E"), r0.get("k"), r0.get("H"), r0.get("I"))
        peers = peer_series(rep, dims)
        L += [f"### {p}", ""]
        if dims[0] is not None:
            L += [f"E = {dims[0]} experts, top-{dims[1]}, H = {dims[2]}, I = {dims[3]}; backend "
                  f"{', '.join(sorted({r['backend'] for r in pr}))}; formats "
                  f"{', '.join(order({r['format'] for r in pr}, FORMATS))}.", ""]
        pics = []
        if plt is not None:
            base = os.path.join(plots_dir, f"{gslug}_{slug(p)}")
            plot_time(plt, pr, peers, p, base + "_time.png", manifest)
            pics.append(base + "_time.png")
            if any(roofline_pct(r) is not None for r in pr):
                plot_roofline(plt, pr, p, base + "_roofline.png", manifest)
                pics.append(base + "_roofline.png")
            if any(split_of(r) for r in pr):
                plot_split(plt, [r for r in pr if r["routing"] == "uniform"] or pr, p, base + "_split.png", manifest)
                pics.append(base + "_split.png")
        for pic in pics:
            L += [f"![{os.path.basename(pic)}]({os.path.relpath(pic, md_dir)})", ""]
        for routing in order({r["routing"] for r in pr}, ROUTINGS):
            sel = [r for r in pr if r["routing"] == routing]
            zs = sorted({r.get("zipf_s") for r in sel if r.get("zipf_s") is not None})
            hot = [(r["tokens"], r.get("max_expert_rows")) for r in sel if r.get("max_expert_rows")]
            caption = f"{routing} routing" + (f" (s = {zs[0]:g})" if zs else "")
            if routing == "zipf" and hot:
                T, m = max(hot)
                avg = T * (dims[1] or 1) / (dims[0] or 1)
                caption += f"; at {T} tokens the busiest expert has {m} rows ({m / avg:.1f}x the mean)"
            body = table(pr, peers, routing)
            if routing == "uniform":
                L += [f"{caption}:", "", body, ""]
            else:
                L += ["<details>", f"<summary>{caption}</summary>", "", body, "", "</details>", ""]
    return L


def generate(inputs, md_path, plots_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("report: matplotlib is needed for the plots: run it with \"$(scripts/python_env.sh)\" scripts/report.py")
    os.makedirs(plots_dir, exist_ok=True)
    md_dir = os.path.dirname(os.path.abspath(md_path))
    plots_dir = os.path.abspath(plots_dir)
    manifest = {}
    reps = [d for d in (load_json(p) for p in inputs) if isinstance(d, dict)]
    L = ["# Performance report", "",
         "Generated by `\"$(scripts/python_env.sh)\" scripts/report.py` from data/report/*.json; do not edit by "
         "hand. How each number came about: docs/perf/log.md.", "",
         "Reproduce on your GPU: `scripts/device_prep.sh` (build machine), `scripts/gpu_check.sh report` (GPU "
         "machine: `moekit tune`, `moekit bench` and `bench/peers.py` for every preset, format and routing; "
         "$PEER_WHEELS names a directory of wheels for peers that are not installed), then copy "
         "`$OUT/report/report.json` to data/report/<gpu>.json and `$OUT/report/tuning.json` to "
         "data/tuning/<gpu>.json, rebuild, and run the command above.", "",
         "How the numbers are taken: `moekit bench` on synthetic weights, each quantity a CUDA graph replayed "
         "after an L2 flush, median (docs/PERFORMANCE.md). *layer* is the whole layer from router logits to the "
         "output (routing, permute, GEMM1, GEMM2, finalize) on the backend the oracle picks (`sm90`: the decode "
         "kernel below the tuned crossover, the prefill kernel from it); *GEMMs* its two GEMMs alone. TB/s and "
         "% copy: the active experts' weight bytes over the GEMMs' time, against the device-to-device copy rate "
         "measured in the same process; TFLOP/s and % bf16: 2 x tokens x k x 3 x H x I over the GEMMs' time, "
         "against a cuBLAS bf16 GEMM measured in the same process. % of roofline: max(bytes at the copy rate, "
         "FLOPs at the bf16 rate) over the GEMMs' time. x peer: the peer's time over moekit's (above 1: moekit "
         "is faster), on the same shape, token count and routing distribution (the peers draw their own "
         "routing from it). Routing: *uniform*, every expert equally likely; *zipf*, the expert of rank r drawn "
         "with probability ~ 1/r^s, k distinct per token, the same experts hot at every count. The time split: "
         "the layer cut after each part, timed the same way; a part's time is the difference of two cuts, so "
         "the parts add up to the layer and what overlaps goes to the later part.", ""]
    if not reps:
        L += ["No data: run `scripts/gpu_check.sh report` on a GPU machine and keep its report.json as "
              "data/report/<gpu>.json.", ""]
    for rep in sorted(reps, key=lambda d: str(d.get("gpu"))):
        L += gpu_section(rep, plots_dir, md_dir, plt, manifest)
    for old in glob.glob(os.path.join(plots_dir, "*.png")):  # plots of an earlier run that this one has not
        if old not in manifest:
            os.remove(old)
    tmp = md_path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(L).rstrip() + "\n")
    os.replace(tmp, md_path)
    print(f"report: {md_path}, {len(manifest)} plots in {plots_dir}")
    return manifest


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "collect":
        ap = argparse.ArgumentParser(prog="report.py collect")
        ap.add_argument("dir")
        ap.add_argument("-o", "--out", required=True)
        a = ap.parse_args(argv[1:])
        collect(a.dir, a.out)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="*", help="report JSON files (default: data/report/*.json)")
    ap.add_argument("--md", default=os.path.join(REPO, "docs", "REPORT.md"))
    ap.add_argument("--plots", default=os.path.join(REPO, "docs", "report"))
    a = ap.parse_args(argv)
    inputs = a.json or sorted(glob.glob(os.path.join(REPO, "data", "report", "*.json")))
    generate(inputs, a.md, a.plots)


if __name__ == "__main__":
    main()
