#!/usr/bin/env python3
"""Checks that the named kernels of a binary use no local memory (cuobjdump -res-usage: STACK and
LOCAL 0; SASS: no LDL / STL).

The FP8 GEMM's consumers need more registers than a kernel of 384 threads starts with (168), and
get them from setmaxnreg.inc only while no trap is reachable from their code: ptxas of CUDA 13.0
allocates the code that can reach a trap within the entry count (issue 49; sm90_fp8_gemm.cuh,
ring_wait). A trap back in their path, or a change that needs more than their 224 registers,
shows here as spills.

Usage: scripts/check_no_spills.py [--fetch-to DIR] BINARY FUNCTION_REGEX
cuobjdump as scripts/check_rs_wgmma.py finds or fetches it (exit 77 without one: CTest skipped).
"""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_rs_wgmma import cuobjdump  # noqa: E402


def main():
    args = sys.argv[1:]
    fetch = None
    if len(args) >= 2 and args[0] == '--fetch-to':
        fetch, args = args[1], args[2:]
    if len(args) != 2:
        print(__doc__)
        return 2
    binary, pattern = args[0], re.compile(args[1])
    tool = cuobjdump(fetch)
    if not tool:
        print('check_no_spills: SKIPPED, no cuobjdump (set CUOBJDUMP, or --fetch-to DIR)')
        return 77
    res = subprocess.run([tool, '-res-usage', binary], capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r'Function (\S+):\s*\n\s*(REG:.*)', res))
    names = sorted(f for f in usage if pattern.search(f))
    if not names:
        print(f'check_no_spills: no function of {binary} matches {pattern.pattern}')
        return 1
    bad = 0
    for f in names:
        u = dict(kv.split(':', 1) for kv in usage[f].split())
        sass = subprocess.run([tool, '-sass', '-fun', f, binary], capture_output=True, text=True).stdout
        ldl, stl = len(re.findall(r'\bLDL\b', sass)), len(re.findall(r'\bSTL\b', sass))
        top = max((int(r) for r in re.findall(r'\bR(\d+)\b', sass)), default=-1)
        ok = u.get('STACK') == '0' and u.get('LOCAL') == '0' and ldl == 0 and stl == 0 and top >= 0
        bad += not ok
        print(f'{f}: REG {u.get("REG")} (highest register in its SASS R{top}), stack {u.get("STACK")}, '
              f'local {u.get("LOCAL")}, {ldl} LDL, {stl} STL{"" if ok else "  <- FAIL"}')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
