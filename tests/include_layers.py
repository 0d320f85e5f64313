#!/usr/bin/env python3
"""The include graph of src/moekit/ points one way: a room includes only rooms below it.

Usage: include_layers.py SOURCE_DIR (ctest: include_layers, label cpu; no build needed).

A room is a folder of src/moekit/. LAYERS lists them from the bottom up; a file may include
headers of its own room and of any room listed before it. An include that runs up the list is
an error, unless it is one of the KNOWN back-arrows below (each with the reason it is there
today); a known back-arrow that no longer exists is an error too, so the list only shrinks.
The public headers (include/moekit/*.hpp) sit under every room and include only each other.
The order follows the tree and ../shared/notes/layout.md (the data path from formats up to the
CLI; files never reach below model/).
"""
import os
import re
import sys

LAYERS = [
    "common",    # errors, bf16, PTX wrappers, the description's enum names
    "formats",   # one header per block format, host + device dequant
    "routing",   # top-k routing, CPU and SM90
    "pipeline",  # activation formats, prepare/finalize (local)
    "experts",   # CPU experts, the float64 reference, the SM90 GEMMs and their layout
    "comm",      # expert parallelism: NCCL windows, dispatch/combine
    "oracle",    # capabilities, the layer checks, tuning tables, the choice
    "backends",  # (prepare/finalize, experts) pairs, the registry
    "api",       # the public API's implementation
    "io",        # safetensors, files
    "model",     # config.json, layer and checkpoint directories
    "bench",     # the `moekit bench` / `moekit tune` drivers
    "cli",       # the `moekit` binary
    "bindings",  # the Python binding
]

# (including file, included header) pairs that run up LAYERS today. Each one is a debt, not a
# precedent: a new include in the same direction from another file fails.
KNOWN = {
    # The plan buffers and launch helpers of prepare/finalize size their rows by the decode
    # GEMM's token chunk (kTokens); the constant belongs in a header below both.
    ("pipeline/prepare_finalize_sm90.cuh", "experts/sm90_moe_gemm.cuh"),
    # The device side of the decode/prefill choice runs the oracle's arithmetic on the GPU
    # (one header shared by host and device so they cannot disagree).
    ("pipeline/kernel_choice_sm90.cu", "oracle/kernel_choice.h"),
    # The decode GEMM static_asserts that the oracle's chunk limits mirror its variants.
    ("experts/sm90_moe_gemm.cu", "oracle/kernel_choice.h"),
}

INCLUDE = re.compile(r'^\s*#\s*include\s*"moekit/([^"]+)"', re.M)
SOURCES = (".h", ".hpp", ".cuh", ".cpp", ".cc", ".cu")


def includes(path):
    with open(path, encoding="utf-8") as f:
        return INCLUDE.findall(f.read())


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: include_layers.py SOURCE_DIR")
    root = sys.argv[1]
    src = os.path.join(root, "src", "moekit")
    rank = {room: i for i, room in enumerate(LAYERS)}
    errors, seen = [], set()

    for room in sorted(os.listdir(src)):
        if os.path.isdir(os.path.join(src, room)) and room not in rank:
            errors.append(f"src/moekit/{room}/: a room not in LAYERS; add it where it belongs")

    for dirpath, _, names in os.walk(src):
        for name in sorted(names):
            if not name.endswith(SOURCES):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, src).replace(os.sep, "/")
            room = rel.split("/")[0]
            if room not in rank:
                continue  # reported above
            for inc in includes(path):
                target = inc.split("/")[0]
                if "/" not in inc:
                    continue  # a public header (moekit/spec.hpp): below every room
                if target not in rank:
                    errors.append(f"src/moekit/{rel}: includes moekit/{inc}, a room not in LAYERS")
                elif rank[target] > rank[room]:
                    if (rel, inc) in KNOWN:
                        seen.add((rel, inc))
                    else:
                        errors.append(f"src/moekit/{rel}: includes moekit/{inc}: {room}/ is below "
                                      f"{target}/ (tests/include_layers.py LAYERS); move the code "
                                      f"that both need down, or this file up")

    for rel, inc in sorted(KNOWN - seen):
        errors.append(f"src/moekit/{rel} no longer includes moekit/{inc}: remove it from "
                      f"KNOWN in tests/include_layers.py")

    public = os.path.join(root, "include", "moekit")
    for name in sorted(os.listdir(public)):
        for inc in includes(os.path.join(public, name)):
            if "/" in inc:
                errors.append(f"include/moekit/{name}: includes moekit/{inc}; the public headers "
                              f"include only each other")

    for e in errors:
        print("include_layers: " + e)
    if errors:
        return 1
    print(f"include_layers: {len(LAYERS)} rooms, every include points down "
          f"({len(KNOWN)} known back-arrows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
