#!/usr/bin/env python3
"""Peer baseline for `moekit bench`: torch._grouped_mm with bf16 weights on the same problem.

Times the two grouped GEMMs of an MoE layer (x @ W13^T for the routed rows, then h @ W2^T) as a
CUDA graph replay after an L2 flush, median of --reps, like `moekit bench` does for its kernels.
The activation between them is left out, which flatters torch. Routing: uniform random top-k.
Prints one JSON row per token count.
"""
import argparse
import json

import torch

SHAPES = {
    "gpt-oss-120b": (128, 4, 2880, 2880),
    "gpt-oss-20b": (32, 4, 2880, 2880),
    "deepseek-v3": (256, 8, 7168, 2048),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="gpt-oss-120b")
    ap.add_argument("--tokens", default="1,8,32,64")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    E, k, H, I = SHAPES[a.shape] if a.shape in SHAPES else map(int, a.shape.split(","))
    dev = "cuda"
    torch.manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02).transpose(-2, -1)  # [E, H, 2I] col-major
    w2 = (torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02).transpose(-2, -1)       # [E, I, H] col-major
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    flush = torch.empty(4 * l2 // 4, dtype=torch.int32, device=dev)
    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)])  # uniform, distinct per token
        counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        M = int(offs[-1])
        x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
        h = torch.randn(M, I, device=dev, dtype=torch.bfloat16)

        def body():
            y1 = torch._grouped_mm(x, w13, offs=offs)
            y2 = torch._grouped_mm(h, w2, offs=offs)
            return y1, y2

        for _ in range(3):
            body()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            with torch.cuda.graph(g, stream=s):
                body()
        torch.cuda.synchronize()
        times = []
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            g.replay()
        for _ in range(a.reps):
            flush.sum()
            start.record()
            g.replay()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e3)
        times.sort()
        active = int((counts > 0).sum())
        us = times[len(times) // 2]
        nbytes = active * 3 * H * I * 2
        row = {"peer": "torch._grouped_mm bf16", "shape": a.shape, "tokens": T, "active_experts": active,
               "gemm_us": us, "weight_bytes": nbytes, "tbps": nbytes / (us * 1e-6) / 1e12,
               "torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
