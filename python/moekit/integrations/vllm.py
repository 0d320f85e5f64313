"""vLLM adapter: moekit in the fused-MoE modular kernel (vllm/model_executor/layers/fused_moe/
modular_kernel.py), both slots:

  MoekitExperts            FusedMoEExpertsModular, Standard format: experts + weighted combine
                           from topk ids/weights; finalize reduces nothing (TopKWeightAndReduceNoOP)
  MoekitBatchedExperts     FusedMoEExpertsModular, BatchedExperts format: the experts alone on
                           [E, max_tokens, K] + expert_num_tokens (TopKWeightAndReduceDelegate)
  MoekitMonolithicExperts  FusedMoEExpertsMonolithic: routing + experts + combine from router logits

Each wraps a moekit.Layer made once at load (convert_weights: the FusedMoE layer's parameters, in
vLLM's names, packed into the kernel layout). The supports checks answer from moekit's backends;
workspace_shapes come from Layer.workspace_bytes (uint8, dim 0 = M). `from moekit.integrations
import vllm` over vLLM itself, or make_classes(mk, reduce) over stand-ins of those two modules.
Limits: no expert parallelism (expert_map), no router weight applied on the input, int32 ids (int64
are converted), fp32 router logits."""

from typing import Any

import moekit

from . import as_int32, checkpoint_of, empty_bytes, empty_like, pack_layer, uint8_dtype

ACTIVATIONS = {"silu": "silu", "swigluoai": "swiglu_oai", "swiglu_oai": "swiglu_oai", "silu_clamped": "silu_clamped"}


def _name(x: Any) -> str:
    return str(getattr(x, "value", x)).lower()


def weight_format(weight_key: Any) -> str:
    """vLLM's weight quant key -> moekit's weight format ('' when moekit has none for it)."""
    if weight_key is None:
        return "bf16"
    k = _name(weight_key)
    return next((f for f in ("mxfp4", "nvfp4", "mxfp8") if f in k), "")


def convert_weights(params: dict, spec: moekit.LayerSpec, device: str) -> moekit.Layer:
    """process_weights_after_loading's step: pack the FusedMoE layer's parameters once."""
    return pack_layer(spec, checkpoint_of(params, spec), device)


def make_classes(mk: Any, reduce: Any) -> dict:
    class _Supports:
        @staticmethod
        def _supports_current_device() -> bool:
            return moekit.cuda_available()

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return False

        @staticmethod
        def _supports_quant_scheme(weight_key: Any, activation_key: Any) -> bool:
            return weight_format(weight_key) != "" and activation_key is None

        @staticmethod
        def _supports_activation(activation: Any) -> bool:
            return _name(activation) in ACTIVATIONS

        @staticmethod
        def _supports_parallel_config(cfg: Any) -> bool:
            return not getattr(cfg, "use_ep", False)

        @staticmethod
        def _supports_shape(hidden_dim: int) -> bool:
            return hidden_dim % 32 == 0

        def supports_expert_map(self) -> bool:
            return False

        def supports_chunking(self) -> bool:
            return True

        @property
        def expects_unquantized_inputs(self) -> bool:
            return True  # bf16 hidden states in; the kernels read them as they are

    class MoekitExperts(_Supports, mk.FusedMoEExpertsModular):
        def __init__(self, moe_config: Any, quant_config: Any, layer: moekit.Layer, **kw: Any) -> None:
            super().__init__(moe_config, quant_config, **kw)
            self.layer = layer

        @staticmethod
        def activation_format() -> Any:
            return mk.FusedMoEActivationFormat.Standard

        def finalize_weight_and_reduce_impl(self) -> Any:
            return reduce.TopKWeightAndReduceNoOP()

        def workspace_dtype(self, act_dtype: Any) -> Any:
            return uint8_dtype(act_dtype)

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
            per_row = -(-self.layer.workspace_bytes(M, topk) // max(M, 1))
            return (M, per_row), (0,), (M, K)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input) -> None:
            if expert_map is not None or apply_router_weight_on_input:
                raise ValueError("moekit: no expert map, no router weight on the input")
            self.layer.forward_topk(hidden_states, as_int32(topk_ids), topk_weights, output, workspace13)

    class MoekitBatchedExperts(MoekitExperts):
        @staticmethod
        def activation_format() -> Any:
            return mk.FusedMoEActivationFormat.BatchedExperts

        def finalize_weight_and_reduce_impl(self) -> Any:
            return reduce.TopKWeightAndReduceDelegate()

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
            per_row = -(-self.layer.batched_workspace_bytes(M) // max(M, 1))
            return (M, per_row), (0,), (local_num_experts, M, K)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input) -> None:
            self.layer.forward_batched(hidden_states, expert_tokens_meta.expert_num_tokens, output, workspace13)

    class MoekitMonolithicExperts(_Supports, mk.FusedMoEExpertsMonolithic):
        def __init__(self, moe_config: Any, quant_config: Any, layer: moekit.Layer, **kw: Any) -> None:
            super().__init__(moe_config, quant_config, **kw)
            self.layer, self._ws = layer, None

        @staticmethod
        def activation_format() -> Any:
            return mk.FusedMoEActivationFormat.Standard

        @staticmethod
        def _supports_routing_method(routing_method: Any, weight_key: Any, activation_key: Any) -> bool:
            return any(m in _name(routing_method) for m in ("default", "renormalize", "deepseek"))

        @staticmethod
        def _supports_router_logits_dtype(dtype: Any, routing_method: Any) -> bool:
            return dtype is None or "float32" in str(dtype)

        def apply(self, hidden_states, w1, w2, router_logits, activation, global_num_experts, expert_map, a1q_scale,
                  apply_router_weight_on_input, num_expert_group=None, e_score_correction_bias=None,
                  routed_scaling_factor=None, topk_group=None) -> Any:
            s = self.layer.spec  # the routing was fixed at load: the call must agree with it
            if (routed_scaling_factor or 1.0) != s.routed_scaling_factor or (num_expert_group or 1) != s.n_group:
                raise ValueError("moekit: routing parameters differ from the layer's")
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
