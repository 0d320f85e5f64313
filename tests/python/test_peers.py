"""bench/peers.py where a peer cannot run (this machine: no CUDA device, maybe no torch): every
requested peer is skipped with its reason in the JSON, and the script exits 0."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def test_unavailable_peers_are_skipped_with_a_reason(tmp_path):
    out = tmp_path / "peers.json"
    wheels = tmp_path / "wheels"
    wheels.mkdir()  # an empty wheel directory: nothing to install, said so
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "peers.py"), "--shape", "8,2,64,64",
                        "--tokens", "1,3", "--routing", "uniform,zipf", "--wheels", str(wheels),
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no wheels in" in r.stdout
    d = json.loads(out.read_text())
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if cuda:  # a GPU machine: the torch peer runs
        assert any(row["peer"] == "torch._grouped_mm" for row in d["rows"])
        return
    assert d["rows"] == []
    assert [s["peer"] for s in d["status"]] == ["torch._grouped_mm", "triton_kernels matmul_ogs",
                                                "flashinfer cutlass_fused_moe"]
    for s in d["status"]:
        assert s["status"] == "skipped" and s["reason"], s
        assert "peer " in r.stdout and s["reason"] in r.stdout
