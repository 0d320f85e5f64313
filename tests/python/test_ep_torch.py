"""Expert parallelism from Python (moekit.torch.ep_group / pack_ep): bad arguments raise ValueError
(everywhere), and on two or more GPUs (marker `gpu`), one process per GPU over a
torch.distributed NCCL group as engines run: the EP layer's output equal bit for bit to the
single-GPU layer on the ranks' tokens concatenated (forward_topk and forward_logits, a rank with
no tokens, the shared expert), the same under a CUDA graph, and a bad call refused on every rank.
The split calls (dispatch -> the caller's experts -> combine, a layer with bf16 combine rows):
with moekit's batched experts between, in place and from a tensor of the caller's, eagerly and
under a CUDA graph, equal bit for bit to forward_topk of the same layer, and within 1e-2 rel-L2 of
the single-GPU layer; and vLLM's prepare/finalize slot (moekit.integrations.vllm's
MoekitEpPrepareAndFinalize + MoekitBatchedExperts) driven in the order vLLM's
FusedMoEKernelModularImpl.apply calls them, equal to forward_topk bit for bit. vLLM itself cannot be
installed on the GPU machine (vLLM 0.33 pins torch 2.14, the machine has torch 2.11): the adapter's
classes are made here over small stand-ins of vLLM's base classes (make_classes takes the modules);
tests/engines/test_vllm.py runs them over the real ones through FusedMoEKernel on the CPU."""

import os
import socket
import types

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
        # The split calls need bf16 combine rows (made before any graph: the group's memory is fixed).
        layer_b = mt.pack_ep(group, spec, ck, max_tokens_per_rank=T_MAX, kernel="decode", combine="bf16")
        try:  # refused before anything collective, alike on every rank
            mt.pack_ep(group, spec, ck, max_tokens_per_rank=T_MAX, dispatch="sideways")
            lines.append("bad dispatch ACCEPTED")
        except ValueError as e:
            lines.append("bad dispatch ValueError" if "dispatch 'sideways'" in str(e) else f"bad dispatch other: {e}")
        # The same layer from this rank's experts under vLLM's parameter names (GPT-OSS's MXFP4).
        from moekit.integrations import vllm as mv
        El, H, I = spec.num_experts // world, spec.hidden, spec.intermediate
        t = {k: torch.from_numpy(np.ascontiguousarray(v))[rank * El:(rank + 1) * El] for k, v in ck.items()}
        bf = lambda a: a.view(torch.int16).view(torch.bfloat16)  # noqa: E731
        params = dict(w13_weight=t["gate_up_proj_blocks"].reshape(El, 2 * I, H // 2), w13_weight_scale=t["gate_up_proj_scales"],
                      w2_weight=t["down_proj_blocks"].reshape(El, H, I // 2), w2_weight_scale=t["down_proj_scales"],
                      w13_bias=bf(t["gate_up_proj_bias"]), w2_bias=bf(t["down_proj_bias"]))
        layer_v = mv.convert_weights_ep(params, spec, group, max_tokens_per_rank=T_MAX, kernel="decode")
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
        graph = _capture(dev, lambda: layer.forward_topk(x, ids, w, out))
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
        lines += _split_checks(layer_b, layer, single, toks, off, rank, dev)
        x, ids, w = (v.to(dev) for v in toks[rank][:3])
        same = torch.equal(layer_v.forward_topk(x, ids, w).view(torch.int16), layer_b.forward_topk(x, ids, w).view(torch.int16))
        layer_v.check()
        lines.append(f"convert_weights_ep {'ok' if same else 'DIFFERENT'}")
    except Exception as e:  # reported through the file: the parent asserts
        lines.append(f"EXCEPTION {type(e).__name__}: {e}")
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def _capture(dev, fn):
    """A CUDA graph of fn's calls, captured on a side stream."""
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        fn()
    return graph


def _split_checks(L, fp32_layer, single, toks, off, rank, dev):
    """dispatch -> forward_batched -> combine of L (bf16 combine rows) against L.forward_topk."""
    lines = []
    x, ids, w, _, shared = (v.to(dev) for v in toks[rank])
    want = L.forward_topk(x, ids, w)
    want_sh = L.forward_topk(x, ids, w, shared=shared)
    L.check()
    recv_x, counts, expert_out = L.batch()
    El, cap, H = recv_x.shape
    ws = L.batched_workspace(cap)
    # In place: the experts write where combine reads.
    expert_out.view(torch.int16).fill_(0x7FC1)
    rx, n = L.dispatch(x, ids, w)
    assert rx.data_ptr() == recv_x.data_ptr() and n.data_ptr() == counts.data_ptr()
    L.forward_batched(rx, n, expert_out, ws)
    got = L.combine(expert_out)
    L.check()
    lines.append(f"split in place {'ok' if torch.equal(got.view(torch.int16), want.view(torch.int16)) else 'DIFFERENT'}")
    # From a tensor of the caller's (copied into place), with the shared expert and given weights.
    mine = torch.full((El, cap, H), float("nan"), dtype=torch.bfloat16, device=dev)
    rx, n = L.dispatch(x, ids, w)
    L.forward_batched(rx, n, mine, ws)
    got = L.combine(mine, topk_weights=w, shared=shared)
    L.check()
    lines.append(f"split copied {'ok' if torch.equal(got.view(torch.int16), want_sh.view(torch.int16)) else 'DIFFERENT'}")
    # Against the single-GPU layer (fp32 combine rows): one more rounding per expert row.
    total = sum(t[0].shape[0] for t in toks)
    cat = [torch.cat([t[i] for t in toks]).to(dev) for i in range(3)]
    ref = torch.empty_like(cat[0])
    single.forward_topk(cat[0], cat[1], cat[2], ref, single.workspace(total))
    r = ref[off:off + x.shape[0]].float()
    err = float((want.float() - r).norm() / max(float(r.norm()), 1e-30)) if r.numel() else 0.0
    lines.append(f"split vs single {'ok' if err <= 1e-2 else 'FAR'} rel-L2 {err:.2e}")
    # Under a CUDA graph: dispatch, the experts and combine captured together, inputs rewritten.
    out = torch.empty_like(x)

    def step():
        rx, n = L.dispatch(x, ids, w)
        L.forward_batched(rx, n, expert_out, ws)
        L.combine(expert_out, out)
    graph = _capture(dev, step)
    toks2 = _tokens(L.spec, len(toks), 77)
    x.copy_(toks2[rank][0].to(dev))
    ids.copy_(toks2[rank][1].to(dev))
    w.copy_(toks2[rank][2].to(dev))
    graph.replay()
    torch.cuda.synchronize(dev)
    L.check()
    want2 = L.forward_topk(x, ids, w)
    L.check()
    lines.append(f"split graph {'ok' if torch.equal(out.view(torch.int16), want2.view(torch.int16)) else 'DIFFERENT'}")
    # vLLM's slot, driven as vLLM's FusedMoEKernelModularImpl.apply drives it.
    got = _through_vllm_slot(L, x, ids, w)
    L.check()
    lines.append(f"vllm slot {'ok' if torch.equal(got.view(torch.int16), want2.view(torch.int16)) else 'DIFFERENT'}")
    # Refusals (before anything runs, alike on every rank): combine without a dispatch; the split
    # calls of a layer with fp32 combine rows.
    for name, call, msg in (("combine without dispatch", lambda: L.combine(expert_out), "without this layer's dispatch"),
                            ("fp32 rows", fp32_layer.batch, "combine")):
        try:
            call()
            lines.append(f"{name} ACCEPTED")
        except ValueError as e:
            lines.append(f"{name} ValueError" if msg in str(e) else f"{name} other: {e}")
    return lines


def _vllm_modules():
    """Stand-ins of vLLM's modular_kernel and topk_weight_and_reduce modules holding the few names
    the adapter's classes use (vLLM is not installable on the GPU machine; the real classes are
    tested on the CPU: tests/engines/test_vllm.py)."""
    import enum

    class Base:
        def __init__(self, *args, **kwargs):
            self.moe_config, self.quant_config = (list(args) + [None, None])[:2]

    class Delegate:
        pass

    mk = types.SimpleNamespace(
        FusedMoEExpertsModular=Base, FusedMoEExpertsMonolithic=Base, FusedMoEPrepareAndFinalizeModular=Base,
        FusedMoEActivationFormat=enum.Enum("FusedMoEActivationFormat", "Standard BatchedExperts"),
        ExpertTokensMetadata=lambda expert_num_tokens, expert_num_tokens_cpu: types.SimpleNamespace(
            expert_num_tokens=expert_num_tokens, expert_num_tokens_cpu=expert_num_tokens_cpu))
    return mk, types.SimpleNamespace(TopKWeightAndReduceDelegate=Delegate, TopKWeightAndReduceNoOP=object)


def _through_vllm_slot(L, x, ids, w):
    """prepare -> allocate_fused_expert_output -> the experts' apply -> finalize, in the order (and
    with the arguments) of vLLM 0.33's FusedMoEKernelModularImpl.apply."""
    from moekit.integrations import vllm as mv
    mk, reduce = _vllm_modules()
    cls = mv.make_classes(mk, reduce)
    quant = types.SimpleNamespace(quant_dtype=None)
    pf = cls["MoekitEpPrepareAndFinalize"](L, expert_map=mv.linear_expert_map(L.spec.num_experts, L.group.rank,
                                                                               L.group.world).to(x.device))
    experts = cls["MoekitBatchedExperts"](None, quant, layer=L)
    a1q, a1q_scale, meta, _, _ = pf.prepare(x, w, ids.long(), L.spec.num_experts, None, False, quant, True)
    El, M, K = a1q.shape
    ws13, _, out_shape = experts.workspace_shapes(M, 0, K, L.spec.top_k, L.spec.num_experts, El, meta, None)
    ws = torch.empty(ws13, dtype=torch.bfloat16, device=x.device)
    fused_out = pf.allocate_fused_expert_output(out_shape, torch.bfloat16, x.device, experts.finalize_weight_and_reduce_impl())
    assert fused_out is not None
    experts.apply(fused_out, a1q, None, None, w, ids, None, L.spec.num_experts, None, a1q_scale, None, ws, None, meta,
                  False)
    output = torch.empty_like(x)
    pf.finalize(output, fused_out, w, ids, False, experts.finalize_weight_and_reduce_impl())
    return output


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
        want = ["topk ok", "logits ok", "topk_shared ok", "graph0 ok", "graph1 ok", "after bad call ok",
                "split in place ok", "split copied ok", "split vs single ok", "split graph ok", "vllm slot ok",
                "convert_weights_ep ok", "bad call ValueError", "bad dispatch ValueError"]
        assert all(w in text for w in want), f"rank {r}: missing {[w for w in want if w not in text]}:\n{text}"
        assert "combine without dispatch ValueError" in text and "fp32 rows ValueError" in text, f"rank {r}:\n{text}"
        print(f"rank {r}: " + "; ".join(line for line in text.splitlines() if "rel-L2" in line))
