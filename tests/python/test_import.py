"""The package imports and works on a machine without a GPU (also when its binding was built
with the SM90 kernels), reports that cleanly, and passes the environment stream through."""

import os
import subprocess
import sys

import numpy as np
import pytest

import moekit


def test_imports_without_a_gpu_and_runs_on_the_cpu():
    code = ("import moekit, numpy as np; s = moekit.LayerSpec(num_experts=4, top_k=1, hidden=64, intermediate=64, "
            "max_tokens=2); L = moekit.synthetic(s); o = np.zeros((2, 64), np.uint16); "
            "L.forward_logits(np.zeros((2, 64), np.uint16), np.zeros((2, 4), np.float32), o, "
            "np.empty(L.workspace_bytes(2), np.uint8)); print(L.backend, moekit.cuda_available())")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["cpu", "False"]


def test_torch_is_not_imported_by_the_core_package():
    # tvm_ffi itself imports torch when torch is installed (its DLPack exchange); moekit's core
    # must add no import of its own.
    code = ("import sys, tvm_ffi; before = 'torch' in sys.modules; import moekit; "
            "print(before, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    before, after = r.stdout.split()
    assert after == before


def test_backends_and_devices_are_described():
    names = {b["name"]: b for b in moekit.backends()}
    assert names["cpu"]["available"] and not names["cpu"]["gpu"]
    if moekit._ffi.built_with_cuda():
        assert names["sm90_decode"]["gpu"]
        assert names["sm90_decode"]["available"] == moekit.cuda_available()
    assert isinstance(moekit._ffi.device_description(0), str)


def test_the_environment_stream_reaches_the_binding():
    """tvm-ffi hands the caller's stream (torch's current stream, or one set explicitly) to the
    binding through TVMFFIEnvGetStream; no GPU is needed to see the handle arrive."""
    tvm_ffi = pytest.importorskip("tvm_ffi")
    assert moekit._ffi.env_stream(2, 0) == 0
    with tvm_ffi.use_raw_stream(tvm_ffi.device("cuda:0"), 0x1234):
        assert moekit._ffi.env_stream(2, 0) == 0x1234
        assert moekit._ffi.env_stream(2, 1) == 0
    assert moekit._ffi.env_stream(2, 0) == 0


def test_numpy_arrays_are_taken_without_copies():
    s = moekit.LayerSpec(num_experts=4, top_k=1, hidden=64, intermediate=64, max_tokens=3)
    L = moekit.synthetic(s)
    out = np.zeros((3, 64), np.uint16)
    before = out.ctypes.data
    L.forward_logits(np.full((3, 64), 0x3F80, np.uint16), np.zeros((3, 4), np.float32), out,
                     np.empty(L.workspace_bytes(3), np.uint8))
    assert out.ctypes.data == before and out.any(), "the result must land in the caller's array"


def test_the_binding_overhead_benchmark_runs_on_the_cpu():
    """bench/binding_overhead.py (the binding's cost per call, T = 0) runs without a GPU and
    prints a time for every call it measures."""
    from conftest import REPO
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "binding_overhead.py"), "--calls", "50",
                        "--rounds", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines()[1:]]
    names = [" ".join(x[:-1]) for x in rows]
    assert names[:3] == ["empty", "ffi, numpy", "layer, numpy"], r.stdout
    assert all(float(x[-1]) > 0 for x in rows)
