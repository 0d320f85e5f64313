"""bench/regret_study.py --bench, the GPU step `choice`'s summary (scripts/gpu_check.sh), on a few
synthetic bench rows: the regret of the layer's path (gemm_us) over the faster kernel alone, per
routing, the points over 3% named, the rows the device chose counted. No moekit binary needed."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def row(routing, tokens, decode, prefill, path, kernel, choice):
    return {"shape": "gpt-oss-120b", "format": "mxfp4", "routing": routing, "tokens": tokens,
            "decode_us": decode, "prefill_us": prefill, "gemm_us": path, "kernel": kernel,
            "kernel_choice": choice, "active_experts": 1, "max_expert_rows": 1}


def test_bench_summary(tmp_path):
    rows = [row("uniform", 8, 100.0, 150.0, 100.0, "decode", "tokens"),
            row("uniform", 256, 300.0, 290.0, 295.0, "prefill", "device"),  # 1.7%: the dead launches
            row("zipf", 128, 300.0, 250.0, 260.0, "prefill", "device"),      # 4.0%: over
            row("zipf", 512, 500.0, 400.0, 400.0, "prefill", "tokens")]
    f = tmp_path / "b.json"
    f.write_text(json.dumps(rows))
    out = subprocess.run([sys.executable, os.path.join(REPO, "bench", "regret_study.py"), "--moekit",
                          str(tmp_path / "no-moekit"), "--bench", str(f)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("uniform: 2 points (1 chosen on the device), worst regret 1.7% (gpt-oss-120b mxfp4 256)")
    assert lines[1].startswith("zipf: 2 points (1 chosen on the device), worst regret 4.0% (gpt-oss-120b mxfp4 128), 1 over")
    assert "gpt-oss-120b mxfp4 128: 4.0% (prefill, device" in out.stdout
    assert "the path over the chosen kernel alone, median 10.0 us, largest 10.0 us (2 points)" in out.stdout
