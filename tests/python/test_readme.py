"""The README's examples run as written: the C++ one is tests/consumer/main.cpp (built and run
against an installed copy by the ctest install_consumer); the Python one runs here where torch is
installed, on the GPU under a CUDA graph and on the CPU backend."""

import os
import re
import subprocess
import sys

import pytest
from conftest import REPO


def block(kind):
    text = open(os.path.join(REPO, "README.md")).read()
    m = re.search(r"<!-- example: %s -->\n```\w+\n(.*?)```" % kind, text, re.S)
    assert m, f"README has no {kind} example"
    return m.group(1)


def test_cpp_example_is_the_consumer_test():
    src = open(os.path.join(REPO, "tests", "consumer", "main.cpp")).read()
    body = "".join(line for line in src.splitlines(True) if not line.startswith("// The README"))
    assert block("cpp") == body


def test_python_example_is_fifteen_lines_or_so():
    assert len(block("python").strip().splitlines()) <= 16


@pytest.mark.parametrize("where", ["default", "cpu"])
def test_python_example_runs(where):
    pytest.importorskip("torch")
    env = dict(os.environ)
    if where == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-c", block("python")], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    assert "moekit.Layer(" in r.stdout
