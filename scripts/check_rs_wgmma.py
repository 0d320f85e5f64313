#!/usr/bin/env python3
"""Checks the SASS of register-input wgmma kernels for writes to a wgmma's A registers before the
WARPGROUP.DEPBAR that retires it.

A register-input wgmma (HGMMA/QGMMA with A in registers) reads its A operand asynchronously; the
PTX ISA makes touching those registers before the wgmma.wait_group undefined. ptxas of CUDA 13.0
reuses them when the PTX value is dead after the wgmma (fixed in a later ptxas), which gave the
FP8 GEMM random wrong results on an H200 (issue 49): a kernel keeps its A values live past the
wait (sm90_fp8_gemm.cuh reg_fence) and this check says whether the built code does.

Usage: scripts/check_rs_wgmma.py [--fetch-to DIR] BINARY [FUNCTION_REGEX]   (default regex: every
wgmma kernel of moekit). Needs cuobjdump ($CUOBJDUMP, PATH or $CUDA_HOME/bin; the toolkit of this
project's build machine has none, and it runs nvdisasm): --fetch-to DIR takes both from their PyPI
wheels (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm: pip download into DIR, once). Without one it says so and exits 77 (CTest:
skipped).
The scan is linear (branches ignored): a commit group (the wgmma marked gsb0 closes it) is
retired by a later WARPGROUP.DEPBAR.LE gsb0, N keeping the N newest.
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import zipfile

# The versions issue 49's analysis used (cuobjdump -sass runs nvdisasm).
WHEELS = ('nvidia-cuda-cuobjdump==13.2.51', 'nvidia-cuda-nvdisasm==13.5.37')

SKIP_OPS = ('ST', 'RED', 'ATOM', 'BRA', 'BAR', 'SYNCS', 'WARPGROUP', 'UTMA', 'UBLKCP', 'EXIT', 'RET', 'CALL', 'NOP',
            'BSSY', 'BSYNC', 'WARPSYNC', 'DEPBAR', 'MEMBAR', 'FENCE', 'CCTL', 'NANOSLEEP', 'YIELD', 'R2UR', 'ELECT',
            'PLOP3', 'ISETP', 'FSETP', 'UISETP', 'PREEXIT', 'BPT', 'KILL')


def cuobjdump(fetch_dir):
    cands = [os.environ.get('CUOBJDUMP'), shutil.which('cuobjdump'),
             os.path.join(os.environ.get('CUDA_HOME', '/usr/local/cuda'), 'bin', 'cuobjdump')]
    if fetch_dir:
        cands += glob.glob(os.path.join(fetch_dir, 'x', '**', 'bin', 'cuobjdump'), recursive=True)
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    if not fetch_dir:
        return None
    os.makedirs(fetch_dir, exist_ok=True)
    try:
        subprocess.run([sys.executable, '-m', 'pip', 'download', '--quiet', '--no-deps', '--only-binary=:all:',
                        '-d', fetch_dir, *WHEELS], check=True, timeout=300, capture_output=True)
        for whl in glob.glob(os.path.join(fetch_dir, 'nvidia_cuda_*.whl')):
            zipfile.ZipFile(whl).extractall(os.path.join(fetch_dir, 'x'))
    except (subprocess.SubprocessError, OSError, zipfile.BadZipFile) as e:
        print(f'check_rs_wgmma: could not fetch {WHEELS}: {e}')
        return None
    found = None
    for c in glob.glob(os.path.join(fetch_dir, 'x', '**', 'bin', '*'), recursive=True):
        os.chmod(c, 0o755)
        if os.path.basename(c) == 'cuobjdump':
            found = c
    return found


def written(text):
    """General registers an instruction writes (its first operand), as a set."""
    t = re.sub(r'^@!?U?P[0-9T] ', '', text)
    parts = t.split(None, 1)
    if len(parts) < 2 or parts[0].startswith(SKIP_OPS):
        return set()
    op, args = parts
    m = re.match(r'R(\d+)$', args.split(',')[0].strip())
    if not m:
        return set()
    n = 4 if '.128' in op else 2 if ('.64' in op or op.startswith(('IMAD.WIDE', 'CS2R', 'HMMA'))) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + n))


def check(sass):
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r'/\*([0-9a-f]{4,})\*/\s+([^;]*?);', sass)]
    pending, cur, hits, wgmmas = [], [], [], 0
    for addr, text in ins:
        if 'GMMA' in text:
            m = re.search(r'GMMA\.\S+ R\d+, R(\d+),', text)
            if m:
                wgmmas += 1
                cur.append((addr, set(range(int(m.group(1)), int(m.group(1)) + 4))))
            if 'gsb0' in text:
                pending.append(cur)
                cur = []
            continue
        m = re.search(r'WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)', text)
        if m:
            keep = int(m.group(1), 16)
            pending = pending[len(pending) - keep:] if keep else []
            continue
        w = written(text)
        if w:
            for group in pending + [cur]:
                for gaddr, regs in group:
                    if w & regs:
                        hits.append((addr, text, gaddr))
    return wgmmas, hits


def main():
    args = sys.argv[1:]
    fetch_dir = None
    if len(args) >= 2 and args[0] == '--fetch-to':
        fetch_dir, args = args[1], args[2:]
    if not args:
        print(__doc__)
        return 2
    binary = args[0]
    pattern = re.compile(args[1] if len(args) > 1 else r'_ZN6moekit4sm90\S*(prefill_gemm_kernel|fp8_gemm_kernel)\S*')
    tool = cuobjdump(fetch_dir)
    if not tool:
        print('check_rs_wgmma: SKIPPED, no cuobjdump (set CUOBJDUMP, or --fetch-to DIR)')
        return 77
    env = dict(os.environ)
    env['PATH'] = os.path.dirname(tool) + os.pathsep + env.get('PATH', '')  # its nvdisasm, if beside it
    syms = subprocess.run([tool, '-symbols', binary], capture_output=True, text=True, env=env).stdout
    funcs = sorted(set(m.group(0) for m in re.finditer(r'_Z\S+', syms) if pattern.fullmatch(m.group(0))))
    if not funcs:
        print(f'check_rs_wgmma: no function of {binary} matches {pattern.pattern}')
        return 1
    bad = 0
    for f in funcs:
        run = subprocess.run([tool, '-sass', '-fun', f, binary], capture_output=True, text=True, env=env)
        n, hits = check(run.stdout)
        if n == 0:
            # Every kernel matched has wgmmas: none read means no SASS (cuobjdump without nvdisasm).
            err = [l for l in (run.stdout + run.stderr).splitlines() if 'fatal' in l]
            print(f'{f}: no wgmma in its SASS as cuobjdump printed it: {err[:1]}')
            bad += 1
            continue
        print(f'{f}: {n} register-input wgmmas, {len(hits)} early writes to their A registers')
        for addr, text, gaddr in hits[:5]:
            print(f'  {addr:05x} {text}   (A of the wgmma at {gaddr:05x}, not yet retired)')
        bad += len(hits) > 0
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
