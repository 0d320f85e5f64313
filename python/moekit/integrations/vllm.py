"""vLLM adapter: moekit in vLLM's fused-MoE kernel (vllm/model_executor/layers/fused_moe/
modular_kernel.py, vLLM 0.33: FusedMoEKernel composing a prepare/finalize with an experts class),
both experts slots:

  MoekitExperts            FusedMoEExpertsModular, Standard format: experts + weighted combine
                           from topk ids/weights; finalize reduces nothing (TopKWeightAndReduceNoOP)
  MoekitBatchedExperts     FusedMoEExpertsModular, BatchedExperts format: the experts alone on
                           [E, max_tokens, K] + expert_num_tokens (TopKWeightAndReduceDelegate: the
                           prepare/finalize weights and reduces)
  MoekitMonolithicExperts  FusedMoEExpertsMonolithic: routing + experts + combine from router logits

and the prepare/finalize slot, expert parallelism (EP) across the ranks of a group:

  MoekitEpPrepareAndFinalize  FusedMoEPrepareAndFinalizeModular, BatchedExperts format: moekit's EP
                           dispatch (prepare) and combine (finalize: weights and sums) of a
                           moekit.torch.EpLayer made with combine="bf16" (convert_weights_ep); pairs
                           with MoekitBatchedExperts over the same EP layer, or with vLLM's own
                           batched experts (their TopKWeightAndReduceDelegate).

Each wraps a moekit.Layer made once at load (convert_weights: the FusedMoE layer's parameters, in
vLLM's names, packed into the kernel layout). The supports checks answer from moekit's backends;
workspace_shapes come from Layer.workspace_bytes, in elements of the activation dtype (vLLM
allocates workspaces and the fused output in workspace_dtype, so it stays the activations' dtype),
first dimension M. `from moekit.integrations import vllm` exposes the classes over vLLM itself
(made on first use). Limits: the experts classes take no expert_map of their own (EP goes
through MoekitEpPrepareAndFinalize, whose expert_map contract is its docstring's), no router weight
applied on the input, no hash routing, int32 ids (int64 are converted), fp32 router logits, bf16
activations."""

from typing import Any

import moekit

from . import as_int32, checkpoint_of, empty_bytes, empty_like, pack_layer

# vLLM MoEActivation values -> moekit activations. swigluoai: w13 rows interleaved (gate, up, ...)
# as in GPT-OSS checkpoints; swigluoai_uninterleave: the same math on [gates; ups].
ACTIVATIONS = {"silu": "silu", "swigluoai": "swiglu_oai", "swigluoai_uninterleave": "swiglu_oai"}
ROUTING_METHODS = ("Default", "Renormalize", "RenormalizeNaive", "DeepSeekV3")


def _value(x: Any) -> str:
    return str(getattr(x, "value", x)).lower()


def weight_format(weight_key: Any) -> str:
    """vLLM's weight QuantKey (dtype, scale dtype, group shape) -> moekit's weight format, '' when
    moekit has none for it. None is unquantized (bf16)."""
    if weight_key is None:
        return "bf16"
    dtype = str(getattr(weight_key, "dtype", ""))
    scale = getattr(weight_key, "scale", None)
    sdtype = str(getattr(scale, "dtype", ""))
    col = getattr(getattr(scale, "group_shape", None), "col", None)
    if dtype.endswith("uint8") and sdtype.endswith("uint8") and col == 32:
        return "mxfp4"
    if "float8_e4m3" in dtype and sdtype.endswith("uint8") and col == 32:
        return "mxfp8"
    if dtype.endswith("uint8") and "float8_e4m3" in sdtype and col == 16 and getattr(weight_key, "scale2", None):
        return "nvfp4"
    return ""


def convert_weights(params: dict, spec: moekit.LayerSpec, device: str, interleaved: bool = True) -> moekit.Layer:
    """process_weights_after_loading's step: pack the FusedMoE layer's parameters once. For bf16
    swiglu_oai weights `interleaved` says whether w13's rows alternate gate, up (vLLM's swigluoai;
    False: swigluoai_uninterleave), moekit's bf16 layout being [gates; ups]."""
    ck = checkpoint_of(params, spec)
    if spec.format == "bf16" and spec.activation == "swiglu_oai" and interleaved:
        w = ck["w13_weight"]
        ck["w13_weight"] = _uninterleave(w)
        if ck.get("w13_bias") is not None:
            ck["w13_bias"] = _uninterleave(ck["w13_bias"])
    return pack_layer(spec, ck, device)


def convert_weights_ep(params: dict, spec: moekit.LayerSpec, group: Any, interleaved: bool = True,
                       **options: Any) -> Any:
    """The EP form of convert_weights (collective: every rank of `group`, a moekit.torch.EpGroup,
    calls it for every layer in the same order): the FusedMoE layer's parameters of this rank's
    experts ([E / world, ...], as vLLM holds them under EP; all E are accepted too) packed into a
    moekit.torch.EpLayer with combine="bf16", which MoekitEpPrepareAndFinalize and
    MoekitBatchedExperts share. options: pack_ep's (max_tokens_per_rank, payload, ...)."""
    import dataclasses

    import moekit.torch as mt
    if options.get("combine", "bf16") != "bf16":
        raise ValueError("moekit EP in vLLM's slots: combine must be 'bf16' (vLLM's experts hand back unweighted rows)")
    lead = int(params["w13_weight"].shape[0])
    ck = checkpoint_of(params, dataclasses.replace(spec, num_experts=lead))
    if spec.format == "bf16" and spec.activation == "swiglu_oai" and interleaved:
        ck["w13_weight"] = _uninterleave(ck["w13_weight"])
        if ck.get("w13_bias") is not None:
            ck["w13_bias"] = _uninterleave(ck["w13_bias"])
    return mt.pack_ep(group, spec, ck, **dict(options, combine="bf16"))


def linear_expert_map(num_experts: int, rank: int, world: int) -> Any:
    """vLLM's expert_map for moekit's placement: global expert e lives on rank e // (E / world), at
    local index e % (E / world); -1 for the other ranks' experts (int32, CPU)."""
    import torch
    El = num_experts // world
    m = torch.full((num_experts,), -1, dtype=torch.int32)
    m[rank * El:(rank + 1) * El] = torch.arange(El, dtype=torch.int32)
    return m


EP_LAYER_MEMBERS = ("dispatch", "combine", "batch", "spec", "first_expert", "local_experts", "group", "options",
                    "device")


def _uninterleave(t: Any) -> Any:
    """[E, 2I, ...] rows gate, up, gate, ... -> [E, 2I, ...] all gates then all ups."""
    if type(t).__module__.split(".")[0] == "torch":
        import torch
        return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
    import numpy as np
    return np.concatenate([t[:, 0::2], t[:, 1::2]], axis=1)


def _moe_bytes_as_elements(nbytes: int, M: int, itemsize: int = 2) -> tuple:
    """A [M, n] workspace shape of the (bf16) activation dtype holding nbytes."""
    elements = -(-nbytes // itemsize)
    return (M, -(-elements // max(M, 1))) if nbytes > 0 else (0,)


def _as_bytes(t: Any) -> Any:
    import torch
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def make_classes(mk: Any, reduce: Any) -> dict:
    """The experts classes over vLLM's modular_kernel and topk_weight_and_reduce modules."""

    class _Supports:
        @staticmethod
        def _supports_current_device() -> bool:
            from vllm.platforms import current_platform
            return moekit.cuda_available() or current_platform.is_cpu()

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return False

        @staticmethod
        def _supports_quant_scheme(weight_key: Any, activation_key: Any) -> bool:
            return weight_format(weight_key) != "" and activation_key is None

        @staticmethod
        def _supports_activation(activation: Any) -> bool:
            return _value(activation) in ACTIVATIONS

        @staticmethod
        def _supports_parallel_config(moe_parallel_config: Any) -> bool:
            return not getattr(moe_parallel_config, "use_ep", False)

        @staticmethod
        def _supports_shape(hidden_dim: int) -> bool:
            return hidden_dim % 32 == 0

        @property
        def expects_unquantized_inputs(self) -> bool:
            return True  # bf16 hidden states in; the kernels read them as they are

    class MoekitExperts(_Supports, mk.FusedMoEExpertsModular):
        def __init__(self, moe_config: Any, quant_config: Any, layer: moekit.Layer = None, **kw: Any) -> None:
            super().__init__(moe_config, quant_config, **kw)
            self.layer = layer

        @staticmethod
        def activation_format() -> Any:
            return mk.FusedMoEActivationFormat.Standard

        def finalize_weight_and_reduce_impl(self) -> Any:
            return reduce.TopKWeightAndReduceNoOP()

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            return _moe_bytes_as_elements(self.layer.workspace_bytes(M, topk), M), (0,), (M, K)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            if expert_map is not None or apply_router_weight_on_input:
                raise ValueError("moekit: no expert map, no router weight on the input")
            self.layer.forward_topk(hidden_states, as_int32(topk_ids), topk_weights.float(), output,
                                    _as_bytes(workspace13))
            return None

    class MoekitBatchedExperts(MoekitExperts):
        @staticmethod
        def activation_format() -> Any:
            return mk.FusedMoEActivationFormat.BatchedExperts

        @staticmethod
        def _supports_parallel_config(moe_parallel_config: Any) -> bool:
            # The experts alone on what a prepare/finalize delivers: EP's is MoekitEpPrepareAndFinalize
            # (the layer then is the EP layer, moekit.torch.EpLayer, of this rank's experts).
            return True

        @property
        def expects_unquantized_inputs(self) -> bool:
            # vLLM's batched prepare/finalize refuses to defer quantization; with moekit's quant
            # configs (weights only) it leaves the bf16 activations as they are.
            return False

        def finalize_weight_and_reduce_impl(self) -> Any:
            return reduce.TopKWeightAndReduceDelegate()

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            return _moe_bytes_as_elements(self.layer.batched_workspace_bytes(M), M), (0,), (local_num_experts, M, K)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            # expert_map is the prepare/finalize's business: the batched format already holds this
            # rank's experts (the layer's: a moekit.torch.EpLayer's local ones under EP).
            self.layer.forward_batched(hidden_states, expert_tokens_meta.expert_num_tokens, output,
                                       _as_bytes(workspace13))
            return None

    class MoekitMonolithicExperts(_Supports, mk.FusedMoEExpertsMonolithic):
        def __init__(self, moe_config: Any, quant_config: Any, layer: moekit.Layer = None, **kw: Any) -> None:
            super().__init__(moe_config, quant_config, **kw)
            self.layer, self._ws = layer, None

        @staticmethod
        def activation_format() -> Any:
            return mk.FusedMoEActivationFormat.Standard

        @staticmethod
        def _supports_routing_method(routing_method: Any, weight_key: Any, activation_key: Any) -> bool:
            return getattr(routing_method, "name", str(routing_method)) in ROUTING_METHODS

        @staticmethod
        def _supports_router_logits_dtype(router_logits_dtype: Any, routing_method: Any) -> bool:
            return router_logits_dtype is None or "float32" in str(router_logits_dtype)

        def apply(self, hidden_states, w1, w2, router_logits, activation, global_num_experts, expert_map, a1q_scale,
                  apply_router_weight_on_input, num_expert_group=None, e_score_correction_bias=None,
                  routed_scaling_factor=None, topk_group=None, routing_replay_out=None):
            s = self.layer.spec  # the routing was fixed at load: the call must agree with it
            if ((routed_scaling_factor or 1.0) != s.routed_scaling_factor or (num_expert_group or 1) != s.n_group
                    or (topk_group or 1) != s.topk_group or (e_score_correction_bias is not None) != s.score_bias):
                raise ValueError("moekit: routing parameters differ from the layer's")
            if expert_map is not None or apply_router_weight_on_input or routing_replay_out is not None:
                raise ValueError("moekit: no expert map, no router weight on the input, no routing capture")
            if self._ws is None:  # one workspace for every step, made before any graph capture
                self._ws = empty_bytes(self.layer.workspace_bytes(s.max_tokens), hidden_states)
            out = empty_like(hidden_states)
            self.layer.forward_logits(hidden_states, router_logits, out, self._ws)
            return out

    class MoekitEpPrepareAndFinalize(mk.FusedMoEPrepareAndFinalizeModular):
        """moekit's EP dispatch and combine in vLLM's prepare/finalize slot (BatchedExperts format).

        ep_layer: a moekit.torch.EpLayer made with combine="bf16" (convert_weights_ep, or
        moekit.torch.pack_ep(..., combine="bf16")): its dispatch sends each (token, expert) row of
        this rank to the expert's rank, its combine brings the experts' unweighted outputs back and
        sums w_j * row_j in slot order in fp32, rounded once (output_is_reduced: each token's output
        is complete on its own rank).

        prepare returns the received rows [E / world, capacity, H] bf16 (a view into moekit's
        memory; capacity = world x max_tokens_per_rank unless pack_ep's expert_capacity says
        otherwise), no scales (moekit quantizes its payload itself and hands the experts the exact
        dequantization), ExpertTokensMetadata(expert_num_tokens [E / world] int32), and no ids or
        weights of its own (vLLM keeps the caller's for finalize). The experts' output buffer is the
        memory combine reads (allocate_fused_expert_output), so combine copies nothing when the
        experts write their rows in place; otherwise finalize copies rows [0, expert_num_tokens[e]).

        expert_map contract: moekit places global expert e on rank e // (E / world) at local index
        e % (E / world) (vLLM's default linear placement; no redundant experts, no EPLB remapping).
        topk_ids are global ids (-1: none). An expert_map given to prepare must be that placement
        for this rank (linear_expert_map); it is checked once per tensor (a host read, so before
        any CUDA-graph capture: pass it to the constructor to check it there), any other map is a
        ValueError.

        Limits: bf16 activations in (defer_input_quant, or experts without activation
        quantization), no router weight on the input, no async prepare/finalize (shared experts are
        not overlapped with the exchange)."""

        def __init__(self, ep_layer: Any, expert_map: Any = None) -> None:
            super().__init__()
            missing = [n for n in EP_LAYER_MEMBERS if not hasattr(ep_layer, n)]
            if missing:
                raise ValueError("MoekitEpPrepareAndFinalize: ep_layer must be a moekit.torch.EpLayer "
                                 f"(convert_weights_ep / moekit.torch.pack_ep); {type(ep_layer).__name__} lacks "
                                 f"{', '.join(missing)}")
            if ep_layer.options.get("combine") != "bf16":
                raise ValueError("MoekitEpPrepareAndFinalize: the EP layer must be made with combine='bf16' (vLLM's "
                                 f"experts hand back unweighted bf16 rows); it has {ep_layer.options.get('combine')!r}")
            self.ep = ep_layer
            self._maps_ok: set = set()
            if expert_map is not None:
                self._check_expert_map(expert_map)

        # -- what vLLM asks the slot --
        @property
        def activation_format(self) -> Any:
            return mk.FusedMoEActivationFormat.BatchedExperts

        def topk_indices_dtype(self) -> Any:
            import torch
            return torch.int32

        def max_num_tokens_per_rank(self) -> Any:
            return int(self.ep.options["max_tokens_per_rank"])

        def num_dispatchers(self) -> int:
            return int(self.ep.group.world)

        def output_is_reduced(self) -> bool:
            return True

        def allocate_fused_expert_output(self, shape: Any, dtype: Any, device: Any, weight_and_reduce_impl: Any) -> Any:
            import torch
            out = self.ep.batch()[2]
            if (isinstance(weight_and_reduce_impl, reduce.TopKWeightAndReduceDelegate) and tuple(shape) == tuple(out.shape)
                    and dtype == torch.bfloat16 and torch.device(device) == out.device):
                return out  # the experts write where combine reads
            return None

        def _check_expert_map(self, expert_map: Any) -> None:
            import torch
            key = (expert_map.data_ptr(), expert_map._version, tuple(expert_map.shape))
            if key in self._maps_ok:
                return
            if expert_map.is_cuda and torch.cuda.is_current_stream_capturing():
                raise ValueError("MoekitEpPrepareAndFinalize: an expert_map seen first during CUDA-graph capture "
                                 "cannot be checked; pass it to the constructor")
            ep = self.ep
            want = linear_expert_map(ep.spec.num_experts, ep.group.rank, ep.group.world)
            if tuple(expert_map.shape) != tuple(want.shape) or not torch.equal(expert_map.cpu().to(torch.int32), want):
                raise ValueError(f"MoekitEpPrepareAndFinalize: expert_map is not moekit's placement (rank r holds "
                                 f"experts [r E/world, (r + 1) E/world) = [{ep.first_expert}, "
                                 f"{ep.first_expert + ep.local_experts}) here, in order; no redundant experts)")
            self._maps_ok.add(key)

        def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map, apply_router_weight_on_input,
                    quant_config, defer_input_quant):
            ep = self.ep
            if num_experts != ep.spec.num_experts:
                raise ValueError(f"MoekitEpPrepareAndFinalize: {num_experts} global experts, the EP layer has "
                                 f"{ep.spec.num_experts}")
            if apply_router_weight_on_input:
                raise ValueError("MoekitEpPrepareAndFinalize: no router weight on the input (combine applies the weights)")
            if getattr(quant_config, "quant_dtype", None) is not None and not defer_input_quant:
                raise ValueError("MoekitEpPrepareAndFinalize: the experts want quantized activations "
                                 f"({quant_config.quant_dtype}); moekit's dispatch hands them bf16 rows")
            if expert_map is not None:
                self._check_expert_map(expert_map)
            recv_x, counts = ep.dispatch(a1, as_int32(topk_ids), _f32(topk_weights))
            meta = mk.ExpertTokensMetadata(expert_num_tokens=counts, expert_num_tokens_cpu=None)
            return recv_x, None, meta, None, None

        def finalize(self, output, fused_expert_output, topk_weights, topk_ids, apply_router_weight_on_input,
                     weight_and_reduce_impl):
            if not isinstance(weight_and_reduce_impl, reduce.TopKWeightAndReduceDelegate):
                raise ValueError("MoekitEpPrepareAndFinalize: the experts must leave weighting and the sum to "
                                 f"finalize (TopKWeightAndReduceDelegate), not {type(weight_and_reduce_impl).__name__}")
            if apply_router_weight_on_input:
                raise ValueError("MoekitEpPrepareAndFinalize: no router weight on the input")
            self.ep.combine(fused_expert_output, output, _f32(topk_weights))

    return dict(MoekitExperts=MoekitExperts, MoekitBatchedExperts=MoekitBatchedExperts,
                MoekitMonolithicExperts=MoekitMonolithicExperts, MoekitEpPrepareAndFinalize=MoekitEpPrepareAndFinalize)


def _f32(t: Any) -> Any:
    """Top-k weights as contiguous float32 (a copy only when they are not)."""
    import torch
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def __getattr__(name: str) -> Any:  # the classes over vLLM itself, made on first use
    if name in ("MoekitExperts", "MoekitBatchedExperts", "MoekitMonolithicExperts", "MoekitEpPrepareAndFinalize"):
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk
        import vllm.model_executor.layers.fused_moe.topk_weight_and_reduce as reduce
        classes = make_classes(mk, reduce)
        globals().update(classes)
        return classes[name]
    raise AttributeError(name)
