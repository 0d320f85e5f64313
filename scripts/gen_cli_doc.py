#!/usr/bin/env python3
"""docs/CLI.md from the `moekit` binary's own --help: the top level, then every subcommand it lists.

    scripts/gen_cli_doc.py build/moekit docs/CLI.md            write it
    scripts/gen_cli_doc.py build/moekit OUT --check docs/CLI.md write OUT, fail if it differs

The ctest `cli_doc` runs the second form (OUT in the build folder), so a changed option or help
text fails CI until docs/CLI.md is regenerated with the first. The binary runs with argv[0]
"moekit", so the usage lines do not name the build folder.
"""
import difflib
import re
import subprocess
import sys

HEADER = """# moekit command reference

Generated from the binary's own `--help` by `scripts/gen_cli_doc.py build/moekit docs/CLI.md`; do
not edit by hand (the ctest `cli_doc` fails when this file and `moekit --help` differ). What the
commands do beyond their options (model directories, input and output files, backends and the
oracle, exit codes): [USAGE.md](USAGE.md).
"""


def help_text(binary, args):
    r = subprocess.run(["moekit", *args, "--help"], executable=binary, capture_output=True, text=True,
                       timeout=60)
    if r.returncode != 0:
        sys.exit(f"gen_cli_doc: `moekit {' '.join(args)} --help` exited {r.returncode}: {r.stderr.strip()}")
    return r.stdout.rstrip() + "\n"


def subcommands(top):
    """The names in the top level's `Subcommands:` list (two-space indent, then the name)."""
    lines = top.splitlines()
    if "Subcommands:" not in lines:
        sys.exit("gen_cli_doc: `moekit --help` lists no subcommands")
    names = []
    for line in lines[lines.index("Subcommands:") + 1:]:
        m = re.match(r"^  (\S+)(\s|$)", line)
        if m:
            names.append(m.group(1))
        elif line and not line.startswith("   "):
            break  # the next section
    return names


def generate(binary):
    top = help_text(binary, [])
    names = subcommands(top)
    out = [HEADER, "Subcommands: " + ", ".join(f"[{n}](#moekit-{n})" for n in names) + ".", "",
           "## moekit", "", "```text", top.rstrip(), "```", ""]
    for n in names:
        out += [f"## moekit {n}", "", "```text", help_text(binary, [n]).rstrip(), "```", ""]
    return "\n".join(out)


def main():
    args = sys.argv[1:]
    check = None
    if "--check" in args:
        i = args.index("--check")
        if i + 1 >= len(args):
            sys.exit("gen_cli_doc: --check needs the committed file")
        check = args[i + 1]
        del args[i:i + 2]
    if len(args) != 2:
        sys.exit(__doc__)
    binary, out = args
    text = generate(binary)
    with open(out, "w") as f:
        f.write(text)
    if check is None:
        return 0
    with open(check) as f:
        committed = f.read()
    if committed == text:
        print(f"gen_cli_doc: {check} matches `moekit --help`")
        return 0
    sys.stdout.writelines(difflib.unified_diff(committed.splitlines(True), text.splitlines(True),
                                               check, "moekit --help"))
    print(f"gen_cli_doc: {check} differs from `moekit --help` (diff above); regenerate it with\n"
          f"  scripts/gen_cli_doc.py build/moekit docs/CLI.md\nand commit it")
    return 1


if __name__ == "__main__":
    sys.exit(main())
