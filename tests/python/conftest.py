"""pytest setup: golden data (../shared/testdata beside the repository, or $MOEKIT_TESTDATA), the
`gpu` marker (skipped without torch, a CUDA device and moekit's SM90 kernels), helpers."""

import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import moekit  # noqa: E402


def testdata(*parts):
    root = os.environ.get("MOEKIT_TESTDATA") or os.path.join(REPO, "..", "shared", "testdata")
    return os.path.join(root, *parts)


GOLDEN = ["bypass_mxfp4_minus1", "dsv3_small_nvfp4", "gptoss_h2880_mxfp4", "gptoss_small_mxfp4",
          "qwen_small_mxfp8", "tiny_bf16_clamped"]


def gpu_ready():
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if not moekit.cuda_available():
        return False, "moekit's SM90 kernels are not built in, or the GPU is not an H100/H200"
    return True, ""


def pytest_collection_modifyitems(config, items):
    ok, why = gpu_ready()
    if ok:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def load_case(name, **overrides):
    """(spec, checkpoint, inputs, expected) of a golden case; inputs/expected as arrays."""
    d = testdata("moe", name)
    spec, ck = moekit.load_layer_dir(d, **overrides)
    inp = {k: v for k, (_, v) in moekit.read_safetensors(os.path.join(d, "input.safetensors")).items()}
    exp = {k: v for k, (_, v) in moekit.read_safetensors(os.path.join(d, "expected.safetensors")).items()}
    return spec, ck, inp, exp


def same_id_sets(a, b):
    return all(sorted(x) == sorted(y) for x, y in zip(np.asarray(a).tolist(), np.asarray(b).tolist()))


POISON = 0x7FC1  # a bf16 NaN no kernel writes
