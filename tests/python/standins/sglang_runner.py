"""SGLang's MoE runner interface, as signatures: MoeQuantInfo, MoeRunnerConfig, the standard
dispatch output / top-k output / combine input, and register_fused_func's registry."""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple


@dataclass
class MoeQuantInfo:
    pass


@dataclass
class MoeRunnerConfig:
    num_experts: Optional[int] = None
    num_local_experts: Optional[int] = None
    hidden_size: Optional[int] = None
    intermediate_size_per_partition: Optional[int] = None
    layer_id: Optional[int] = None
    top_k: Optional[int] = None
    num_fused_shared_experts: Optional[int] = None
    params_dtype: Any = None
    activation: str = "silu"
    is_gated: bool = True
    apply_router_weight_on_input: bool = False
    inplace: bool = True
    no_combine: bool = False
    routed_scaling_factor: Optional[float] = None
    apply_routed_scaling_factor_on_output: bool = False
    gemm1_alpha: Optional[float] = None
    gemm1_clamp_limit: Optional[float] = None


@dataclass
class StandardTopKOutput:
    topk_weights: Any
    topk_ids: Any
    router_logits: Any = None


@dataclass
class StandardDispatchOutput:
    hidden_states: Any
    topk_output: StandardTopKOutput


@dataclass
class StandardCombineInput:
    hidden_states: Any


FUSED_FUNCS: Dict[Tuple[str, str], Callable] = {}


def register_fused_func(a2a_backend_name: str, runner_backend_name: str):
    def decorator(fused_func: Callable) -> Callable:
        key = (a2a_backend_name, runner_backend_name)
        if key in FUSED_FUNCS:
            raise ValueError(f"Fused function for {a2a_backend_name} to {runner_backend_name} is already registered.")
        FUSED_FUNCS[key] = fused_func
        return fused_func
    return decorator
