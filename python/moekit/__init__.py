"""moekit: the expert part of Mixture-of-Experts layers (routing, grouped-GEMM experts with
MXFP4 / NVFP4 / MXFP8 / BF16 weights, weighted combine) on Hopper GPUs and on the CPU.

    spec = moekit.LayerSpec(num_experts=32, top_k=4, hidden=2880, intermediate=2880,
                            format="mxfp4", activation="swiglu_oai", norm_topk_prob=True,
                            biases=True, max_tokens=64)
    layer = moekit.pack(spec, checkpoint)          # {name: array} in the checkpoint layout
    ws = np.empty(layer.workspace_bytes(T), np.uint8)
    layer.forward_logits(x, router_logits, out, ws)  # writes out in place

Tensors are taken without copies from numpy, torch or any DLPack producer: bf16 hidden states
and outputs (numpy: uint16 arrays of bf16 bits; rows may be strided), fp32 router logits, int32
top-k ids, fp32 top-k weights. On CUDA tensors the kernels run on the producer's current stream
(torch's current stream), asynchronously, and can be captured in CUDA graphs; outside a
capture a call replays a CUDA graph the layer keeps (one graph launch instead of one launch per
kernel; MOEKIT_LAUNCH_GRAPHS=0 when the layer is made turns that off), so call a layer from one
thread at a time. `moekit.torch` registers the same calls as torch custom ops. Bad arguments
raise ValueError with the reason, before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _ffi

__version__ = _ffi.version()

__all__ = [
    "LayerSpec", "Plan", "Layer", "plan", "pack", "synthetic", "checkpoint_tensors", "backends", "explain",
    "cuda_available", "quantize_activations_fp8", "load_layer_dir", "random_checkpoint", "bf16_to_float", "float_to_bf16", "parse_device",
]


@dataclasses.dataclass
class LayerSpec:
    """One MoE layer's expert part (include/moekit/spec.hpp): sizes, weight format, activation,
    routing, biases, and the most tokens one forward call takes."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    format: str = "bf16"  # mxfp4 | nvfp4 | mxfp8 | bf16
    scale_rule: str = "floor"  # floor | rceil (how MX scales were chosen; informative)
    activation: str = "silu"  # silu | swiglu_oai | silu_clamped
    swiglu_alpha: float = 1.702
    swiglu_beta: float = 1.0
    swiglu_limit: float = 7.0
    scoring: str = "softmax"  # softmax | sigmoid | sqrtsoftplus (DeepSeek-V4)
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    score_bias: bool = False  # an e_score_correction_bias [E] comes with the weights
    hash_vocab: int = 0  # > 0: hash routing (DeepSeek-V4): a tid2eid [hash_vocab, top_k] table comes with the
    #                     weights, and forward_logits takes the rows' token_ids
    biases: bool = False  # GEMM biases (GPT-OSS) come with the weights
    activation_format: str = "standard"  # standard | batched: the backend family
    max_tokens: int = 0  # tokens per forward call at most
    # The experts' input precision (not the activation function above): bf16 | fp8. fp8 quantizes
    # both GEMMs' inputs to E4M3 per token row per 128 along K (docs/FORMATS.md, "FP8 activations"),
    # with activation_scale fp32 (amax / 448) or ue8m0 (its power of two up, DeepSeek-V4's rule).
    # (CLI: --activations, --activation-scale; config.json: activation_dtype, activation_scale.)
    activation_dtype: str = "bf16"
    activation_scale: str = "fp32"  # fp32 | ue8m0; fp32 unless activation_dtype is fp8

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: Dict[str, Any], **overrides: Any) -> "LayerSpec":
        """From a model directory's config.json (SPEC section 7 field names)."""
        q = config.get("quantization", {})
        spec = cls(
            num_experts=int(config["num_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]),
            format=q.get("format", "bf16"),
            scale_rule=q.get("scale_rule", "floor"),
            activation=config.get("hidden_act", "silu"),
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            swiglu_beta=float(config.get("swiglu_beta", 1.0)),
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
            scoring=config.get("scoring_func", "softmax"),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            n_group=int(config.get("n_group", 1)),
            topk_group=int(config.get("topk_group", 1)),
            hash_vocab=int(config.get("hash_vocab", 0)),
            activation_dtype=config.get("activation_dtype", "bf16"),
            activation_scale=config.get("activation_scale", "fp32"),
        )
        return dataclasses.replace(spec, **overrides)


def parse_device(device: Any) -> Tuple[int, int]:
    """'cpu', 'cuda', 'cuda:N' (or a torch.device) -> (DLPack device type, index)."""
    s = str(device)
    if s == "cpu":
        return 1, 0
    if s == "cuda":
        return 2, 0
    if s.startswith("cuda:") and s[5:].isdigit():
        return 2, int(s[5:])
    raise ValueError(f"device {s!r}: expected 'cpu', 'cuda' or 'cuda:N'")


def _device_str(device_type: int, device_id: int) -> str:
    return "cpu" if device_type == 1 else f"cuda:{device_id}"


@dataclasses.dataclass
class Plan:
    """The backend the oracle chose for a layer on a device, and its packed buffers."""

    spec: LayerSpec
    backend: str
    device: str
    buffers: List[Tuple[str, int, int]]  # (name, bytes, alignment)
    explain: str


def plan(spec: LayerSpec, device: Any = "cpu", backend: Optional[str] = None) -> Plan:
    dt, di = parse_device(device)
    chosen, text, buffers = _ffi.plan(spec.to_dict(), dt, di, backend or "")
    return Plan(spec, str(chosen), _device_str(dt, di), [(str(n), int(b), int(a)) for n, b, a in buffers], str(text))


def checkpoint_tensors(spec: LayerSpec) -> List[Tuple[str, str, Tuple[int, ...], bool]]:
    """The checkpoint tensors spec.format takes: (name, dtype, shape, optional). dtype is a
    safetensors name; F8_E4M3 may be given as uint8 bits and BF16 as uint16 bits."""
    return [(str(n), str(d), tuple(int(x) for x in s), bool(o)) for n, d, s, o in _ffi.checkpoint_tensors(spec.to_dict())]


def _numpy_alloc(nbytes: int, device: str) -> Any:
    if device != "cpu":
        raise ValueError(f"no allocator for {device}: pass allocate=, or use moekit.torch.pack")
    # 256-byte aligned bytes
    raw = np.empty(nbytes + 256, np.uint8)
    off = (-raw.ctypes.data) % 256
    return raw[off:off + nbytes]


class Layer:
    """One MoE layer over packed weights (created by pack() or synthetic()). Forward calls write
    `out` in place and return nothing; they allocate nothing and never synchronize."""

    def __init__(self, plan: Plan, packed: Sequence[Any], handle: Any) -> None:
        self.plan = plan
        self.spec = plan.spec
        self.backend = plan.backend
        self.device = plan.device
        self.packed = list(packed)
        self._h = handle

    def workspace_bytes(self, tokens: int, k: Optional[int] = None) -> int:
        """Workspace bytes of forward_logits / forward_topk with `tokens` tokens (k slots)."""
        return int(_ffi.workspace_bytes(self._h, tokens, k or 0))

    def batched_workspace_bytes(self, rows_per_expert: int) -> int:
        return int(_ffi.batched_workspace_bytes(self._h, rows_per_expert))

    def forward_logits(self, x, logits, out, workspace, shared=None, topk_ids=None, topk_weights=None,
                       token_ids=None) -> None:
        """Routing + experts + combine: x [T, H] bf16, logits [T, E] f32 -> out [T, H] bf16.
        shared [T, H] bf16 is added before the one rounding; topk_ids/topk_weights [T, k]
        receive the routing when given. token_ids [T] int32/int64: the rows' token ids, which a
        hash-routed layer (spec.hash_vocab > 0) takes its experts by (tid2eid[token_id]); on a
        GPU an id outside the table gives its row no expert and makes check() raise."""
        if token_ids is None:
            _ffi.forward_logits(self._h, x, logits, out, workspace, shared, topk_ids, topk_weights)
        else:
            _ffi.forward_logits_tokens(self._h, x, logits, out, workspace, shared, topk_ids, topk_weights, token_ids)

    def forward_topk(self, x, topk_ids, topk_weights, out, workspace, shared=None) -> None:
        """Experts + combine from top-k ids [T, k] int32 (-1: none) and weights [T, k] f32."""
        _ffi.forward_topk(self._h, x, topk_ids, topk_weights, out, workspace, shared)

    def forward_batched(self, x, expert_num_tokens, out, workspace) -> None:
        """Experts alone: x [E, M, H] bf16 with expert_num_tokens [E] int32 -> out [E, M, H],
        rows [0, count) of each expert only."""
        _ffi.forward_batched(self._h, x, expert_num_tokens, out, workspace)

    def check(self, stream: Optional[int] = None) -> None:
        """Waits for `stream` (a CUDA stream handle; default: torch's current stream when torch
        is loaded, else the default stream) and raises when the last call met bad device data (an
        id out of range, a batched count past its capacity). Not inside CUDA-graph capture."""
        if stream is None:
            stream = 0
            torch = sys.modules.get("torch")
            if torch is not None and self.device != "cpu":
                stream = torch.cuda.current_stream(torch.device(self.device)).cuda_stream
        _ffi.check(self._h, int(stream))

    def __repr__(self) -> str:
        s = self.spec
        return (f"moekit.Layer({self.backend} on {self.device}, E={s.num_experts} k={s.top_k} H={s.hidden} "
                f"I={s.intermediate} {s.format} {s.activation}, max_tokens={s.max_tokens})")


def _allocate_packed(p: Plan, allocate: Optional[Callable[[int, str], Any]]) -> List[Any]:
    alloc = allocate or _numpy_alloc
    return [alloc(nbytes, p.device) for _, nbytes, _ in p.buffers]


def pack(spec: LayerSpec, checkpoint: Dict[str, Any], device: Any = "cpu", backend: Optional[str] = None,
         allocate: Optional[Callable[[int, str], Any]] = None) -> Layer:
    """Converts checkpoint tensors ({name: array}, names and layouts of checkpoint_tensors(spec))
    into the chosen backend's packed weights, in buffers from allocate(nbytes, device) (numpy on
    the CPU by default), and returns the layer over them. Load time: synchronizes."""
    p = plan(spec, device, backend)
    packed = _allocate_packed(p, allocate)
    dt, di = parse_device(p.device)
    names = list(checkpoint.keys())
    _ffi.pack(spec.to_dict(), p.backend, dt, di, names, [checkpoint[n] for n in names], packed)
    return Layer(p, packed, _ffi.layer_create(spec.to_dict(), p.backend, dt, di, packed))


def synthetic(spec: LayerSpec, device: Any = "cpu", backend: Optional[str] = None, seed: int = 1,
              allocate: Optional[Callable[[int, str], Any]] = None) -> Layer:
    """A layer with random but valid packed weights (benchmarks, tests)."""
    p = plan(spec, device, backend)
    packed = _allocate_packed(p, allocate)
    dt, di = parse_device(p.device)
    _ffi.synthesize(spec.to_dict(), p.backend, dt, di, packed, seed)
    return Layer(p, packed, _ffi.layer_create(spec.to_dict(), p.backend, dt, di, packed))


def backends() -> List[Dict[str, Any]]:
    """Every backend built in: name, summary, activation format, whether it needs an SM90 GPU,
    whether it can run here, and the activation dtypes (LayerSpec.activation_dtype) it runs."""
    return [dict(name=str(n), summary=str(s), activation_format=str(f), gpu=bool(g), available=bool(a),
                 activation_dtypes=[str(x) for x in d])
            for n, s, f, g, a, d in _ffi.backends()]


def quantize_activations_fp8(x: Any, activation_scale: str = "fp32") -> Tuple[np.ndarray, np.ndarray]:
    """The quantization a layer with activation_dtype "fp8" applies to both GEMMs' inputs
    (docs/FORMATS.md, "FP8 activations"): x [rows, K] float32 -> (codes [rows, K] uint8, E4M3
    bits; scales [rows, ceil(K / 128)] float32), one scale per row per 128 along K, fp32
    (amax / 448) or ue8m0 (the power of two at or above it). For checking an engine's quantizer."""
    a = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if a.ndim != 2:
        raise ValueError(f"x: {a.ndim} dimensions, expected [rows, K]")
    codes = np.empty(a.shape, np.uint8)
    scales = np.empty((a.shape[0], (a.shape[1] + 127) // 128), np.float32)
    _ffi.quantize_activations_fp8(a, activation_scale, codes, scales)
    return codes, scales


def explain(spec: LayerSpec, device: Any = "cpu", backend: Optional[str] = None, tokens: int = 1) -> str:
    """The oracle's decision for spec on device at `tokens` tokens, with every rejection."""
    dt, di = parse_device(device)
    return str(_ffi.explain(spec.to_dict(), dt, di, backend or "", tokens))


def cuda_available() -> bool:
    """True when the SM90 kernels are built in and an SM90 GPU is present."""
    return any(b["gpu"] and b["available"] for b in backends())


# ---- numpy helpers ------------------------------------------------------------------------------

def float_to_bf16(a: Any) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays NaN."""
    f = np.ascontiguousarray(a, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), r)


def bf16_to_float(a: Any) -> np.ndarray:
    """bf16 bits (uint16) -> float32."""
    return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


_ST_DTYPES = {"U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16, "I32": np.int32, "I64": np.int64,
              "F16": np.float16, "F32": np.float32, "F64": np.float64, "BF16": np.uint16, "F8_E4M3": np.uint8,
              "F8_E5M2": np.uint8, "F8_E8M0": np.uint8, "BOOL": np.bool_}


def read_safetensors(path: str) -> Dict[str, Tuple[str, np.ndarray]]:
    """{name: (safetensors dtype, array)}; BF16 as uint16 bits, F8 as uint8 bits (a copy in memory)."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    body = memoryview(data)[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        arr = np.frombuffer(body[a:b], dtype=_ST_DTYPES[t["dtype"]]).reshape(t["shape"]).copy()
        out[name] = (t["dtype"], arr)
    return out


def load_layer_dir(path: str, **overrides: Any) -> Tuple[LayerSpec, Dict[str, np.ndarray]]:
    """A model directory (config.json + experts.safetensors, SPEC section 7) as a LayerSpec and
    its checkpoint tensors; overrides set LayerSpec fields (max_tokens, ...)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    tensors = {k: v for k, (_, v) in read_safetensors(os.path.join(path, "experts.safetensors")).items()}
    biases = any(n in tensors for n in ("gate_up_proj_bias", "down_proj_bias", "w13_bias", "w2_bias"))
    spec = LayerSpec.from_config(config, biases=biases, score_bias="e_score_correction_bias" in tensors)
    return dataclasses.replace(spec, **overrides), tensors


def random_checkpoint(spec: LayerSpec, seed: int = 0) -> Dict[str, np.ndarray]:
    """Random but valid checkpoint tensors for spec (codes anywhere legal, scales that keep the
    layer's outputs finite, small biases): a stand-in for a real checkpoint's tensors."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, dtype, shape, optional in checkpoint_tensors(spec):
        if name == "e_score_correction_bias":
            if spec.score_bias:
                out[name] = rng.normal(0, 0.1, shape).astype(np.float32)
            continue
        if name == "tid2eid":  # hash routing: k distinct experts per token id
            out[name] = np.stack([rng.permutation(spec.num_experts)[:spec.top_k] for _ in range(shape[0])]).astype(np.int32)
            continue
        if optional:  # GEMM biases
            if spec.biases:
                out[name] = float_to_bf16(rng.normal(0, 0.1, shape))
            continue
        if name.endswith("scale_2"):
            out[name] = rng.uniform(0.005, 0.02, shape).astype(np.float32)
        elif dtype == "BF16":
            out[name] = float_to_bf16(rng.normal(0, 0.02, shape))
        elif "scale" in name and dtype == "U8":  # E8M0 exponents around 2^-6
            out[name] = rng.integers(117, 122, shape, dtype=np.uint8)
        elif "scale" in name:  # E4M3 block scales 0.5 .. 6
            out[name] = rng.integers(0x30, 0x48, shape, dtype=np.uint8)
        elif dtype == "F8_E4M3":  # codes of magnitude <= 2^3, no NaN
            c = rng.integers(0, 256, shape, dtype=np.uint8)
            out[name] = np.where((c & 0x78) > 0x50, c & 0x87, c).astype(np.uint8)
        else:  # fp4 codes: any byte
            out[name] = rng.integers(0, 256, shape, dtype=np.uint8)
    return out
