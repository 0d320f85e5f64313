#!/usr/bin/env python3
"""torch's baseline for `moekit bench --ep R --ep-gpus --peer torch`: NCCL all_to_all_single moving
the same dispatch and combine bytes as moekit's EP kernels, on the same GPUs, one process per GPU.

Dispatch: each rank sends tokens x k rows of the payload's bytes (bf16: 2H; mxfp8: H + H/32;
nvfp4: H/2 + H/16, each part padded to 16 bytes as moekit sends them; one copy per (token,
expert) slot, as moekit's direct dispatch does), split evenly over the ranks; combine sends the
same number of rows back, fp32 (4H bytes) or bf16 (2H) as --combine says. Each collective is
timed with CUDA events after a barrier, an L2 flush and a one-int all_reduce on the same stream
(so that every rank's timed region starts at about the same moment, as moekit's bench does),
alone and 10 back to back (the steady state, per call); median of --reps; the slowest rank's
median is reported. Writes a JSON list (--json) and prints
one line per row.
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = {
    "deepseek-v3": (256, 8, 7168),
    "gpt-oss-120b": (128, 4, 2880),
    "gpt-oss-20b": (32, 4, 2880),
    "qwen3-30b-a3b": (128, 8, 2048),
    "qwen3-235b-a22b": (128, 8, 4096),
    "deepseek-v4-pro": (384, 6, 7168),
    "deepseek-v4-flash": (256, 6, 4096),
    "deepseek-v4.1-flash": (384, 6, 5120),
}


def pad16(n):
    return (n + 15) // 16 * 16


def payload_bytes(payload, H):
    if payload == "bf16":
        return 2 * H
    if payload == "mxfp8":
        return pad16(H) + pad16(H // 32)
    if payload == "nvfp4":
        return pad16(H // 2) + pad16(H // 16)
    raise ValueError(payload)


def timed(fn, reps, flush, one, inner=1):
    """Median us per call; inner > 1: that many calls back to back per timed region (the steady
    state, as moekit's bench times it)."""
    times = []
    for i in range(reps + 2):
        flush.fill_(i)
        dist.barrier()
        dist.all_reduce(one)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(inner):
            fn()
        e.record()
        e.synchronize()
        if i >= 2:
            times.append(s.elapsed_time(e) * 1e3 / inner)
    times.sort()
    return times[len(times) // 2]


def run(rank, world, a, port, out_path):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    E, k, H = SHAPES[a.shape] if a.shape in SHAPES else map(int, a.shape.split(","))
    l2 = torch.cuda.get_device_properties(rank).L2_cache_size
    flush = torch.empty(4 * l2 // 4, dtype=torch.int32, device="cuda")
    one = torch.ones(1, dtype=torch.int32, device="cuda")
    rows_out = []
    for payload in a.payloads.split(","):
        for T in [int(t) for t in a.tokens.split(",")]:
            rows = T * k
            rows -= rows % world
            rows = max(rows, world)
            send = torch.randint(0, 255, (rows, payload_bytes(payload, H)), dtype=torch.uint8, device="cuda")
            recv = torch.empty_like(send)
            cb = 4 * H if a.combine == "fp32" else 2 * H
            back = torch.randint(0, 255, (rows, cb), dtype=torch.uint8, device="cuda")
            back_recv = torch.empty_like(back)
            d = timed(lambda: dist.all_to_all_single(recv, send), a.reps, flush, one)
            c = timed(lambda: dist.all_to_all_single(back_recv, back), a.reps, flush, one)
            ds = timed(lambda: dist.all_to_all_single(recv, send), max(3, a.reps // 2), flush, one, 10)
            cs = timed(lambda: dist.all_to_all_single(back_recv, back), max(3, a.reps // 2), flush, one, 10)
            # The slowest rank's medians.
            t = torch.tensor([d, c, ds, cs], dtype=torch.float64, device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rank == 0:
                row = {"peer": "torch.all_to_all_single", "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                       "torch": torch.__version__, "ranks": world, "payload": payload, "combine": a.combine,
                       "tokens_per_rank": T, "rows_per_rank": rows, "dispatch_us": round(t[0].item(), 2),
                       "combine_us": round(t[1].item(), 2), "dispatch_steady_us": round(t[2].item(), 2),
                       "combine_steady_us": round(t[3].item(), 2)}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    if rank == 0 and out_path:
        with open(out_path, "w") as f:
            json.dump(rows_out, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek-v3")
    ap.add_argument("--tokens", default="1,128")
    ap.add_argument("--payloads", default="bf16")
    ap.add_argument("--combine", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--world", type=int, default=0, help="ranks (default: every visible GPU)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    world = a.world or torch.cuda.device_count()
    mp.spawn(run, args=(world, a, 29500 + os.getpid() % 1000, a.json), nprocs=world)


if __name__ == "__main__":
    main()
