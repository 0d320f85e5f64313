"""pytest setup of the engine adapters' tests: each engine runs in a virtual environment of its
own (scripts/engine_env.sh: vLLM and SGLang pin their own torch), with moekit from the working tree
(PYTHONPATH=python, MOEKIT_FFI_LIBRARY=the built binding). tests/python is on the path for the
float64 reference (reference.py). With MOEKIT_REQUIRE_ENGINES set (scripts/test.sh), a missing
engine package is an error, not a skip."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))


def engine(name):
    """Imports the engine package; skips (errors under MOEKIT_REQUIRE_ENGINES) when it is missing."""
    import importlib

    import pytest
    if os.environ.get("MOEKIT_REQUIRE_ENGINES"):
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"{name} is not installed (scripts/engine_env.sh {name})")
