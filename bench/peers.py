#!/usr/bin/env python3
"""Peers of `moekit bench`, on the same problem, timed the same way, on the GPU machine.

Each peer that can be imported runs; each that cannot is skipped with the reason printed (and
recorded in the JSON). None of the peers' code is in this repository: they are the installed
packages, or wheels the user hands over with --wheels DIR (installed with pip from DIR, no
index; the GPU machine reaches nothing outside).

  torch       torch._grouped_mm with bf16 weights: the two grouped GEMMs of the layer on the
              routed rows (no routing, activation or finalize; that flatters it). Scope "gemms".
  triton      OpenAI's triton_kernels (matmul_ogs, or matmul in newer versions) with MXFP4
              weights, the way GPT-OSS runs it: routing from the logits, GEMM1 with the gather
              and SwiGLU fused, GEMM2 with the scatter and the routing weights. Scope "layer".
  flashinfer  FlashInfer's cutlass_fused_moe with bf16 weights from top-k ids and weights:
              permute, both GEMMs, SwiGLU, finalize. Scope "layer".

Routing: router logits log p + Gumbel noise with p uniform or Zipf (the expert of rank r drawn
with probability ~ 1/r^s, over a seeded permutation), so the top-k of every token is k distinct
experts drawn from p, the distribution `moekit bench --routing` uses (not the same draws).
Timing: each call captured in a CUDA graph, replayed after a read of 4x the L2, CUDA events,
median of --reps (with --budget-ms, stop after that many ms once 3 are in); a peer that cannot
be captured is timed eagerly the same way and its rows say so ("timing": "eager").

Usage: peers.py --shape E,k,H,I|PRESET [--moekit BIN] --tokens 1,8,64 [--routing uniform,zipf]
                [--zipf-s 1.0] [--peers torch,triton,flashinfer] [--reps 20] [--budget-ms 0]
                [--wheels DIR] [--json FILE]
Prints one JSON row per measurement; --json writes {"rows": [...], "status": [...]}.
"""
import argparse
import glob
import json
import math
import os
import subprocess
import sys
import traceback

PEERS = ("torch", "triton", "flashinfer")
PEER_NAMES = {"torch": "torch._grouped_mm", "triton": "triton_kernels matmul_ogs",
              "flashinfer": "flashinfer cutlass_fused_moe"}
PEER_WEIGHTS = {"torch": "bf16", "triton": "mxfp4", "flashinfer": "bf16"}
PEER_SCOPE = {"torch": "gemms", "triton": "layer", "flashinfer": "layer"}
PEER_MODULE = {"torch": "torch", "triton": "triton_kernels", "flashinfer": "flashinfer"}


def install_wheels(directory):
    """pip install every wheel of DIR, dependencies from DIR only; report, never fail."""
    wheels = sorted(glob.glob(os.path.join(directory, "*.whl")))
    if not wheels:
        print(f"peers: no wheels in {directory}", flush=True)
        return
    env = dict(os.environ, PIP_BREAK_SYSTEM_PACKAGES="1")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
           "--find-links", directory]
    r = subprocess.run(cmd + wheels, env=env, capture_output=True, text=True)
    if r.returncode == 0:
        print(f"peers: installed {', '.join(os.path.basename(w) for w in wheels)}", flush=True)
        return
    for w in wheels:  # one by one, so that one wheel's missing dependency spares the others
        r = subprocess.run(cmd + [w], env=env, capture_output=True, text=True)
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        print(f"peers: {os.path.basename(w)}: " + ("installed" if r.returncode == 0 else f"not installed ({last})"),
              flush=True)


def router_logits(torch, T, E, routing, s, seed, device):
    """[T, E] float32 logits whose top-k are k distinct experts drawn from uniform or Zipf p."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if routing == "zipf":
        rank = torch.randperm(E, generator=torch.Generator(device="cpu").manual_seed(seed ^ 0x5A17))
        logp = -s * torch.log((rank + 1).double())
        logp = (logp - torch.logsumexp(logp, 0)).float()
    else:
        logp = torch.full((E,), -math.log(E))
    u = torch.rand((T, E), generator=g).clamp_(1e-12, 1 - 1e-7)
    return (logp[None, :] - torch.log(-torch.log(u))).to(device)


class Timer:
    """CUDA-graph (or eager) replays after an L2 flush, median, like moekit bench."""

    def __init__(self, torch, reps, budget_ms):
        self.torch, self.reps, self.budget_ms = torch, reps, budget_ms
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        self.flush = torch.ones(max(l2, 1 << 20), dtype=torch.float32, device="cuda")  # 4 x L2 bytes

    def __call__(self, fn):
        torch = self.torch
        fn()  # compile / autotune / allocate outside the graph
        torch.cuda.synchronize()
        run, how = fn, "eager"
        try:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                with torch.cuda.graph(g, stream=s):
                    fn()
            torch.cuda.synchronize()
            run, how = g.replay, "graph"
        except Exception as e:  # noqa: BLE001 - any capture failure: time it eagerly
            print(f"peers: CUDA graph capture failed ({type(e).__name__}: {str(e)[:120]}); timing eagerly", flush=True)
            torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(2):
            run()
        t, total = [], 0.0
        for _ in range(self.reps):
            self.flush.sum()
            a.record()
            run()
            b.record()
            b.synchronize()
            t.append(a.elapsed_time(b) * 1e3)
            total += t[-1] / 1e3
            if self.budget_ms > 0 and len(t) >= 3 and total >= self.budget_ms:
                break
        t.sort()
        return t[len(t) // 2], how


# ---- the peers: each make_*(torch, E, k, H, I) returns (version, run(logits, x) -> fn) ----------

def make_torch(torch, E, k, H, I):
    if not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm")
    w13 = (torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02).transpose(-2, -1)  # [E, H, 2I]
    w2 = (torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02).transpose(-2, -1)       # [E, I, H]

    def prepare(logits, x):
        ids = torch.topk(logits, k, dim=-1).indices
        counts = torch.bincount(ids.flatten(), minlength=E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        M = int(offs[-1])
        xr = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(M, I, device="cuda", dtype=torch.bfloat16)

        def fn():
            torch._grouped_mm(xr, w13, offs=offs)
            torch._grouped_mm(h, w2, offs=offs)
        return fn
    return f"torch {torch.__version__}", prepare


def make_triton(torch, E, k, H, I):
    import importlib.metadata as md
    import inspect
    import triton_kernels  # noqa: F401 - the import is the availability check
    try:
        from triton_kernels.matmul_ogs import matmul_ogs as mm, PrecisionConfig, FlexCtx, FnSpecs, FusedActivation
    except ImportError:
        from triton_kernels.matmul import matmul as mm, PrecisionConfig, FlexCtx, FnSpecs, FusedActivation
    from triton_kernels.numerics import InFlexData
    from triton_kernels.numerics_details.mxfp import downcast_to_mxfp
    from triton_kernels.swiglu import swiglu_fn
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout
    try:
        from triton_kernels.routing import routing
    except ImportError:  # newer versions: build the routing data from topk
        from triton_kernels.matmul_ogs import GatherIndx, RoutingData, ScatterIndx
        from triton_kernels.tensor import make_ragged_tensor_metadata
        from triton_kernels.topk import topk

        def routing(logits, n_expts_act, sm_first=False):
            sparse = topk(logits, n_expts_act)
            dispatch, combine = sparse.mask_metadata.col_sorted_indx, sparse.mask_metadata.row_sorted_indx
            ragged = make_ragged_tensor_metadata(sparse.mask_metadata.col_sum, dispatch.shape[0])
            return (RoutingData(sparse.vals.flatten()[combine], ragged.slice_sizes, logits.shape[-1], n_expts_act,
                                ragged), GatherIndx(combine, dispatch), ScatterIndx(dispatch, combine))

    num_warps = 8

    def quantize(w):  # w [E, K, N] bf16, MXFP4 along K (axis 1), in the Hopper layouts
        q, s = downcast_to_mxfp(w, torch.uint8, axis=1)
        try:
            vl, vo = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
            sl, so = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=num_warps)
        except (AttributeError, TypeError):
            vl, vo, sl, so = layout.StridedLayout, {}, layout.StridedLayout, {}
        return convert_layout(wrap_torch_tensor(q, dtype=FP4), vl, **vo), convert_layout(wrap_torch_tensor(s), sl, **so)

    w1, s1 = quantize(torch.randn(E, H, 2 * I, device="cuda", dtype=torch.bfloat16) * 0.02)
    w2, s2 = quantize(torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16) * 0.02)
    fields = set(inspect.signature(PrecisionConfig).parameters)
    scale_field = "b_mx_scale" if "b_mx_scale" in fields else "weight_scale"
    pc1 = PrecisionConfig(flex_ctx=FlexCtx(rhs_data=InFlexData()), **{scale_field: s1})
    pc2 = PrecisionConfig(flex_ctx=FlexCtx(rhs_data=InFlexData()), **{scale_field: s2})
    try:
        act = FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit"), reduction_n=2), (1.702, 7.0))
    except TypeError:
        act = FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit")), (1.702, 7.0), 2)
    b1 = torch.zeros(E, 2 * I, device="cuda", dtype=torch.float32)
    b2 = torch.zeros(E, H, device="cuda", dtype=torch.float32)

    def prepare(logits, x):
        lg = logits.to(torch.bfloat16)

        def fn():
            rd, gi, si = routing(lg, k)
            h = mm(x, w1, b1, rd, gather_indx=gi, precision_config=pc1, fused_activation=act)
            mm(h, w2, b2, rd, scatter_indx=si, precision_config=pc2, gammas=rd.gate_scal)
        return fn
    try:
        version = md.version("triton_kernels")
    except md.PackageNotFoundError:
        version = "?"
    import triton
    return f"triton_kernels {version}, triton {triton.__version__}", prepare


def make_flashinfer(torch, E, k, H, I):
    import flashinfer
    from flashinfer.fused_moe import cutlass_fused_moe
    w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02  # [E, 2I, H]: up and gate rows
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02

    def prepare(logits, x):
        top = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        ids = top.indices.to(torch.int32).contiguous()
        wts = (top.values / top.values.sum(-1, keepdim=True)).float().contiguous()
        out = torch.empty_like(x)

        def fn():
            cutlass_fused_moe(x, ids, wts, w1, w2, torch.bfloat16, quant_scales=[], output=out)
        return fn
    return f"flashinfer {flashinfer.__version__}", prepare


MAKERS = {"torch": make_torch, "triton": make_triton, "flashinfer": make_flashinfer}


def shape_dims(shape, moekit):
    """E, k, H, I of "E,k,H,I" or of a preset name (from `moekit bench --list-shapes`, the one table)."""
    if shape.replace(",", "").isdigit():
        return tuple(int(v) for v in shape.split(","))
    out = subprocess.run([moekit, "bench", "--list-shapes"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        f = line.split()
        if f and f[0] == shape:
            return tuple(int(v) for v in f[1:5])
    sys.exit(f"peers: unknown shape {shape!r} (moekit bench --list-shapes names {', '.join(l.split()[0] for l in out.splitlines())})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", required=True,
                    help="E,k,H,I, or a preset name of `moekit bench --list-shapes`; repeat it for several")
    ap.add_argument("--moekit", default="", help="the moekit binary that names the presets (default: moekit on PATH)")
    ap.add_argument("--tokens", default="1,8,32,64")
    ap.add_argument("--routing", default="uniform", help="uniform, zipf or both (uniform,zipf)")
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-ms", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--wheels", default="", help="a directory of wheels to install first (pip, no index)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    shapes = [(name, shape_dims(name, a.moekit or "moekit")) for name in a.shape]
    tokens = [int(t) for t in a.tokens.split(",")]
    routings = [r for r in a.routing.split(",") if r]
    peers = [p for p in a.peers.split(",") if p]
    rows = []
    status = {p: {"peer": PEER_NAMES.get(p, p), "weights": PEER_WEIGHTS.get(p, "?"), "scope": PEER_SCOPE.get(p, "?")}
              for p in peers}

    def skip(p, reason):
        status[p].update(status="skipped", reason=reason)
        print(f"peer {p}: skipped ({reason})", flush=True)

    def write():
        if a.json:
            with open(a.json + ".tmp", "w") as f:
                json.dump({"rows": rows, "status": list(status.values())}, f, indent=1)
            os.replace(a.json + ".tmp", a.json)

    if a.wheels:
        install_wheels(a.wheels)
    try:
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
    except Exception as e:  # noqa: BLE001
        for p in peers:
            skip(p, f"torch with CUDA is needed ({e})")
        write()
        return
    timer = Timer(torch, a.reps, a.budget_ms)
    device = torch.cuda.get_device_name(0)
    for name, (E, k, H, I) in shapes:
        for p in peers:
            st = status[p]
            if st.get("status") == "skipped":
                continue  # not importable: said once
            if p not in MAKERS:
                skip(p, "unknown peer")
                continue
            try:
                version, prepare = MAKERS[p](torch, E, k, H, I)
            except ImportError as e:
                skip(p, f"not importable: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - an API this script does not know, a shape it refuses
                st.setdefault("failures", []).append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
                print(f"peer {p}, {name}: {st['failures'][-1]}", flush=True)
                traceback.print_exc()
                torch.cuda.empty_cache()
                continue
            st["version"] = version
            for routing in routings:
                for T in tokens:
                    try:
                        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                        fn = prepare(router_logits(torch, T, E, routing, a.zipf_s, a.seed + T, "cuda"), x)
                        us, how = timer(fn)
                    except Exception as e:  # noqa: BLE001 - one point failing spares the others
                        st.setdefault("failures", []).append(f"{name} {routing} T={T}: {type(e).__name__}: {str(e)[:160]}")
                        print(f"peer {p}: {st['failures'][-1]}", flush=True)
                        torch.cuda.synchronize()
                        continue
                    row = {"peer": st["peer"], "weights": st["weights"], "scope": st["scope"], "version": version,
                           "timing": how, "shape": name, "E": E, "k": k, "H": H, "I": I, "routing": routing,
                           "zipf_s": a.zipf_s if routing == "zipf" else None, "tokens": T, "us": us, "device": device}
                    rows.append(row)
                    st["status"] = "ran"
                    print(json.dumps(row), flush=True)
                    write()
            del prepare
            torch.cuda.empty_cache()
    for p in peers:
        if "status" not in status[p]:
            skip(p, (status[p].get("failures") or ["no point ran"])[0])
    write()


if __name__ == "__main__":
    main()
