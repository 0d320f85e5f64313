"""moekit's forward calls as torch custom ops, and packing into torch tensors (imported only
where torch is: `import moekit.torch`).

    layer = moekit.torch.pack(spec, checkpoint, device="cuda")   # packed weights: torch tensors
    ws = layer.workspace(T)                                       # torch's allocator
    torch.ops.moekit.forward_logits(layer.key, x, logits, out, ws)

Ops (schemas in OPS below; each mutates `out` and `workspace` and returns nothing):
  moekit::forward_logits(layer, x, logits, out, workspace, shared=None, token_ids=None)
  moekit::forward_topk(layer, x, topk_ids, topk_weights, out, workspace, shared=None)
  moekit::forward_batched(layer, x, expert_num_tokens, out, workspace)
  moekit::ep_dispatch(layer, x, topk_ids, topk_weights, recv_x, expert_num_tokens)
  moekit::ep_combine(layer, expert_out, out, topk_weights=None, shared=None)
`layer` is the integer key of a layer registered here (as vLLM passes a layer name); for the two
ep_ ops, of an EP layer (EpLayer.key; recv_x and expert_num_tokens are its batch() views, named so
that torch knows what dispatch writes). They are
registered with torch.library directly (CPU and CUDA kernels, and fake kernels for
torch.compile), without torch.library.custom_op's per-call overhead. The kernels run on torch's
current stream: tvm-ffi reads it from the tensors at each call, so the ops are CUDA-graph safe.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

import moekit
from moekit import _ffi

_LAYERS: List["weakref.ref[moekit.Layer]"] = []


def register(layer: moekit.Layer) -> int:
    """The key under which the ops find `layer`. The registry holds it weakly: the layer (its packed
    weights) lives as long as its owner keeps it (a module, an engine's layer object), and a key
    used after that is a ValueError, not the memory of a model that is gone."""
    _LAYERS.append(weakref.ref(layer))
    return len(_LAYERS) - 1


def _layer(key: int) -> moekit.Layer:
    L = _LAYERS[key]() if 0 <= key < len(_LAYERS) else None
    if L is None:
        raise ValueError(f"moekit: layer key {key} names no live layer (released, or never registered)")
    return L


OPS = {
    "forward_logits": "forward_logits(int layer, Tensor x, Tensor logits, Tensor(a!) out, Tensor(b!) workspace, "
                      "Tensor? shared=None, Tensor? token_ids=None) -> ()",
    "forward_topk": "forward_topk(int layer, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor(a!) out, "
                    "Tensor(b!) workspace, Tensor? shared=None) -> ()",
    "forward_batched": "forward_batched(int layer, Tensor x, Tensor expert_num_tokens, Tensor(a!) out, "
                       "Tensor(b!) workspace) -> ()",
    "ep_dispatch": "ep_dispatch(int layer, Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor(a!) recv_x, "
                   "Tensor(b!) expert_num_tokens) -> ()",
    "ep_combine": "ep_combine(int layer, Tensor expert_out, Tensor(a!) out, Tensor? topk_weights=None, "
                  "Tensor? shared=None) -> ()",
}


def _forward_logits(layer: int, x, logits, out, workspace, shared=None, token_ids=None) -> None:
    if token_ids is None:
        _ffi.forward_logits(_layer(layer)._h, x, logits, out, workspace, shared, None, None)
    else:
        _ffi.forward_logits_tokens(_layer(layer)._h, x, logits, out, workspace, shared, None, None, token_ids)


def _forward_topk(layer: int, x, topk_ids, topk_weights, out, workspace, shared=None) -> None:
    _ffi.forward_topk(_layer(layer)._h, x, topk_ids, topk_weights, out, workspace, shared)


def _forward_batched(layer: int, x, expert_num_tokens, out, workspace) -> None:
    _ffi.forward_batched(_layer(layer)._h, x, expert_num_tokens, out, workspace)


_EP_LAYERS: List["EpLayer"] = []


def _ep_dispatch(layer: int, x, topk_ids, topk_weights, recv_x, expert_num_tokens) -> None:
    L = _EP_LAYERS[layer]
    want_x, want_n, _ = L.batch()
    if recv_x.data_ptr() != want_x.data_ptr() or expert_num_tokens.data_ptr() != want_n.data_ptr():
        raise ValueError("moekit::ep_dispatch: recv_x and expert_num_tokens must be the layer's batch() views")
    _ffi.ep_dispatch(L._h, x, topk_ids, topk_weights)


def _ep_combine(layer: int, expert_out, out, topk_weights=None, shared=None) -> None:
    _ffi.ep_combine(_EP_LAYERS[layer]._h, expert_out, out, topk_weights, shared)


def _fake(*args, **kwargs) -> None:  # the ops only mutate their outputs: nothing to infer
    return None


_lib = torch.library.Library("moekit", "FRAGMENT")
for _name, _schema in OPS.items():
    _lib.define(_schema)
    _fn = {"forward_logits": _forward_logits, "forward_topk": _forward_topk, "forward_batched": _forward_batched,
           "ep_dispatch": _ep_dispatch, "ep_combine": _ep_combine}[_name]
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


# ---- expert parallelism -------------------------------------------------------------------------
# One rank per process, as vLLM and SGLang run: the ranks of a torch.distributed process group
# make an NCCL communicator of moekit's own from a unique id that the group's first rank makes and
# broadcasts over the group (as vLLM's PyNccl does), then an EP layer per MoE layer. A forward
# call runs on torch's current stream, allocates nothing and can be captured in a CUDA graph.

EP_OPTION_NAMES = ("max_tokens_per_rank", "payload", "combine", "expert_capacity", "timeout_ms",
                   "nvfp4_global_scale", "mx_scale_rule", "kernel", "dispatch")


class EpGroup:
    """moekit's EP group over the ranks of a torch.distributed process group (collective)."""

    def __init__(self, process_group: Any = None, device: Any = None, transport: str = "auto") -> None:
        import torch.distributed as dist

        if transport not in ("auto", "nvlink", "host"):
            raise ValueError(f"moekit.torch.EpGroup: transport {transport!r} (auto | nvlink | host)")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("moekit.torch.EpGroup: torch.distributed is not initialized "
                             "(call torch.distributed.init_process_group first)")
        if not torch.cuda.is_available():
            raise ValueError("moekit.torch.EpGroup: no CUDA device here (expert parallelism runs on SM90 GPUs, "
                             "one rank per GPU)")
        pg = process_group if process_group is not None else dist.group.WORLD
        world = dist.get_world_size(pg)
        rank = dist.get_rank(pg)
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if dev.type != "cuda":
            raise ValueError(f"moekit.torch.EpGroup: device {dev} is not a CUDA device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        # The group's first rank makes the id; broadcast_object_list works over NCCL and Gloo groups.
        box = [bytes(_ffi.ep_unique_id()) if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg,
                                   device=dev if dist.get_backend(pg) == "nccl" else None)
        with torch.cuda.device(dev):
            self._h = _ffi.ep_group_create(box[0], world, rank, dev.index, transport)
        self.process_group = pg
        self.world, self.rank, self.device = world, rank, dev
        self.transport = str(_ffi.ep_group_info(self._h)[3])

    def __repr__(self) -> str:
        return f"moekit.torch.EpGroup(rank {self.rank} of {self.world}, {self.device}, {self.transport})"


def _device_view(ptr: int, shape: Tuple[int, ...], strides: Tuple[int, ...], dtype: torch.dtype, device: Any,
                 owner: Any) -> torch.Tensor:
    """A torch tensor over device memory moekit owns (no copy), through __cuda_array_interface__;
    the interface object keeps `owner` alive with the tensor."""
    item = {torch.bfloat16: 2, torch.int32: 4}[dtype]
    iface = dict(shape=tuple(shape), typestr="<i2" if item == 2 else "<i4", data=(ptr, False),
                 strides=tuple(s * item for s in strides), version=2)
    t = torch.as_tensor(types.SimpleNamespace(__cuda_array_interface__=iface, owner=owner), device=device)
    return t.view(dtype) if dtype == torch.bfloat16 else t


def ep_group(process_group: Any = None, device: Any = None, transport: str = "auto") -> EpGroup:
    """An EP group over the ranks of `process_group` (default: the world), this rank's experts on
    `device` (default: the current CUDA device); transport "auto" (NVLink load/store where every
    rank is reachable, else NCCL's host all-to-all), "nvlink" or "host". Collective."""
    return EpGroup(process_group, device, transport)


class EpLayer:
    """One MoE layer split over an EpGroup's ranks: this rank holds experts
    [first_expert, first_expert + local_experts). Made by pack_ep (collective)."""

    def __init__(self, group: EpGroup, spec: moekit.LayerSpec, handle: Any, options: Dict[str, Any]) -> None:
        self.group, self.spec, self._h, self.options = group, spec, handle, options
        self.first_expert, self.local_experts = (int(v) for v in _ffi.ep_layer_info(handle))
        self.device = group.device
        self._batch: Optional[Tuple[Any, ...]] = None
        self._T = -1  # tokens of the pending dispatch
        _EP_LAYERS.append(self)
        self.key = len(_EP_LAYERS) - 1  # the ep_ ops' layer argument

    def forward_logits(self, x: torch.Tensor, logits: torch.Tensor, out: Optional[torch.Tensor] = None,
                       shared: Optional[torch.Tensor] = None, topk_ids: Optional[torch.Tensor] = None,
                       topk_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Routes this rank's T tokens (x [T, H] bf16, logits [T, E] f32), runs them on their
        experts' ranks and combines: out [T, H] bf16 (allocated when not given). Every rank calls it."""
        if out is None:
            out = torch.empty_like(x)
        _ffi.ep_forward_logits(self._h, x, logits, out, shared, topk_ids, topk_weights)
        return out

    def forward_topk(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     out: Optional[torch.Tensor] = None, shared: Optional[torch.Tensor] = None) -> torch.Tensor:
        """From given top-k ids [T, k] int32 (global ids, -1: none) and weights [T, k] f32."""
        if out is None:
            out = torch.empty_like(x)
        _ffi.ep_forward_topk(self._h, x, topk_ids, topk_weights, out, shared)
        return out

    def batched_workspace_bytes(self, rows_per_expert: int) -> int:
        return int(_ffi.ep_batched_workspace_bytes(self._h, rows_per_expert))

    def batched_workspace(self, rows_per_expert: int) -> torch.Tensor:
        return torch.empty(self.batched_workspace_bytes(rows_per_expert), dtype=torch.uint8, device=self.device)

    def forward_batched(self, x: torch.Tensor, expert_num_tokens: torch.Tensor, out: torch.Tensor,
                        workspace: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The local experts alone on the batched format: x [local_experts, M, H] bf16."""
        if workspace is None:
            workspace = self.batched_workspace(x.shape[1])
        _ffi.ep_forward_batched(self._h, x, expert_num_tokens, out, workspace)
        return out

    # forward_topk split around experts of the caller's (an engine's prepare/finalize slot); the
    # layer must be made with combine="bf16". docs/EP.md, "Dispatch and combine apart".

    def batch(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views into the group's memory (no copies; fixed while the group's memory does not grow:
        make every layer of the group first): recv_x [local_experts, capacity, H] bf16 (the rows
        dispatch delivers; row stride H rounded up to 64), expert_num_tokens [local_experts] int32,
        and expert_out [local_experts, capacity, H] bf16, dense: where combine reads the experts'
        unweighted outputs (experts that write there spare combine a copy)."""
        info = [int(v) for v in _ffi.ep_batch(self._h)]
        if self._batch is None or self._batch[0] != info:
            x, xs_e, xs_r, n, y, El, cap, H = info
            views = (_device_view(x, (El, cap, H), (xs_e, xs_r, 1), torch.bfloat16, self.device, self),
                     _device_view(n, (El,), (1,), torch.int32, self.device, self),
                     _device_view(y, (El, cap, H), (cap * H, H, 1), torch.bfloat16, self.device, self))
            self._batch = (info, views)
        return self._batch[1]

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Sends this rank's tokens (x [T, H] bf16, global top-k ids [T, k] int32 (-1: none),
        weights [T, k] f32) to their experts' ranks; returns (recv_x, expert_num_tokens) of batch().
        Every rank calls it, then combine, with no other call of the group's layers between."""
        recv_x, counts, _ = self.batch()
        torch.ops.moekit.ep_dispatch.default(self.key, x, topk_ids, topk_weights, recv_x, counts)
        self._T = x.shape[0]
        return recv_x, counts

    def combine(self, expert_out: torch.Tensor, out: Optional[torch.Tensor] = None,
                topk_weights: Optional[torch.Tensor] = None, shared: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Brings the experts' outputs (expert_out [local_experts, capacity, H] bf16, unweighted:
        batch()'s expert_out or a tensor of the caller's) back to their tokens' ranks: out [T, H]
        bf16 = the weighted sum in slot order, rounded once (allocated when not given);
        topk_weights [T, k] f32 default to dispatch's."""
        if out is None:
            out = torch.empty((max(self._T, 0), self.spec.hidden), dtype=torch.bfloat16, device=self.device)
        torch.ops.moekit.ep_combine.default(self.key, expert_out, out, topk_weights, shared)
        return out

    def check(self) -> None:
        """Waits for torch's current stream; raises ValueError / RuntimeError with the reason when
        an earlier call failed (a peer that timed out, an expert past its capacity, a bad id)."""
        _ffi.ep_check(self._h, torch.cuda.current_stream(self.device).cuda_stream)

    def reset(self) -> None:
        """After a failure: clears the group's windows (collective)."""
        _ffi.ep_reset(self._h)

    def __repr__(self) -> str:
        return (f"moekit.torch.EpLayer(experts {self.first_expert}..{self.first_expert + self.local_experts - 1} "
                f"of {self.spec.num_experts}, rank {self.group.rank} of {self.group.world}, {self.options})")


def pack_ep(group: EpGroup, spec: moekit.LayerSpec, checkpoint: Optional[Dict[str, Any]] = None, *,
            max_tokens_per_rank: Optional[int] = None, payload: str = "bf16", combine: str = "fp32",
            expert_capacity: int = 0, timeout_ms: float = 10000.0, nvfp4_global_scale: float = 0.0,
            mx_scale_rule: str = "floor", kernel: str = "auto", dispatch: str = "") -> EpLayer:
    """An EP layer over `group` (collective: every rank calls it, in the same order for every
    layer). checkpoint: the tensors of checkpoint_tensors(spec) with a leading expert dimension of
    this rank's experts or of all E (this rank's are taken); None: synthetic weights.
    max_tokens_per_rank defaults to spec.max_tokens. combine: "fp32" (bit-identical to one GPU) |
    "bf16" | "bf16_sum" (bf16 rows summed on their experts' rank first: fewer bytes, one more
    rounding; forward calls only), include/moekit/ep.hpp. dispatch: "auto" | "direct" | "fanout" (how
    rows cross NVLink, docs/EP.md; "": $MOEKIT_EP_DISPATCH, else auto). Bad arguments raise ValueError."""
    if not isinstance(group, EpGroup):
        raise ValueError("moekit.torch.pack_ep: group must be a moekit.torch.EpGroup (moekit.torch.ep_group())")
    t = max_tokens_per_rank if max_tokens_per_rank is not None else spec.max_tokens
    options = dict(max_tokens_per_rank=int(t), payload=payload, combine=combine, expert_capacity=int(expert_capacity),
                   timeout_ms=float(timeout_ms), nvfp4_global_scale=float(nvfp4_global_scale),
                   mx_scale_rule=mx_scale_rule, kernel=kernel, dispatch=dispatch)
    ck = _as_tensors(checkpoint or {})
    names = list(ck.keys())
    with torch.cuda.device(group.device):
        h = _ffi.ep_layer_create(group._h, spec.to_dict(), options, names, [ck[n] for n in names])
    return EpLayer(group, spec, h, options)
