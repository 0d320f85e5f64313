"""Models of the real transformers package for the "moekit" experts backend's tests: configs of
GPT-OSS, Qwen3-MoE, DeepSeek-V3 and Mixtral at tiny or at real layer sizes, random weights scaled
so that every sublayer matters, teacher-forced comparisons, and checkpoint writers for GPT-OSS
MXFP4 and DeepSeek-V3 FP8 (128x128 blocks) in the layouts the published checkpoints use.

Weights: N(0, 1/fan_in) everywhere (so each projection keeps unit scale), attention and expert
output projections times 1/4 (each sublayer adds a quarter of the residual's scale; DeepSeek-V3's
routed experts also divided by its routed_scaling_factor), routers times
8 (top-k choices well apart, few near-ties that bf16 rounding could flip), and an output head
that is 0.4 times a permuted copy of the embeddings plus a random matrix: a bigram table, so that
the logits have margins like a trained model's where a random head gives near-ties at every
position (with it, the context changes the prediction at about 5% of the positions; the rel-L2 of
all logits and the per-call comparison against float64 carry the numerics)."""

import json
import math
import os

import torch

ARCHS = ("gpt_oss", "qwen3_moe", "deepseek_v3", "mixtral")

# Real layer dimensions (hidden, expert intermediate, experts, top-k, ...) of the published models.
REAL = {
    "gpt_oss": dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128),  # gpt-oss-20b
    "qwen3_moe": dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128,
                      num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128),
    "deepseek_v3": dict(hidden_size=7168, moe_intermediate_size=2048, intermediate_size=18432, n_routed_experts=256,
                        num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1, num_attention_heads=128,
                        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, routed_scaling_factor=2.5),
}


def config(arch, size="tiny", layers=None, vocab=128):
    """A transformers config of `arch` at tiny sizes or at the real model's layer sizes."""
    import transformers as tf
    common = dict(vocab_size=vocab, max_position_embeddings=512 if size == "tiny" else 8192, tie_word_embeddings=False)
    if arch == "gpt_oss":
        kw = dict(hidden_size=128, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16)
        kw.update(REAL[arch] if size == "real" else {})
        n = layers or 2
        return tf.GptOssConfig(num_hidden_layers=n, layer_types=["sliding_attention", "full_attention"] * (n // 2)
                               + ["sliding_attention"] * (n % 2), **kw, **common)
    if arch == "qwen3_moe":
        kw = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                  num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        kw.update(REAL[arch] if size == "real" else {})
        return tf.Qwen3MoeConfig(num_hidden_layers=layers or 2, norm_topk_prob=True, **kw, **common)
    if arch == "deepseek_v3":
        kw = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16,
                  num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, num_attention_heads=4,
                  num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
                  v_head_dim=32)
        kw.update(REAL[arch] if size == "real" else {})
        return tf.DeepseekV3Config(num_hidden_layers=layers or 3, first_k_dense_replace=1,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kw, **common)
    if arch == "mixtral":
        kw = dict(hidden_size=128, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)
        if size == "real":  # Mixtral-8x7B's layer
            kw.update(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128)
        return tf.MixtralConfig(num_hidden_layers=layers or 2, **kw, **common)
    raise ValueError(arch)


@torch.no_grad()
def init_weights(model, seed=1):
    """The weights described in the module docstring, in place (any device, any dtype)."""
    dev = model.device
    g = torch.Generator(device=dev).manual_seed(seed)  # on the model's device: real sizes are GBs
    transposed = model.config.model_type == "gpt_oss"  # experts [E, in, out]

    def rand(shape, std):
        return (std * torch.randn(shape, generator=g, device=dev)).to(model.dtype)

    for n, p in model.named_parameters():
        if p.dim() == 1:  # norms stay 1; biases small
            if n.endswith("bias"):
                p.copy_(rand(p.shape, 0.1))
            continue
        if "embed" in n:
            p.copy_(rand(p.shape, 1.0))
            continue
        if n.endswith("_bias"):  # [E, N] expert biases
            p.copy_(rand(p.shape, 0.1))
            continue
        fan_in = p.shape[-2] if ("experts" in n and transposed) else p.shape[-1]
        std = 1.0 / math.sqrt(fan_in)
        if n.endswith("gate.weight") or "router" in n:
            std *= 8
        if "o_proj" in n or "down_proj" in n:
            std *= 0.25
        if "experts.down_proj" in n:  # DeepSeek-V3 multiplies the routed experts' sum by this
            std /= getattr(model.config, "routed_scaling_factor", 1.0)
        p.copy_(rand(p.shape, std))
    emb = model.get_input_embeddings().weight
    perm = torch.randperm(emb.shape[0], generator=g, device=dev)
    head = model.get_output_embeddings().weight
    head.add_(0.4 * emb[perm] / math.sqrt(emb.shape[1]))
    for m in model.modules():  # DeepSeek-V3's router bias
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.copy_(0.05 * torch.randn(m.e_score_correction_bias.shape, generator=g, device=dev))
    return model


@torch.no_grad()
def make_mxfp4_exact(model, seed=5):
    """Every experts module's weights replaced by random MXFP4 values (what transformers holds after
    loading an MXFP4 checkpoint dequantized), at the scale init_weights gives them."""
    lut = torch.tensor(FP4 + [-v for v in FP4], device=model.device)
    g = torch.Generator(device=model.device).manual_seed(seed)
    transposed = model.config.model_type == "gpt_oss"
    for n, p in model.named_parameters():
        if not (n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj")):
            continue
        w = p.transpose(1, 2) if transposed else p  # [E, N, K], K the reduction axis
        E, N, K = w.shape
        gain = 1.0 if n.endswith("gate_up_proj") else 0.25
        base = 127 + round(math.log2(gain / (2.93 * math.sqrt(K))))
        for e in range(E):
            codes = torch.randint(0, 16, (N, K), generator=g, device=p.device)
            exp = torch.randint(base - 1, base + 2, (N, K // 32, 1), generator=g, device=p.device).float() - 127
            w[e].copy_((lut[codes].reshape(N, K // 32, 32) * torch.exp2(exp)).reshape(N, K).to(p.dtype))
    return model


def build(arch, size="tiny", layers=None, device="cpu", implementation="eager", seed=1, vocab=128):
    import transformers as tf
    torch.manual_seed(seed)
    with torch.device(device):
        m = tf.AutoModelForCausalLM.from_config(config(arch, size, layers, vocab), dtype=torch.bfloat16,
                                                experts_implementation=implementation)
    return init_weights(m.eval(), seed)


def tokens(model, batch, length, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=g).to(model.device)


@torch.no_grad()
def logits(model, implementation, ids):
    model.set_experts_implementation(implementation)
    return model(ids).logits.float()


def compare(test, ref):
    """rel-L2, next-token argmax agreement, and the positions that differ with the reference's
    top-1 margin (its best logit minus the logit of the token the test picked)."""
    rel = float((test - ref).norm() / ref.norm())
    a, b = test.argmax(-1), ref.argmax(-1)
    agree = float((a == b).float().mean())
    diff = (a != b).nonzero().tolist()
    margins = [(tuple(p), float(ref[tuple(p)][b[tuple(p)]] - ref[tuple(p)][a[tuple(p)]])) for p in diff]
    return rel, agree, margins


# ---- checkpoints ---------------------------------------------------------------------------------

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _mxfp4_random(shape, g, gain=1.0):
    """Random MXFP4 blocks [..., K/32, 16] and scales [..., K/32] of about gain / sqrt(K) rms (the
    E2M1 codes' own rms is 2.9), each block's exponent within one of that."""
    *lead, K = shape
    blocks = torch.randint(0, 256, (*lead, K // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    base = 127 + round(math.log2(gain / (2.93 * math.sqrt(K))))
    scales = torch.randint(base - 1, base + 2, (*lead, K // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


def write_gpt_oss_mxfp4(model, path, seed=5):
    """`model` (a GPT-OSS model) saved as an MXFP4 checkpoint: its experts' weights replaced by
    random MXFP4 blocks and scales ({gate_up,down}_proj_{blocks,scales}, GPT-OSS layout), the
    config's quantization_config set to mxfp4."""
    from safetensors.torch import load_file, save_file
    model.save_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    for f in [f for f in os.listdir(path) if f.endswith(".safetensors")]:
        sd = load_file(os.path.join(path, f))
        for name in [n for n in sd if n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj")]:
            del sd[name]
            rows, K, gain = (2 * I, H, 1.0) if name.endswith("gate_up_proj") else (H, I, 0.25)
            blocks, scales = _mxfp4_random((E, rows, K), g, gain)
            sd[name + "_blocks"], sd[name + "_scales"] = blocks, scales
        save_file(sd, os.path.join(path, f), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as fh:
        c = json.load(fh)
    c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(c, fh)


def fp8_block_quantize(w, block=128):
    """[N, K] float -> (e4m3 [N, K], fp32 scale_inv [ceil(N/128), ceil(K/128)]): DeepSeek-V3's
    format, amax of each 128x128 block to 448."""
    N, K = w.shape
    sn, sk = -(-N // block), -(-K // block)
    wp = torch.zeros(sn * block, sk * block, dtype=torch.float32)
    wp[:N, :K] = w.float()
    blocks = wp.reshape(sn, block, sk, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    q = (blocks / scale[:, None, :, None]).reshape(sn * block, sk * block)[:N, :K].to(torch.float8_e4m3fn)
    return q, scale.float()


def write_deepseek_v3_fp8(model, path):
    """`model` (a DeepSeek-V3 model) saved as an FP8 checkpoint as DeepSeek publishes it: every
    expert and attention projection (2-D .weight outside norms, embeddings, router and head) in
    e4m3 with a .weight_scale_inv per 128x128 block."""
    from safetensors.torch import load_file, save_file
    model.save_pretrained(path)
    for f in [f for f in os.listdir(path) if f.endswith(".safetensors")]:
        sd = load_file(os.path.join(path, f))
        for name in list(sd):
            t = sd[name]
            if (t.dim() == 2 and name.endswith(".weight") and "norm" not in name and "embed" not in name
                    and "lm_head" not in name and not name.endswith("mlp.gate.weight")):
                sd[name], sd[name[:-len("weight")] + "weight_scale_inv"] = fp8_block_quantize(t)
        save_file(sd, os.path.join(path, f), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as fh:
        c = json.load(fh)
    c["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                "weight_block_size": [128, 128]}
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(c, fh)
