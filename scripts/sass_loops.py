#!/usr/bin/env python3
"""Instructions per k loop in SASS: for every kernel of a `cuobjdump -sass` listing, every loop
(a backward branch and the instructions from its target to it) that holds tensor instructions
(HGMMA or HMMA), with the loop's length, its tensor-instruction shape and count, and the
instructions by opcode. What docs/perf/log.md's "instructions per k-block" figures count (the
barrier waits' slow paths inside the loop included). Loops that hold other loops (a persistent
kernel's tile loop) are listed too: a k loop is the shortest line of its shape.

Usage:
  cuobjdump -sass OBJECT_OR_BINARY > k.sass      # cuobjdump needs nvdisasm on PATH; both come
                                                 # with the toolkit or the nvidia-cuda-cuobjdump /
                                                 # nvidia-cuda-nvdisasm wheels
  scripts/sass_loops.py k.sass [--kernel REGEX] [--ops]
An object whose fatbin is compressed: `cuobjdump -xelf all OBJECT` first, then -sass the .cubin.
"""
import argparse
import collections
import re
import sys


def parse(path):
    funcs, cur = {}, None
    with open(path) as f:
        for line in f:
            m = re.search(r"Function : (\S+)", line)
            if m:
                cur = m.group(1)
                funcs[cur] = []
                continue
            m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
            if m and cur:
                funcs[cur].append((int(m.group(1), 16), m.group(2).strip()))
    return funcs


def opcode(text):
    op = text.split()[1] if text.startswith("@") else text.split()[0]
    return op.split(".")[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sass")
    ap.add_argument("--kernel", default="", help="only kernels whose (mangled) name matches")
    ap.add_argument("--ops", action="store_true", help="print each loop's opcode counts")
    a = ap.parse_args(argv)
    for name, ins in parse(a.sass).items():
        if not re.search(a.kernel, name):
            continue
        at = {addr: i for i, (addr, _) in enumerate(ins)}
        loops = set()
        for i, (addr, text) in enumerate(ins):
            m = re.search(r"BRA (0x[0-9a-f]+)", text)
            if not m:
                continue
            target = int(m.group(1), 16)
            if target >= addr or target not in at:
                continue
            body = ins[at[target] : i + 1]
            tensor = collections.Counter(
                re.search(r"(HGMMA\.\S+?|HMMA\.\S+?)\.F32", t).group(1)
                for _, t in body
                if re.search(r"(HGMMA|HMMA)\.\S+?\.F32", t)
            )
            if tensor:
                ops = collections.Counter(opcode(t) for _, t in body)
                loops.add((tuple(sorted(tensor.items())), len(body), tuple(sorted(ops.items(), key=lambda kv: -kv[1]))))
        if not loops:
            continue
        print(name)
        for tensor, n, ops in sorted(loops):
            shapes = ", ".join(f"{s} x{c}" for s, c in tensor)
            print(f"  {n:5d} instructions: {shapes}")
            if a.ops:
                print("        " + " ".join(f"{o}:{c}" for o, c in ops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
