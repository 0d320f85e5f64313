#!/usr/bin/env python3
"""Golden cases for DeepSeek-V4's router, in float64 NumPy, written from DeepSeek's published Gate
(inference/model.py: Gate.forward) and ../shared/notes/deepseek_v4.md; it never imports moekit.

  score    s = sqrt(softplus(logit)), softplus as torch's F.softplus (beta 1, threshold 20)
  learned  choice = s + bias (gate.bias, selection only); the top-k of the choice over all experts
  hash     the experts are tid2eid[input_id], in the table's order (no choice, no bias)
  weights  the chosen experts' s (no bias), divided by their sum, times routed_scaling_factor

Ties in the choice go to the lower expert id (SPEC section 7; torch.topk leaves them unspecified).
The inputs are fp32 values (what a layer gets) drawn so that the k-th and (k+1)-th choices differ
by more than 1e-5 relative, so an fp32 implementation must pick the same experts; rows with exact
ties are made on purpose (equal logits and biases). Each case is one safetensors file in
dsv4_router/:
  logits F32 [T, E]; learned: bias F32 [E]; hash: tid2eid I64 or I32 [V, k], input_ids I64 [T]
  topk_ids I32 [T, k] (learned: best first; hash: the table's order), topk_weights F64 [T, k]
  metadata: kind, num_experts, top_k, routed_scaling_factor, hash_vocab

Usage: tests/golden/dsv4_router.py [OUT_DIR]   (default: dsv4_router/ beside this script)
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_np as st  # noqa: E402


def sqrt_softplus(x):
    x = np.asarray(x, np.float64)
    sp = np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
    return np.sqrt(sp)


def gate(logits, k, rsf, bias=None, table=None, input_ids=None):
    """DeepSeek-V4's Gate on logits [T, E] (float64 math): (ids [T, k], weights [T, k])."""
    s = sqrt_softplus(logits)
    if table is not None:
        ids = np.asarray(table)[np.asarray(input_ids)]
    else:
        choice = s + np.asarray(bias, np.float64)
        ids = np.argsort(-choice, axis=1, kind="stable")[:, :k]  # stable: ties to the lower id
    w = np.take_along_axis(s, ids, 1)
    w = w / w.sum(1, keepdims=True)
    return ids.astype(np.int32), w * rsf


def margin_ok(choice_row, k):
    """The k-th and (k+1)-th best choices differ by more than 1e-5 relative, or tie exactly."""
    c = np.sort(choice_row)[::-1]
    if k >= len(c):
        return True
    a, b = c[k - 1], c[k]
    return a == b or (a - b) > 1e-5 * max(abs(a), abs(b), 1e-30)


def learned_case(rng, E, k, T, rsf, scale=2.0, extreme=False):
    bias = rng.normal(0.0, 0.3, E).astype(np.float32)
    # Two tie rows first (T >= 3): row 1, every logit 0.5 (the bias alone chooses); row 2, k - 1
    # clear winners and two experts tied exactly at the k-th place (equal logit, equal bias): the
    # lower id must win. The bias entries of row 2's experts are set here, before any row is drawn.
    tie = rng.choice(E, size=k + 1, replace=False)
    bias[tie[: k - 1]] = np.float32(0.0)
    bias[tie[k - 1:]] = np.float32(0.125)
    logits = np.empty((T, E), np.float32)
    for t in range(T):
        while True:
            if t == 1:
                row = np.full(E, 0.5, np.float32)
            elif t == 2:
                row = np.full(E, -3.0, np.float32)
                row[tie[: k - 1]] = np.float32(4.0) + np.arange(k - 1, dtype=np.float32)
                row[tie[k - 1:]] = np.float32(2.0)
            else:
                row = rng.normal(0.0, scale, E).astype(np.float32)
                if extreme:  # around softplus's threshold, far past it, and far below zero
                    pick = rng.choice(E, size=8, replace=False)
                    row[pick] = np.array([19.9, 20.0, 20.1, 25.0, 40.0, -30.0, -12.5, 0.0], np.float32)
            choice = sqrt_softplus(row) + bias.astype(np.float64)
            if margin_ok(choice, k):
                break
            assert t not in (1, 2), "a tie row without its margin"
        logits[t] = row
    ids, w = gate(logits, k, rsf, bias=bias)
    if T >= 3:
        assert sorted(ids[2]) == sorted(list(tie[: k - 1]) + [min(tie[k - 1:])])
    return {"logits": ("F32", logits), "bias": ("F32", bias), "topk_ids": ("I32", ids),
            "topk_weights": ("F64", w)}, {"kind": "learned", "num_experts": E, "top_k": k,
                                          "routed_scaling_factor": rsf, "hash_vocab": 0}


def hash_case(rng, E, k, V, T, rsf, i32=False):
    table = np.stack([rng.permutation(E)[:k] for _ in range(V)]).astype(np.int64)
    ids_in = rng.integers(0, V, T).astype(np.int64)
    ids_in[:3] = [0, V - 1, 0]  # the table's first and last rows, and a repeat
    logits = rng.normal(0.0, 2.0, (T, E)).astype(np.float32)
    logits[-1, table[ids_in[-1], 0]] = np.float32(30.0)  # a chosen logit past softplus's threshold
    ids, w = gate(logits, k, rsf, table=table, input_ids=ids_in)
    return {"logits": ("F32", logits), "tid2eid": ("I32" if i32 else "I64", table), "input_ids": ("I64", ids_in),
            "topk_ids": ("I32", ids), "topk_weights": ("F64", w)}, {
        "kind": "hash", "num_experts": E, "top_k": k, "routed_scaling_factor": rsf, "hash_vocab": V}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "dsv4_router")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(20260447)
    cases = {
        "learned_e16_k4": learned_case(rng, 16, 4, 40, 1.5),
        "learned_e256_k6_flash": learned_case(rng, 256, 6, 17, 1.5),
        "learned_e384_k6_pro": learned_case(rng, 384, 6, 33, 2.5),
        "learned_e64_k6_extreme": learned_case(rng, 64, 6, 24, 2.5, scale=8.0, extreme=True),
        "hash_e16_k4": hash_case(rng, 16, 4, 50, 40, 1.5),
        "hash_e384_k6_pro_i32": hash_case(rng, 384, 6, 1000, 33, 2.5, i32=True),
        "hash_e256_k6_flash": hash_case(rng, 256, 6, 1500, 9, 1.5),
    }
    for name, (tensors, meta) in cases.items():
        st.write(os.path.join(out, name + ".safetensors"), tensors, meta)
        print(f"{name}: {tensors['logits'][1].shape[0]} tokens, E={meta['num_experts']} k={meta['top_k']}")


if __name__ == "__main__":
    main()
