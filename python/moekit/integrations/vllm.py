"""vLLM adapter: moekit in vLLM's fused-MoE kernel (vllm/model_executor/layers/fused_moe/
modular_kernel.py, vLLM 0.33: FusedMoEKernel composing a prepare/finalize with an experts class),
both experts slots:

  MoekitExperts            FusedMoEExpertsModular, Standard format: experts + weighted combine
                           from topk ids/weights; finalize reduces nothing (TopKWeightAndReduceNoOP)
  MoekitBatchedExperts     FusedMoEExpertsModular, BatchedExperts format: the experts alone on
                           [E, max_tokens, K] + expert_num_tokens (TopKWeightAndReduceDelegate: the
                           prepare/finalize weights and reduces)
  MoekitMonolithicExperts  FusedMoEExpertsMonolithic: routing + experts + combine from router logits

Each wraps a moekit.Layer made once at load (convert_weights: the FusedMoE layer's parameters, in
vLLM's names, packed into the kernel layout). The supports checks answer from moekit's backends;
workspace_shapes come from Layer.workspace_bytes, in elements of the activation dtype (vLLM
allocates workspaces and the fused output in workspace_dtype, so it stays the activations' dtype),
first dimension M. `from moekit.integrations import vllm` exposes the classes over vLLM itself
(made on first use). Limits: no expert parallelism (expert_map) yet, no router weight applied on
the input, no hash routing, int32 ids (int64 are converted), fp32 router logits, bf16 activations."""

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
            if expert_map is not None:
                raise ValueError("moekit: no expert map")
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

    return dict(MoekitExperts=MoekitExperts, MoekitBatchedExperts=MoekitBatchedExperts,
                MoekitMonolithicExperts=MoekitMonolithicExperts)


def __getattr__(name: str) -> Any:  # the classes over vLLM itself, made on first use
    if name in ("MoekitExperts", "MoekitBatchedExperts", "MoekitMonolithicExperts"):
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk
        import vllm.model_executor.layers.fused_moe.topk_weight_and_reduce as reduce
        classes = make_classes(mk, reduce)
        globals().update(classes)
        return classes[name]
    raise AttributeError(name)
