"""The package on an H100/H200 with torch (marker `gpu`; skipped elsewhere): all three entry points
against the float64 reference, nothing written past the batched counts, no allocation or copy
during a forward call, the caller's stream without a sync, CUDA-graph replays bit-identical to
eager calls, torch.compile(fullgraph=True) and torch.library.opcheck, the shared expert, strided
and staged rows, and the device error flag."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moekit  # noqa: E402
import reference as ref  # noqa: E402
from conftest import POISON, same_id_sets  # noqa: E402

pytestmark = pytest.mark.gpu

SPECS = {
    # GPT-OSS: MXFP4, swiglu_oai, biases, softmax routing.
    "mxfp4": dict(num_experts=16, top_k=4, hidden=2880, intermediate=1024, format="mxfp4", activation="swiglu_oai",
                  norm_topk_prob=True, biases=True),
    # DeepSeek-style: NVFP4, silu, grouped sigmoid routing with a score bias and a scaling factor.
    "nvfp4": dict(num_experts=32, top_k=8, hidden=1024, intermediate=512, format="nvfp4", activation="silu",
                  scoring="sigmoid", n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                  score_bias=True),
    "mxfp8": dict(num_experts=16, top_k=2, hidden=1024, intermediate=768, format="mxfp8", activation="silu",
                  norm_topk_prob=True),
    # H not a multiple of 64: x is staged with zero padding columns.
    "bf16": dict(num_experts=8, top_k=2, hidden=1056, intermediate=320, format="bf16", activation="silu_clamped",
                 swiglu_limit=10.0),
}
MAX_T = 512


def make(fmt, seed=1, backend=None):
    import moekit.torch as mt
    spec = moekit.LayerSpec(max_tokens=MAX_T, **SPECS[fmt])
    ck = moekit.random_checkpoint(spec, seed=seed)
    return spec, ck, mt.pack(spec, ck, "cuda", backend)


_OTHER = {}


def other_backend(spec, ck, backend):
    import moekit.torch as mt
    key = (spec.format, backend)
    if key not in _OTHER:
        _OTHER[key] = mt.pack(spec, ck, "cuda", backend)
    return _OTHER[key]


@pytest.fixture(scope="module", params=list(SPECS))
def layer(request):
    return make(request.param)


def inputs(spec, T, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, spec.hidden, device="cuda", generator=g).to(torch.bfloat16)
    logits = 2 * torch.randn(T, spec.num_experts, device="cuda", generator=g)
    return x, logits


def bits(t):
    return t.view(torch.int16).cpu().numpy().view(np.uint16)


def poisoned(*shape):
    return torch.full(shape, POISON, dtype=torch.int16, device="cuda").view(torch.bfloat16)


@pytest.mark.parametrize("T", [1, 8, 64])
@pytest.mark.parametrize("backend", ["sm90_decode", "sm90_decode_batched", "sm90_prefill", "sm90_prefill_batched"])
def test_entry_points_against_float64_reference(layer, T, backend):
    spec, ck, L0 = layer
    L = L0 if L0.backend == backend else other_backend(spec, ck, backend)
    x, logits = inputs(spec, T, seed=T)
    ws = L.workspace(T)
    out = poisoned(T, spec.hidden)
    ids = torch.full((T, spec.top_k), -5, dtype=torch.int32, device="cuda")
    w = torch.full((T, spec.top_k), float("nan"), device="cuda")
    L.forward_logits(x, logits, out, ws, topk_ids=ids, topk_weights=w)
    L.check()
    torch.cuda.synchronize()
    ids_np, w_np = ids.cpu().numpy(), w.cpu().numpy()
    rid, _ = ref.route(spec, logits.cpu().numpy(), ck.get("e_score_correction_bias"))
    assert same_id_sets(ids_np, rid)
    y_ref = ref.layer(spec, ck, bits(x), ids_np, w_np)
    assert ref.rel_l2(moekit.bf16_to_float(bits(out)), y_ref) <= 1e-2
    # forward_topk with the same routing: the same bits.
    out2 = poisoned(T, spec.hidden)
    L.forward_topk(x, ids, w, out2, ws)
    assert torch.equal(out2.view(torch.int16), out.view(torch.int16))
    # forward_batched on the same rows: every expert's rows, nothing past the counts.
    E, M = spec.num_experts, T
    counts = np.bincount(ids_np[ids_np >= 0], minlength=E).astype(np.int32)
    xb = torch.zeros(E, M, spec.hidden, dtype=torch.bfloat16, device="cuda")
    fill = np.zeros(E, int)
    xn = bits(x)
    xb_np = np.zeros((E, M, spec.hidden), np.uint16)
    for t in range(T):
        for e in ids_np[t]:
            if e >= 0:
                xb_np[e, fill[e]] = xn[t]
                fill[e] += 1
    xb.view(torch.int16).copy_(torch.from_numpy(xb_np.view(np.int16)))
    outb = poisoned(E, M, spec.hidden)
    L.forward_batched(xb, torch.from_numpy(counts).cuda(), outb, L.batched_workspace(M))
    L.check()
    ob = bits(outb)
    for e in range(E):
        assert (ob[e, counts[e]:] == POISON).all(), f"rows past expert {e}'s count were written"
        if counts[e]:
            assert ref.rel_l2(moekit.bf16_to_float(ob[e, :counts[e]]), ref.expert_rows(spec, ck, xb_np[e, :counts[e]], e)) <= 1e-2


def test_no_allocation_and_no_copy_during_forward(layer):
    spec, _, L = layer
    T = 64
    x, logits = inputs(spec, T)
    out = torch.empty_like(x)
    ws = L.workspace(T)
    L.forward_logits(x, logits, out, ws)  # warm-up: lazy CUDA state
    torch.cuda.synchronize()
    ptr = out.data_ptr()
    before = torch.cuda.memory_stats()
    for _ in range(10):
        L.forward_logits(x, logits, out, ws)
        torch.ops.moekit.forward_logits(L.key, x, logits, out, ws)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    for k in ("allocation.all.allocated", "allocated_bytes.all.allocated", "active_bytes.all.current"):
        assert after[k] == before[k], k
    assert out.data_ptr() == ptr


def test_non_default_stream_without_sync(layer):
    spec, _, L = layer
    T = 8
    x, logits = inputs(spec, T, seed=3)
    want = torch.empty_like(x)
    L.forward_logits(x, logits, want, L.workspace(T))
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    xs = torch.zeros_like(x)
    out = torch.zeros_like(x)
    ws = L.workspace(T)
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # the producer is late: a launch on another stream reads zeros
        xs.copy_(x)
        L.forward_logits(xs, logits, out, ws)
    s.synchronize()
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("T", [1, 8, 64, 512])
def test_cuda_graph_replay_is_bit_identical(layer, T):
    spec, _, L = layer
    x, logits = inputs(spec, T, seed=T)
    x2, logits2 = inputs(spec, T, seed=T + 1)
    ws = L.workspace(T)
    eager, eager2 = torch.empty_like(x), torch.empty_like(x)
    L.forward_logits(x, logits, eager, ws)
    L.forward_logits(x2, logits2, eager2, ws)
    out = torch.empty_like(x)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        L.forward_logits(x, logits, out, ws)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        L.forward_logits(x, logits, out, ws)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
    x.copy_(x2)
    logits.copy_(logits2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager2.view(torch.int16))


def test_torch_compile_fullgraph_and_opcheck(layer):
    spec, _, L = layer
    T = 8
    x, logits = inputs(spec, T, seed=5)
    ids = torch.zeros(T, spec.top_k, dtype=torch.int32, device="cuda")
    w = torch.zeros(T, spec.top_k, device="cuda")
    eager = torch.empty_like(x)
    L.forward_logits(x, logits, eager, L.workspace(T), topk_ids=ids, topk_weights=w)

    nbytes = L.workspace_bytes(T)  # host metadata, taken outside the compiled region (as engines size buffers)

    def f(x, logits):
        out = torch.empty_like(x)
        ws = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        torch.ops.moekit.forward_logits(L.key, x, logits, out, ws)
        return out * 1  # a consumer of the result in the same graph

    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(compiled(x, logits).view(torch.int16), eager.view(torch.int16))
    ws = L.workspace(T)
    torch.library.opcheck(torch.ops.moekit.forward_logits.default, (L.key, x, logits, torch.empty_like(x), ws))
    torch.library.opcheck(torch.ops.moekit.forward_topk.default, (L.key, x, ids, w, torch.empty_like(x), ws))
    E, M = spec.num_experts, 4
    xb = torch.randn(E, M, spec.hidden, device="cuda").to(torch.bfloat16)
    counts = torch.full((E,), 2, dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.moekit.forward_batched.default,
                          (L.key, xb, counts, torch.zeros_like(xb), L.batched_workspace(M)))


def test_shared_expert_and_strided_rows(layer):
    spec, ck, L = layer
    T, H = 16, spec.hidden
    x, logits = inputs(spec, T, seed=7)
    shared = (0.5 * torch.randn(T, H, device="cuda")).to(torch.bfloat16)
    ids = torch.zeros(T, spec.top_k, dtype=torch.int32, device="cuda")
    w = torch.zeros(T, spec.top_k, device="cuda")
    out = torch.empty_like(x)
    L.forward_logits(x, logits, out, L.workspace(T), shared=shared, topk_ids=ids, topk_weights=w)
    y_ref = ref.layer(spec, ck, bits(x), ids.cpu().numpy(), w.cpu().numpy()) + ref.bf16(bits(shared))
    assert ref.rel_l2(moekit.bf16_to_float(bits(out)), y_ref) <= 1e-2
    # x and out as column windows of wider tensors (row strides > H): the same bits.
    wide_x = torch.zeros(T, H + 64, dtype=torch.bfloat16, device="cuda")
    wide_x[:, 32:32 + H] = x
    wide_out = poisoned(T, 2 * H)
    L.forward_logits(wide_x[:, 32:32 + H], logits, wide_out[:, H:], L.workspace(T), shared=shared)
    assert torch.equal(wide_out[:, H:].view(torch.int16), out.view(torch.int16))
    assert (wide_out[:, :H].view(torch.int16) == POISON).all()


def test_device_errors_come_back_through_check(layer):
    spec, _, L = layer
    T = 4
    x, _ = inputs(spec, T)
    ids = torch.zeros(T, spec.top_k, dtype=torch.int32, device="cuda")
    ids[1, 0] = spec.num_experts  # out of range: the kernels skip the slot and raise the flag
    w = torch.full((T, spec.top_k), 0.5, device="cuda")
    L.forward_topk(x, ids, w, torch.empty_like(x), L.workspace(T))
    with pytest.raises(ValueError, match="out of range"):
        L.check()
    L.forward_topk(x, torch.zeros_like(ids), w, torch.empty_like(x), L.workspace(T))
    L.check()


def test_tensors_on_another_device_or_the_cpu_are_refused(layer):
    spec, _, L = layer
    x, logits = inputs(spec, 2)
    with pytest.raises(ValueError, match="logits: on cpu, the layer is on cuda:0"):
        L.forward_logits(x, logits.cpu(), torch.empty_like(x), L.workspace(2))
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="on cuda:1"):
            L.forward_logits(x.to("cuda:1"), logits, torch.empty_like(x), L.workspace(2))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU")
def test_a_layer_on_the_second_gpu_runs_there():
    import moekit.torch as mt
    spec = moekit.LayerSpec(max_tokens=16, **SPECS["mxfp4"])
    ck = moekit.random_checkpoint(spec, seed=2)
    L0, L1 = mt.pack(spec, ck, "cuda:0"), mt.pack(spec, ck, "cuda:1")
    assert L1.device == "cuda:1"
    x, logits = inputs(spec, 8)
    want = torch.empty_like(x)
    L0.forward_logits(x, logits, want, L0.workspace(8))
    x1, l1 = x.to("cuda:1"), logits.to("cuda:1")
    out1 = torch.empty_like(x1)
    with torch.cuda.device(0):  # the current device is not the layer's
        L1.forward_logits(x1, l1, out1, L1.workspace(8))
    torch.cuda.synchronize(1)
    assert torch.equal(out1.cpu().view(torch.int16), want.cpu().view(torch.int16))
