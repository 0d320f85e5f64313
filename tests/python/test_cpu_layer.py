"""The Python package on numpy arrays through the CPU backends: the golden cases of
../shared/testdata/moe (made by an independent float64 implementation), the three entry points,
the shared expert, strided rows, awkward token counts, and the float64 reference of reference.py."""

import numpy as np
import pytest
from conftest import GOLDEN, POISON, load_case, same_id_sets

import moekit
import reference as ref

CPU_BACKENDS = ["cpu", "cpu_batched"]


def bf16_in(a):
    return a if a.dtype == np.uint16 else moekit.float_to_bf16(a)


def poisoned(shape):
    return np.full(shape, POISON, np.uint16)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", GOLDEN)
def test_golden_case(case, backend):
    spec, ck, inp, exp = load_case(case, max_tokens=64)
    layer = moekit.pack(spec, ck, backend=backend)
    assert layer.backend == backend
    x = bf16_in(inp["hidden_states"])
    T, H = x.shape
    out = poisoned((T, H))
    if "router_logits" in inp:
        k = spec.top_k
        ids = np.full((T, k), -7, np.int32)
        w = np.full((T, k), np.nan, np.float32)
        layer.forward_logits(x, inp["router_logits"], out, np.empty(layer.workspace_bytes(T), np.uint8),
                             topk_ids=ids, topk_weights=w)
        assert same_id_sets(ids, exp["topk_ids"])
        np.testing.assert_allclose(np.sort(w, 1), np.sort(exp["topk_weights"], 1), rtol=1e-5, atol=1e-7)
    else:
        ids, w = inp["topk_ids"], inp["topk_weights"]
        layer.forward_topk(x, ids, w, out, np.empty(layer.workspace_bytes(T, ids.shape[1]), np.uint8))
    y = moekit.bf16_to_float(out)
    assert np.isfinite(y).all()
    assert ref.rel_l2(y, exp["y_ref"]) <= 1e-2


@pytest.mark.parametrize("case", ["gptoss_small_mxfp4", "dsv3_small_nvfp4", "qwen_small_mxfp8", "tiny_bf16_clamped"])
def test_numpy_reference_agrees_with_golden(case):
    """The float64 reference of reference.py (used by the GPU tests) on the golden cases."""
    spec, ck, inp, exp = load_case(case, max_tokens=64)
    ids, w = ref.route(spec, inp["router_logits"], ck.get("e_score_correction_bias"))
    assert same_id_sets(ids, exp["topk_ids"])
    y = ref.layer(spec, ck, bf16_in(inp["hidden_states"]), ids, w)
    assert ref.rel_l2(y, exp["y_ref"]) <= 1e-6


def small_spec(**kw):
    base = dict(num_experts=8, top_k=2, hidden=128, intermediate=64, format="mxfp4", activation="swiglu_oai",
                norm_topk_prob=True, biases=True, max_tokens=128)
    base.update(kw)
    return moekit.LayerSpec(**base)


@pytest.fixture(scope="module")
def gptoss():
    spec = small_spec()
    return spec, moekit.random_checkpoint(spec, seed=3)


def inputs(spec, T, seed=0):
    rng = np.random.default_rng(seed)
    return moekit.float_to_bf16(rng.normal(0, 1, (T, spec.hidden))), rng.normal(0, 2, (T, spec.num_experts)).astype(
        np.float32)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8", "bf16"])
@pytest.mark.parametrize("T", [0, 1, 3, 118])
def test_entry_points_against_float64_reference(fmt, T):
    spec = small_spec(format=fmt, activation="silu" if fmt == "nvfp4" else "swiglu_oai")
    ck = moekit.random_checkpoint(spec, seed=7)
    x, logits = inputs(spec, T, seed=T)
    for backend in CPU_BACKENDS:
        layer = moekit.pack(spec, ck, backend=backend)
        ws = np.empty(layer.workspace_bytes(T), np.uint8)
        out = poisoned((T, spec.hidden))
        ids = np.zeros((T, spec.top_k), np.int32)
        w = np.zeros((T, spec.top_k), np.float32)
        layer.forward_logits(x, logits, out, ws, topk_ids=ids, topk_weights=w)
        if T == 0:
            continue
        rid, rw = ref.route(spec, logits)
        assert same_id_sets(ids, rid)
        y_ref = ref.layer(spec, ck, x, ids, w)
        assert ref.rel_l2(moekit.bf16_to_float(out), y_ref) <= 1e-2
        # The same routing given as top-k: the same bits.
        out2 = poisoned((T, spec.hidden))
        layer.forward_topk(x, ids, w, out2, ws)
        np.testing.assert_array_equal(out2, out)


def test_batched_entry_point_writes_only_counted_rows(gptoss):
    spec, ck = gptoss
    E, M, H = spec.num_experts, 5, spec.hidden
    rng = np.random.default_rng(11)
    x = moekit.float_to_bf16(rng.normal(0, 1, (E, M, H)))
    counts = np.array([0, 1, 5, 2, 0, 3, 4, 1], np.int32)
    for backend in CPU_BACKENDS:
        layer = moekit.pack(spec, ck, backend=backend)
        out = poisoned((E, M, H))
        layer.forward_batched(x, counts, out, np.empty(layer.batched_workspace_bytes(M), np.uint8))
        for e in range(E):
            c = counts[e]
            assert (out[e, c:] == POISON).all(), f"rows past expert {e}'s count were written"
            if c:
                y = ref.expert_rows(spec, ck, x[e, :c], e)
                assert ref.rel_l2(moekit.bf16_to_float(out[e, :c]), y) <= 1e-2


def test_shared_expert_added_before_the_one_rounding(gptoss):
    spec, ck = gptoss
    T = 9
    x, logits = inputs(spec, T, seed=5)
    shared = moekit.float_to_bf16(np.random.default_rng(6).normal(0, 0.5, (T, spec.hidden)))
    layer = moekit.pack(spec, ck)
    ws = np.empty(layer.workspace_bytes(T), np.uint8)
    ids = np.zeros((T, spec.top_k), np.int32)
    w = np.zeros((T, spec.top_k), np.float32)
    out = poisoned((T, spec.hidden))
    layer.forward_logits(x, logits, out, ws, shared=shared, topk_ids=ids, topk_weights=w)
    y_ref = ref.layer(spec, ck, x, ids, w) + ref.bf16(shared)
    y = moekit.bf16_to_float(out)
    assert ref.rel_l2(y, y_ref) <= 1e-2
    # One rounding: within half a bf16 ulp of the reference sum on (nearly) every element.
    err = np.abs(y - y_ref) / np.maximum(np.abs(y_ref), 1e-30)
    assert np.mean(err <= 2.0 ** -8 + 1e-3) > 0.99
    # forward_topk takes it too.
    out2 = poisoned((T, spec.hidden))
    layer.forward_topk(x, ids, w, out2, ws, shared=shared)
    np.testing.assert_array_equal(out2, out)


def test_strided_rows_give_the_same_bits(gptoss):
    spec, ck = gptoss
    T, H = 7, spec.hidden
    x, logits = inputs(spec, T, seed=8)
    layer = moekit.pack(spec, ck)
    ws = np.empty(layer.workspace_bytes(T), np.uint8)
    dense = poisoned((T, H))
    layer.forward_logits(x, logits, dense, ws)
    wide_x = np.zeros((T, H + 40), np.uint16)
    wide_x[:, 8:8 + H] = x
    wide_out = np.full((T, 2 * H), POISON, np.uint16)
    layer.forward_logits(wide_x[:, 8:8 + H], logits, wide_out[:, H:], ws)
    np.testing.assert_array_equal(wide_out[:, H:], dense)
    assert (wide_out[:, :H] == POISON).all()


def test_bad_device_data_is_reported_on_the_cpu_before_writing(gptoss):
    spec, ck = gptoss
    layer = moekit.pack(spec, ck)
    T = 3
    x, _ = inputs(spec, T)
    ids = np.array([[0, 1], [2, spec.num_experts], [-1, 3]], np.int32)
    w = np.ones((T, 2), np.float32)
    out = poisoned((T, spec.hidden))
    with pytest.raises(ValueError, match="out of range"):
        layer.forward_topk(x, ids, w, out, np.empty(layer.workspace_bytes(T), np.uint8))
    assert (out == POISON).all()
    layer.check()  # the CPU has no device flag


def test_minus_one_ids_and_all_tokens_on_one_expert(gptoss):
    spec, ck = gptoss
    T = 6
    x, _ = inputs(spec, T, seed=2)
    ids = np.array([[3, -1]] * T, np.int32)
    ids[2] = [-1, -1]  # a token with no expert: y = 0
    w = np.full((T, 2), 0.5, np.float32)
    layer = moekit.pack(spec, ck)
    out = poisoned((T, spec.hidden))
    layer.forward_topk(x, ids, w, out, np.empty(layer.workspace_bytes(T), np.uint8))
    y = moekit.bf16_to_float(out)
    assert (y[2] == 0).all()
    assert ref.rel_l2(y, ref.layer(spec, ck, x, ids, w)) <= 1e-2


def test_synthetic_layer_and_explain():
    spec = small_spec(max_tokens=4)
    layer = moekit.synthetic(spec, seed=3)
    x, logits = inputs(spec, 4)
    out = poisoned((4, spec.hidden))
    layer.forward_logits(x, logits, out, np.empty(layer.workspace_bytes(4), np.uint8))
    assert np.isfinite(moekit.bf16_to_float(out)).all()
    text = moekit.explain(spec, tokens=4)
    assert "chosen:" in text and "cpu" in text
    names = [b["name"] for b in moekit.backends()]
    assert "cpu" in names and "cpu_batched" in names
    assert "moekit.Layer(cpu on cpu" in repr(layer)
    p = moekit.plan(spec)
    assert p.backend == "cpu" and p.buffers[0][0] == "w13.codes"
    assert [t[0] for t in moekit.checkpoint_tensors(spec)][:2] == ["gate_up_proj_blocks", "gate_up_proj_scales"]


def test_layer_keeps_its_packed_buffers_alive(gptoss):
    spec, ck = gptoss
    layer = moekit.pack(spec, ck)
    x, logits = inputs(spec, 2)
    a = poisoned((2, spec.hidden))
    layer.forward_logits(x, logits, a, np.empty(layer.workspace_bytes(2), np.uint8))
    layer.packed = None  # the Python references go; the layer object holds the buffers
    import gc
    gc.collect()
    b = poisoned((2, spec.hidden))
    layer.forward_logits(x, logits, b, np.empty(layer.workspace_bytes(2), np.uint8))
    np.testing.assert_array_equal(a, b)
