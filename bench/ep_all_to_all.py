#!/usr/bin/env python3
"""torch's baseline for `moekit bench --ep`: NCCL all_to_all_single moving the same dispatch and
combine bytes as moekit's EP kernels (DeepSeek-V3 profile by default).

Every visible GPU is one rank (torch.multiprocessing, NCCL backend). Dispatch: each rank sends
tokens x k rows of H bf16 (one copy per (token, expert) slot, as moekit's direct dispatch does),
split evenly over the ranks; combine sends the same rows back (bf16; moekit's combine pulls fp32
rows). Timed as CUDA events around one collective after a barrier and an L2 flush, median of
--reps. On one GPU the collective is a local copy of one rank's rows (NCCL allows one rank per
GPU), so compare it with moekit's kernels for bytes per second, not for NVLink latency.
Prints one JSON row per token count.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {"deepseek-v3": (256, 8, 7168), "gpt-oss-120b": (128, 4, 2880), "qwen3-30b-a3b": (128, 8, 2048)}


def run(rank, world, a, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    E, k, H = SHAPES[a.shape] if a.shape in SHAPES else map(int, a.shape.split(","))
    l2 = torch.cuda.get_device_properties(rank).L2_cache_size
    flush = torch.empty(4 * l2 // 4, dtype=torch.int32, device="cuda")
    for T in [int(t) for t in a.tokens.split(",")]:
        rows = T * k
        rows -= rows % world
        x = torch.randn(rows, H, device="cuda").bfloat16()
        out = torch.empty_like(x)
        times = []
        for i in range(a.reps + 2):
            flush.fill_(i)
            dist.barrier()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dist.all_to_all_single(out, x)
            e.record()
            e.synchronize()
            if i >= 2:
                times.append(s.elapsed_time(e) * 1e3)
        times.sort()
        us = times[len(times) // 2]
        if rank == 0:
            moved = 2 * rows * H * 2 * world  # read + written, all ranks
            print(json.dumps({"peer": "torch.all_to_all_single", "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                              "ranks": world, "tokens_per_rank": T, "rows_per_rank": rows, "us": round(us, 2),
                              "GBps_read_written": round(moved / us / 1e3, 1)}), flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek-v3")
    ap.add_argument("--tokens", default="1,128")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    world = torch.cuda.device_count()
    mp.spawn(run, args=(world, a, 29500 + os.getpid() % 1000), nprocs=world)


if __name__ == "__main__":
    main()
