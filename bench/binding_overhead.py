"""What the Python binding costs per forward call, without the kernels: calls with T = 0 (the
argument checks and the binding run, nothing is launched or computed), on the CPU backend or on
a GPU layer. Runs on a machine without a GPU.

  empty          a tvm-ffi call with two integers (the floor of any call)
  ffi            moekit._ffi.forward_logits(handle, x, logits, out, ws, None, None, None)
  layer          Layer.forward_logits(x, logits, out, ws): the documented call
  op             torch.ops.moekit.forward_logits(key, x, logits, out, ws) (torch only)
for numpy arrays and, when torch is installed, torch tensors (tvm-ffi takes torch tensors through
torch's DLPack C exchange API, numpy arrays through __dlpack__).

Usage: python bench/binding_overhead.py [--device cpu|cuda] [--calls 20000] [--rounds 15]
Prints the median over rounds of the time per call, in us.
"""

import argparse
import statistics
import sys
import time

import numpy as np

import moekit
from moekit import _ffi


def per_call_us(fn, calls, rounds):
    for _ in range(min(calls, 2000)):
        fn()
    t = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        t.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return statistics.median(t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    try:
        import torch
        import moekit.torch as mt
    except ImportError:
        torch = None
    if a.device != "cpu" and torch is None:
        sys.exit("binding_overhead: a GPU layer needs torch")
    # The shape does not matter at T = 0; a small layer packs quickly.
    spec = moekit.LayerSpec(num_experts=8, top_k=2, hidden=64, intermediate=64, format="bf16", max_tokens=4)
    layer = mt.synthetic(spec, a.device, seed=1) if torch is not None else moekit.synthetic(spec, "cpu", seed=1)
    h, f = layer._h, _ffi.forward_logits
    rows = [("empty", lambda: _ffi.env_stream(1, 0))]
    if a.device == "cpu":
        x, lg = np.zeros((0, spec.hidden), np.uint16), np.zeros((0, spec.num_experts), np.float32)
        out, ws = np.zeros((0, spec.hidden), np.uint16), np.zeros(layer.workspace_bytes(0), np.uint8)
        rows += [("ffi, numpy", lambda: f(h, x, lg, out, ws, None, None, None)),
                 ("layer, numpy", lambda: layer.forward_logits(x, lg, out, ws))]
    if torch is not None:
        tx = torch.zeros(0, spec.hidden, dtype=torch.bfloat16, device=a.device)
        tl = torch.zeros(0, spec.num_experts, device=a.device)
        to, tw = torch.empty_like(tx), layer.workspace(0)
        rows += [("ffi, torch", lambda: f(h, tx, tl, to, tw, None, None, None)),
                 ("layer, torch", lambda: layer.forward_logits(tx, tl, to, tw)),
                 ("op, torch", lambda: torch.ops.moekit.forward_logits(layer.key, tx, tl, to, tw))]
    print(f"binding_overhead: moekit {moekit.__version__}, device {a.device}, "
          f"torch {torch.__version__ if torch is not None else '-'}; us per call (T = 0)")
    for name, fn in rows:
        print(f"  {name:<14} {per_call_us(fn, a.calls, a.rounds):7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
