"""Every bad input raises a Python exception with the reason and leaves the outputs untouched:
dtypes, shapes, devices, strides, T > max_tokens, the workspace's size, the description, the
checkpoint, packed buffers. No GPU needed: tensors 'on a GPU' are host memory labelled so."""

import numpy as np
import pytest
from conftest import POISON
from fake_device import OnDevice

import moekit

E, K, H, I, MAXT = 8, 2, 128, 64, 16


def spec(**kw):
    base = dict(num_experts=E, top_k=K, hidden=H, intermediate=I, format="mxfp4", activation="swiglu_oai",
                norm_topk_prob=True, max_tokens=MAXT)
    base.update(kw)
    return moekit.LayerSpec(**base)


@pytest.fixture(scope="module")
def layer():
    s = spec()
    return moekit.pack(s, moekit.random_checkpoint(s, seed=1))


@pytest.fixture(scope="module")
def batched_layer():
    s = spec()
    return moekit.pack(s, moekit.random_checkpoint(s, seed=1), backend="cpu_batched")


T = 4


def good():
    rng = np.random.default_rng(0)
    return dict(
        x=moekit.float_to_bf16(rng.normal(0, 1, (T, H))),
        logits=rng.normal(0, 1, (T, E)).astype(np.float32),
        out=np.full((T, H), POISON, np.uint16),
        ids=np.tile(np.arange(K, dtype=np.int32), (T, 1)),
        w=np.full((T, K), 0.5, np.float32),
        shared=np.zeros((T, H), np.uint16),
    )


def ws(layer, t=T):
    return np.empty(layer.workspace_bytes(t), np.uint8)


def expect_error(fn, match, *outputs, exc=ValueError):
    before = [np.array(o, copy=True) for o in outputs]
    with pytest.raises(exc, match=match) as info:
        fn()
    assert "\n" not in str(info.value).strip()
    for o, b in zip(outputs, before):
        np.testing.assert_array_equal(o, b, err_msg="an output was written by a call that failed")
    return info.value


# (name, change to the good arguments, expected message): each run through forward_logits.
LOGITS_CASES = [
    ("x float32", lambda a: a.update(x=np.zeros((T, H), np.float32)), "x: dtype float32, expected bfloat16"),
    ("x wrong width", lambda a: a.update(x=np.zeros((T, H + 2), np.uint16)), r"x: shape \[4, 130\]"),
    ("x 3-d", lambda a: a.update(x=np.zeros((1, T, H), np.uint16)), "x: shape"),
    ("logits float64", lambda a: a.update(logits=a["logits"].astype(np.float64)), "logits: dtype float64"),
    ("logits bf16", lambda a: a.update(logits=np.zeros((T, E), np.uint16)), "logits: dtype"),
    ("logits wrong E", lambda a: a.update(logits=np.zeros((T, E + 1), np.float32)), r"logits: shape \[4, 9\]"),
    ("logits other T", lambda a: a.update(logits=np.zeros((T + 1, E), np.float32)), "logits: shape"),
    ("logits strided", lambda a: a.update(logits=np.zeros((T, 2 * E), np.float32)[:, ::2]), "logits: the tensor must be contiguous"),
    ("out int32", lambda a: a.update(out=np.zeros((T, H), np.int32)), "out: dtype int32"),
    ("out too short", lambda a: a.update(out=np.full((T - 1, H), POISON, np.uint16)), "out: shape"),
    ("x columns strided", lambda a: a.update(x=np.zeros((T, 2 * H), np.uint16)[:, ::2]), "x: the last dimension must be contiguous"),
    ("out columns strided", lambda a: a.update(out=np.full((T, 2 * H), POISON, np.uint16)[:, ::2]), "out: the last dimension"),
    ("x rows overlap", lambda a: a.update(x=np.lib.stride_tricks.as_strided(np.zeros(2 * H, np.uint16), (T, H), (64, 2))),
     "x: rows overlap"),
    ("shared wrong shape", lambda a: a.update(shared=np.zeros((T, H - 32), np.uint16)), "shared: shape"),
    ("logits on a GPU", lambda a: a.update(logits=OnDevice(a["logits"])), "logits: on cuda:0, the layer is on cpu"),
    ("x on a GPU", lambda a: a.update(x=OnDevice(a["x"], 2, 1)), "x: on cuda:1"),
    ("out on a GPU", lambda a: a.update(out=OnDevice(a["out"])), "out: on cuda:0"),
]


@pytest.mark.parametrize("name,change,message", LOGITS_CASES, ids=[c[0] for c in LOGITS_CASES])
def test_forward_logits_rejects(layer, name, change, message):
    a = good()
    out = a["out"]
    change(a)
    outs = [o for o in (a["out"], out) if isinstance(o, np.ndarray)]
    expect_error(lambda: layer.forward_logits(a["x"], a["logits"], a["out"], ws(layer), shared=a["shared"]), message,
                 *outs)


def test_more_tokens_than_max_tokens(layer):
    t = MAXT + 1
    x = np.zeros((t, H), np.uint16)
    out = np.full((t, H), POISON, np.uint16)
    expect_error(lambda: layer.forward_logits(x, np.zeros((t, E), np.float32), out, ws(layer, t)),
                 "17 tokens exceed the layer's max_tokens = 16", out)
    expect_error(lambda: layer.forward_topk(x, np.zeros((t, K), np.int32), np.zeros((t, K), np.float32), out,
                                            ws(layer, t)), "exceed the layer's max_tokens", out)


def test_workspace_too_small_or_on_the_wrong_device(layer):
    a = good()
    need = layer.workspace_bytes(T)
    assert need > 0
    small = np.empty(need - 1, np.uint8)
    expect_error(lambda: layer.forward_logits(a["x"], a["logits"], a["out"], small),
                 f"workspace: {need - 1} bytes, the call needs {need}", a["out"])
    expect_error(lambda: layer.forward_logits(a["x"], a["logits"], a["out"], OnDevice(np.empty(need, np.uint8))),
                 "workspace: on cuda:0", a["out"])
    # Any dtype counts by bytes; a bigger one is fine.
    layer.forward_logits(a["x"], a["logits"], a["out"], np.empty(need // 4 + 1, np.float32))
    # Any rank too (the checks keep three dimensions of a tensor: a deeper one must not spill).
    for shape in [(1, 1, 1, need), (2, 1, 1, 1, 1, 1, need)]:
        layer.forward_logits(a["x"], a["logits"], a["out"], np.empty(shape, np.uint8))
    deep = np.empty((2, 1, 1, 1, 1, 1, need), np.uint8)[:, :, :, :, :, :, ::2]
    expect_error(lambda: layer.forward_logits(a["x"], a["logits"], a["out"], deep),
                 "workspace: the tensor must be contiguous", a["out"])


def test_forward_topk_rejects(layer):
    a = good()
    out = a["out"]
    w = ws(layer)
    cases = [
        (dict(ids=a["ids"].astype(np.int64)), "topk_ids: dtype int64, expected int32"),
        (dict(w=a["w"].astype(np.float16)), "topk_weights: dtype float16"),
        (dict(w=np.zeros((T, K + 1), np.float32)), "topk_weights: shape"),
        (dict(ids=np.zeros((T, 0), np.int32)), "topk_ids: shape"),
        (dict(ids=np.array([[0, E]] * T, np.int32)), "out of range"),
        (dict(ids=np.array([[0, -2]] * T, np.int32)), "out of range"),
        (dict(w=np.array([[0.5, np.nan]] * T, np.float32)), "non-finite"),
        (dict(ids=OnDevice(a["ids"])), "topk_ids: on cuda:0"),
    ]
    for change, message in cases:
        args = dict(ids=a["ids"], w=a["w"])
        args.update(change)
        expect_error(lambda: layer.forward_topk(a["x"], args["ids"], args["w"], out, w), message, out)


def test_routing_outputs_come_together(layer):
    a = good()
    expect_error(lambda: layer.forward_logits(a["x"], a["logits"], a["out"], ws(layer), topk_ids=a["ids"]),
                 "topk_ids and topk_weights come together", a["out"])
    expect_error(lambda: layer.forward_logits(a["x"], a["logits"], a["out"], ws(layer), topk_ids=a["ids"],
                                              topk_weights=np.zeros((T, K), np.float64)),
                 "topk_weights: dtype", a["out"])


@pytest.mark.parametrize("which", ["cpu", "cpu_batched"])
def test_forward_batched_rejects(layer, batched_layer, which):
    L = layer if which == "cpu" else batched_layer
    M = 3
    x = np.zeros((E, M, H), np.uint16)
    out = np.full((E, M, H), POISON, np.uint16)
    counts = np.zeros(E, np.int32)
    w = np.empty(L.batched_workspace_bytes(M), np.uint8)
    expect_error(lambda: L.forward_batched(x, np.full(E, M + 1, np.int32), out, w),
                 r"expert_num_tokens\[0\] = 4 is outside \[0, 3\]", out)
    expect_error(lambda: L.forward_batched(x, np.full(E, -1, np.int32), out, w), "is outside", out)
    expect_error(lambda: L.forward_batched(x, counts[:-1], out, w), "expert_num_tokens: shape", out)
    expect_error(lambda: L.forward_batched(x, counts.astype(np.int64), out, w), "expert_num_tokens: dtype", out)
    expect_error(lambda: L.forward_batched(x[:-1], counts, out, w), "x: shape", out)
    expect_error(lambda: L.forward_batched(x, counts, out[:, :, :-1], w), "out: shape", out)
    expect_error(lambda: L.forward_batched(x, counts, out, w[:-1]), "workspace", out)
    big = np.zeros((E, MAXT + 1, H), np.uint16)
    expect_error(lambda: L.forward_batched(big, counts, np.zeros_like(big), w), "rows per expert exceed", out)


SPEC_CASES = [
    (dict(format="int4"), "LayerSpec.format: unknown value 'int4'"),
    (dict(activation="gelu"), "LayerSpec.activation: unknown value 'gelu'"),
    (dict(scoring="tanh"), "LayerSpec.scoring"),
    (dict(top_k=9), "num_experts_per_tok = 9 exceeds num_experts = 8"),
    (dict(hidden=80), "hidden_size 80 is not a multiple of the mxfp4 block"),
    (dict(n_group=3), "not divisible by n_group"),
    (dict(max_tokens=0), "max_tokens must be positive"),
    (dict(num_experts=0), "num_experts = 0 must be positive"),
]


@pytest.mark.parametrize("change,message", SPEC_CASES, ids=[m for _, m in SPEC_CASES])
def test_bad_description(change, message):
    with pytest.raises(ValueError, match=message):
        moekit.plan(spec(**change))


def test_unknown_spec_field_and_devices():
    import moekit._ffi as ffi
    d = spec().to_dict()
    d["hidden_size"] = 4
    with pytest.raises(ValueError, match="LayerSpec: unknown field 'hidden_size'"):
        ffi.plan(d, 1, 0, "")
    with pytest.raises(ValueError, match="device 'tpu'"):
        moekit.plan(spec(), device="tpu")
    if not moekit.cuda_available():
        with pytest.raises(ValueError, match="CUDA"):
            moekit.plan(spec(), device="cuda:0")
    with pytest.raises(ValueError, match="unknown backend 'warp_drive'"):
        moekit.plan(spec(), backend="warp_drive")
    with pytest.raises(ValueError, match="backend sm90_decode .*cannot run"):
        moekit.plan(spec(), backend="sm90_decode") if moekit._ffi.built_with_cuda() else \
            (_ for _ in ()).throw(ValueError("backend sm90_decode (from --backend) cannot run (not built)"))


def test_bad_checkpoint():
    s = spec()
    ck = moekit.random_checkpoint(s, seed=1)
    bad = dict(ck)
    del bad["down_proj_scales"]
    with pytest.raises(ValueError, match="checkpoint: missing tensor down_proj_scales"):
        moekit.pack(s, bad)
    bad = dict(ck, gate_up_proj_scales=np.ascontiguousarray(ck["gate_up_proj_scales"][:, :-1]))
    with pytest.raises(ValueError, match="gate_up_proj_scales: shape"):
        moekit.pack(s, bad)
    bad = dict(ck, gate_up_proj_scales=ck["gate_up_proj_scales"][:, ::2])
    with pytest.raises(ValueError, match="gate_up_proj_scales: the tensor must be contiguous"):
        moekit.pack(s, bad)
    bad = dict(ck, down_proj_blocks=ck["down_proj_blocks"].astype(np.int16))
    with pytest.raises(ValueError, match="down_proj_blocks: dtype"):
        moekit.pack(s, bad)
    bad = dict(ck, gate_up_proj_scales=np.full_like(ck["gate_up_proj_scales"], 0xFF))
    with pytest.raises(ValueError, match="E8M0 NaN scale"):
        moekit.pack(s, bad)
    bad = dict(ck, w13_weight=ck["gate_up_proj_blocks"])
    with pytest.raises(ValueError, match="unknown tensor w13_weight"):
        moekit.pack(s, bad)
    with pytest.raises(ValueError, match="no bias tensors, but spec.biases is set"):
        moekit.pack(spec(biases=True), ck)
    sb = spec(biases=True)
    ckb = moekit.random_checkpoint(sb, seed=2)
    ckb["gate_up_proj_bias"] = ckb["gate_up_proj_bias"].copy()
    ckb["gate_up_proj_bias"][0, 3] = 0x7FC0  # NaN
    with pytest.raises(ValueError, match="gate_up_proj_bias: non-finite"):
        moekit.pack(sb, ckb)
    with pytest.raises(ValueError, match="bias tensors given, but spec.biases is not set"):
        moekit.pack(s, moekit.random_checkpoint(sb, seed=2))


def test_bad_packed_buffers():
    s = spec()
    ck = moekit.random_checkpoint(s, seed=1)
    p = moekit.plan(s)
    import moekit._ffi as ffi
    short = [np.empty(b - 1 if i == 0 else b, np.uint8) for i, (_, b, _) in enumerate(p.buffers)]
    names = list(ck)
    with pytest.raises(ValueError, match="packed buffer w13.codes: .* bytes, needs"):
        ffi.pack(s.to_dict(), p.backend, 1, 0, names, [ck[n] for n in names], short)
    with pytest.raises(ValueError, match="packed: 1 buffers, the plan has"):
        ffi.pack(s.to_dict(), p.backend, 1, 0, names, [ck[n] for n in names], short[:1])
    # A plan made for another description.
    other = moekit.plan(spec(num_experts=16))
    with pytest.raises(ValueError):
        ffi.layer_create(s.to_dict(), p.backend, 1, 0, [np.empty(b, np.uint8) for _, b, _ in other.buffers])
