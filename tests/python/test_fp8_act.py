"""FP8 activations (LayerSpec.activation_dtype = "fp8"): moekit's quantizer bit for bit against an
independent one built on torch's float8_e4m3fn cast, the CPU layer against the float64 reference
of reference.py with that torch quantizer on both GEMMs' inputs, and the description's round trip
through the Python API."""

import numpy as np
import pytest

import moekit
import reference as ref

torch = pytest.importorskip("torch")


def torch_quant(x, rule):
    """Per row per 128 along K (the last group partial: padded with zeros), amax floored at 1e-4,
    s = amax / 448 in fp32, ue8m0: the smallest power of two >= s (frexp: exact; 2**ceil(log2(s))
    in fp32 can round log2 down just above a power of two), q = fp8(clamp(x / s)) by torch's cast
    (round to nearest even)."""
    x = torch.from_numpy(np.ascontiguousarray(x, np.float32))
    R, K = x.shape
    G = (K + 127) // 128
    xp = torch.zeros((R, G * 128), dtype=torch.float32)
    xp[:, :K] = x
    xg = xp.view(R, G, 128)
    amax = xg.abs().amax(-1).clamp_min(torch.tensor(1e-4, dtype=torch.float32))
    s = amax / torch.tensor(448.0, dtype=torch.float32)
    if rule == "ue8m0":
        m, e = torch.frexp(s)
        s = torch.where(m == 0.5, s, torch.ldexp(torch.ones_like(s), e))
    q = (xg / s[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    codes = q.view(torch.uint8).reshape(R, G * 128)[:, :K]
    deq = (q.to(torch.float32) * s[..., None]).reshape(R, G * 128)[:, :K]
    return codes.numpy(), s.numpy(), deq.numpy()


def awkward_rows(rng):
    rows = []
    for K in [1, 3, 127, 128, 130, 256, 320, 2880]:
        for mag in [-40, -12, 0, 9, 30]:
            x = rng.normal(0, 1, (3, K)).astype(np.float32) * np.float32(2.0 ** mag)
            x[1, ::7] *= np.float32(1e-3)  # values far below their group's amax: subnormal codes
            x[2, : min(K, 128)] = 0.0  # an all-zero first group
            rows.append(moekit.bf16_to_float(moekit.float_to_bf16(x)))
    edges = np.zeros((1, 128), np.float32)
    edges[0, :16] = [448, 440, 432, 431, -448, 1, 1.0625, 1.1875, 2**-6, 2**-9, 2**-10, 3 * 2**-10, 5 * 2**-10,
                     -(2**-11), -0.0, 0.5]
    rows.append(edges)
    return rows


@pytest.mark.parametrize("rule", ["fp32", "ue8m0"])
def test_quantizer_bit_exact_against_torch(rule):
    rng = np.random.default_rng(1)
    for x in awkward_rows(rng):
        codes, scales = moekit.quantize_activations_fp8(x, rule)
        tc, ts, _ = torch_quant(x, rule)
        np.testing.assert_array_equal(scales.view(np.uint32), ts.view(np.uint32))
        np.testing.assert_array_equal(codes, tc)
    # Random fp32 (not only bf16) values over a wide range.
    x = (rng.normal(0, 1, (64, 1000)) * 2.0 ** rng.integers(-30, 30, (64, 1))).astype(np.float32)
    codes, scales = moekit.quantize_activations_fp8(x, rule)
    tc, ts, _ = torch_quant(x, rule)
    np.testing.assert_array_equal(scales.view(np.uint32), ts.view(np.uint32))
    np.testing.assert_array_equal(codes, tc)


def test_quantizer_edges_and_errors():
    x = np.zeros((2, 130), np.float32)
    x[1, 129] = np.nan
    codes, scales = moekit.quantize_activations_fp8(x, "ue8m0")
    assert scales[0, 0] == np.float32(2.0**-22) and (codes[0] == 0).all()  # zero group: floor 1e-4
    assert np.isnan(scales[1, 1]) and (codes[1, 128:] == 0x7F).all() and (codes[1, :128] == 0).all()
    with pytest.raises(ValueError):
        moekit.quantize_activations_fp8(x, "e8m0")
    with pytest.raises(ValueError):
        moekit.quantize_activations_fp8(np.zeros(5, np.float32))


def spec_of(fmt="mxfp4", **kw):
    base = dict(num_experts=8, top_k=2, hidden=320, intermediate=192, format=fmt, activation="silu_clamped",
                swiglu_limit=0.5, norm_topk_prob=True, max_tokens=64, activation_dtype="fp8",
                activation_scale="ue8m0")
    base.update(kw)
    return moekit.LayerSpec(**base)


@pytest.mark.parametrize("rule", ["fp32", "ue8m0"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp8", "bf16"])
@pytest.mark.parametrize("T", [0, 1, 3, 37])
def test_layer_against_float64_with_torch_quantization(fmt, rule, T):
    spec = spec_of(fmt, activation_scale=rule)
    ck = moekit.random_checkpoint(spec, seed=5)
    rng = np.random.default_rng(T)
    x = moekit.float_to_bf16(rng.normal(0, 1, (T, spec.hidden)))
    ids = np.array([rng.permutation(spec.num_experts)[: spec.top_k] for _ in range(T)], np.int32).reshape(
        T, spec.top_k)
    if T >= 3:
        ids[1, 1] = -1  # an empty slot
    w = rng.uniform(0.1, 1, (T, spec.top_k)).astype(np.float32)
    outs = []
    for backend in ["cpu", "cpu_batched"]:
        layer = moekit.pack(spec, ck, backend=backend)
        out = np.full((T, spec.hidden), 0x7FC0, np.uint16)
        layer.forward_topk(x, ids, w, out, np.empty(layer.workspace_bytes(T, spec.top_k), np.uint8))
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])
    if T == 0:
        return
    y = moekit.bf16_to_float(outs[0])
    want = ref.layer(spec, ck, x, ids, w, quant=lambda v: torch_quant(v, rule)[2])
    assert ref.rel_l2(y, want) <= 3e-3
    # The cost of fp8 activations on this data (4-8e-2 here: E4M3 keeps 4 significant bits, on
    # both GEMMs' inputs), far above bf16's.
    ref16 = ref.layer(spec, ck, x, ids, w)
    assert 10 * ref.rel_l2(moekit.bf16_to_float(moekit.float_to_bf16(ref16)), ref16) < ref.rel_l2(y, ref16) <= 1e-1


def test_spec_round_trip_and_refusals():
    spec = spec_of()
    d = spec.to_dict()
    assert d["activation_dtype"] == "fp8" and d["activation_scale"] == "ue8m0"
    assert moekit.LayerSpec(**d) == spec
    cfg = {"num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 320, "intermediate_size": 192,
           "activation_dtype": "fp8", "activation_scale": "ue8m0", "quantization": {"format": "mxfp4"}}
    got = moekit.LayerSpec.from_config(cfg)
    assert got.activation_dtype == "fp8" and got.activation_scale == "ue8m0"
    plain = {k: v for k, v in cfg.items() if not k.startswith("activation_")}
    assert moekit.LayerSpec.from_config(plain).activation_dtype == "bf16"
    p = moekit.plan(spec)
    assert p.backend == "cpu"
    assert "fp8 (ue8m0 scales) activations" in p.explain
    for bad in [dict(activation_dtype="fp16"), dict(activation_scale="e8m0"),
                dict(activation_dtype="bf16", activation_scale="ue8m0")]:
        with pytest.raises(ValueError):
            moekit.plan(spec_of(**bad))
    b = {x["name"]: x for x in moekit.backends()}
    assert b["cpu"]["activation_dtypes"] == ["bf16", "fp8"]
    assert b["cpu_batched"]["activation_dtypes"] == ["bf16", "fp8"]
    text = moekit.explain(spec, "cpu")
    for name, info in b.items():
        if info["gpu"] and "fp8" not in info["activation_dtypes"]:
            # An SM90 backend without fp8 inputs says so, whatever the device.
            line = next(ln for ln in text.splitlines() if f" {name} " in ln)
            assert "no fp8 activations" in line, line


@pytest.mark.parametrize("backend", ["cpu", "cpu_batched"])
def test_batched_entry_quantizes_the_same_way(backend):
    """forward_batched (the experts alone) on rows [0, count) of each expert: the same bits as
    forward_topk of each row with its expert and weight 1 (the other slot empty)."""
    spec = spec_of("mxfp4", activation_scale="fp32")
    ck = moekit.random_checkpoint(spec, seed=9)
    layer = moekit.pack(spec, ck, backend=backend)
    E, M, H = spec.num_experts, 5, spec.hidden
    rng = np.random.default_rng(4)
    counts = np.array([5, 0, 3, 1, 0, 5, 2, 0], np.int32)
    x = moekit.float_to_bf16(rng.normal(0, 1, (E, M, H)))
    out = np.full((E, M, H), 0x7FC0, np.uint16)
    layer.forward_batched(x, counts, out, np.empty(layer.batched_workspace_bytes(M), np.uint8))
    for e in range(E):
        n = int(counts[e])
        if n == 0:
            continue
        ids = np.array([[e, -1]] * n, np.int32)
        w = np.array([[1.0, 0.0]] * n, np.float32)
        y = np.full((n, H), 0x7FC0, np.uint16)
        layer.forward_topk(np.ascontiguousarray(x[e, :n]), ids, w, y, np.empty(layer.workspace_bytes(n, 2), np.uint8))
        np.testing.assert_array_equal(out[e, :n], y)
    assert (out[1] == 0x7FC0).all()  # rows past the counts untouched
