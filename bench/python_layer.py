"""The layer through Python on an H100/H200: host overhead per forward call, and the layer's time
under a CUDA graph next to `moekit bench` on the same problem.

  host_us      wall time per call while the GPU is kept busy (torch.cuda._sleep ahead of each
               round of calls), so that no call waits for the device: what a call costs the host.
               Median over --rounds rounds. Direct (Layer.forward_logits) and through the torch
               op (torch.ops.moekit.forward_logits). Eager calls replay a graph the layer keeps
               (pipeline/launch_sm90.cuh): host_us repeats one call (nothing to update),
               fresh_host_us alternates two sets of x, logits and out (what an engine's new
               tensors per call cost: the graph's nodes that read them are updated first).
  bind_us      the same direct call with T = 0 (no token: the binding and the argument checks,
               no kernel launch).
  eager_us     device time per call of 100 eager calls back to back (events around them, no
               flush): with the layer's graphs, and (eager_direct_us) with a layer made under
               MOEKIT_LAUNCH_GRAPHS=0, whose calls launch kernel by kernel.
  graph_us     one forward_logits captured in a CUDA graph, replayed after an L2 flush (a read of
               4x the L2), timed with events, median of --reps; the method of `moekit bench`.
  bench_us     `moekit bench`'s layer_us for the same shape, format and token count (--moekit).

The two time the same work: both read x in place, and the GEMMs' time follows the routing (how
many experts are active, how many rows each gets), so the router logits here are drawn until
they activate as many experts as the bench's routing did (`experts` / `bench_exp`; the bench
draws its own logits). Synthetic weights, random logits N(0, 2).
Usage: python bench/python_layer.py [--shape gpt-oss-120b] [--format mxfp4] [--tokens 1,8,32,64]
                                    [--moekit .devbuild/moekit] [--reps 50] [--rounds 15] [--json FILE]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import moekit
import moekit.torch as mt

SHAPES = {  # as `moekit bench --shape` names them
    "gpt-oss-120b": dict(num_experts=128, top_k=4, hidden=2880, intermediate=2880, activation="swiglu_oai", norm_topk_prob=True),
    "gpt-oss-20b": dict(num_experts=32, top_k=4, hidden=2880, intermediate=2880, activation="swiglu_oai", norm_topk_prob=True),
    "deepseek-v3": dict(num_experts=256, top_k=8, hidden=7168, intermediate=2048, scoring="sigmoid", n_group=8,
                        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True),
    "qwen3-30b-a3b": dict(num_experts=128, top_k=8, hidden=2048, intermediate=768, norm_topk_prob=True),
    "deepseek-v4-pro": dict(num_experts=384, top_k=6, hidden=7168, intermediate=3072, activation="silu_clamped",
                            swiglu_limit=10.0, scoring="sqrtsoftplus", routed_scaling_factor=2.5, norm_topk_prob=True),
    "deepseek-v4-flash": dict(num_experts=256, top_k=6, hidden=4096, intermediate=2048, activation="silu_clamped",
                              swiglu_limit=10.0, scoring="sqrtsoftplus", routed_scaling_factor=1.5, norm_topk_prob=True),
    "deepseek-v4.1-flash": dict(num_experts=384, top_k=6, hidden=5120, intermediate=2304, activation="silu_clamped",
                                swiglu_limit=10.0, scoring="sqrtsoftplus", routed_scaling_factor=1.5,
                                norm_topk_prob=True),
}


def host_us(fn, calls=100, rounds=15):
    """Median over rounds of the host time per call; each round's calls run behind ~50 ms of
    device work, and stay well below the driver's queue of pending launches (5 per call)."""
    t = []
    for r in range(rounds + 1):  # round 0: warm-up
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter_ns()
        if r > 0:
            t.append((t1 - t0) / calls / 1e3)
    torch.cuda.synchronize()
    return statistics.median(t)


def graph_us(g, reps):
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    flush = torch.ones(max(l2, 1 << 20), dtype=torch.float32, device="cuda")  # 4 x L2 bytes
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        g.replay()
    t = []
    for _ in range(reps):
        flush.sum()  # reads 4 x L2, as moekit bench's flush does
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b) * 1e3)
    return statistics.median(t)


def eager_us(fn, calls=100):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        fn()
    t = []
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(20_000_000)  # the host's launches get ahead of the device
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(t)


def bench_us(binary, shape, fmt, T, reps):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([binary, "bench", "--shape", shape, "--format", fmt, "--tokens", str(T), "--reps", str(reps),
                        "--json", f.name], check=True, capture_output=True)
        rows = json.load(open(f.name))
    return rows[0]["layer_us"], rows[0]["active_experts"]


def routed(layer, x, logits, out, ws):
    """Active experts and token chunks of 8 rows (the decode GEMM's tasks per group) of a routing."""
    spec = layer.spec
    ids = torch.empty(x.shape[0], spec.top_k, dtype=torch.int32, device="cuda")
    w = torch.empty(x.shape[0], spec.top_k, device="cuda")
    layer.forward_logits(x, logits, out, ws, topk_ids=ids, topk_weights=w)
    layer.check()
    counts = torch.bincount(ids.flatten().long(), minlength=spec.num_experts)
    return int((counts > 0).sum()), int(((counts + 7) // 8).sum())


def logits_like_bench(layer, x, out, ws, T, want, tries=200):
    """Router logits N(0, 2) whose routing activates `want` experts (the bench's count; None: the
    first draw), or the closest of `tries` draws."""
    best = None
    for s in range(tries):
        g = torch.Generator(device="cuda").manual_seed(1000 * T + s)
        logits = 2 * torch.randn(T, layer.spec.num_experts, device="cuda", generator=g)
        active, chunks = routed(layer, x, logits, out, ws)
        if best is None or (want is not None and abs(active - want) < abs(best[1] - want)):
            best = (logits, active, chunks)
        if want is None or active == want:
            break
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gpt-oss-120b", choices=list(SHAPES))
    ap.add_argument("--format", default="mxfp4")
    ap.add_argument("--tokens", default="1,8,32,64")
    ap.add_argument("--moekit", default="")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    spec = moekit.LayerSpec(format=a.format, max_tokens=max(tokens), **SHAPES[a.shape])
    layer = mt.synthetic(spec, "cuda", seed=1)
    os.environ["MOEKIT_LAUNCH_GRAPHS"] = "0"  # read when a layer is made
    direct_layer = mt.synthetic(spec, "cuda", seed=1)
    del os.environ["MOEKIT_LAUNCH_GRAPHS"]
    print(f"python_layer: {a.shape} {a.format}, {layer}, {torch.cuda.get_device_name()}, moekit {moekit.__version__}, "
          f"torch {torch.__version__}")
    # T = 0: the binding and the checks without a launch.
    x0 = torch.empty(0, spec.hidden, device="cuda", dtype=torch.bfloat16)
    l0, o0, w0 = torch.empty(0, spec.num_experts, device="cuda"), torch.empty_like(x0), layer.workspace(0)
    bind = host_us(lambda: layer.forward_logits(x0, l0, o0, w0), rounds=a.rounds)
    print(f"bind_us (T = 0, no launch): {bind:.2f}")
    print(f"{'tokens':>6} {'experts':>7} {'bench_exp':>9} {'host_us':>8} {'fresh_us':>8} {'op_host_us':>10} "
          f"{'eager_us':>8} {'eager_dir':>9} {'graph_us':>9} {'bench_us':>9} {'ratio':>6}")
    rows = []
    for T in tokens:
        bus, bexp = bench_us(a.moekit, a.shape, a.format, T, a.reps) if a.moekit else (float("nan"), None)
        g_ = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn(T, spec.hidden, device="cuda", generator=g_).to(torch.bfloat16)
        out, ws = torch.empty_like(x), layer.workspace(T)
        logits, experts, chunks = logits_like_bench(layer, x, out, ws, T, bexp)
        direct = host_us(lambda: layer.forward_logits(x, logits, out, ws), rounds=a.rounds)
        sets = [(x, logits, out), (x.clone(), logits.clone(), torch.empty_like(out))]
        turn = [0]

        def fresh():
            turn[0] ^= 1
            xi, li, oi = sets[turn[0]]
            layer.forward_logits(xi, li, oi, ws)

        fresh_us = host_us(fresh, rounds=a.rounds)
        op = host_us(lambda: torch.ops.moekit.forward_logits(layer.key, x, logits, out, ws), rounds=a.rounds)
        eager = eager_us(lambda: layer.forward_logits(x, logits, out, ws))
        eager_direct = eager_us(lambda: direct_layer.forward_logits(x, logits, out, ws))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            layer.forward_logits(x, logits, out, ws)
        gus = graph_us(g, a.reps)
        print(f"{T:>6} {experts:>7} {bexp if bexp is not None else '-':>9} {direct:>8.2f} {fresh_us:>8.2f} "
              f"{op:>10.2f} {eager:>8.1f} {eager_direct:>9.1f} {gus:>9.1f} {bus:>9.1f} {gus / bus:>6.3f}")
        rows.append(dict(tokens=T, active_experts=experts, token_chunks=chunks, host_us=direct,
                         fresh_host_us=fresh_us, op_host_us=op, eager_us=eager, eager_direct_us=eager_direct,
                         bind_us=bind, graph_us=gus, bench_us=bus, bench_active_experts=bexp))
    if a.json:
        json.dump(dict(shape=a.shape, format=a.format, device=torch.cuda.get_device_name(), rows=rows),
                  open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
