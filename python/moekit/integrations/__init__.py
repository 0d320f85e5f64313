"""moekit inside inference engines: transformers (the "moekit" experts backend of its experts
interface), vllm (fused-MoE experts classes for the modular and the monolithic slot) and sglang
(a MoE runner core registered through SGLang's extension point). Each is built over the engine's
own classes (tested against the pinned packages: tests/python/test_transformers.py,
tests/engines); the helpers here take any DLPack tensors (torch on a GPU or the CPU, numpy)."""

from typing import Any

import numpy as np


def is_torch(t: Any) -> bool:
    return type(t).__module__.split(".")[0] == "torch"


def empty_like(t: Any) -> Any:
    return t.new_empty(t.shape) if is_torch(t) else np.empty_like(t)


def empty_bytes(nbytes: int, like: Any) -> Any:
    """A uint8 buffer of nbytes on like's device (torch's allocator for torch tensors)."""
    if is_torch(like):
        import torch
        return torch.empty(nbytes, dtype=torch.uint8, device=like.device)
    return np.empty(nbytes, np.uint8)


def as_int32(t: Any) -> Any:
    """Top-k ids as int32 (a copy only when they are not)."""
    if is_torch(t):
        import torch
        return t if t.dtype == torch.int32 else t.to(torch.int32)
    return t if t.dtype == np.int32 else t.astype(np.int32)


def uint8_dtype(like_dtype: Any) -> Any:
    if type(like_dtype).__module__.split(".")[0] == "torch":
        import torch
        return torch.uint8
    return np.uint8


def checkpoint_of(params: dict, spec: Any) -> dict:
    """An engine's FusedMoE parameters (w13_weight, w13_weight_scale, w13_bias, ...: the names vLLM
    and SGLang give them) as moekit checkpoint tensors (views). MXFP4 keeps GPT-OSS's layout under
    the engines' names: w13_weight is the gate_up_proj_blocks bytes [E, 2I, H/2]."""
    if spec.format != "mxfp4":  # ModelOpt-style names are the engines' own
        return {k: v for k, v in params.items() if v is not None}
    E, H, I = spec.num_experts, spec.hidden, spec.intermediate
    ck = {"gate_up_proj_blocks": params["w13_weight"].reshape(E, 2 * I, H // 32, 16),
          "gate_up_proj_scales": params["w13_weight_scale"],
          "down_proj_blocks": params["w2_weight"].reshape(E, H, I // 32, 16),
          "down_proj_scales": params["w2_weight_scale"]}
    if params.get("w13_bias") is not None:
        ck.update(gate_up_proj_bias=params["w13_bias"], down_proj_bias=params["w2_bias"])
    return ck


def pack_layer(spec: Any, checkpoint: dict, device: str) -> Any:
    """Packs with torch tensors when the checkpoint holds torch tensors, with numpy otherwise."""
    import moekit
    if any(is_torch(v) for v in checkpoint.values()):
        import moekit.torch as mt
        return mt.pack(spec, checkpoint, device)
    return moekit.pack(spec, checkpoint, device)
