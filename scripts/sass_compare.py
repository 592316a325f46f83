#!/usr/bin/env python3
"""Which kernels two builds compile differently, from `cuobjdump -sass` output of each.

Per function present in either file: `same` when the instruction sequences are equal after dropping
addresses and encodings (so a rebuilt object with the same code compares equal), else `differs` with
the instruction counts and the opcode histogram difference (e.g. `LOP3.LUT +3, NOP -6`: a register
allocation change rather than new work). Session 35 used it to show that a kept combination of two
measured variants (v3 with three block-sum sets at MT 1 / NP <= 32, two elsewhere) compiles every
kernel exactly as one of the measured builds did: a claim about bytes of code, which a GPU run
cannot give when the device time is spent.

Usage:
  cuobjdump -sass a.o > a.sass; cuobjdump -sass b.o > b.sass
  scripts/sass_compare.py a.sass b.sass [--kernel SUBSTR] [--only-diff]
Exit status 0 when every compared function is the same, 1 when some differ, 2 when a file holds no
function.
"""
import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_sass_summary import opcode  # noqa: E402  (the predicate-stripping opcode of a SASS line)
from sass_loop_hazards import functions  # noqa: E402  (the cuobjdump -sass reader: name, [(addr, text)])

# Branch / call targets are addresses, which move when code before them changes size.
_TARGET = re.compile(r"\b(BRA|CALL\.REL\.NOINC|CALL\.REL|BSSY|JMP|BRX)\b(.*?)0x[0-9a-f]+")


def read_functions(path):
    """{mangled name: [instruction text, addresses and branch targets dropped]} of one file."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return {name: [_TARGET.sub(r"\1\2<addr>", s) for _, s in ins] for name, ins in functions(f.read())}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--kernel", default="", help="compare only functions whose name contains this")
    ap.add_argument("--only-diff", action="store_true", help="print only the functions that differ")
    args = ap.parse_args()
    fa, fb = read_functions(args.a), read_functions(args.b)
    if not fa or not fb:
        print("no function in %s" % (args.a if not fa else args.b), file=sys.stderr)
        return 2
    names = sorted(n for n in set(fa) | set(fb) if args.kernel in n)

    def opcodes_delta(a, b):
        ha = collections.Counter(opcode(i) for i in a)
        hb = collections.Counter(opcode(i) for i in b)
        delta = ", ".join("%s %+d" % (k, hb[k] - ha[k]) for k in sorted(set(ha) | set(hb)) if ha[k] != hb[k])
        return delta or "same opcodes, other operands"

    return report(fa, fb, names, opcodes_delta, args.only_diff)


def report(fa, fb, names, describe, only_diff=False, after_diff=None):
    """Print, per name, `only in a/b`, `same N` or `differs N -> M  name  [describe(a, b)]` (then
    after_diff(a, b), if given), then the count; the exit status: 1 when some differ, else 0.
    fa / fb: {name: [instruction or line]}. Shared with scripts/ptx_compare.py."""
    n_diff = 0
    for n in names:
        if n not in fa or n not in fb:
            n_diff += 1
            print("only in %s: %s" % ("b" if n not in fa else "a", n))
            continue
        if fa[n] == fb[n]:
            if not only_diff:
                print("same     %5d  %s" % (len(fa[n]), n))
            continue
        n_diff += 1
        print("differs  %5d -> %5d  %s  [%s]" % (len(fa[n]), len(fb[n]), n, describe(fa[n], fb[n])))
        if after_diff is not None:
            after_diff(fa[n], fb[n])
    print("%d of %d functions differ" % (n_diff, len(names)))
    return 1 if n_diff else 0


if __name__ == "__main__":
    sys.exit(main())
