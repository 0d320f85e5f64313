#!/usr/bin/env python3
"""Throughput of transformers' experts implementations on one GPU, in one run: "moekit" against
transformers' "grouped_mm" and "batched_mm" on the same model (real layer sizes of gpt-oss-20b,
qwen3-30b-a3b or deepseek-v3, a few layers, random weights: tests/python/hf_models.py).

  decode:  generate(cache_implementation="static") with transformers' automatic torch.compile
           (CUDA graphs) at batch 1 and 32: new tokens per second, timed after a warm-up generate
  prefill: one forward of a 2048-token sequence (batch 1, no cache): tokens per second

GPT-OSS runs with MXFP4 values in its experts (what transformers holds after loading the MXFP4
checkpoint dequantized), so moekit runs its MXFP4 kernels and transformers' implementations their
bf16 GEMMs on the same values; the others run bf16 weights everywhere.
moekit keeps its packed copy beside the bf16 weights here (transformers' implementations need them
in the same run): deepseek-v3 at 2 MoE layers is ~45 GB of bf16 experts twice.
Usage: bench/transformers_generate.py --arch gpt_oss [--layers 4] [--batches 1,32] [--new-tokens 64]
       [--prefill 2048] [--impls moekit,grouped_mm,batched_mm] [--json out.json]"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import hf_models as hm  # noqa: E402

import moekit.integrations.transformers as mkt  # noqa: E402


def timed(fn, reps):
    fn()  # warm-up (compiles, packs, captures)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def guarded(fn):
    """fn()'s result, or None when it runs out of GPU memory (the memory given back)."""
    try:
        return fn()
    except torch.OutOfMemoryError:
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="gpt_oss", choices=["gpt_oss", "qwen3_moe", "deepseek_v3"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--impls", default="moekit,grouped_mm,batched_mm")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    layers = a.layers + (1 if a.arch == "deepseek_v3" else 0)  # its first layer is dense
    m = hm.build(a.arch, size="real", layers=layers, device="cuda", vocab=32000)
    if a.arch == "gpt_oss":
        hm.make_mxfp4_exact(m)
    rows = []
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
          f"{__import__('transformers').__version__}; {a.arch}, {a.layers} MoE layers, real layer sizes")
    for impl in a.impls.split(","):
        torch._dynamo.reset()
        if impl == "moekit":
            status = mkt.prepare(m, max_tokens=max(a.prefill, 2048))[0][1]
        else:
            m.set_experts_implementation(impl)
            status = impl
        ids = hm.tokens(m, 1, a.prefill)
        with torch.no_grad():
            t = guarded(lambda: timed(lambda: m(ids), a.reps))
        if t is None:  # batched_mm gathers a weight matrix per (token, slot): 253 GiB at 2048 gpt-oss tokens
            rows.append(dict(impl=impl, what=f"prefill {a.prefill}", tokens_per_s=None, ms=None, status="out of memory"))
            print(f"{impl:>11}  prefill {a.prefill:5d}: out of GPU memory  [{status}]")
        else:
            rows.append(dict(impl=impl, what=f"prefill {a.prefill}", tokens_per_s=a.prefill / t, ms=t * 1e3, status=status))
            print(f"{impl:>11}  prefill {a.prefill:5d}: {a.prefill / t:10.0f} tok/s  ({t * 1e3:8.2f} ms)  [{status}]")
        for b in [int(x) for x in a.batches.split(",")]:
            prompt = hm.tokens(m, b, a.prompt)
            kw = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False,
                      cache_implementation="static", pad_token_id=0)
            t = guarded(lambda: timed(lambda: m.generate(prompt, **kw), a.reps))
            if t is None:
                rows.append(dict(impl=impl, what=f"decode batch {b}", tokens_per_s=None, ms=None, status="out of memory"))
                print(f"{impl:>11}  decode batch {b:3d}: out of GPU memory")
                continue
            tps = b * a.new_tokens / t
            rows.append(dict(impl=impl, what=f"decode batch {b}", tokens_per_s=tps, ms=t * 1e3, status=status))
            print(f"{impl:>11}  decode batch {b:3d}: {tps:10.0f} tok/s  ({t * 1e3:8.2f} ms for {a.new_tokens} "
                  f"new tokens, prefill of {a.prompt} included)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(arch=a.arch, layers=a.layers, device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
