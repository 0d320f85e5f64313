"""moekit's forward calls as torch custom ops, and packing into torch tensors (imported only
where torch is: `import moekit.torch`).

    layer = moekit.torch.pack(spec, checkpoint, device="cuda")   # packed weights: torch tensors
    ws = layer.workspace(T)                                       # torch's allocator
    torch.ops.moekit.forward_logits(layer.key, x, logits, out, ws)

Ops (schemas in OPS below; each mutates `out` and `workspace` and returns nothing):
  moekit::forward_logits(layer, x, logits, out, workspace, shared=None, token_ids=None)
  moekit::forward_topk(layer, x, topk_ids, topk_weights, out, workspace, shared=None)
  moekit::forward_batched(layer, x, expert_num_tokens, out, workspace)
`layer` is the integer key of a layer registered here (as vLLM passes a layer name). They are
registered with torch.library directly (CPU and CUDA kernels, and fake kernels for
torch.compile), without torch.library.custom_op's per-call overhead. The kernels run on torch's
current stream: tvm-ffi reads it from the tensors at each call, so the ops are CUDA-graph safe.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

import moekit
from moekit import _ffi

_LAYERS: List[moekit.Layer] = []


def register(layer: moekit.Layer) -> int:
    """The key under which the ops find `layer` (kept alive for the process)."""
    _LAYERS.append(layer)
    return len(_LAYERS) - 1


OPS = {
    "forward_logits": "forward_logits(int layer, Tensor x, Tensor logits, Tensor(a!) out, Tensor(b!) workspace, "
                      "Tensor? shared=None, Tensor? token_ids=None) -> ()",
    "forward_topk": "forward_topk(int layer, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor(a!) out, "
                    "Tensor(b!) workspace, Tensor? shared=None) -> ()",
    "forward_batched": "forward_batched(int layer, Tensor x, Tensor expert_num_tokens, Tensor(a!) out, "
                       "Tensor(b!) workspace) -> ()",
}


def _forward_logits(layer: int, x, logits, out, workspace, shared=None, token_ids=None) -> None:
    if token_ids is None:
        _ffi.forward_logits(_LAYERS[layer]._h, x, logits, out, workspace, shared, None, None)
    else:
        _ffi.forward_logits_tokens(_LAYERS[layer]._h, x, logits, out, workspace, shared, None, None, token_ids)


def _forward_topk(layer: int, x, topk_ids, topk_weights, out, workspace, shared=None) -> None:
    _ffi.forward_topk(_LAYERS[layer]._h, x, topk_ids, topk_weights, out, workspace, shared)


def _forward_batched(layer: int, x, expert_num_tokens, out, workspace) -> None:
    _ffi.forward_batched(_LAYERS[layer]._h, x, expert_num_tokens, out, workspace)


def _fake(*args, **kwargs) -> None:  # the ops only mutate their outputs: nothing to infer
    return None


_lib = torch.library.Library("moekit", "FRAGMENT")
for _name, _schema in OPS.items():
    _lib.define(_schema)
    _fn = {"forward_logits": _forward_logits, "forward_topk": _forward_topk, "forward_batched": _forward_batched}[_name]
    _lib.impl(_name, _fn, "CPU")
    _lib.impl(_name, _fn, "CUDA")
    torch.library.register_fake("moekit::" + _name, _fake, lib=_lib)


class TorchLayer(moekit.Layer):
    """A moekit.Layer whose packed weights are torch tensors, registered for the ops."""

    def __init__(self, layer: moekit.Layer) -> None:
        super().__init__(layer.plan, layer.packed, layer._h)
        self.key = register(self)

    def workspace(self, tokens: int, k: Optional[int] = None) -> torch.Tensor:
        return torch.empty(self.workspace_bytes(tokens, k), dtype=torch.uint8, device=self.device)

    def batched_workspace(self, rows_per_expert: int) -> torch.Tensor:
        return torch.empty(self.batched_workspace_bytes(rows_per_expert), dtype=torch.uint8, device=self.device)

    def __call__(self, x: torch.Tensor, logits: torch.Tensor, out: Optional[torch.Tensor] = None,
                 workspace: Optional[torch.Tensor] = None, shared: Optional[torch.Tensor] = None,
                 token_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """forward_logits through the op; out and workspace are allocated when not given;
        token_ids [T] (int32/int64) for a hash-routed layer."""
        if out is None:
            out = torch.empty_like(x)
        if workspace is None:
            workspace = self.workspace(x.shape[0])
        torch.ops.moekit.forward_logits.default(self.key, x, logits, out, workspace, shared,  # no overload lookup
                                                token_ids)
        return out


def _torch_alloc(nbytes: int, device: str) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _device(device: Any) -> str:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def _as_tensors(checkpoint: Dict[str, Any]) -> Dict[str, Any]:
    # numpy arrays and torch tensors alike are DLPack producers; bf16 may come as torch.bfloat16.
    return {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in checkpoint.items()}


def pack(spec: moekit.LayerSpec, checkpoint: Dict[str, Any], device: Any = "cuda",
         backend: Optional[str] = None) -> TorchLayer:
    """Packs checkpoint tensors (torch or numpy, host or device) into torch tensors on `device`
    (torch's caching allocator) and returns the registered layer over them."""
    return TorchLayer(moekit.pack(spec, _as_tensors(checkpoint), _device(device), backend,
                                  allocate=_torch_alloc))


def synthetic(spec: moekit.LayerSpec, device: Any = "cuda", backend: Optional[str] = None,
              seed: int = 1) -> TorchLayer:
    """A registered layer with random but valid packed weights in torch tensors."""
    return TorchLayer(moekit.synthetic(spec, _device(device), backend, seed, allocate=_torch_alloc))


pack_weights_torch = pack  # the name the design notes use
