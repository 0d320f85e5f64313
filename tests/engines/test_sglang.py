"""moekit's SGLang adapter (python/moekit/integrations/sglang.py) against the real SGLang package
(pinned in scripts/engine_env.sh), on the CPU: "moekit" registered through SGLang's own extension
point (register_moe_runner_core), MoekitRunnerCore a DispatchMoeRunnerCore implementing every
abstract member with SGLang's signatures (this fails when SGLang's interface drifts), and a
forward through SGLang's own MoeRunner (the object a FusedMoE layer calls) with moekit's CPU backend
against SGLang's torch-native MoE (moe_forward_native, its reference implementation) on the same
weights: GPT-OSS's swiglu (interleaved gate/up, biases) and silu, bf16 weights."""

import inspect

import numpy as np
import pytest
from conftest import engine

sglang = engine("sglang")
torch = pytest.importorskip("torch")

import moekit  # noqa: E402
import reference as ref  # noqa: E402
from moekit.integrations import sglang as msg  # noqa: E402
from sglang.srt.layers.moe.fused_moe_native import moe_forward_native  # noqa: E402
from sglang.srt.layers.moe.moe_runner import base as sg_base  # noqa: E402
from sglang.srt.layers.moe.moe_runner import runner as sg_runner  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput, StandardDispatchOutput  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput  # noqa: E402
from sglang.srt.layers.moe.utils import resolve_moe_runner_backend  # noqa: E402

# (spec, SGLang's runner config) of a GPT-OSS-like and of a Qwen-like layer.
CASES = {
    "gpt_oss_swiglu": (moekit.LayerSpec(num_experts=8, top_k=2, hidden=128, intermediate=64, activation="swiglu_oai",
                                        swiglu_alpha=1.702, swiglu_limit=7.0, biases=True, max_tokens=32),
                       dict(activation="silu", gemm1_alpha=1.702, gemm1_clamp_limit=7.0, gate_up_interleaved=True)),
    "silu": (moekit.LayerSpec(num_experts=8, top_k=3, hidden=96, intermediate=64, activation="silu", max_tokens=32),
             dict(activation="silu")),
}


def runner_config(spec, **kw):
    return sg_base.MoeRunnerConfig(num_experts=spec.num_experts, num_local_experts=spec.num_experts,
                                   hidden_size=spec.hidden, intermediate_size_per_partition=spec.intermediate,
                                   top_k=spec.top_k, params_dtype=torch.bfloat16, **kw)


def bf(a):
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    spec, kw = CASES[request.param]
    ck = moekit.random_checkpoint(spec, seed=6)
    I = spec.intermediate
    w13 = bf(ck["w13_weight"])
    layer = type("FusedMoELayer", (), {})()  # what moe_forward_native reads off SGLang's FusedMoE layer
    layer.num_experts = spec.num_experts
    if kw.get("gate_up_interleaved"):  # SGLang keeps GPT-OSS's interleaved rows
        w13 = torch.stack([w13[:, :I], w13[:, I:]], 2).reshape(w13.shape)
    layer.w13_weight, layer.w2_weight = w13, bf(ck["w2_weight"])
    params = dict(w13_weight=layer.w13_weight, w2_weight=layer.w2_weight)
    if spec.biases:
        b13 = bf(ck["w13_bias"]).float()
        if kw.get("gate_up_interleaved"):
            b13 = torch.stack([b13[:, :I], b13[:, I:]], 2).reshape(b13.shape)
        layer.w13_weight_bias, layer.w2_weight_bias = b13, bf(ck["w2_bias"]).float()
        params.update(w13_weight_bias=layer.w13_weight_bias.to(torch.bfloat16), w2_weight_bias=bf(ck["w2_bias"]))
    L = msg.convert_weights(params, spec, "cpu", interleaved=bool(kw.get("gate_up_interleaved")))
    return request.param, spec, kw, ck, layer, L


def test_registered_through_sglangs_extension_point():
    msg.register()
    backend = resolve_moe_runner_backend("moekit")
    assert backend.value == "moekit"
    assert sg_runner._CUSTOM_RUNNER_CORE_FACTORIES["moekit"] is msg.MoekitRunnerCore
    msg.register()  # idempotent


def test_classes_subclass_sglangs_bases_with_its_signatures():
    assert issubclass(msg.MoekitRunnerCore, sg_base.DispatchMoeRunnerCore)
    assert issubclass(msg.MoekitQuantInfo, sg_base.MoeQuantInfo)
    assert not inspect.isabstract(msg.MoekitRunnerCore), msg.MoekitRunnerCore.__abstractmethods__
    for name in sg_base.DispatchMoeRunnerCore.__abstractmethods__ | {"__init__"}:
        mine = inspect.getattr_static(msg.MoekitRunnerCore, name)
        theirs = inspect.getattr_static(sg_base.DispatchMoeRunnerCore, name)
        f = lambda o: o.fget if isinstance(o, property) else o  # noqa: E731
        assert list(inspect.signature(f(mine)).parameters) == list(inspect.signature(f(theirs)).parameters), name


@pytest.mark.parametrize("T", [1, 7, 32])
def test_forward_through_moe_runner_against_sglangs_native_moe(case, T):
    name, spec, kw, ck, layer, L = case
    cfg = runner_config(spec, **kw)
    runner = sg_runner.MoeRunner(resolve_moe_runner_backend("moekit"), cfg)
    assert isinstance(runner.runner_core, msg.MoekitRunnerCore)
    rng = np.random.default_rng(T)
    xb = moekit.float_to_bf16(rng.normal(0, 1, (T, spec.hidden)))
    logits = rng.normal(0, 2, (T, spec.num_experts))
    ids, w = ref.route(spec, logits)
    topk = StandardTopKOutput(topk_weights=torch.from_numpy(w.astype(np.float32)),
                              topk_ids=torch.from_numpy(ids.astype(np.int64)), router_logits=torch.from_numpy(logits))
    x = bf(xb)
    res = runner.run(StandardDispatchOutput(hidden_states=x, hidden_states_scale=None, topk_output=topk),
                     msg.MoekitQuantInfo(layer=L))
    assert isinstance(res, StandardCombineInput) and res.hidden_states.shape == (T, spec.hidden)
    native = moe_forward_native(layer, x, topk, cfg)
    got = res.hidden_states.float().numpy()
    assert ref.rel_l2(got, native.float().numpy()) <= 1e-2
    assert ref.rel_l2(got, ref.layer(spec, ck, xb, ids, w)) <= 1e-2


def test_routed_scaling_factor_and_refusals(case):
    name, spec, kw, ck, layer, L = case
    info = msg.MoekitQuantInfo(layer=L)
    rng = np.random.default_rng(1)
    xb = moekit.float_to_bf16(rng.normal(0, 1, (5, spec.hidden)))
    ids, w = ref.route(spec, rng.normal(0, 2, (5, spec.num_experts)))
    topk = StandardTopKOutput(torch.from_numpy(w.astype(np.float32)), torch.from_numpy(ids.astype(np.int32)), None)
    d = StandardDispatchOutput(bf(xb), None, topk)
    core = msg.MoekitRunnerCore(runner_config(spec, **kw))
    scaled = core.run_from_dispatch(d, info, runner_config(spec, routed_scaling_factor=2.0, **kw))
    assert ref.rel_l2(scaled.hidden_states.float().numpy(), 2.0 * ref.layer(spec, ck, xb, ids, w)) <= 1e-2
    for bad, why in ((dict(activation="gelu"), "activation"), (dict(kw, no_combine=True), "no_combine"),
                     (dict(kw, apply_router_weight_on_input=True), "router weight")):
        with pytest.raises(ValueError, match=why):
            core.run_from_dispatch(d, info, runner_config(spec, **bad))
    other = dict(activation="silu") if spec.activation == "swiglu_oai" else \
        dict(activation="silu", gemm1_alpha=1.702, gemm1_clamp_limit=7.0)
    with pytest.raises(ValueError, match="packed for"):
        core.run_from_dispatch(d, info, runner_config(spec, **other))
