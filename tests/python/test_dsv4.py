"""DeepSeek-V4 from Python: the router goldens of tests/golden/dsv4_router (float64 NumPy after
DeepSeek's Gate, tests/golden/dsv4_router.py) through a packed layer's forward_logits on both CPU
backends (token ids int32 and int64, the table as the golden stores it), y against reference.py;
the errors of a hash-routed layer (ValueError, nothing written); the torch op with token_ids on
an SM90 GPU (marker gpu)."""

import os
import sys

import numpy as np
import pytest
from conftest import POISON, REPO

import moekit
import reference as ref

sys.path.insert(0, os.path.join(REPO, "tests", "golden"))
import safetensors_np  # noqa: E402

GOLDEN = os.path.join(REPO, "tests", "golden", "dsv4_router")
NAMES = sorted(f[:-len(".safetensors")] for f in os.listdir(GOLDEN) if f.endswith(".safetensors"))


def golden(name):
    t, meta = safetensors_np.read(os.path.join(GOLDEN, name + ".safetensors"))
    g = {k: v for k, (_, v) in t.items()}
    g["meta"] = meta
    return g


def golden_layer(g, backend="cpu", device="cpu"):
    m = g["meta"]
    hash_ = m["kind"] == "hash"
    T = g["logits"].shape[0]
    spec = moekit.LayerSpec(num_experts=int(m["num_experts"]), top_k=int(m["top_k"]), hidden=64, intermediate=64,
                            format="mxfp4", activation="silu_clamped", swiglu_limit=10.0, scoring="sqrtsoftplus",
                            norm_topk_prob=True, routed_scaling_factor=float(m["routed_scaling_factor"]),
                            score_bias=not hash_, hash_vocab=int(m["hash_vocab"]), max_tokens=T)
    ck = moekit.random_checkpoint(spec, seed=3)
    if hash_:
        ck["tid2eid"] = g["tid2eid"]  # int64 or int32, as the golden stores it
    else:
        ck["e_score_correction_bias"] = g["bias"]
    return spec, ck, moekit.pack(spec, ck, device, backend)


def check_routing(g, ids, w):
    k = ids.shape[1]
    hash_ = g["meta"]["kind"] == "hash"
    for t in range(ids.shape[0]):
        want = dict(zip(g["topk_ids"][t].tolist(), g["topk_weights"][t].tolist()))
        if hash_:
            assert ids[t].tolist() == g["topk_ids"][t].tolist(), t
        assert set(ids[t].tolist()) == set(want), t
        for j in range(k):
            assert abs(w[t, j] - want[ids[t, j]]) <= 1e-6 * abs(want[ids[t, j]]), (t, j)


@pytest.mark.parametrize("backend", ["cpu", "cpu_batched"])
@pytest.mark.parametrize("name", NAMES)
def test_router_goldens(name, backend):
    g = golden(name)
    spec, ck, layer = golden_layer(g, backend)
    T, k, H = g["logits"].shape[0], spec.top_k, spec.hidden
    x = moekit.float_to_bf16(np.random.default_rng(1).normal(0, 1, (T, H)))
    for tok_dtype in (np.int64, np.int32):
        ids = np.full((T, k), -7, np.int32)
        w = np.full((T, k), np.nan, np.float32)
        out = np.full((T, H), POISON, np.uint16)
        tok = g["input_ids"].astype(tok_dtype) if "input_ids" in g else None
        layer.forward_logits(x, g["logits"], out, np.empty(layer.workspace_bytes(T), np.uint8), topk_ids=ids,
                             topk_weights=w, token_ids=tok)
        check_routing(g, ids, w)
        y = ref.layer(spec, ck, x, ids, w)
        assert ref.rel_l2(moekit.bf16_to_float(out), y) <= 1e-2
    # reference.py's routing (written from SPEC.md) agrees with the golden too.
    rids, rw = ref.route(spec, g["logits"], g.get("bias"), g.get("tid2eid"), g.get("input_ids"))
    check_routing(g, rids, rw.astype(np.float64))


def hash_layer(**kw):
    spec = moekit.LayerSpec(num_experts=16, top_k=4, hidden=64, intermediate=64, format="mxfp4",
                            activation="silu_clamped", swiglu_limit=10.0, scoring="sqrtsoftplus", norm_topk_prob=True,
                            routed_scaling_factor=1.5, hash_vocab=50, max_tokens=8, **kw)
    ck = moekit.random_checkpoint(spec, seed=5)
    return spec, ck


def test_hash_layer_errors_are_value_errors_and_write_nothing():
    spec, ck = hash_layer()
    layer = moekit.pack(spec, ck)
    T, H = 4, spec.hidden
    x = moekit.float_to_bf16(np.random.default_rng(2).normal(0, 1, (T, H)))
    logits = np.random.default_rng(3).normal(0, 2, (T, 16)).astype(np.float32)
    ws = np.empty(layer.workspace_bytes(T), np.uint8)
    out = np.full((T, H), POISON, np.uint16)
    with pytest.raises(ValueError, match="token_ids: required"):
        layer.forward_logits(x, logits, out, ws)
    with pytest.raises(ValueError, match="token 2 has id 50, outside the hash table's 50 rows"):
        layer.forward_logits(x, logits, out, ws, token_ids=np.array([0, 1, 50, 2], np.int64))
    with pytest.raises(ValueError, match="token_ids: dtype float32, expected int32 or int64"):
        layer.forward_logits(x, logits, out, ws, token_ids=np.zeros(T, np.float32))
    assert (out == POISON).all()
    layer.forward_logits(x, logits, out, ws, token_ids=np.array([0, 1, 49, 2], np.int32))
    assert (out != POISON).all()
    # The table's entries are checked when packing.
    bad = dict(ck)
    bad["tid2eid"] = ck["tid2eid"].copy()
    bad["tid2eid"][3, 1] = 16
    with pytest.raises(ValueError, match=r"tid2eid row 3 \(token id 3\), slot 1: expert 16 is out of range"):
        moekit.pack(spec, bad)
    bad["tid2eid"][3, 1] = bad["tid2eid"][3, 0]
    with pytest.raises(ValueError, match="lists expert .* more than once"):
        moekit.pack(spec, bad)
    with pytest.raises(ValueError, match="no expert bias"):
        moekit.plan(hash_layer(score_bias=True)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["hash_e16_k4", "learned_e16_k4"])
def test_torch_op_with_token_ids(name):
    torch = pytest.importorskip("torch")
    import moekit.torch as mt
    g = golden(name)
    spec, ck, cpu = golden_layer(g)
    L = mt.pack(spec, ck, "cuda")
    T, H = g["logits"].shape[0], spec.hidden
    x_np = moekit.float_to_bf16(np.random.default_rng(1).normal(0, 1, (T, H)))
    want = np.full((T, H), POISON, np.uint16)
    tok = g.get("input_ids")
    cpu.forward_logits(x_np, g["logits"], want, np.empty(cpu.workspace_bytes(T), np.uint8), token_ids=tok)
    x = torch.from_numpy(x_np.view(np.int16)).view(torch.bfloat16).cuda()
    logits = torch.from_numpy(g["logits"]).cuda()
    out = torch.empty_like(x)
    tt = torch.from_numpy(tok).cuda() if tok is not None else None
    torch.ops.moekit.forward_logits.default(L.key, x, logits, out, L.workspace(T), None, tt)
    torch.cuda.synchronize()
    L.check()
    y = moekit.bf16_to_float(out.view(torch.int16).cpu().numpy().view(np.uint16))
    assert ref.rel_l2(y, moekit.bf16_to_float(want)) <= 1e-2
