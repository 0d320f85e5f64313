"""moekit's vLLM adapter (python/moekit/integrations/vllm.py) against the real vLLM package (pinned
in scripts/engine_env.sh), on the CPU: the classes subclass vLLM's own experts base classes and
implement every abstract method (and those the monolithic base leaves raising); the signatures of
every method the adapter overrides equal vLLM's (this fails when vLLM's interface drifts); the
supports checks; and forwards through vLLM's own composition, FusedMoEKernel, with moekit's CPU
backend as the experts: the standard slot after vLLM's no-EP prepare/finalize, the batched slot
after vLLM's reference BatchedPrepareAndFinalize (vLLM permutes into [E, M, K] and weights and sums
the experts' rows itself), and the monolithic slot, against the float64 reference of the same
weights. vLLM's own experts kernels cannot run here (test_the_engines_experts_kernels says why)."""

import inspect

import numpy as np
import pytest
from conftest import engine

vllm = engine("vllm")
torch = pytest.importorskip("torch")

import moekit  # noqa: E402
import reference as ref  # noqa: E402
import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
import vllm.model_executor.layers.fused_moe.topk_weight_and_reduce as twr  # noqa: E402
from moekit.integrations import vllm as mv  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (  # noqa: E402
    FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType)
from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import BatchedPrepareAndFinalize  # noqa: E402
from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import (  # noqa: E402
    MoEPrepareAndFinalizeNoDPEPModular, MoEPrepareAndFinalizeNoDPEPMonolithic)
from vllm.model_executor.layers.quantization.utils import quant_utils as qu  # noqa: E402
from vllm.v1.worker.workspace import init_workspace_manager  # noqa: E402

POISON = 0x7FC1

# GPT-OSS-like (MXFP4, swigluoai, biases) and Qwen-like (bf16, silu) layers.
SPECS = {
    "mxfp4": moekit.LayerSpec(num_experts=8, top_k=2, hidden=128, intermediate=64, format="mxfp4",
                              activation="swiglu_oai", norm_topk_prob=True, biases=True, max_tokens=32),
    "bf16": moekit.LayerSpec(num_experts=8, top_k=3, hidden=96, intermediate=64, format="bf16", activation="silu",
                             norm_topk_prob=True, max_tokens=32),
}
ACT = {"mxfp4": MoEActivation.SWIGLUOAI, "bf16": MoEActivation.SILU}


@pytest.fixture(scope="module", autouse=True)
def workspace_manager():
    init_workspace_manager(torch.device("cpu"))  # what vLLM's model runner does on its device


def moe_config(spec, activation, routing=RoutingMethodType.Renormalize):
    return FusedMoEConfig(num_experts=spec.num_experts, experts_per_token=spec.top_k, hidden_dim=spec.hidden,
                          intermediate_size=spec.intermediate, num_local_experts=spec.num_experts,
                          num_logical_experts=spec.num_experts, activation=activation, device="cpu",
                          routing_method=routing, moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
                          in_dtype=torch.bfloat16, router_logits_dtype=torch.float32, has_bias=spec.biases)


def engine_params(spec, seed=4):
    """The layer's parameters as vLLM's FusedMoE holds them (torch tensors). MXFP4 (GPT-OSS):
    w13_weight = gate_up_proj_blocks bytes [E, 2I, H/2], rows interleaved gate, up."""
    ck = moekit.random_checkpoint(spec, seed=seed)
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in ck.items()}
    E, H, I = spec.num_experts, spec.hidden, spec.intermediate
    if spec.format == "mxfp4":
        bf = lambda a: a.view(torch.int16).view(torch.bfloat16)  # noqa: E731
        return ck, dict(w13_weight=t["gate_up_proj_blocks"].reshape(E, 2 * I, H // 2),
                        w13_weight_scale=t["gate_up_proj_scales"], w2_weight=t["down_proj_blocks"].reshape(E, H, I // 2),
                        w2_weight_scale=t["down_proj_scales"], w13_bias=bf(t["gate_up_proj_bias"]),
                        w2_bias=bf(t["down_proj_bias"]))
    bf = lambda a: a.view(torch.int16).view(torch.bfloat16)  # noqa: E731
    return ck, dict(w13_weight=bf(t["w13_weight"]), w2_weight=bf(t["w2_weight"]))


@pytest.fixture(scope="module", params=list(SPECS))
def layer(request):
    spec = SPECS[request.param]
    ck, params = engine_params(spec)
    # vLLM's swigluoai takes interleaved rows; only MXFP4 is in that layout here (bf16 is silu).
    return request.param, spec, ck, params, mv.convert_weights(params, spec, "cpu")


def routed(spec, T, seed=0):
    rng = np.random.default_rng(seed)
    xb = moekit.float_to_bf16(rng.normal(0, 1, (T, spec.hidden)))
    logits = rng.normal(0, 2, (T, spec.num_experts)).astype(np.float32)
    ids, w = ref.route(spec, logits)
    x = torch.from_numpy(xb.view(np.int16)).view(torch.bfloat16)
    return xb, x, torch.from_numpy(logits), torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(w.astype(np.float32))


def as_float(t):
    return t.float().numpy()


# ---- the interface --------------------------------------------------------------------------------

def _overridden(cls, base):
    return [n for n, v in vars(cls).items() if callable(v) or isinstance(v, (staticmethod, property))
            if hasattr(base, n) and not n.startswith("__")]


def _params(obj):
    f = obj.fget if isinstance(obj, property) else obj
    return list(inspect.signature(f).parameters)


def test_classes_subclass_vllms_bases_and_implement_every_abstract_method():
    for cls, base in ((mv.MoekitExperts, mk.FusedMoEExpertsModular), (mv.MoekitBatchedExperts, mk.FusedMoEExpertsModular),
                      (mv.MoekitMonolithicExperts, mk.FusedMoEExpertsMonolithic)):
        assert issubclass(cls, base) and issubclass(cls, mk.FusedMoEExperts)
        assert not inspect.isabstract(cls), f"{cls.__name__} leaves {cls.__abstractmethods__}"
    # The monolithic base leaves these raising NotImplementedError for kernels to opt in.
    for name in ("apply", "_supports_routing_method", "_supports_router_logits_dtype"):
        assert getattr(mv.MoekitMonolithicExperts, name) is not getattr(mk.FusedMoEExpertsMonolithic, name), name


def test_signatures_equal_vllms():
    """Every method the adapter overrides takes exactly the parameters of vLLM's own (names, order):
    a vLLM release that changes one fails here, not in a server."""
    checked = 0
    for cls in (mv.MoekitExperts, mv.MoekitBatchedExperts, mv.MoekitMonolithicExperts):
        base = mk.FusedMoEExpertsMonolithic if cls is mv.MoekitMonolithicExperts else mk.FusedMoEExpertsModular
        for klass in cls.__mro__:
            if klass.__module__ != mv.__name__:
                continue
            for name in _overridden(klass, base):
                if name == "__init__":
                    continue
                mine, theirs = inspect.getattr_static(klass, name), inspect.getattr_static(base, name)
                assert _params(mine) == _params(theirs), f"{cls.__name__}.{name}: {_params(mine)} vs {_params(theirs)}"
                checked += 1
    assert checked >= 20
    # The constructor takes vLLM's arguments (and the packed layer after them).
    assert _params(mv.MoekitExperts.__init__)[:3] == _params(mk.FusedMoEExperts.__init__)[:3]


def test_supports_checks_against_vllms_own_keys_and_enums():
    cfg = moe_config(SPECS["mxfp4"], MoEActivation.SWIGLUOAI)
    ok, why = mv.MoekitExperts.is_supported_config(mv.MoekitExperts, cfg, qu.kMxfp4Static, None,
                                                   mk.FusedMoEActivationFormat.Standard)
    from vllm.platforms import current_platform
    here = moekit.cuda_available() or current_platform.is_cpu()
    assert ok == here and (ok or "current device" in why), why
    assert [mv.weight_format(k) for k in (None, qu.kMxfp4Static, qu.kMxfp8Static, qu.kNvfp4Static,
                                           qu.kFp8StaticTensorSym, qu.kInt4Static)] == \
        ["bf16", "mxfp4", "mxfp8", "nvfp4", "", ""]
    assert not mv.MoekitExperts._supports_quant_scheme(qu.kMxfp4Static, qu.kFp8DynamicTokenSym)
    assert mv.MoekitExperts._supports_activation(MoEActivation.SILU)
    assert mv.MoekitExperts._supports_activation(MoEActivation.SWIGLUOAI)
    assert not mv.MoekitExperts._supports_activation(MoEActivation.GELU)
    ep = FusedMoEParallelConfig.make_no_parallel()
    ep.use_ep = True
    assert not mv.MoekitExperts._supports_parallel_config(ep)
    assert mv.MoekitMonolithicExperts._supports_routing_method(RoutingMethodType.DeepSeekV3, None, None)
    assert not mv.MoekitMonolithicExperts._supports_routing_method(RoutingMethodType.Llama4, None, None)
    assert not mv.MoekitMonolithicExperts._supports_router_logits_dtype(torch.bfloat16, RoutingMethodType.Default)


# ---- forwards through FusedMoEKernel --------------------------------------------------------------

@pytest.mark.parametrize("T", [1, 5, 32])
def test_standard_slot_through_fused_moe_kernel(layer, T):
    name, spec, ck, params, L = layer
    experts = mv.MoekitExperts(moe_config(spec, ACT[name]), FUSED_MOE_UNQUANTIZED_CONFIG, layer=L)
    kernel = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(), experts)
    xb, x, _, ids, w = routed(spec, T, seed=T)
    out = kernel.apply(x, params["w13_weight"], params["w2_weight"], w, ids, ACT[name], spec.num_experts, None, False)
    assert out.shape == (T, spec.hidden) and out.dtype == torch.bfloat16
    assert ref.rel_l2(as_float(out), ref.layer(spec, ck, xb, ids.numpy(), w.numpy())) <= 1e-2


def test_batched_slot_through_vllms_dispatch_and_combine(layer):
    """vLLM's reference BatchedPrepareAndFinalize permutes the tokens into [E, M, K] and, after
    moekit's experts, weights and sums the rows itself (TopKWeightAndReduceNaiveBatched): vLLM's
    dispatch and combine around moekit equal moekit's own standard path and the float64 result."""
    name, spec, ck, params, L = layer
    T = 13
    xb, x, _, ids, w = routed(spec, T, seed=7)
    experts = mv.MoekitBatchedExperts(moe_config(spec, ACT[name]), FUSED_MOE_UNQUANTIZED_CONFIG, layer=L,
                                      max_num_tokens=T, num_dispatchers=1)
    kernel = mk.FusedMoEKernel(BatchedPrepareAndFinalize(T, spec.num_experts, 1, 0), experts)
    out = kernel.apply(x, params["w13_weight"], params["w2_weight"], w, ids, ACT[name], spec.num_experts, None, False)
    want = ref.layer(spec, ck, xb, ids.numpy(), w.numpy())
    assert ref.rel_l2(as_float(out), want) <= 1e-2
    std = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(),
                            mv.MoekitExperts(moe_config(spec, ACT[name]), FUSED_MOE_UNQUANTIZED_CONFIG, layer=L))
    out_std = std.apply(x, params["w13_weight"], params["w2_weight"], w, ids, ACT[name], spec.num_experts, None, False)
    assert ref.rel_l2(as_float(out), as_float(out_std)) <= 1e-2


def test_monolithic_slot_routes_from_logits(layer):
    name, spec, ck, params, L = layer
    experts = mv.MoekitMonolithicExperts(moe_config(spec, ACT[name]), FUSED_MOE_UNQUANTIZED_CONFIG, layer=L)
    kernel = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPMonolithic(), experts)
    xb, x, logits, ids, w = routed(spec, 9, seed=2)
    out = kernel.apply_monolithic(x, params["w13_weight"], params["w2_weight"], logits, ACT[name], spec.num_experts,
                                  None, False, routed_scaling_factor=1.0, routing_sink=None)
    assert ref.rel_l2(as_float(out), ref.layer(spec, ck, xb, ids.numpy(), w.numpy())) <= 1e-2
    with pytest.raises(ValueError, match="routing parameters"):
        kernel.apply_monolithic(x, params["w13_weight"], params["w2_weight"], logits, ACT[name], spec.num_experts,
                                None, False, routed_scaling_factor=2.5, routing_sink=None)


def test_workspace_shapes_are_in_the_activation_dtype(layer):
    """vLLM allocates workspace13 and the fused output in workspace_dtype: it must stay bf16 (the
    output is written in it); dim 0 is M, as vLLM's chunking wants."""
    name, spec, ck, params, L = layer
    experts = mv.MoekitExperts(moe_config(spec, ACT[name]), FUSED_MOE_UNQUANTIZED_CONFIG, layer=L)
    assert experts.workspace_dtype(torch.bfloat16) == torch.bfloat16
    for M in (1, 7, 32):
        ws13, ws2, out = experts.workspace_shapes(M, 2 * spec.intermediate, spec.hidden, spec.top_k, spec.num_experts,
                                                  spec.num_experts, None, ACT[name])
        assert ws13[0] == M and ws13[1] * M * 2 >= L.workspace_bytes(M, spec.top_k) and out == (M, spec.hidden)


def test_swigluoai_bf16_weights_are_uninterleaved_at_conversion():
    """vLLM's swigluoai keeps GPT-OSS's interleaved w13 rows; moekit's bf16 layout is [gates; ups]."""
    spec = moekit.LayerSpec(num_experts=4, top_k=2, hidden=64, intermediate=32, format="bf16", activation="swiglu_oai",
                            max_tokens=8)
    ck, params = engine_params(spec)
    inter = dict(params, w13_weight=torch.stack([params["w13_weight"][:, :32], params["w13_weight"][:, 32:]], 2)
                 .reshape(4, 64, 64))
    L = mv.convert_weights(inter, spec, "cpu", interleaved=True)
    xb, x, _, ids, w = routed(spec, 5)
    out = torch.empty(5, 64, dtype=torch.bfloat16)
    L.forward_topk(x, ids.int(), w, out, torch.empty(L.workspace_bytes(5), dtype=torch.uint8))
    assert ref.rel_l2(as_float(out), ref.layer(spec, ck, xb, ids.numpy(), w.numpy())) <= 1e-2


def test_the_engines_experts_kernels():
    """vLLM's own experts kernels, the reference a GPU run would compare against, on this machine:
    TritonExperts needs a CUDA device, CPUUnquantizedExperts the CPU build's vllm._C (the PyPI wheel
    is the CUDA build). The test runs them where they import and run, and says why otherwise."""
    spec = SPECS["bf16"]
    ck, params = engine_params(spec)
    xb, x, _, ids, w = routed(spec, 4)
    failures = []
    for modname, clsname in (("vllm.model_executor.layers.fused_moe.experts.triton_moe", "TritonExperts"),
                             ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts")):
        try:
            import importlib
            cls = getattr(importlib.import_module(modname), clsname)
            kernel = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(),
                                       cls(moe_config(spec, MoEActivation.SILU), FUSED_MOE_UNQUANTIZED_CONFIG))
            out = kernel.apply(x, params["w13_weight"], params["w2_weight"], w, ids, MoEActivation.SILU,
                               spec.num_experts, None, False)
        except Exception as e:  # noqa: BLE001 - the reason is what the skip reports
            failures.append(f"{clsname}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]} (at {_where(e)})")
            continue
        L = mv.convert_weights(params, spec, "cpu")
        got = torch.empty_like(x)
        L.forward_topk(x, ids.int(), w, got, torch.empty(L.workspace_bytes(4), dtype=torch.uint8))
        assert ref.rel_l2(as_float(got), as_float(out)) <= 1e-2
    if failures:
        from vllm.platforms import current_platform
        pytest.skip(f"vLLM's experts kernels cannot run on this machine (vLLM platform "
                    f"{type(current_platform).__name__}: no CUDA device): " + "; ".join(failures))


def _where(e):
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename.split('site-packages/')[-1]}:{tb.tb_lineno} {tb.tb_frame.f_code.co_name}"
