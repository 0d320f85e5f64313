"""A float64 MoE layer in numpy, written from SPEC.md alone (independent of the C++ code): the
checkpoint tensors of SPEC section 7 dequantized exactly, routing, GEMMs and activations in
float64, the activation output rounded to bf16 as every kernel stores it, y before its final
rounding. Slow and obvious; experts are dequantized one at a time."""

import numpy as np

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def e4m3(b):
    b = np.asarray(b, np.uint8).astype(np.int64)
    s = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.where((b & 0x7F) == 0x7F, np.nan, s * v)


def e8m0(b):
    return 2.0 ** (np.asarray(b, np.int64) - 127)


def bf16(bits):
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def round_bf16(v):
    f = np.asarray(v, np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32).view(np.float32).astype(np.float64)


def fp4_codes(packed):
    """[..., n] bytes -> [..., 2n] codes, element 2i in the low nibble."""
    lo, hi = packed & 0xF, packed >> 4
    return np.stack([lo, hi], -1).reshape(*packed.shape[:-1], -1)


class Weights:
    """Logical rows (w13: gate rows then up rows) of one expert at a time, in float64."""

    def __init__(self, spec, ck):
        self.spec, self.ck = spec, ck

    def _matrix(self, e, which):
        s, ck, f = self.spec, self.ck, self.spec.format
        if f == "mxfp4":
            blocks, scales = (ck["gate_up_proj_blocks"], ck["gate_up_proj_scales"]) if which == 13 else \
                (ck["down_proj_blocks"], ck["down_proj_scales"])
            codes = fp4_codes(blocks[e])  # [N, K/32, 32]
            w = (E2M1[codes] * e8m0(scales[e])[..., None]).reshape(codes.shape[0], -1)
        elif f == "nvfp4":
            n = "w13" if which == 13 else "w2"
            q = E2M1[fp4_codes(ck[n + "_weight"][e])]  # [N, K]
            sc = np.repeat(e4m3(ck[n + "_weight_scale"][e]), 16, axis=-1)
            g = np.asarray(ck[n + "_weight_scale_2"][e], np.float64)
            rows = q.shape[0]
            g_rows = np.where(np.arange(rows) < rows // 2, g.reshape(-1)[0], g.reshape(-1)[-1]) if g.size == 2 \
                else np.full(rows, float(g))
            w = q * sc * g_rows[:, None]
        elif f == "mxfp8":
            n = "w13" if which == 13 else "w2"
            w = e4m3(ck[n + "_weight"][e]) * np.repeat(e8m0(ck[n + "_weight_scale"][e]), 32, axis=-1)
        else:
            w = bf16(ck["w13_weight" if which == 13 else "w2_weight"][e])
        if which == 13 and f == "mxfp4":  # GPT-OSS: gate, up, gate, up, ...
            w = np.concatenate([w[0::2], w[1::2]])
        return w

    def bias(self, e, which):
        s, ck = self.spec, self.ck
        names = ("gate_up_proj_bias", "down_proj_bias") if s.format == "mxfp4" else ("w13_bias", "w2_bias")
        b = ck.get(names[0] if which == 13 else names[1])
        if b is None:
            return 0.0
        b = bf16(b[e]) if b.dtype == np.uint16 else np.asarray(b[e], np.float64)
        if which == 13 and s.format == "mxfp4":
            b = np.concatenate([b[0::2], b[1::2]])
        return b

    def expert(self, e):
        return self._matrix(e, 13), self.bias(e, 13), self._matrix(e, 2), self.bias(e, 2)


def activation(spec, g, u):
    sig = lambda v: 1.0 / (1.0 + np.exp(-v))
    L = spec.swiglu_limit
    if spec.activation == "swiglu_oai":
        g = np.minimum(g, L)
        u = np.clip(u, -L, L)
        return g * sig(spec.swiglu_alpha * g) * (u + spec.swiglu_beta)
    if spec.activation == "silu_clamped":
        g = np.minimum(g, L)
        return g * sig(g) * np.clip(u, -L, L)
    return g * sig(g) * u


def route(spec, logits, score_bias=None, table=None, token_ids=None):
    """SPEC section 7 routing: ids [T, k], weights [T, k] (float64). Hash routing (a tid2eid
    table [V, k] and the rows' token ids): the table's experts, weighted by their scores."""
    logits = np.asarray(logits, np.float64)
    T, E = logits.shape
    k = spec.top_k
    if spec.scoring == "softmax":
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        choice = p.copy()
    elif spec.scoring == "sqrtsoftplus":  # softplus with torch's threshold of 20
        p = np.sqrt(np.where(logits > 20, logits, np.log1p(np.exp(np.minimum(logits, 20)))))
        choice = p + (0.0 if score_bias is None else np.asarray(score_bias, np.float64))
    else:
        p = 1.0 / (1.0 + np.exp(-logits))
        choice = p + (0.0 if score_bias is None else np.asarray(score_bias, np.float64))
        if spec.n_group > 1:
            gs = E // spec.n_group
            grouped = choice.reshape(T, spec.n_group, gs)
            top2 = np.sort(grouped, -1)[..., -2:].sum(-1) if gs > 1 else grouped[..., 0]
            keep = np.argsort(-top2, axis=1, kind="stable")[:, :spec.topk_group]
            mask = np.zeros((T, spec.n_group), bool)
            np.put_along_axis(mask, keep, True, 1)
            choice = np.where(np.repeat(mask, gs, 1), choice, -np.inf)
    ids = np.argsort(-choice, axis=1, kind="stable")[:, :k].astype(np.int32)
    if table is not None:
        ids = np.asarray(table)[np.asarray(token_ids)].astype(np.int32)
    w = np.take_along_axis(p, ids, 1)
    if spec.norm_topk_prob:
        w = w / w.sum(1, keepdims=True)
    return ids, w * spec.routed_scaling_factor


def layer(spec, ck, x_bits, ids, weights, quant=None):
    """y [T, H] float64 from bf16 x bits, ids [T, k] (-1 = none) and weights [T, k]. quant: applied
    to both GEMMs' input rows (fp8 activations: float32 [n, K] -> the values the GEMM multiplies)."""
    x = bf16(x_bits)
    if quant is not None:
        x = np.asarray(quant(x.astype(np.float32)), np.float64)
    T = x.shape[0]
    y = np.zeros((T, spec.hidden))
    W = Weights(spec, ck)
    I = spec.intermediate
    ids = np.asarray(ids)
    for e in np.unique(ids[ids >= 0]):
        t, j = np.nonzero(ids == e)
        w13, b13, w2, b2 = W.expert(int(e))
        h = x[t] @ w13.T + b13
        a = round_bf16(activation(spec, h[:, :I], h[:, I:]))
        if quant is not None:
            a = np.asarray(quant(a.astype(np.float32)), np.float64)
        y[t] += np.asarray(weights, np.float64)[t, j][:, None] * (a @ w2.T + b2)
    return y


def expert_rows(spec, ck, x_bits, e):
    """One expert on rows of x: [n, H] float64 (no top-k weight)."""
    x = bf16(x_bits)
    w13, b13, w2, b2 = Weights(spec, ck).expert(int(e))
    h = x @ w13.T + b13
    a = round_bf16(activation(spec, h[:, :spec.intermediate], h[:, spec.intermediate:]))
    return a @ w2.T + b2


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (den if den > 0 else 1.0))
