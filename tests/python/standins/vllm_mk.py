"""vLLM's fused-MoE modular-kernel base classes, as signatures: FusedMoEExpertsModular and
FusedMoEExpertsMonolithic with the methods a kernel implements and the check order of
is_supported_config; the activation formats; the weight-and-reduce markers; the batched metadata."""

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional


class FusedMoEActivationFormat(enum.Enum):
    Standard = "standard"
    BatchedExperts = "batched_experts"


class TopKWeightAndReduce(ABC):
    pass


class TopKWeightAndReduceNoOP(TopKWeightAndReduce):
    """The experts weighted and summed over k themselves: output is (M, K)."""


class TopKWeightAndReduceDelegate(TopKWeightAndReduce):
    """The prepare/finalize applies the weights and reduces."""


@dataclass
class ExpertTokensMetadata:
    expert_num_tokens: Any
    expert_num_tokens_cpu: Optional[Any] = None


class FusedMoEExperts(ABC):
    def __init__(self, moe_config: Any, quant_config: Any, max_num_tokens: Optional[int] = None,
                 num_dispatchers: Optional[int] = None):
        if self.activation_format() == FusedMoEActivationFormat.Standard and (
                max_num_tokens is not None or num_dispatchers is not None):
            raise ValueError("max_num_tokens and num_dispatchers should only be set for BatchedExperts")
        if self.activation_format() == FusedMoEActivationFormat.BatchedExperts and (
                max_num_tokens is None or num_dispatchers is None):
            raise ValueError("max_num_tokens and num_dispatchers must be set for BatchedExperts")
        self.moe_config, self.quant_config = moe_config, quant_config
        self.max_num_tokens, self.num_dispatchers = max_num_tokens, num_dispatchers

    def process_weights_after_loading(self, layer: Any) -> None:
        pass

    @property
    def expects_unquantized_inputs(self) -> bool:
        return False

    @staticmethod
    @abstractmethod
    def activation_format() -> FusedMoEActivationFormat: ...

    @staticmethod
    def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
        if not cls._supports_current_device():
            return False, "current device"
        if not (moe_config.is_act_and_mul or cls._supports_no_act_and_mul()):
            return False, "no act_and_mul"
        if not cls._supports_activation(moe_config.activation):
            return False, f"{moe_config.activation} activation"
        if not cls._supports_quant_scheme(weight_key, activation_key):
            return False, f"quantization scheme {weight_key}x{activation_key}"
        if not cls._supports_parallel_config(moe_config.moe_parallel_config):
            return False, "parallel config"
        if not cls._supports_routing_method(moe_config.routing_method, weight_key, activation_key):
            return False, "routing method"
        if not cls._supports_router_logits_dtype(moe_config.router_logits_dtype, moe_config.routing_method):
            return False, "router logits dtype"
        if not cls._supports_shape(moe_config.hidden_dim):
            return False, "hidden dim"
        if activation_format != cls.activation_format():
            return False, "activation format"
        return True, None

    @staticmethod
    @abstractmethod
    def _supports_current_device() -> bool: ...

    @staticmethod
    @abstractmethod
    def _supports_no_act_and_mul() -> bool: ...

    @staticmethod
    @abstractmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool: ...

    @staticmethod
    @abstractmethod
    def _supports_activation(activation) -> bool: ...

    @staticmethod
    @abstractmethod
    def _supports_parallel_config(moe_parallel_config) -> bool: ...

    @staticmethod
    def _supports_routing_method(routing_method, weight_key, activation_key) -> bool:
        return True

    @staticmethod
    def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
        return True

    @staticmethod
    def _supports_shape(hidden_dim: int) -> bool:
        return True


class FusedMoEExpertsModular(FusedMoEExperts):
    @staticmethod
    def is_monolithic() -> bool:
        return False

    def workspace_dtype(self, act_dtype):
        return act_dtype

    @abstractmethod
    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation): ...

    @abstractmethod
    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduce: ...

    @abstractmethod
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input) -> None: ...


class FusedMoEExpertsMonolithic(FusedMoEExperts):
    @staticmethod
    def is_monolithic() -> bool:
        return True

    @staticmethod
    def _supports_routing_method(routing_method, weight_key, activation_key) -> bool:
        raise NotImplementedError

    @staticmethod
    def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
        raise NotImplementedError

    def apply(self, hidden_states, w1, w2, router_logits, activation, global_num_experts, expert_map, a1q_scale,
              apply_router_weight_on_input, num_expert_group=None, e_score_correction_bias=None,
              routed_scaling_factor=None, topk_group=None):
        raise NotImplementedError
