"""scripts/report.py, the performance report's generator, on a small checked-in JSON (synthetic
numbers, tests/python/data/report_small.json): the markdown, non-empty PNGs with the expected
series, partial data, and the GPU machine's collect step. Needs matplotlib (scripts/python_env.sh
installs it); skipped without it."""

import importlib.util
import json
import os
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SAMPLE = os.path.join(HERE, "data", "report_small.json")


def load_report_module():
    spec = importlib.util.spec_from_file_location("moekit_report", os.path.join(REPO, "scripts", "report.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/python_env.sh installs it)")
    return load_report_module()


def sample():
    with open(SAMPLE) as f:
        return json.load(f)


def write(tmp_path, name, data):
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return str(p)


def check_png(path):
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n", path
    assert os.path.getsize(path) > 5000, path


def by_kind(manifest, preset, kind):
    hits = [p for p in manifest if p.endswith(f"_{preset}_{kind}.png")]
    assert len(hits) == 1, (preset, kind, sorted(manifest))
    return hits[0]


def test_full_sample_makes_every_plot_with_its_series(report, tmp_path):
    md = tmp_path / "REPORT.md"
    manifest = report.generate([SAMPLE], str(md), str(tmp_path / "plots"))
    assert len(manifest) == 6  # two presets x (time, roofline, split)
    for path in manifest:
        check_png(path)
    torch = "torch._grouped_mm bf16 (GEMMs only)"
    for preset in ("gpt_oss_120b", "mixtral_8x7b"):
        assert manifest[by_kind(manifest, preset, "time")] == ["moekit mxfp4", "moekit bf16", torch]
        assert sorted(manifest[by_kind(manifest, preset, "roofline")]) == sorted(
            ["mxfp4 uniform", "mxfp4 zipf", "bf16 uniform", "bf16 zipf"])
        assert manifest[by_kind(manifest, preset, "split")] == report.PARTS
    text = md.read_text()
    assert "Synthetic numbers" in text
    for want in ("### gpt-oss-120b", "### mixtral-8x7b", "The oracle's regret", "x " + torch,
                 "skipped (No module named 'triton_kernels')", "580.159.04", "Not in this run: gpt-oss-20b",
                 "<summary>zipf routing (s = 1)"):
        assert want in text, want
    for path in manifest:  # every plot is linked from the markdown, relative to it
        assert os.path.relpath(path, tmp_path) in text


def test_regret_and_roofline_numbers(report):
    r = {"gemm_us": 103.0, "decode_us": 103.0, "prefill_us": 100.0}
    assert report.regret_pct(r) == pytest.approx(3.0)
    assert report.regret_pct({"gemm_us": 100.0, "decode_us": 100.0, "prefill_us": 0}) is None
    # 3 MB at 3 TB/s is 1 us; 1.56 GFLOP at 780 TFLOP/s is 2 us: the roofline is 2 us.
    r = {"gemm_us": 4.0, "gemm_bytes": 3e6, "copy_tbps": 3.0, "flops": 1.56e9, "bf16_tflops": 780.0}
    assert report.roofline_pct(r) == pytest.approx(50.0)


def test_partial_data_still_makes_a_report(report, tmp_path):
    d = sample()
    d["peers"], d["peer_status"], d["tuning"] = [], [], {}
    d["bench"] = [r for r in d["bench"] if r["format"] == "mxfp4" and r["routing"] == "uniform"]
    for r in d["bench"]:
        for p in report.PARTS:
            r[p + "_us"] = None  # no time split
        if r["tokens"] == 64:
            del r["decode_us"], r["bf16_tflops"], r["layer_us"]  # fields a crashed run may lack
    d["bench"].append({"shape": "gpt-oss-120b", "format": "mxfp4", "tokens": "bad"})  # not a row
    md = tmp_path / "REPORT.md"
    manifest = report.generate([write(tmp_path, "partial.json", d)], str(md), str(tmp_path / "plots"))
    kinds = sorted(os.path.basename(p).rsplit("_", 1)[1] for p in manifest)
    assert kinds == ["roofline.png", "roofline.png", "time.png", "time.png"]  # no split without data
    for path in manifest:
        check_png(path)
    assert manifest[by_kind(manifest, "gpt_oss_120b", "time")] == ["moekit mxfp4"]
    text = md.read_text()
    assert "Peers: none in this run." in text and "| mxfp4 | 64 | decode | — |" in text


def test_no_data_and_stale_plots(report, tmp_path):
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "old_preset_time.png").write_bytes(b"x")
    md = tmp_path / "REPORT.md"
    assert report.generate([], str(md), str(plots)) == {}
    assert "No data" in md.read_text()
    assert not (plots / "old_preset_time.png").exists()


def test_collect_merges_the_gpu_run_pieces(report, tmp_path):
    d = sample()
    run = tmp_path / "run"
    run.mkdir()
    for i, preset in enumerate(("gpt-oss-120b", "mixtral-8x7b")):
        (run / f"bench_{i}.json").write_text(json.dumps([r for r in d["bench"] if r["shape"] == preset]))
    (run / "bench_broken.json").write_text("[{")  # a run cut short
    (run / "peers_uniform.json").write_text(json.dumps({"rows": d["peers"], "status": d["peer_status"]}))
    (run / "peers_zipf.json").write_text(json.dumps({"rows": [], "status": d["peer_status"]}))
    (run / "tuning.json").write_text(json.dumps(d["tuning"]))
    out = tmp_path / "report.json"
    report.collect(str(run), str(out))
    merged = json.loads(out.read_text())
    assert merged["gpu"] == "NVIDIA H100 80GB HBM3"
    assert len(merged["bench"]) == len(d["bench"])
    assert len(merged["peers"]) == len(d["peers"])
    assert merged["peer_status"] == d["peer_status"]  # no duplicates
    assert len(merged["tuning"]["entries"]) == 4
    md, plots = tmp_path / "R.md", tmp_path / "p"
    report.main([str(out), "--md", str(md), "--plots", str(plots)])  # the command line, as documented
    assert md.exists() and len(list(plots.glob("*.png"))) == 6


def test_gpu_script_end_to_end_on_the_cpu_backend(report, tmp_path):
    """scripts/report_gpu.sh's plumbing (tune, bench, peers, collect) with the CPU backend on small
    shapes; tune needs an SM90 GPU and fails here, which the script reports and goes past."""
    moekit = os.environ.get("MOEKIT_BIN") or os.path.join(REPO, "build", "moekit")
    if not os.path.exists(moekit):
        pytest.skip(f"no moekit binary at {moekit}")
    env = dict(os.environ, OUT=str(tmp_path), B=os.path.dirname(moekit), REPORT_PRESETS="8,2,64,64 4,1,64,128",
               REPORT_FORMATS="bf16 mxfp4", REPORT_TOKENS="1,3", REPORT_BACKEND="cpu", REPORT_REPS="1")
    r = subprocess.run([os.path.join(REPO, "scripts", "report_gpu.sh")], env=env, capture_output=True, text=True,
                       timeout=600)
    assert "[bench 4/4" in r.stdout, r.stdout + r.stderr
    merged = json.loads((tmp_path / "report" / "report.json").read_text())
    assert len(merged["bench"]) == 2 * 2 * 2 * 2  # shapes x formats x routings x token counts
    assert {row["routing"] for row in merged["bench"]} == {"uniform", "zipf"}
    assert all(s["status"] == "skipped" for s in merged["peer_status"]) or merged["peers"]
    md = tmp_path / "R.md"
    manifest = report.generate([str(tmp_path / "report" / "report.json")], str(md), str(tmp_path / "plots"))
    assert len(manifest) == 2  # one time plot per shape (no GEMM times, no split on the CPU)
    assert "### 8,2,64,64" in md.read_text()
