"""Expert parallelism from Python (moekit.torch.ep_group / pack_ep): bad arguments raise ValueError
(everywhere), and on two or more GPUs (marker `gpu`), one process per GPU over a
torch.distributed NCCL group as engines run: the EP layer's output equal bit for bit to the
single-GPU layer on the ranks' tokens concatenated (forward_topk and forward_logits, a rank with
no tokens, the shared expert), the same under a CUDA graph, and a bad call refused on every rank."""

import os
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moekit  # noqa: E402

SPEC = dict(num_experts=16, top_k=4, hidden=256, intermediate=192, format="mxfp4", activation="swiglu_oai",
            norm_topk_prob=True, biases=True)
T_MAX = 16


def test_pack_ep_needs_a_group():
    import moekit.torch as mt
    spec = moekit.LayerSpec(max_tokens=T_MAX, **SPEC)
    with pytest.raises(ValueError, match="EpGroup"):
        mt.pack_ep(object(), spec)


def test_ep_group_needs_torch_distributed():
    import torch.distributed as dist
    import moekit.torch as mt
    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    with pytest.raises(ValueError, match="init_process_group"):
        mt.ep_group()
    with pytest.raises(ValueError, match="transport"):
        mt.ep_group(transport="carrier pigeon")


def _tokens(spec, R, seed):
    """Every rank's tokens (rank 1 none), drawn alike on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(R):
        T = 0 if r == 1 else T_MAX - 3 * r
        x = torch.randn(T, spec.hidden, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(spec.num_experts, generator=g)[:spec.top_k] for _ in range(T)]).int() \
            if T else torch.zeros(0, spec.top_k, dtype=torch.int32)
        w = torch.rand(T, spec.top_k, generator=g) + 0.1
        logits = torch.randn(T, spec.num_experts, generator=g)
        shared = torch.randn(T, spec.hidden, generator=g).to(torch.bfloat16)
        out.append((x, ids, w, logits, shared))
    return out


def _worker(rank, world, port, result_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch.distributed as dist
    import moekit.torch as mt
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    dev = torch.device("cuda", rank)
    lines = []
    try:
        spec = moekit.LayerSpec(max_tokens=T_MAX, **SPEC)
        ck = moekit.random_checkpoint(spec, seed=3)
        group = mt.ep_group()
        layer = mt.pack_ep(group, spec, ck, max_tokens_per_rank=T_MAX, kernel="decode")  # as sm90_decode
        assert layer.first_expert == rank * (spec.num_experts // world)
        toks = _tokens(spec, world, 5)
        # The single-GPU layer on every rank's tokens (this GPU).
        total = sum(t[0].shape[0] for t in toks)
        single = mt.pack(moekit.LayerSpec(max_tokens=max(total, 1), **SPEC), ck, dev, "sm90_decode")
        cat = [torch.cat([t[i] for t in toks]).to(dev) for i in range(5)]
        off = sum(t[0].shape[0] for t in toks[:rank])
        x, ids, w, logits, shared = (v.to(dev) for v in toks[rank])
        T = x.shape[0]
        for name in ("topk", "logits", "topk_shared"):
            want = torch.empty_like(cat[0])
            ws = single.workspace(total)
            if name == "logits":
                single.forward_logits(cat[0], cat[3], want, ws)
                got = layer.forward_logits(x, logits)
            else:
                sh = name.endswith("shared")
                single.forward_topk(cat[0], cat[1], cat[2], want, ws, cat[4] if sh else None)
                got = layer.forward_topk(x, ids, w, shared=shared if sh else None)
            layer.check()
            same = torch.equal(got.view(torch.int16), want[off:off + T].view(torch.int16))
            lines.append(f"{name} {'ok' if same else 'DIFFERENT'}")
        # Under a CUDA graph, inputs rewritten in place between replays.
        out = torch.empty_like(x)
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
            layer.forward_topk(x, ids, w, out)
        for rep in range(2):
            toks2 = _tokens(spec, world, 50 + rep)
            x.copy_(toks2[rank][0].to(dev))
            w.copy_(toks2[rank][2].to(dev))
            ids.copy_(toks2[rank][1].to(dev))
            out.fill_(7)
            graph.replay()
            torch.cuda.synchronize(dev)
            layer.check()
            cat2 = [torch.cat([t[i] for t in toks2]).to(dev) for i in range(3)]
            want = torch.empty_like(cat2[0])
            single.forward_topk(cat2[0], cat2[1], cat2[2], want, single.workspace(total))
            same = torch.equal(out.view(torch.int16), want[off:off + T].view(torch.int16))
            lines.append(f"graph{rep} {'ok' if same else 'DIFFERENT'}")
        # A bad call is refused before anything runs (every rank makes it, so nobody waits).
        try:
            layer.forward_topk(x.float(), ids, w)
            lines.append("bad call ACCEPTED")
        except ValueError as e:
            lines.append("bad call ValueError" if "x: dtype" in str(e) else f"bad call other: {e}")
        layer.forward_topk(x, ids, w)
        layer.check()
        lines.append("after bad call ok")
    except Exception as e:  # reported through the file: the parent asserts
        lines.append(f"EXCEPTION {type(e).__name__}: {e}")
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.gpu
def test_ep_layer_over_torch_distributed(tmp_path):
    if not moekit.cuda_available():
        pytest.skip("needs an SM90 GPU and the CUDA-built binding")
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip("needs two or more GPUs")
    world = min(world, 4)
    import torch.multiprocessing as mp
    os.environ["MOEKIT_SLICE_COST"] = "1000000"  # whole segments in both layers: the same sums
    ctx = mp.spawn(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=False)
    import time
    deadline = time.time() + 600
    while not ctx.join(timeout=5):  # True once every rank has ended (an exception re-raises here)
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("a rank hung")
    for r in range(world):
        text = (tmp_path / f"rank{r}.txt").read_text()
        assert "EXCEPTION" not in text and "DIFFERENT" not in text and "ACCEPTED" not in text, f"rank {r}:\n{text}"
        assert text.count("ok") == 6 and "bad call ValueError" in text, f"rank {r}:\n{text}"
