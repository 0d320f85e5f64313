"""The "moekit" experts backend inside the real transformers package (pinned in
scripts/python_env.sh), on the CPU: tiny GPT-OSS, Qwen3-MoE, DeepSeek-V3 and Mixtral models built
from configs with random weights (tests/python/hf_models.py), every MoE layer through moekit
against transformers' own "eager" experts on the same weights (teacher-forced logits: rel-L2 and
next-token argmax), the GPT-OSS MXFP4 and DeepSeek-V3 FP8 checkpoint formats against transformers'
dequantized reference, FP8Experts modules, replaced weights, chunked calls, the zero-allocation
buffers, fallbacks with their reasons, torch.compile(fullgraph=True) and static-cache generate."""

import logging
import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/python_env.sh installs it)")
if os.environ.get("MOEKIT_REQUIRE_ENGINES"):  # CI: the real package must be there
    import transformers  # noqa: F401
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

import hf_models as hm  # noqa: E402
import moekit.integrations.transformers as mkt  # noqa: E402
from transformers.integrations import finegrained_fp8 as tf_fp8  # noqa: E402
from transformers.integrations import moe as tf_moe  # noqa: E402

BATCH, LENGTH = 16, 32  # 512 teacher-forced positions
# rel-L2 of the logits against eager per architecture (bf16 weights; measured values in
# docs/ENGINES.md are about half of these) and the least share of equal next-token argmaxes.
REL_MAX = {"gpt_oss": 1e-2, "qwen3_moe": 1e-2, "deepseek_v3": 1e-2, "mixtral": 1e-2}
AGREE_MIN = 0.99


@pytest.fixture(scope="module", params=hm.ARCHS)
def model(request):
    return request.param, hm.build(request.param)


def test_moekit_is_registered_in_both_experts_interfaces():
    assert tf_moe.ALL_EXPERTS_FUNCTIONS["moekit"] is mkt.moekit_experts_forward
    assert tf_fp8.ALL_FP8_EXPERTS_FUNCTIONS["moekit"] is mkt.moekit_experts_forward
    m = hm.build("qwen3_moe", implementation="moekit")
    assert m.config._experts_implementation == "moekit"


def test_logits_against_eager(model, capsys):
    arch, m = model
    ids = hm.tokens(m, BATCH, LENGTH)
    ref = hm.logits(m, "eager", ids)
    got = hm.logits(m, "moekit", ids)
    grouped = hm.logits(m, "grouped_mm", ids)  # transformers' own second implementation, for scale
    rows = mkt.status(m)
    assert rows and all(r.startswith("moekit cpu bf16") for _, r in rows), rows
    rel, agree, flips = hm.compare(got, ref)
    rel_g, agree_g, _ = hm.compare(grouped, ref)
    with capsys.disabled():
        print(f"\n{arch}: moekit vs eager rel-L2 {rel:.2e}, argmax {agree:.2%} of {ref.shape[0] * ref.shape[1]}; "
              f"grouped_mm vs eager {rel_g:.2e}, {agree_g:.2%}; differing positions (eager's margin): {flips}")
    assert rel <= REL_MAX[arch]
    assert agree >= AGREE_MIN, flips


def _experts_io(m, ids):
    """(module, hidden_states, top_k_index, top_k_weights) of every experts call of a forward."""
    calls = []

    def hook(mod, args, kwargs):
        calls.append((mod, *[a.clone() for a in args]))

    hs = [mod.register_forward_pre_hook(hook, with_kwargs=True) for _, mod in mkt.experts_modules(m)]
    with torch.no_grad():
        m(ids)
    for h in hs:
        h.remove()
    return calls


@torch.no_grad()
def test_each_experts_call_against_eager_and_float64(model, capsys):
    """The experts modules alone on the same inputs: moekit is closer to the float64 result of the
    same bf16 weights than transformers' eager bf16 loop is (eager rounds each step to bf16)."""
    arch, m = model
    m.set_experts_implementation("eager")
    worst = []
    for mod, x, idx, w in _experts_io(m, hm.tokens(m, 2, 16)):
        eager = type(mod).forward.__wrapped__(mod, x, idx, w).double()
        mod.config._experts_implementation = "moekit"  # this module only
        got = mod(x, idx, w).double()
        mod.config._experts_implementation = "eager"
        f64 = _float64_experts(mod, x, idx, w)
        r_m = float((got - f64).norm() / f64.norm())
        r_e = float((eager - f64).norm() / f64.norm())
        worst.append((r_m, r_e))
        assert r_m <= 4e-3 and r_m <= r_e * 1.05, (r_m, r_e)
    with capsys.disabled():
        print(f"\n{arch}: experts calls vs float64, moekit / eager rel-L2: "
              + ", ".join(f"{a:.1e}/{b:.1e}" for a, b in worst))


def _float64_experts(mod, x, idx, w):
    gu, dn = mod.gate_up_proj.double(), mod.down_proj.double()
    if mod.is_transposed:
        gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = gu[e] @ x[t].double()
            if mod.has_bias:
                h = h + mod.gate_up_proj_bias[e].double()
            if mod.is_concatenated:
                g, u = h.chunk(2)
            else:
                g, u = h[0::2], h[1::2]
            if hasattr(mod, "alpha"):  # GPT-OSS
                g, u = g.clamp(max=mod.limit), u.clamp(-mod.limit, mod.limit)
                a = g * torch.sigmoid(mod.alpha * g) * (u + 1)
            else:
                a = torch.nn.functional.silu(g) * u
            y = dn[e] @ a
            if mod.has_bias:
                y = y + mod.down_proj_bias[e].double()
            out[t] += float(w[t, j]) * y
    return out


def test_gpt_oss_mxfp4_checkpoint_runs_as_mxfp4(tmp_path, capsys):
    """A GPT-OSS MXFP4 checkpoint (blocks + scales) loaded by transformers (dequantized to bf16:
    exact) runs through moekit's MXFP4 kernels: the weights are re-encoded losslessly. Reference:
    the same checkpoint through transformers' eager experts."""
    hm.write_gpt_oss_mxfp4(hm.build("gpt_oss"), str(tmp_path))
    cfg = transformers.Mxfp4Config(dequantize=True)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16, quantization_config=cfg,
                                                          experts_implementation="moekit")
    ids = hm.tokens(m, BATCH, LENGTH)
    got = hm.logits(m, "moekit", ids)
    rows = mkt.status(m)
    assert all(r == "moekit cpu mxfp4 (MXFP4 values, re-encoded exactly)" for _, r in rows), rows
    rel, agree, flips = hm.compare(got, hm.logits(m, "eager", ids))
    with capsys.disabled():
        print(f"\ngpt_oss MXFP4 checkpoint: moekit mxfp4 vs eager (dequantized) rel-L2 {rel:.2e}, argmax {agree:.2%}; "
              f"{flips}")
    assert rel <= 1e-2 and agree >= AGREE_MIN
    # The re-encoding decodes to exactly transformers' dequantized weights.
    mod = mkt.experts_modules(m)[0][1]
    blocks, scales = mkt._mxfp4_encode(mod.gate_up_proj.transpose(1, 2))
    assert _mxfp4_decode(blocks, scales).equal(mod.gate_up_proj.transpose(1, 2))
    # Weights that are not MXFP4 values stay bf16 (one bf16 ulp off an MXFP4 value).
    w = mod.gate_up_proj.transpose(1, 2).clone()
    w.view(torch.int16)[0, 0, 0] += 1
    assert mkt._mxfp4_encode(w) is None


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_mxfp4_values_in_concatenated_layouts(arch):
    """Models whose experts hold [gates; ups] (not GPT-OSS's interleaved rows) with MXFP4 values are
    packed as MXFP4 too (rows interleaved for moekit's layout) and agree with eager."""
    m = hm.make_mxfp4_exact(hm.build(arch))
    ids = hm.tokens(m, 4, 16)
    assert all(r == "moekit cpu mxfp4 (MXFP4 values, re-encoded exactly)" for _, r in mkt.prepare(m)), mkt.status(m)
    rel, agree, flips = hm.compare(hm.logits(m, "moekit", ids), hm.logits(m, "eager", ids))
    assert rel <= 1e-2 and agree >= AGREE_MIN, (rel, flips)
    assert all(r == "moekit cpu bf16 (bf16 module)" for _, r in mkt.prepare(m, format="bf16")), mkt.status(m)


def _mxfp4_decode(blocks, scales):
    lut = torch.tensor(hm.FP4 + [-v for v in hm.FP4])
    codes = torch.stack([blocks & 15, blocks >> 4], -1).reshape(*blocks.shape[:-1], 32).long()
    v = lut[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return v.reshape(*scales.shape[:-1], -1).to(torch.bfloat16)


def test_deepseek_v3_fp8_checkpoint(tmp_path, capsys):
    """A DeepSeek-V3 FP8 checkpoint (e4m3 + 128x128 scale_inv): transformers dequantizes it to bf16
    where it cannot run FP8 (here: no GPU), and moekit runs the dequantized experts; reference: the
    same load through eager."""
    hm.write_deepseek_v3_fp8(hm.build("deepseek_v3"), str(tmp_path))
    m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16,
                                                          experts_implementation="moekit")
    ids = hm.tokens(m, BATCH, LENGTH)
    got = hm.logits(m, "moekit", ids)
    assert all(r == "moekit cpu bf16 (bf16 module)" for _, r in mkt.status(m)), mkt.status(m)
    rel, agree, flips = hm.compare(got, hm.logits(m, "eager", ids))
    with capsys.disabled():
        print(f"\ndeepseek_v3 FP8 checkpoint (dequantized): moekit vs eager rel-L2 {rel:.2e}, argmax {agree:.2%}; {flips}")
    assert rel <= 1e-2 and agree >= AGREE_MIN


def test_fp8_experts_module_is_dequantized_like_transformers():
    """An FP8Experts module (what transformers keeps on a GPU that runs FP8) through moekit: its
    weights dequantized at pack as transformers' Fp8Dequantize does, against the bf16 experts module
    holding transformers' own dequantization, through eager."""
    m = hm.build("deepseek_v3")
    ref = dict(mkt.experts_modules(m))["model.layers.1.mlp.experts"]
    cfg = m.config
    cls = tf_moe.use_experts_implementation(experts_class=tf_fp8.FP8Experts,
                                            experts_interface=tf_fp8.ALL_FP8_EXPERTS_FUNCTIONS)
    fp8 = cls(cfg, block_size=[128, 128])
    deq = tf_fp8.Fp8Dequantize(None)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(ref, name)
            q, s = zip(*[hm.fp8_block_quantize(w[e]) for e in range(w.shape[0])])
            getattr(fp8, name).data = torch.stack(q)
            getattr(fp8, name + "_scale_inv").data = torch.stack(s)
            getattr(ref, name).copy_(torch.stack([deq._dequantize_one(a, b, torch.bfloat16) for a, b in zip(q, s)]))
    x = torch.randn(7, cfg.hidden_size).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(cfg.n_routed_experts)[:cfg.num_experts_per_tok] for _ in range(7)])
    w = torch.rand(7, cfg.num_experts_per_tok)
    cfg._experts_implementation = "moekit"
    got = fp8(x, idx, w)
    assert fp8.__dict__["_moekit"].source == "FP8 module, dequantized to bf16"
    cfg._experts_implementation = "eager"
    want = ref(x, idx, w)
    assert float((got.float() - want.float()).norm() / want.float().norm()) <= 1e-2


def test_replace_weights_frees_the_originals_and_keeps_the_results():
    m = hm.build("qwen3_moe")
    ids = hm.tokens(m, 2, 16)
    before = hm.logits(m, "moekit", ids)
    mkt.prepare(m, replace_weights=True)
    for _, mod in mkt.experts_modules(m):
        assert mod.gate_up_proj.numel() == 0 and mod.down_proj.numel() == 0
    assert torch.equal(hm.logits(m, "moekit", ids), before)


def test_a_deleted_model_gives_its_packed_layers_back():
    """The torch ops' registry holds layers weakly: deleting the model frees moekit's packed
    weights (on a GPU, 3.2 GiB per gpt-oss-20b pair of layers stayed allocated before), and the
    key of a freed layer is a ValueError."""
    import gc
    import weakref

    import moekit.torch as mt
    m = hm.build("qwen3_moe")
    mkt.prepare(m)
    st = mkt.experts_modules(m)[0][1].__dict__["_moekit"]
    layer, key = weakref.ref(st.layer), st.layer.key
    x = torch.zeros(1, st.hidden, dtype=torch.bfloat16)
    ids, w = torch.zeros(1, st.top_k, dtype=torch.int32), torch.ones(1, st.top_k)
    out = torch.empty_like(x)
    torch.ops.moekit.forward_topk(key, x, ids, w, out, st.workspace)  # live: runs
    del m, st
    gc.collect()
    assert layer() is None
    with pytest.raises(ValueError, match=f"layer key {key} names no live layer"):
        mt._layer(key)


def test_calls_of_every_size_chunked_and_buffered():
    """Up to graph_tokens tokens a call writes the module's own output buffer (no allocation);
    larger calls get a tensor of their own; above max_tokens they run in chunks. All equal to the
    unchunked call."""
    m = hm.build("gpt_oss")
    mod = mkt.experts_modules(m)[0][1]
    E, k, H = mod.num_experts, m.config.num_experts_per_tok, m.config.hidden_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(23, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(23)])
    w = torch.rand(23, k, generator=g).to(torch.bfloat16)
    m.set_experts_implementation("moekit")
    whole = mod(x, idx, w).clone()
    mkt.prepare(m, max_tokens=8, graph_tokens=4)
    st = mod.__dict__["_moekit"]
    for T in (0, 1, 3, 4, 5, 8, 9, 23):
        out = mod(x[:T], idx[:T], w[:T])
        assert out.shape == (T, H)
        assert torch.equal(out, whole[:T]), T
        if 0 < T <= 4:
            assert out.data_ptr() == st.out.data_ptr()
        elif T > 4:
            assert out.data_ptr() != st.out.data_ptr()


def test_unsupported_configurations_fall_back_with_a_reason(caplog):
    caplog.set_level(logging.WARNING, logger="moekit")
    cfg = hm.config("qwen3_moe")
    cfg.hidden_act = "gelu"
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, experts_implementation="moekit")
    hm.init_weights(m)
    ids = hm.tokens(m, 2, 8)
    assert torch.equal(hm.logits(m, "moekit", ids), hm.logits(m, "grouped_mm", ids))
    assert all(r == "fallback: activation GELUActivation (moekit: gated silu)" for _, r in mkt.status(m)), mkt.status(m)
    assert sum("running transformers' grouped_mm instead" in r.message for r in caplog.records) == 1
    # float32 models: moekit takes bf16 hidden states
    m32 = transformers.AutoModelForCausalLM.from_config(hm.config("mixtral"), dtype=torch.float32,
                                                        experts_implementation="moekit")
    with torch.no_grad():
        m32(ids)
    assert all(r.startswith("fallback: torch.float32 hidden states") for _, r in mkt.status(m32)), mkt.status(m32)


def test_torch_compile_fullgraph():
    """torch.compile traces the experts call (the moekit::forward_topk op, fake kernel) without a
    graph break, on packed modules; an unpacked module met while compiling is a clean error."""
    m = hm.build("mixtral")
    ids = hm.tokens(m, 2, 8)
    mkt.prepare(m)
    want = hm.logits(m, "moekit", ids)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        got = compiled(ids).logits.float()
    assert torch.equal(got, want)
    fresh = hm.build("mixtral", implementation="moekit")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="pack it first"):
        with torch.no_grad():
            torch.compile(fresh, backend="aot_eager", fullgraph=True)(ids)


def test_static_cache_generate_matches_eager():
    m = hm.build("qwen3_moe")
    ids = hm.tokens(m, 2, 8)
    out = {}
    for impl in ("eager", "moekit"):
        m.set_experts_implementation(impl)
        out[impl] = m.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static",
                               pad_token_id=0)
    assert torch.equal(out["moekit"], out["eager"])


def test_prepare_checks_its_options():
    m = hm.build("mixtral")
    with pytest.raises(ValueError, match="format"):
        mkt.prepare(m, format="mxfp4")
    with pytest.raises(ValueError, match="max_tokens"):
        mkt.prepare(m, max_tokens=0)
