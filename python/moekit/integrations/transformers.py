"""Hugging Face transformers: moekit as an experts backend ("moekit") of transformers' experts
interface (transformers/integrations/moe.py, ExpertsInterface; transformers 5.x).

    import moekit.integrations.transformers as mkt        # registers "moekit"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="moekit")
    mkt.prepare(model, replace_weights=True)             # optional: pack every MoE layer now, free the originals
    # or, on a loaded model: model.set_experts_implementation("moekit")

Every experts module of the model then runs its experts and the weighted combine in one moekit call
(moekit::forward_topk on the top-k ids and weights the model's router computed). What runs where:
- Experts modules made by @use_experts_implementation with gated experts: GPT-OSS (swiglu_oai,
  interleaved gate/up, biases, transposed weights), Qwen3-MoE / Qwen2-MoE, DeepSeek-V3 and Mixtral
  (silu), and any other model whose experts use transformers' default gate with silu.
- Weights: bf16 modules are packed as moekit bf16, except weights that are exactly MXFP4 values
  (a GPT-OSS MXFP4 checkpoint, which transformers loads dequantized to bf16 without its Triton
  kernels): those are re-encoded as moekit MXFP4, losslessly (decoded back bit for bit at pack;
  bf16 otherwise; prepare(format="bf16") keeps bf16). FP8 checkpoints (FineGrainedFP8: DeepSeek-V3) run dequantized to bf16:
  transformers dequantizes them at load where it cannot run FP8 (no GPU, dequantize=True), and a
  module it kept in FP8 (FP8Experts) is dequantized here at pack the same way (e4m3 x scale in fp32,
  rounded once to bf16).
- Devices: the CPU backend on CPU tensors, the SM90 backends on an H100/H200 (the oracle picks;
  prepare(backend=...) forces one).
Packing happens once per module, on its first call (or in prepare()). With replace_weights=True the
module's own weight tensors are then emptied, so the model holds the packed copy only (the module
can then run through moekit only: switching implementation afterwards fails, and save_pretrained
would write empty weights). Calls allocate nothing for up to `graph_tokens` tokens: the top-k
staging and the output are the module's own buffers, the workspace is one buffer per device shared
by the moekit layers on it (they run one after another); the returned tensor is the module's output
buffer, valid until the module's next call (as a CUDA graph's outputs are). Larger calls get a fresh
output tensor, and calls above `max_tokens` tokens run in chunks of max_tokens. The calls go through
the torch op torch.ops.moekit.forward_topk (fake kernel registered), so torch.compile traces them
without a graph break and CUDA graphs (static-cache generate with compile, torch.cuda.graph) capture
them; pack before compiling (the first eager call, e.g. generate's prefill, or prepare()).
Unsupported configurations (other gates, non-bf16 hidden states, expert parallel shards, FP8 with
static activation scales, a device no backend serves, ...) run transformers' own "grouped_mm"
implementation instead, with the reason logged once per module class and reason.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from transformers.integrations import moe as _tf_moe

import moekit
import moekit.torch as mt

try:  # FineGrainedFP8 (FP8Experts modules) has its own interface
    from transformers.integrations import finegrained_fp8 as _tf_fp8
except ImportError:  # pragma: no cover - older transformers
    _tf_fp8 = None

logger = logging.getLogger("moekit")

NAME = "moekit"
DEFAULT_MAX_TOKENS = 2048  # tokens per moekit call; more are chunked
DEFAULT_GRAPH_TOKENS = 256  # calls up to this many tokens allocate nothing


@dataclasses.dataclass
class Options:
    """prepare()'s options, kept per module (modules packed lazily use the defaults)."""

    replace_weights: bool = False
    max_tokens: int = DEFAULT_MAX_TOKENS
    graph_tokens: int = DEFAULT_GRAPH_TOKENS
    backend: Optional[str] = None  # None: the oracle's choice for the device
    format: str = "auto"  # auto | bf16 (bf16: never re-encode MXFP4-exact weights as mxfp4)


class _Unsupported(Exception):
    pass


@dataclasses.dataclass
class _State:
    layer: Any = None  # moekit.torch.TorchLayer
    device: Any = None
    hidden: int = 0
    top_k: int = 0
    max_tokens: int = 0
    graph_tokens: int = 0
    ids: Any = None  # [max_tokens, k] int32
    weights: Any = None  # [max_tokens, k] float32
    out: Any = None  # [graph_tokens, H] bf16
    workspace: Any = None  # uint8, shared by the device's moekit layers
    format: str = ""
    source: str = ""  # where the weights came from (bf16 module, MXFP4 checkpoint, FP8 module)
    replaced: bool = False
    fallback: Optional[Callable] = None
    reason: str = ""


_WORKSPACES: Dict[str, torch.Tensor] = {}
_LOGGED = set()


def _log_once(cls: str, reason: str, instead: str) -> None:
    if (cls, reason) not in _LOGGED:
        _LOGGED.add((cls, reason))
        logger.warning("moekit: %s: %s; running transformers' %s instead", cls, reason, instead)


def _workspace(device: torch.device, nbytes: int) -> torch.Tensor:
    """The device's shared workspace, grown (a new buffer) when a layer needs more. Layers packed
    before keep the buffer they were given, so addresses captured in CUDA graphs stay valid."""
    key = str(device)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.numel() < nbytes:
        ws = torch.empty(max(nbytes, 256), dtype=torch.uint8, device=device)
        _WORKSPACES[key] = ws
    return ws


# ---- what a module computes ------------------------------------------------------------------

def _is_silu(act_fn: Any) -> bool:
    # transformers' ACT2FN["silu"] is its own SiLUActivation (nn.functional.silu), "swish" nn.SiLU
    return isinstance(act_fn, torch.nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


def _gate(module: torch.nn.Module) -> Dict[str, Any]:
    """moekit's activation (LayerSpec fields) for the module's gate, or _Unsupported."""
    cls = type(module)
    gate = getattr(cls, "_apply_gate", None)
    if _tf_fp8 is not None and isinstance(module, _tf_fp8.FP8Experts):  # FP8Experts._apply_gate
        if getattr(module, "swiglu_alpha", None) is not None:
            return dict(activation="swiglu_oai", swiglu_alpha=float(module.swiglu_alpha),
                        swiglu_limit=float(module.swiglu_limit), swiglu_beta=1.0)
        act_fn = getattr(module, "act_fn", None)
        if not _is_silu(act_fn):
            raise _Unsupported(f"activation {type(act_fn).__name__} (moekit: gated silu)")
        if getattr(module, "limit", None) is not None:
            return dict(activation="silu_clamped", swiglu_limit=float(module.limit))
        return dict(activation="silu")
    if gate is _tf_moe._default_apply_gate:
        act_fn = getattr(module, "act_fn", None)
        if not _is_silu(act_fn):
            raise _Unsupported(f"activation {type(act_fn).__name__} (moekit: gated silu)")
        return dict(activation="silu")
    if gate is not None and gate.__qualname__ == "GptOssExperts._apply_gate":
        # gate.clamp(max=limit); up.clamp(+-limit); gate * sigmoid(alpha * gate) * (up + 1)
        return dict(activation="swiglu_oai", swiglu_alpha=float(module.alpha), swiglu_limit=float(module.limit),
                    swiglu_beta=1.0)
    name = getattr(gate, "__qualname__", None)
    raise _Unsupported(f"gate {name} is not one moekit computes" if name else "no gate (_apply_gate)")


def _mxfp4_encode(w: torch.Tensor, interleave: bool = False) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """[E, N, K] bf16 -> (blocks [E, N, K/32, 16] u8, scales [E, N, K/32] u8) when every 32-block
    along K is exactly E2M1 codes times a power of two (what transformers' MXFP4 dequantization
    produces), else None (found at the first expert for ordinary bf16 weights). Checked by decoding
    the result back to the same bf16 bits; scales by the OCP rule (floor(log2 amax) - 2).
    interleave: rows [first half; second half] are encoded as alternating rows (moekit's MXFP4
    gate/up order), one expert at a time."""
    E, N, K = w.shape
    if K % 32 or E == 0:
        return None
    dev = w.device
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32, device=dev)
    code_of_2x = torch.full((13,), 0, dtype=torch.uint8, device=dev)  # 2|v| -> E2M1 code
    code_of_2x[torch.tensor([0, 1, 2, 3, 4, 6, 8, 12], device=dev)] = torch.arange(8, dtype=torch.uint8, device=dev)
    valid_2x = torch.zeros(13, dtype=torch.bool, device=dev)
    valid_2x[torch.tensor([0, 1, 2, 3, 4, 6, 8, 12], device=dev)] = True
    blocks = scales = None
    for e in range(E):  # one expert at a time: temporaries of one expert only
        we = torch.stack([w[e, :N // 2], w[e, N // 2:]], 1).reshape(N, K) if interleave else w[e]
        x = we.float().reshape(N, K // 32, 32)
        amax = x.abs().amax(-1)
        _, ex = torch.frexp(amax)  # amax = m * 2^ex, m in [0.5, 1): floor(log2 amax) = ex - 1
        exp = torch.where(amax > 0, ex - 3, torch.full_like(ex, -127)).clamp(-127, 127)
        q = x / torch.exp2(exp.float()).unsqueeze(-1)
        twice = q.abs() * 2
        idx = twice.round().clamp(max=12).long()
        if not bool(((twice == idx) & valid_2x[idx]).all()):
            return None
        code = code_of_2x[idx] | (torch.signbit(q).to(torch.uint8) << 3)
        back = lut[(code & 7).long()] * torch.where(code >= 8, -1.0, 1.0) * torch.exp2(exp.float()).unsqueeze(-1)
        if not torch.equal(back.to(torch.bfloat16).view(torch.int16), we.reshape(N, K // 32, 32).view(torch.int16)):
            return None
        if blocks is None:
            blocks = torch.empty(E, N, K // 32, 16, dtype=torch.uint8, device=dev)
            scales = torch.empty(E, N, K // 32, dtype=torch.uint8, device=dev)
        blocks[e] = code[..., 0::2] | (code[..., 1::2] << 4)
        scales[e] = (exp + 127).to(torch.uint8)
    return blocks, scales


def _fp8_dequant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """FineGrainedFP8 [E, N, K] e4m3 with scale_inv [E, sN, sK] (blocks, or one per tensor) ->
    bf16: e4m3 x scale in fp32, rounded once (transformers' Fp8Dequantize)."""
    E, N, K = w.shape
    out = torch.empty(E, N, K, dtype=torch.bfloat16, device=w.device)
    sf = s.float().reshape(E, s.shape[-2] if s.dim() >= 2 else 1, s.shape[-1] if s.dim() >= 1 else 1)
    bn, bk = -(-N // sf.shape[1]), -(-K // sf.shape[2])
    for e in range(E):
        full = sf[e].repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
        out[e] = (w[e].float() * full).to(torch.bfloat16)
    return out


def _describe(module: torch.nn.Module, k: int, opts: Options) -> Tuple[moekit.LayerSpec, Dict[str, Any], str, List[str]]:
    """(spec, checkpoint tensors, where they came from, the module's weight attribute names)."""
    if getattr(module, "has_gate", True) is False:
        raise _Unsupported("experts without a gate (moekit: gated experts)")
    act = _gate(module)
    E = int(module.num_experts)
    fp8 = _tf_fp8 is not None and isinstance(module, _tf_fp8.FP8Experts)
    w13, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or w13.dim() != 3 or w2.dim() != 3:
        raise _Unsupported("no [E, ., .] gate_up_proj / down_proj weights")
    names = ["gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"]
    if fp8:
        if getattr(module, "activation_scheme", "dynamic") != "dynamic":
            raise _Unsupported("FP8 with static activation scales (moekit keeps bf16 activations)")
        if w13.dtype != torch.float8_e4m3fn:
            raise _Unsupported(f"FP8Experts weights of dtype {w13.dtype} (moekit: e4m3 with fp32 scales)")
        w13 = _fp8_dequant(w13, module.gate_up_proj_scale_inv)
        w2 = _fp8_dequant(w2, module.down_proj_scale_inv)
        names += ["gate_up_proj_scale_inv", "down_proj_scale_inv"]
        source = "FP8 module, dequantized to bf16"
    else:
        if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
            raise _Unsupported(f"{w13.dtype} weights (moekit: bf16; load with dtype=torch.bfloat16)")
        source = "bf16 module"
    transposed = bool(getattr(module, "is_transposed", False))
    if transposed:  # [E, H, 2I] and [E, I, H] (GPT-OSS)
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    H, I2 = int(w13.shape[2]), int(w13.shape[1])
    I = I2 // 2
    if w13.shape[0] != E or w2.shape[0] != E or I2 != 2 * I or tuple(w2.shape[1:]) != (H, I):
        raise _Unsupported(f"weights {tuple(w13.shape)} / {tuple(w2.shape)} are not whole [E, 2I, H] / [E, H, I] "
                           f"experts (tensor or expert parallel shards)")
    interleaved = not bool(getattr(module, "is_concatenated", True))
    b13 = getattr(module, "gate_up_proj_bias", None) if getattr(module, "has_bias", False) else None
    b2 = getattr(module, "down_proj_bias", None) if getattr(module, "has_bias", False) else None
    spec = moekit.LayerSpec(num_experts=E, top_k=k, hidden=H, intermediate=I, biases=b13 is not None or b2 is not None,
                            max_tokens=opts.max_tokens, **act)
    ck: Dict[str, Any] = {}
    enc = None
    if opts.format == "auto" and not fp8:  # a dequantized MXFP4 checkpoint: exact MXFP4 values
        enc13 = _mxfp4_encode(w13, interleave=not interleaved)
        enc2 = _mxfp4_encode(w2) if enc13 is not None else None
        enc = (enc13, enc2) if enc2 is not None else None
    if enc is not None:  # moekit's MXFP4 layout (GPT-OSS's): gate, up interleaved rows
        spec = dataclasses.replace(spec, format="mxfp4")
        ck.update(gate_up_proj_blocks=enc[0][0], gate_up_proj_scales=enc[0][1], down_proj_blocks=enc[1][0],
                  down_proj_scales=enc[1][1])
        if b13 is not None:
            ck["gate_up_proj_bias"] = (b13 if interleaved else torch.stack([b13[:, :I], b13[:, I:]], 2).reshape(E, -1)).detach()
        if b2 is not None:
            ck["down_proj_bias"] = b2.detach()
        return spec, ck, "MXFP4 values, re-encoded exactly", names
    if interleaved:  # moekit bf16: gate rows, then up rows
        w13 = torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1)
        if b13 is not None:
            b13 = torch.cat([b13[:, 0::2], b13[:, 1::2]], dim=1)
    ck.update(w13_weight=w13.detach(), w2_weight=w2.detach())
    if b13 is not None:
        ck["w13_bias"] = b13.detach()
    if b2 is not None:
        ck["w2_bias"] = b2.detach()
    return spec, ck, source, names


def _top_k(module: torch.nn.Module, top_k_index: Optional[torch.Tensor]) -> int:
    if top_k_index is not None:
        return int(top_k_index.shape[-1])
    k = getattr(getattr(module, "config", None), "num_experts_per_tok", None)
    if k is None:
        raise _Unsupported("top_k unknown before the first call (no config.num_experts_per_tok)")
    return int(k)


def _fallback_fn(module: torch.nn.Module) -> Callable:
    fp8 = _tf_fp8 is not None and isinstance(module, _tf_fp8.FP8Experts)
    interface = _tf_fp8.ALL_FP8_EXPERTS_FUNCTIONS if fp8 else _tf_moe.ALL_EXPERTS_FUNCTIONS
    fn = interface.get("grouped_mm")
    if fn is None:  # the module's own eager forward (the function @use_experts_implementation wrapped)
        fn = type(module).forward.__wrapped__
    return fn


def _setup(module: torch.nn.Module, device: torch.device, hidden_dtype: Optional[torch.dtype],
           top_k_index: Optional[torch.Tensor], opts: Options) -> _State:
    cls = type(module).__name__
    try:
        if hidden_dtype is not None and hidden_dtype != torch.bfloat16:
            raise _Unsupported(f"{hidden_dtype} hidden states (moekit: bf16)")
        if device.type not in ("cpu", "cuda"):
            raise _Unsupported(f"device {device}")
        spec, ck, source, names = _describe(module, _top_k(module, top_k_index), opts)
        try:
            layer = mt.pack(spec, ck, device, opts.backend)
        except ValueError as e:  # no backend for this spec on this device, bad shapes, ...
            raise _Unsupported(str(e).splitlines()[0]) from None
    except _Unsupported as e:
        _log_once(cls, str(e), "grouped_mm")
        return _State(fallback=_fallback_fn(module), reason=str(e))
    del ck
    st = _State(layer=layer, device=device, hidden=spec.hidden, top_k=spec.top_k, max_tokens=spec.max_tokens,
                graph_tokens=min(opts.graph_tokens, spec.max_tokens), format=spec.format, source=source)
    st.ids = torch.empty(spec.max_tokens, spec.top_k, dtype=torch.int32, device=device)
    st.weights = torch.empty(spec.max_tokens, spec.top_k, dtype=torch.float32, device=device)
    st.out = torch.empty(st.graph_tokens, spec.hidden, dtype=torch.bfloat16, device=device)
    st.workspace = _workspace(device, layer.workspace_bytes(spec.max_tokens, spec.top_k))
    if device.type == "cuda":  # fixed addresses, mutated in place: CUDA graphs keep them (as StaticCache does)
        for t in (st.ids, st.weights, st.out, st.workspace):
            torch._dynamo.mark_static_address(t)
    if opts.replace_weights:
        for name in names:
            p = getattr(module, name, None)
            if isinstance(p, torch.Tensor):
                setattr(module, name, torch.nn.Parameter(p.new_empty(0), requires_grad=False))
        st.replaced = True
    return st


def _device_of(module: torch.nn.Module) -> torch.device:
    p = getattr(module, "gate_up_proj", None)
    if not isinstance(p, torch.Tensor):
        p = next(module.parameters())
    return p.device


# ---- the registered functions -----------------------------------------------------------------

def _run(st: _State, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    T = x.shape[0]
    key = st.layer.key
    if T <= st.graph_tokens:
        out = st.out[:T]
    else:
        out = torch.empty(T, st.hidden, dtype=torch.bfloat16, device=x.device)
    for a in range(0, T, st.max_tokens):
        b = min(a + st.max_tokens, T)
        ids, w = st.ids[:b - a], st.weights[:b - a]
        ids.copy_(top_k_index[a:b])
        w.copy_(top_k_weights[a:b])
        torch.ops.moekit.forward_topk.default(key, x[a:b], ids, w, out[a:b], st.workspace, None)
    return out


def moekit_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """The "moekit" entry of transformers' ExpertsInterface: hidden_states [T, H] bf16, top_k_index
    [T, k] (any int dtype), top_k_weights [T, k] (any float dtype) -> [T, H] bf16."""
    st = self.__dict__.get("_moekit")
    if st is None:
        if torch.compiler.is_compiling():
            raise RuntimeError("moekit: an experts module met for the first time inside torch.compile; pack it "
                               "first: moekit.integrations.transformers.prepare(model), or one eager forward")
        st = _setup(self, hidden_states.device, hidden_states.dtype, top_k_index,
                    self.__dict__.get("_moekit_options") or Options())
        self.__dict__["_moekit"] = st
    if st.fallback is not None:
        return st.fallback(self, hidden_states, top_k_index, top_k_weights)
    if hidden_states.dtype != torch.bfloat16 and not st.replaced:
        _log_once(type(self).__name__, f"{hidden_states.dtype} hidden states (moekit: bf16)", "grouped_mm")
        return _fallback_fn(self)(self, hidden_states, top_k_index, top_k_weights)
    if hidden_states.device != st.device or hidden_states.dtype != torch.bfloat16:
        raise ValueError(f"moekit: {type(self).__name__} was packed for bf16 on {st.device}, called with "
                         f"{hidden_states.dtype} on {hidden_states.device} (prepare(model) again after moving it)")
    return _run(st, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Registers "moekit" in transformers' experts interfaces (done on import)."""
    _tf_moe.ExpertsInterface.register(NAME, moekit_experts_forward)
    if _tf_fp8 is not None:
        _tf_fp8.FP8ExpertsInterface.register(NAME, moekit_experts_forward)


register()


# ---- model-level helpers ----------------------------------------------------------------------

def experts_modules(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """The model's experts modules that dispatch through transformers' experts interface."""
    return [(n, m) for n, m in model.named_modules()
            if getattr(type(m).forward, "__wrapped__", None) is not None and hasattr(m, "has_gate")]


def prepare(model: torch.nn.Module, replace_weights: bool = False, max_tokens: int = DEFAULT_MAX_TOKENS,
            graph_tokens: int = DEFAULT_GRAPH_TOKENS, backend: Optional[str] = None, format: str = "auto",
            set_implementation: bool = True) -> List[Tuple[str, str]]:
    """Packs every experts module of `model` now (instead of on its first call) with these options
    and, unless set_implementation=False, switches the model to "moekit". Returns status(model).
    Modules packed before are packed again (after a move to another device, say) unless their
    weights were replaced."""
    if format not in ("auto", "bf16"):
        raise ValueError(f"format {format!r}: expected 'auto' or 'bf16'")
    if max_tokens < 1 or graph_tokens < 0:
        raise ValueError("max_tokens must be >= 1 and graph_tokens >= 0")
    if set_implementation and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(NAME)
    opts = Options(replace_weights=replace_weights, max_tokens=max_tokens, graph_tokens=graph_tokens,
                   backend=backend, format=format)
    for n, m in model.named_modules():
        if type(m).__name__ == "Mxfp4GptOssExperts":
            logger.warning("moekit: %s runs transformers' MXFP4 Triton kernels, outside the experts interface; load "
                           "with quantization_config=Mxfp4Config(dequantize=True) to run it through moekit", n)
    for _, m in experts_modules(model):
        old = m.__dict__.get("_moekit")
        if old is not None and old.replaced:
            if old.device != _device_of(m):
                raise ValueError("moekit: the weights were replaced by the packed copy; it cannot be packed again")
            continue
        m.__dict__["_moekit_options"] = opts
        dtype = getattr(getattr(m, "config", None), "dtype", None)
        m.__dict__["_moekit"] = _setup(m, _device_of(m), dtype if isinstance(dtype, torch.dtype) else None, None, opts)
    return status(model)


def status(model: torch.nn.Module) -> List[Tuple[str, str]]:
    """(module name, what runs it) for every experts module: "moekit <backend> <format> (<source>)",
    "fallback: <reason>", or "not packed yet"."""
    rows = []
    for n, m in experts_modules(model):
        st = m.__dict__.get("_moekit")
        if st is None:
            rows.append((n, "not packed yet"))
        elif st.fallback is not None:
            rows.append((n, f"fallback: {st.reason}"))
        else:
            rows.append((n, f"moekit {st.layer.backend} {st.format} ({st.source})"))
    return rows
