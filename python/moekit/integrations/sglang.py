"""SGLang adapter: moekit as a MoE runner's fused function (sglang/srt/layers/moe/moe_runner/
base.py). fused_experts_none_to_moekit, registered as @register_fused_func("none", "moekit"),
maps a StandardDispatchOutput (hidden_states + topk_output), a MoekitQuantInfo (the moekit Layer
packed at load, and its workspace) and a MoeRunnerConfig to a StandardCombineInput: experts and
the weighted combine in one call on the current stream. `from moekit.integrations import sglang`
registers it over SGLang itself; make_runner(base, combine_input_cls, register) over stand-ins.
Limits: the standard top-k format (no expert parallelism), int32 ids (int64 are converted)."""

import dataclasses
from typing import Any, Optional, Tuple

import moekit

from . import as_int32, checkpoint_of, empty_bytes, empty_like, pack_layer

ACTIVATIONS = {"silu": "silu", "swiglu": "swiglu_oai", "swiglu_oai": "swiglu_oai", "silu_clamped": "silu_clamped"}


def supports(runner_config: Any, spec: moekit.LayerSpec) -> Tuple[bool, str]:
    """Whether a runner config asks for what the layer computes; (ok, reason)."""
    act = ACTIVATIONS.get(str(getattr(runner_config, "activation", "silu")))
    if not getattr(runner_config, "is_gated", True) or act is None:
        return False, f"activation {runner_config.activation!r} (gated silu / swiglu only)"
    if act != spec.activation:
        return False, f"activation {act} but the layer was packed for {spec.activation}"
    alpha, limit = getattr(runner_config, "gemm1_alpha", None), getattr(runner_config, "gemm1_clamp_limit", None)
    if alpha is not None and abs(alpha - spec.swiglu_alpha) > 1e-6:
        return False, f"gemm1_alpha {alpha} but the layer has {spec.swiglu_alpha}"
    if limit is not None and abs(limit - spec.swiglu_limit) > 1e-6:
        return False, f"gemm1_clamp_limit {limit} but the layer has {spec.swiglu_limit}"
    return True, ""


def convert_weights(params: dict, spec: moekit.LayerSpec, device: str) -> moekit.Layer:
    """process_weights_after_loading's step: pack the layer's parameters once."""
    return pack_layer(spec, checkpoint_of(params, spec), device)


def make_runner(base: Any, combine_input_cls: Any, register: Any) -> Tuple[type, Any]:
    """(MoekitQuantInfo, the fused function) over SGLang's MoeQuantInfo, StandardCombineInput and
    register_fused_func (or stand-ins of them)."""

    @dataclasses.dataclass
    class MoekitQuantInfo(base):
        layer: moekit.Layer = None
        workspace: Optional[Any] = None  # made on the first call for layer.spec.max_tokens tokens

    @register("none", "moekit")
    def fused_experts_none_to_moekit(dispatch_output: Any, quant_info: Any, runner_config: Any) -> Any:
        layer = quant_info.layer
        ok, why = supports(runner_config, layer.spec)
        if not ok:
            raise ValueError(f"moekit runner: {why}")
        x = dispatch_output.hidden_states
        topk = dispatch_output.topk_output
        weights = topk.topk_weights
        scale = getattr(runner_config, "routed_scaling_factor", None) or 1.0
        if scale != 1.0 and getattr(runner_config, "apply_routed_scaling_factor_on_output", False):
            weights = weights * scale  # the sum is linear in the weights: one multiply of [T, k]
        if quant_info.workspace is None:
            quant_info.workspace = empty_bytes(layer.workspace_bytes(layer.spec.max_tokens), x)
        out = empty_like(x)
        layer.forward_topk(x, as_int32(topk.topk_ids), weights, out, quant_info.workspace)
        return combine_input_cls(hidden_states=out)

    return MoekitQuantInfo, fused_experts_none_to_moekit


def __getattr__(name: str) -> Any:  # registered over SGLang itself on first use
    if name in ("MoekitQuantInfo", "fused_experts_none_to_moekit"):
        from sglang.srt.layers.moe.moe_runner.base import MoeQuantInfo, register_fused_func
        from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
        info, fn = make_runner(MoeQuantInfo, StandardCombineInput, register_fused_func)
        globals().update(MoekitQuantInfo=info, fused_experts_none_to_moekit=fn)
        return globals()[name]
    raise AttributeError(name)
