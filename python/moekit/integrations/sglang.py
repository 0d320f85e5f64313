"""SGLang adapter: moekit as an out-of-tree MoE runner backend "moekit" (sglang/srt/layers/moe/
moe_runner/, SGLang 0.5.23): `register()` (done on import) registers a runner core through
SGLang's own extension point, register_moe_runner_core("moekit", ...), so that
MoeRunner(resolve_moe_runner_backend("moekit"), config) runs moekit: MoekitRunnerCore is a
DispatchMoeRunnerCore, which takes the standard dispatch output (hidden_states + top-k ids and
weights) and returns a StandardCombineInput, experts and the weighted combine in one call on the
current stream. MoekitQuantInfo (a MoeQuantInfo) carries the moekit Layer packed at load
(convert_weights: the FusedMoE layer's w13/w2 parameters) and its workspace.

SGLang describes GPT-OSS's activation as activation "silu" with gemm1_alpha / gemm1_clamp_limit
set and gate/up rows interleaved (gate_up_interleaved); supports() maps the runner config onto
moekit's activations. Limits: the standard top-k format (no expert parallelism), int32 ids (int64
are converted), bf16 activations, no router weight applied on the input."""

import dataclasses
from typing import Any, Optional, Tuple

import moekit

from . import as_int32, checkpoint_of, empty_bytes, empty_like, pack_layer

NAME = "moekit"


def activation_of(runner_config: Any) -> Tuple[Optional[dict], str]:
    """moekit LayerSpec activation fields for a MoeRunnerConfig, or (None, reason)."""
    act = str(getattr(runner_config, "activation", "silu"))
    if not getattr(runner_config, "is_gated", True):
        return None, f"activation {act!r} without a gate (moekit: gated experts)"
    alpha = getattr(runner_config, "gemm1_alpha", None)
    limit = getattr(runner_config, "gemm1_clamp_limit", None)
    if act in ("swiglu", "swiglu_oai") or (act == "silu" and alpha is not None):
        if limit is None:
            return None, "swiglu without gemm1_clamp_limit"
        beta = getattr(runner_config, "gemm1_beta", None)
        return dict(activation="swiglu_oai", swiglu_alpha=float(alpha if alpha is not None else 1.702),
                    swiglu_limit=float(limit), swiglu_beta=float(1.0 if beta is None else beta)), ""
    if act == "silu":
        swiglu_limit = getattr(runner_config, "swiglu_limit", None)
        if swiglu_limit is not None:
            return dict(activation="silu_clamped", swiglu_limit=float(swiglu_limit)), ""
        return dict(activation="silu"), ""
    return None, f"activation {act!r} (moekit: silu, swiglu)"


def supports(runner_config: Any, spec: moekit.LayerSpec) -> Tuple[bool, str]:
    """Whether a runner config asks for what the layer computes; (ok, reason)."""
    want, why = activation_of(runner_config)
    if want is None:
        return False, why
    if want["activation"] != spec.activation:
        return False, f"activation {want['activation']} but the layer was packed for {spec.activation}"
    for key in ("swiglu_alpha", "swiglu_limit", "swiglu_beta"):
        if key in want and abs(want[key] - getattr(spec, key)) > 1e-6:
            return False, f"{key} {want[key]} but the layer has {getattr(spec, key)}"
    if getattr(runner_config, "apply_router_weight_on_input", False):
        return False, "router weight applied on the input"
    if getattr(runner_config, "no_combine", False):
        return False, "no_combine (moekit combines)"
    return True, ""


def convert_weights(params: dict, spec: moekit.LayerSpec, device: str, interleaved: bool = True) -> moekit.Layer:
    """process_weights_after_loading's step: pack the layer's parameters once (vLLM's and SGLang's
    names, w13_weight / w2_weight / w13_weight_bias ...). bf16 swiglu weights with `interleaved`
    rows (SGLang's gate_up_interleaved) are reordered to moekit's [gates; ups]."""
    from .vllm import _uninterleave
    params = {("w13_bias" if k == "w13_weight_bias" else "w2_bias" if k == "w2_weight_bias" else k): v
              for k, v in params.items()}
    ck = checkpoint_of(params, spec)
    if spec.format == "bf16" and spec.activation == "swiglu_oai" and interleaved:
        ck["w13_weight"] = _uninterleave(ck["w13_weight"])
        if ck.get("w13_bias") is not None:
            ck["w13_bias"] = _uninterleave(ck["w13_bias"])
    return pack_layer(spec, ck, device)


def make_runner(quant_info_base: Any, core_base: Any, combine_input_cls: Any) -> Tuple[type, type]:
    """(MoekitQuantInfo, MoekitRunnerCore) over SGLang's MoeQuantInfo, DispatchMoeRunnerCore and
    StandardCombineInput."""

    @dataclasses.dataclass
    class MoekitQuantInfo(quant_info_base):
        layer: moekit.Layer = None
        workspace: Optional[Any] = None  # made on the first call for layer.spec.max_tokens tokens

    class MoekitRunnerCore(core_base):
        @property
        def runner_backend(self) -> Any:
            from sglang.srt.layers.moe.utils import resolve_moe_runner_backend
            return resolve_moe_runner_backend(NAME)

        def run_from_dispatch(self, dispatch_output: Any, quant_info: Any, runner_config: Any, hooks: Any = None) -> Any:
            layer = quant_info.layer
            ok, why = supports(runner_config, layer.spec)
            if not ok:
                raise ValueError(f"moekit runner: {why}")
            if hooks is not None:
                raise ValueError("moekit runner: no LoRA hooks")
            x = dispatch_output.hidden_states
            topk = dispatch_output.topk_output
            weights = topk.topk_weights
            scale = getattr(runner_config, "routed_scaling_factor", None)
            if scale is not None and scale != 1.0:  # SGLang's runners scale the combined output by it
                weights = weights * scale  # the sum is linear in the weights: one multiply of [T, k]
            if quant_info.workspace is None:
                quant_info.workspace = empty_bytes(layer.workspace_bytes(layer.spec.max_tokens), x)
            out = empty_like(x)
            layer.forward_topk(x, as_int32(topk.topk_ids), weights.float(), out, quant_info.workspace)
            return combine_input_cls(hidden_states=out)

    return MoekitQuantInfo, MoekitRunnerCore


def register() -> None:
    """Makes the classes over SGLang and registers the "moekit" runner backend with its core
    (SGLang's register_moe_runner_core; idempotent). Done on first use of the classes."""
    if "MoekitRunnerCore" not in globals():
        from sglang.srt.layers.moe.moe_runner.base import DispatchMoeRunnerCore, MoeQuantInfo
        from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
        info, core = make_runner(MoeQuantInfo, DispatchMoeRunnerCore, StandardCombineInput)
        globals().update(MoekitQuantInfo=info, MoekitRunnerCore=core)
    from sglang.srt.layers.moe.moe_runner.runner import register_moe_runner_core
    try:
        register_moe_runner_core(NAME, globals()["MoekitRunnerCore"])
    except ValueError as e:  # registered before (the only refusal for a name that is not built in)
        if "already registered" not in str(e):
            raise


def __getattr__(name: str) -> Any:  # made over SGLang itself on first use
    if name in ("MoekitQuantInfo", "MoekitRunnerCore"):
        register()
        return globals()[name]
    raise AttributeError(name)
