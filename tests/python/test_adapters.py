"""The engine adapters (python/moekit/integrations) against stand-ins of vLLM's and SGLang's base
classes (tests/python/standins): signatures, supports checks, workspace shapes, weight conversion
from the engines' parameter names, and results equal to moekit's own calls, on numpy on the CPU
(the same code runs on torch tensors on a GPU)."""

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import POISON

import moekit
import reference as ref
from moekit.integrations import sglang as msg
from moekit.integrations import vllm as mv
from standins import sglang_runner as sgl
from standins import vllm_mk as mk

CLASSES = mv.make_classes(mk, mk)
MoekitExperts = CLASSES["MoekitExperts"]
MoekitBatchedExperts = CLASSES["MoekitBatchedExperts"]
MoekitMonolithicExperts = CLASSES["MoekitMonolithicExperts"]
QuantInfo, fused = msg.make_runner(sgl.MoeQuantInfo, sgl.StandardCombineInput, sgl.register_fused_func)

SPEC = moekit.LayerSpec(num_experts=8, top_k=2, hidden=128, intermediate=64, format="mxfp4", activation="swiglu_oai",
                        norm_topk_prob=True, biases=True, max_tokens=32)


def engine_params(spec, seed=4):
    """The checkpoint as vLLM / SGLang hold it for GPT-OSS MXFP4: w13_weight = the blocks' bytes."""
    ck = moekit.random_checkpoint(spec, seed=seed)
    E, H, I = spec.num_experts, spec.hidden, spec.intermediate
    return ck, dict(w13_weight=ck["gate_up_proj_blocks"].reshape(E, 2 * I, H // 2), w13_weight_scale=ck["gate_up_proj_scales"],
                    w2_weight=ck["down_proj_blocks"].reshape(E, H, I // 2), w2_weight_scale=ck["down_proj_scales"],
                    w13_bias=ck["gate_up_proj_bias"], w2_bias=ck["down_proj_bias"])


@pytest.fixture(scope="module")
def packed():
    ck, params = engine_params(SPEC)
    return ck, mv.convert_weights(params, SPEC, "cpu")


def routed(T, seed=0):
    rng = np.random.default_rng(seed)
    x = moekit.float_to_bf16(rng.normal(0, 1, (T, SPEC.hidden)))
    logits = rng.normal(0, 2, (T, SPEC.num_experts)).astype(np.float32)
    ids, w = ref.route(SPEC, logits)
    return x, logits, ids.astype(np.int32), w.astype(np.float32)


def test_signatures_mirror_the_engines_base_classes():
    for cls, base in ((MoekitExperts, mk.FusedMoEExpertsModular), (MoekitMonolithicExperts, mk.FusedMoEExpertsMonolithic)):
        for name in ("apply", "workspace_shapes", "finalize_weight_and_reduce_impl"):
            if hasattr(base, name):
                assert list(inspect.signature(getattr(cls, name)).parameters) == \
                    list(inspect.signature(getattr(base, name)).parameters), f"{cls.__name__}.{name}"
        assert not inspect.isabstract(cls), f"{cls.__name__} leaves abstract methods"
    assert inspect.signature(fused).parameters.keys() == {"dispatch_output", "quant_info", "runner_config"}
    assert sgl.FUSED_FUNCS[("none", "moekit")] is fused


def test_vllm_supports_checks():
    moe = SimpleNamespace(is_act_and_mul=True, activation="swigluoai", moe_parallel_config=SimpleNamespace(use_ep=False),
                          routing_method="Renormalize", router_logits_dtype="torch.float32", hidden_dim=2880)
    ok, why = MoekitExperts.is_supported_config(MoekitExperts, moe, "mxfp4", None, mk.FusedMoEActivationFormat.Standard)
    assert ok == moekit.cuda_available() and (ok or why == "current device")
    assert MoekitExperts._supports_quant_scheme("nvfp4", None) and MoekitExperts._supports_quant_scheme(None, None)
    assert not MoekitExperts._supports_quant_scheme("int4_w4a16", None)
    assert not MoekitExperts._supports_quant_scheme("mxfp4", "fp8_per_tensor")
    assert not MoekitExperts._supports_activation("gelu") and MoekitExperts._supports_activation("silu")
    assert not MoekitExperts._supports_parallel_config(SimpleNamespace(use_ep=True))
    assert MoekitMonolithicExperts._supports_routing_method("DeepSeekV3", None, None)
    assert not MoekitMonolithicExperts._supports_routing_method("Llama4", None, None)
    assert not MoekitMonolithicExperts._supports_router_logits_dtype("torch.bfloat16", "Renormalize")
    assert MoekitBatchedExperts.activation_format() == mk.FusedMoEActivationFormat.BatchedExperts
    assert isinstance(MoekitExperts(None, None, layer=None).finalize_weight_and_reduce_impl(), mk.TopKWeightAndReduceNoOP)


@pytest.mark.parametrize("T", [1, 5, 32])
def test_vllm_modular_standard(packed, T):
    ck, layer = packed
    experts = MoekitExperts(None, None, layer=layer)
    x, _, ids, w = routed(T, seed=T)
    ws13_shape, ws2_shape, out_shape = experts.workspace_shapes(T, 2 * SPEC.intermediate, SPEC.hidden, SPEC.top_k,
                                                                SPEC.num_experts, SPEC.num_experts, None, "swigluoai")
    assert ws13_shape[0] == T and out_shape == (T, SPEC.hidden)
    ws13 = np.empty(ws13_shape, experts.workspace_dtype(np.dtype(np.uint16)))
    out = np.full(out_shape, POISON, np.uint16)
    experts.apply(out, x, None, None, w, ids.astype(np.int64), "swigluoai", SPEC.num_experts, None, None, None, ws13,
                  np.empty(ws2_shape, np.uint8), None, False)
    assert ref.rel_l2(moekit.bf16_to_float(out), ref.layer(SPEC, ck, x, ids, w)) <= 1e-2


def test_vllm_modular_batched(packed):
    ck, layer = packed
    E, M, H = SPEC.num_experts, 6, SPEC.hidden
    experts = MoekitBatchedExperts(None, None, layer=layer, max_num_tokens=M, num_dispatchers=1)
    rng = np.random.default_rng(3)
    x = moekit.float_to_bf16(rng.normal(0, 1, (E, M, H)))
    counts = np.array([1, 0, 6, 2, 3, 0, 1, 4], np.int32)
    ws13_shape, _, out_shape = experts.workspace_shapes(M, 2 * SPEC.intermediate, H, SPEC.top_k, E, E, None, "swigluoai")
    out = np.full(out_shape, POISON, np.uint16)
    experts.apply(out, x, None, None, None, None, "swigluoai", E, None, None, None, np.empty(ws13_shape, np.uint8), None,
                  mk.ExpertTokensMetadata(counts), False)
    for e in range(E):
        assert (out[e, counts[e]:] == POISON).all()
        if counts[e]:
            assert ref.rel_l2(moekit.bf16_to_float(out[e, :counts[e]]), ref.expert_rows(SPEC, ck, x[e, :counts[e]], e)) <= 1e-2


def test_vllm_monolithic(packed):
    ck, layer = packed
    experts = MoekitMonolithicExperts(None, None, layer=layer)
    x, logits, ids, w = routed(9, seed=2)
    out = experts.apply(x, None, None, logits, "swigluoai", SPEC.num_experts, None, None, False,
                        routed_scaling_factor=1.0)
    assert ref.rel_l2(moekit.bf16_to_float(out), ref.layer(SPEC, ck, x, ids, w)) <= 1e-2
    with pytest.raises(ValueError, match="routing parameters"):
        experts.apply(x, None, None, logits, "swigluoai", SPEC.num_experts, None, None, False, routed_scaling_factor=2.5)


def test_sglang_runner(packed):
    ck, layer = packed
    info = QuantInfo(layer=layer)
    x, _, ids, w = routed(7, seed=9)
    cfg = sgl.MoeRunnerConfig(activation="swiglu", gemm1_alpha=1.702, gemm1_clamp_limit=7.0)
    res = fused(sgl.StandardDispatchOutput(x, sgl.StandardTopKOutput(w, ids)), info, cfg)
    assert isinstance(res, sgl.StandardCombineInput)
    assert ref.rel_l2(moekit.bf16_to_float(res.hidden_states), ref.layer(SPEC, ck, x, ids, w)) <= 1e-2
    # The routed scaling factor applied on the output, as SGLang asks for it.
    cfg2 = sgl.MoeRunnerConfig(activation="swiglu", routed_scaling_factor=2.0, apply_routed_scaling_factor_on_output=True)
    res2 = fused(sgl.StandardDispatchOutput(x, sgl.StandardTopKOutput(w, ids)), info, cfg2)
    assert ref.rel_l2(moekit.bf16_to_float(res2.hidden_states), 2.0 * ref.layer(SPEC, ck, x, ids, w)) <= 1e-2
    for bad, why in ((sgl.MoeRunnerConfig(activation="gelu"), "activation"),
                     (sgl.MoeRunnerConfig(activation="silu"), "packed for swiglu_oai"),
                     (sgl.MoeRunnerConfig(activation="swiglu", gemm1_alpha=1.0), "gemm1_alpha")):
        with pytest.raises(ValueError, match=why):
            fused(sgl.StandardDispatchOutput(x, sgl.StandardTopKOutput(w, ids)), info, bad)


def test_engine_names_convert_to_the_checkpoint_layout():
    for fmt in ("nvfp4", "mxfp8", "bf16"):
        spec = moekit.LayerSpec(num_experts=4, top_k=1, hidden=64, intermediate=64, format=fmt, max_tokens=4)
        ck = moekit.random_checkpoint(spec, seed=1)
        layer = msg.convert_weights(dict(ck, w13_bias=None), spec, "cpu")  # ModelOpt names are the engines'
        assert layer.backend == "cpu"
