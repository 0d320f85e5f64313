#!/usr/bin/env python3
"""A small DeepSeek-V4 checkpoint in the published layout, and its layers' expected outputs, in
float64 NumPy; it never imports moekit.

The checkpoint (dsv4_checkpoint/ckpt/) follows DeepSeek's own names and dtypes
(../shared/notes/deepseek_v4.md), shapes scaled down: 2 layers (layer 0 hash-routed,
num_hash_layers = 1), E = 8 experts, top-3, H = 64, I = 64, vocabulary 48, two shards and an index:
  layers.L.ffn.experts.j.{w1,w3,w2}.weight  I8 [N, K/2]: two E2M1 codes per byte, element 2i in
                                            the low nibble (what float4_e2m1fn_x2 stores)
  layers.L.ffn.experts.j.{w1,w3,w2}.scale   F8_E8M0 [N, K/32]: 2^(b - 127) per 32 along K
  layers.L.ffn.gate.weight                  BF16 [E, H]
  layers.0.ffn.gate.tid2eid                 I64 [48, 3]     (hash layer: no bias)
  layers.1.ffn.gate.bias                    F32 [E]         (learned layer: no table)
  layers.L.ffn.shared_experts.{w1,w3,w2}.weight  F8_E4M3 [N, K], .scale F8_E8M0 [ceil(N/128), ceil(K/128)]
  embed.weight, layers.L.attn_norm.weight   stand-ins for the rest of the model
config.json as DeepSeek publishes it: expert_dtype fp4, quantization_config fp8 (ue8m0, 128x128).

input.safetensors: hidden_states BF16 [9, 64], input_ids I64 [9]. expected_layer{L}.safetensors:
y_ref F32 [9, 64] (float64, before the final bf16 rounding), topk_ids I32 [9, 3], topk_weights F32.

The math: routing as DeepSeek's Gate (logits = x W^T from the bf16 values; s = sqrt(softplus);
learned: the top-3 of s + bias, hash: tid2eid[input_id]; weights s / sum(s) * 1.5), the experts
as ../shared/SPEC.md section 7 states the layer's numerics: dequantized weights exact, bf16 x,
h = x W13^T, a = silu(min(gate, 10)) * clamp(up, +-10) rounded to bf16, a W2^T; y = sum_k w_k y_k
plus the shared expert's output (the same expert math, weight 1) rounded to bf16, the tensor the
layer adds. Inputs are drawn so that the 3rd and 4th choices differ by more than 1e-4 relative.

Usage: tests/golden/dsv4_checkpoint.py [OUT_DIR]   (default: dsv4_checkpoint/ beside this script)
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_np as st  # noqa: E402
from dsv4_router import sqrt_softplus  # noqa: E402

E, K_TOP, H, I, V, T, LAYERS, LIMIT, RSF = 8, 3, 64, 64, 48, 9, 2, 10.0, 1.5
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def e4m3(b):
    b = np.asarray(b, np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 7
    return sign * np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))


def bf16_bits(x):
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_value(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def round_bf16(x):
    return bf16_value(bf16_bits(x))


def fp4_weight(rng, n, k):
    """Packed codes I8 [n, k/2], E8M0 scales [n, k/32], and the exact values [n, k]."""
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scales = rng.integers(120, 124, (n, k // 32), dtype=np.uint8)  # 2^-7 .. 2^-4
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(n, k)  # element 2i: low nibble
    w = E2M1[codes] * np.repeat(2.0 ** (scales.astype(np.int64) - 127), 32, axis=1)
    return packed.view(np.int8), scales, w


def fp8_weight(rng, n, k):
    """E4M3 codes [n, k] (|v| <= 15, no NaN), E8M0 scales of 128x128 blocks, the exact values."""
    c = rng.integers(0, 256, (n, k), dtype=np.uint8)
    c = np.where((c & 0x78) > 0x50, c & 0x87, c).astype(np.uint8)
    rb, cb = (n + 127) // 128, (k + 127) // 128
    scales = rng.integers(116, 119, (rb, cb), dtype=np.uint8)  # 2^-11 .. 2^-9
    s = np.repeat(np.repeat(2.0 ** (scales.astype(np.int64) - 127), 128, 0), 128, 1)[:n, :k]
    return c, scales, e4m3(c) * s


def expert_out(x, w1, w3, w2):
    g, u = x @ w1.T, x @ w3.T
    a = np.minimum(g, LIMIT)
    a = round_bf16(a / (1.0 + np.exp(-a)) * np.clip(u, -LIMIT, LIMIT))
    return a @ w2.T


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                             "dsv4_checkpoint")
    ck = os.path.join(out, "ckpt")
    os.makedirs(ck, exist_ok=True)
    rng = np.random.default_rng(4747)
    tensors = {"embed.weight": ("BF16", bf16_bits(rng.normal(0, 0.02, (V, H))))}
    layers = []
    for L in range(LAYERS):
        P = f"layers.{L}.ffn."
        lay = {"experts": []}
        for j in range(E):
            ws = []
            for name, n, k in (("w1", I, H), ("w3", I, H), ("w2", H, I)):
                packed, scales, w = fp4_weight(rng, n, k)
                tensors[f"{P}experts.{j}.{name}.weight"] = ("I8", packed)
                tensors[f"{P}experts.{j}.{name}.scale"] = ("F8_E8M0", scales)
                ws.append(w)
            lay["experts"].append(ws)
        gate_bits = bf16_bits(rng.normal(0, 0.15, (E, H)))
        tensors[P + "gate.weight"] = ("BF16", gate_bits)
        lay["gate"] = bf16_value(gate_bits)
        if L == 0:  # the hash layer
            table = np.stack([rng.permutation(E)[:K_TOP] for _ in range(V)]).astype(np.int64)
            tensors[P + "gate.tid2eid"] = ("I64", table)
            lay["table"] = table
        else:
            bias = rng.normal(0, 0.2, E).astype(np.float32)
            tensors[P + "gate.bias"] = ("F32", bias)
            lay["bias"] = bias.astype(np.float64)
        sh = []
        for name, n, k in (("w1", I, H), ("w3", I, H), ("w2", H, I)):
            c, scales, w = fp8_weight(rng, n, k)
            tensors[f"{P}shared_experts.{name}.weight"] = ("F8_E4M3", c)
            tensors[f"{P}shared_experts.{name}.scale"] = ("F8_E8M0", scales)
            sh.append(w)
        lay["shared"] = sh
        tensors[f"layers.{L}.attn_norm.weight"] = ("BF16", bf16_bits(np.ones(H)))
        layers.append(lay)

    # Inputs whose learned routing has a clear margin (3rd vs 4th choice) in layer 1.
    x_rows, ids_in = [], rng.integers(0, V, T)
    ids_in[:2] = [0, V - 1]
    while len(x_rows) < T:
        xb = bf16_bits(rng.normal(0, 1, H))
        c = sqrt_softplus(bf16_value(xb) @ layers[1]["gate"].T) + layers[1]["bias"]
        cs = np.sort(c)[::-1]
        if cs[K_TOP - 1] - cs[K_TOP] > 1e-4 * abs(cs[K_TOP - 1]):
            x_rows.append(xb)
    x_bits = np.stack(x_rows)
    x = bf16_value(x_bits)
    st.write(os.path.join(out, "input.safetensors"),
             {"hidden_states": ("BF16", x_bits), "input_ids": ("I64", ids_in.astype(np.int64))})

    for L, lay in enumerate(layers):
        s = sqrt_softplus(x @ lay["gate"].T)
        if "table" in lay:
            ids = lay["table"][ids_in]
        else:
            ids = np.argsort(-(s + lay["bias"]), axis=1, kind="stable")[:, :K_TOP]
        w = np.take_along_axis(s, ids, 1)
        w = w / w.sum(1, keepdims=True) * RSF
        y = np.zeros((T, H))
        for t in range(T):
            for j in range(K_TOP):
                w1, w3, w2 = lay["experts"][ids[t, j]]
                y[t] += w[t, j] * expert_out(x[t:t + 1], w1, w3, w2)[0]
        y += round_bf16(expert_out(x, *lay["shared"]))
        st.write(os.path.join(out, f"expected_layer{L}.safetensors"),
                 {"y_ref": ("F32", y.astype(np.float32)), "topk_ids": ("I32", ids.astype(np.int32)),
                  "topk_weights": ("F32", w.astype(np.float32))})

    # Two shards and the index, tensors in order.
    names = list(tensors)
    half = len(names) // 2
    weight_map = {}
    for s_i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{s_i + 1:05d}-of-00002.safetensors"
        st.write(os.path.join(ck, fname), {n: tensors[n] for n in part}, {"format": "pt"})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(ck, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    config = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "num_hidden_layers": LAYERS,
        "hidden_size": H, "moe_intermediate_size": I, "n_routed_experts": E, "num_experts_per_tok": K_TOP,
        "n_shared_experts": 1, "num_hash_layers": 1, "vocab_size": V, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": RSF, "swiglu_limit": LIMIT,
        "hidden_act": "silu", "expert_dtype": "fp4", "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    }
    with open(os.path.join(ck, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    print(f"{ck}: {len(names)} tensors; input and expected outputs of layers 0 (hash) and 1 (learned)")


if __name__ == "__main__":
    main()
