"""moekit's vLLM adapter (python/moekit/integrations/vllm.py) against the real vLLM package (pinned
in scripts/engine_env.sh), on the CPU: the classes subclass vLLM's own experts base classes and
implement every abstract method (and those the monolithic base leaves raising); the signatures of
every method the adapter overrides equal vLLM's (this fails when vLLM's interface drifts); the
supports checks; and forwards through vLLM's own composition, FusedMoEKernel, with moekit's CPU
backend as the experts: the standard slot after vLLM's no-EP prepare/finalize, the batched slot
after vLLM's reference BatchedPrepareAndFinalize (vLLM permutes into [E, M, K] and weights and sums
the experts' rows itself), and the monolithic slot, against the float64 reference of the same
weights. vLLM's own experts kernels cannot run here (test_the_engines_experts_kernels says why).
The prepare/finalize slot (MoekitEpPrepareAndFinalize, moekit's EP dispatch/combine): subclassing,
signatures, the expert_map contract and the refusals here; on the CPU its forwards through
FusedMoEKernel run over ReferenceEp, this file's torch rendering of moekit's split EP contract for
one rank (moekit's EP layer itself needs CUDA GPUs: tests/python/test_ep_torch.py runs it on two)."""

import inspect
import types

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
    pf = mv.MoekitEpPrepareAndFinalize
    assert issubclass(pf, mk.FusedMoEPrepareAndFinalizeModular) and issubclass(pf, mk.FusedMoEPrepareAndFinalize)
    assert not inspect.isabstract(pf), f"MoekitEpPrepareAndFinalize leaves {pf.__abstractmethods__}"
    for name in mk.FusedMoEPrepareAndFinalizeModular.__abstractmethods__:
        assert name in vars(pf), name
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
    # The prepare/finalize slot: every method it overrides, against FusedMoEPrepareAndFinalizeModular.
    pf, pbase = mv.MoekitEpPrepareAndFinalize, mk.FusedMoEPrepareAndFinalizeModular
    names = _overridden(pf, pbase)
    assert set(pbase.__abstractmethods__) | {"allocate_fused_expert_output"} <= set(names), names
    for name in names:
        mine, theirs = inspect.getattr_static(pf, name), inspect.getattr_static(pbase, name)
        if name == "__init__":
            continue
        assert _params(mine) == _params(theirs), f"MoekitEpPrepareAndFinalize.{name}: {_params(mine)} vs {_params(theirs)}"
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
    assert mv.MoekitBatchedExperts._supports_parallel_config(ep)  # after MoekitEpPrepareAndFinalize
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


def _where(e, within=""):
    """The innermost frame of e's traceback (whose file is under `within`, when given)."""
    tb, hit = e.__traceback__, None
    while tb is not None:
        if within in tb.tb_frame.f_code.co_filename:
            hit = tb
        tb = tb.tb_next
    if hit is None:
        return "?"
    return f"{hit.tb_frame.f_code.co_filename.split('site-packages/')[-1]}:{hit.tb_lineno} {hit.tb_frame.f_code.co_name}"


# ---- the prepare/finalize slot: expert parallelism --------------------------------------------------

class ReferenceEp:
    """moekit's split EP contract (include/moekit/ep.hpp EpLayer::batch / dispatch / combine, docs/EP.md)
    in torch on the CPU for one rank of a group of one: dispatch puts each (token, slot) row of
    expert e at row n_e of e (tokens in order: the single-GPU permute), poisoning the rest; combine
    sums fma(w_j, row_j) in fp32 in slot order and rounds once to bf16. The members are those
    MoekitEpPrepareAndFinalize uses of a moekit.torch.EpLayer (mv.EP_LAYER_MEMBERS)."""

    def __init__(self, spec, max_tokens, combine="bf16"):
        self.spec, self.first_expert, self.local_experts = spec, 0, spec.num_experts
        self.group = types.SimpleNamespace(world=1, rank=0)
        self.options = dict(max_tokens_per_rank=max_tokens, combine=combine)
        self.device = torch.device("cpu")
        shape = (spec.num_experts, max_tokens, spec.hidden)
        self._x = torch.empty(shape, dtype=torch.bfloat16)
        self._n = torch.zeros(spec.num_experts, dtype=torch.int32)
        self._y = torch.empty(shape, dtype=torch.bfloat16)
        self.calls = []

    def batch(self):
        return self._x, self._n, self._y

    def dispatch(self, x, topk_ids, topk_weights):
        assert topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32
        self.calls.append("dispatch")
        self._x.view(torch.int16).fill_(POISON)
        self._y.view(torch.int16).fill_(POISON)
        n = [0] * self.spec.num_experts
        self._rows = torch.full(topk_ids.shape, -1, dtype=torch.int64)
        for t in range(x.shape[0]):
            for j in range(topk_ids.shape[1]):
                e = int(topk_ids[t, j])
                if e >= 0:
                    self._x[e, n[e]] = x[t]
                    self._rows[t, j] = e * self._x.shape[1] + n[e]
                    n[e] += 1
        self._n.copy_(torch.tensor(n, dtype=torch.int32))
        self._w = topk_weights
        return self._x, self._n

    def combine(self, expert_out, out=None, topk_weights=None):
        self.calls.append("combine" + (" in place" if expert_out.data_ptr() == self._y.data_ptr() else ""))
        w = (topk_weights if topk_weights is not None else self._w).double()
        rows = expert_out.reshape(-1, self.spec.hidden).double()
        acc = torch.zeros(self._rows.shape[0], self.spec.hidden, dtype=torch.float32)
        for j in range(self._rows.shape[1]):
            r = self._rows[:, j]
            ok = r >= 0
            # fma in fp32: the product and the sum rounded once (exact in float64, then to fp32)
            acc[ok] = (acc[ok].double() + w[ok, j:j + 1] * rows[r[ok]]).float()
        out.copy_(acc.to(torch.bfloat16))
        return out


def test_ep_slot_refusals_and_the_expert_map_contract():
    spec = SPECS["bf16"]
    with pytest.raises(ValueError, match="moekit.torch.EpLayer"):
        mv.MoekitEpPrepareAndFinalize(object())
    with pytest.raises(ValueError, match="combine='bf16'"):
        mv.MoekitEpPrepareAndFinalize(ReferenceEp(spec, 8, combine="fp32"))
    ep = ReferenceEp(spec, 8)
    pf = mv.MoekitEpPrepareAndFinalize(ep, expert_map=mv.linear_expert_map(spec.num_experts, 0, 1))
    assert pf.activation_format == mk.FusedMoEActivationFormat.BatchedExperts
    assert (pf.topk_indices_dtype(), pf.max_num_tokens_per_rank(), pf.num_dispatchers(), pf.output_is_reduced(),
            pf.supports_async()) == (torch.int32, 8, 1, True, False)
    # vLLM's linear placement for rank 1 of 2: experts 4..7 at local 0..3.
    assert mv.linear_expert_map(8, 1, 2).tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    xb, x, _, ids, w = routed(spec, 3)
    bad_map = mv.linear_expert_map(spec.num_experts, 0, 1).flip(0).contiguous()
    args = dict(a1=x, topk_weights=w, topk_ids=ids, num_experts=spec.num_experts, expert_map=None,
                apply_router_weight_on_input=False, quant_config=FUSED_MOE_UNQUANTIZED_CONFIG, defer_input_quant=True)
    for change, msg in ((dict(expert_map=bad_map), "not moekit's placement"),
                        (dict(num_experts=spec.num_experts * 2), "global experts"),
                        (dict(apply_router_weight_on_input=True), "router weight")):
        with pytest.raises(ValueError, match=msg):
            pf.prepare(**dict(args, **change))
    assert ep.calls == []  # refused before anything moved
    recv_x, scale, meta, ids_out, w_out = pf.prepare(**args)
    assert recv_x is ep.batch()[0] and meta.expert_num_tokens is ep.batch()[1] and scale is ids_out is w_out is None
    with pytest.raises(ValueError, match="TopKWeightAndReduceDelegate"):
        pf.finalize(torch.empty_like(x), ep.batch()[2], w, ids, False, twr.TopKWeightAndReduceNoOP())
    # The experts' output buffer is the memory combine reads, when the shapes agree.
    assert pf.allocate_fused_expert_output(ep.batch()[2].shape, torch.bfloat16, torch.device("cpu"),
                                           twr.TopKWeightAndReduceDelegate()) is ep.batch()[2]
    assert pf.allocate_fused_expert_output((1, 2, 3), torch.bfloat16, torch.device("cpu"),
                                           twr.TopKWeightAndReduceDelegate()) is None


def test_ep_slot_without_a_gpu_says_so():
    """Making the EP layer on a machine without a CUDA device: a one-line ValueError, whether
    torch.distributed is set up or not."""
    import moekit.torch as mt
    import torch.distributed as dist
    spec = SPECS["bf16"]
    ck, params = engine_params(spec)
    with pytest.raises(ValueError, match="EpGroup"):
        mv.convert_weights_ep(params, spec, group=None)
    with pytest.raises(ValueError, match="combine must be 'bf16'"):
        mv.convert_weights_ep(params, spec, group=None, combine="fp32")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="no CUDA device"):
            mt.ep_group()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("T", [0, 1, 13])
def test_ep_slot_through_fused_moe_kernel_with_moekits_batched_experts(layer, T):
    """FusedMoEKernel(MoekitEpPrepareAndFinalize, MoekitBatchedExperts) on one rank: vLLM's own
    composition calls prepare (dispatch), the experts on [E, M, K] (writing into the buffer combine
    reads: allocate_fused_expert_output) and finalize (combine); the output equals the float64
    reference, and moekit's standard slot."""
    name, spec, ck, params, L = layer
    ep = ReferenceEp(spec, 16)
    pf = mv.MoekitEpPrepareAndFinalize(ep)
    experts = mv.MoekitBatchedExperts(moe_config(spec, ACT[name]), FUSED_MOE_UNQUANTIZED_CONFIG, layer=L,
                                      max_num_tokens=pf.max_num_tokens_per_rank(), num_dispatchers=pf.num_dispatchers())
    kernel = mk.FusedMoEKernel(pf, experts)
    xb, x, _, ids, w = routed(spec, max(T, 1), seed=11 + T)
    xb, x, ids, w = xb[:T], x[:T], ids[:T], w[:T]
    out = kernel.apply(x, params["w13_weight"], params["w2_weight"], w, ids, ACT[name], spec.num_experts,
                       mv.linear_expert_map(spec.num_experts, 0, 1), False)
    assert out.shape == (T, spec.hidden) and out.dtype == torch.bfloat16
    assert ep.calls == ["dispatch", "combine in place"], ep.calls
    if T == 0:
        return
    assert ref.rel_l2(as_float(out), ref.layer(spec, ck, xb, ids.numpy(), w.numpy())) <= 1e-2
    std = mk.FusedMoEKernel(MoEPrepareAndFinalizeNoDPEPModular(),
                            mv.MoekitExperts(moe_config(spec, ACT[name]), FUSED_MOE_UNQUANTIZED_CONFIG, layer=L))
    out_std = std.apply(x, params["w13_weight"], params["w2_weight"], w, ids, ACT[name], spec.num_experts, None, False)
    assert ref.rel_l2(as_float(out), as_float(out_std)) <= 1e-2


def test_ep_slot_with_vllms_own_batched_experts(monkeypatch):
    """FusedMoEKernel(MoekitEpPrepareAndFinalize, vLLM's NaiveBatchedExperts): vLLM's reference batched
    experts (torch matmuls) between moekit's dispatch and combine, bf16 weights, silu. Without a
    GPU, its CUDA-graph capture probe (_is_capturing_or_compiling asks torch.accelerator for the
    current stream, which initializes CUDA) is answered "no" here: nothing is captured on the CPU."""
    from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe as fbm
    from vllm.model_executor.layers.fused_moe.experts.fused_batched_moe import NaiveBatchedExperts
    if not torch.cuda.is_available():
        monkeypatch.setattr(fbm, "_is_capturing_or_compiling", lambda: False)
    spec = SPECS["bf16"]
    ck, params = engine_params(spec)
    ep = ReferenceEp(spec, 16)
    pf = mv.MoekitEpPrepareAndFinalize(ep)
    experts = NaiveBatchedExperts(moe_config(spec, MoEActivation.SILU), FUSED_MOE_UNQUANTIZED_CONFIG,
                                  max_num_tokens=pf.max_num_tokens_per_rank(), num_dispatchers=pf.num_dispatchers())
    kernel = mk.FusedMoEKernel(pf, experts)
    xb, x, _, ids, w = routed(spec, 11, seed=3)
    try:
        out = kernel.apply(x, params["w13_weight"], params["w2_weight"], w, ids, MoEActivation.SILU,
                           spec.num_experts, None, False)
    except Exception as e:  # noqa: BLE001 - the reason is what the skip reports
        pytest.skip(f"vLLM's NaiveBatchedExperts cannot run here: {type(e).__name__}: "
                    f"{(str(e).splitlines() or [''])[0][:100]} (at {_where(e)}, from {_where(e, 'site-packages/vllm/')})")
    assert ep.calls == ["dispatch", "combine in place"], ep.calls
    assert ref.rel_l2(as_float(out), ref.layer(spec, ck, xb, ids.numpy(), w.numpy())) <= 1e-2
