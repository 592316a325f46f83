#!/usr/bin/env python3
"""Which kernels two builds compile differently, from their PTX (`nvcc -ptx`): the development machine's
stand-in for scripts/sass_compare.py, which needs cuobjdump (only the GPU machine has it). ptxas is
deterministic, so a function whose PTX is the same compiles to the same SASS.

Per function (.entry / .func, up to its closing brace) present in either file: `same` when the bodies are
equal after dropping what a rebuild or a rename moves -- `.loc` / `.file` lines and comments, the numbers
of branch labels ($L__BB3_7 -> $L__BB_7) and the per-file hashes of internal-linkage names -- else
`differs` with the count of lines each side has that the other lacks. `--map A=B` (repeatable) rewrites A
to B in file a's function names before matching, for a function that gained a template parameter
(`--map 'kernelILb0EE=kernelILb0ELb0EE'`); `--ignore-symbols` also compares bodies with every mangled
name replaced (calls of such renamed functions); `--common` skips the functions only one file defines;
`--diff` prints a unified diff of each differing body. A function's own name in its body (its
parameters are named after it) is always replaced.
Session 36 used it to show that the selection kernels without the window exchange compile as before it.

Usage:
  nvcc <the object's flags> -ptx file.cu -o a.ptx   (the same for the other build: b.ptx)
  scripts/ptx_compare.py a.ptx b.ptx [--kernel SUBSTR] [--map A=B ...] [--ignore-symbols] [--common] [--only-diff]
                         [--diff]
Exit status 0 when every compared function is the same, 1 when some differ, 2 when a file holds no
function.
"""
import argparse
import difflib
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_compare import report  # noqa: E402  (the per-function report and exit status, shared)

_START = re.compile(r"^(?:\.visible\s+|\.weak\s+)?(?:\.entry|\.func)\b")
_NAME = re.compile(r"([A-Za-z_$][\w$]*)\s*\(")
_RETVAL = re.compile(r"\.func\s*\([^)]*\)")  # a .func's return parameter, before its name
# Internal linkage: nvcc names a file's anonymous namespace and internal symbols with a hash of the file.
_INTERNAL = (re.compile(r"_ZN\d+_INTERNAL_[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}"),
             re.compile(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}"))
_LABEL = re.compile(r"\$L__BB\d+_")
_MANGLED = re.compile(r"\b_Z\w+")


def _normal(line, self_name=None, ignore_symbols=False):
    if self_name:
        line = line.replace(self_name, "<self>")  # a function's parameters are named after it
    if ignore_symbols:
        line = _MANGLED.sub("<sym>", line)
    for r, sub in zip(_INTERNAL, ("_ZN<internal>", "<anon>")):
        line = r.sub(sub, line)
    return _LABEL.sub("$L__BB_", line)


def functions(text):
    """[(name, [lines])] of the .entry / .func definitions in PTX text (declarations, which end in ';'
    before any body, are skipped), without comments, blank, .loc and .file lines. A definition's body
    opens and closes with a brace at column 0."""
    out, lines = [], text.split("\n")
    i = 0
    while i < len(lines):
        if not _START.match(lines[i]):
            i += 1
            continue
        m = _NAME.search(_RETVAL.sub("", lines[i], count=1))
        name = m.group(1) if m else "<unnamed %d>" % len(out)
        body, opened = [], False
        while i < len(lines):
            raw = lines[i].rstrip()
            i += 1
            s = raw.split("//", 1)[0].strip()
            if not s or s.startswith(".loc") or s.startswith(".file"):
                continue
            body.append(s)
            if raw == "{":
                opened = True
            elif raw == "}" and opened:
                out.append((name, body))
                break
            elif not opened and s.endswith(";"):
                break  # a declaration
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--kernel", default="", help="compare only functions whose name contains this")
    ap.add_argument("--map", action="append", default=[], metavar="A=B", help="rename A to B in file a's function names")
    ap.add_argument("--ignore-symbols", action="store_true", help="compare bodies with mangled names replaced")
    ap.add_argument("--common", action="store_true", help="compare only the functions both files define")
    ap.add_argument("--only-diff", action="store_true", help="print only the functions that differ")
    ap.add_argument("--diff", action="store_true", help="print a unified diff of each differing body")
    args = ap.parse_args()
    maps = []
    for m in args.map:
        if "=" not in m:
            ap.error("--map takes A=B, not %r" % m)
        maps.append(tuple(m.split("=", 1)))
    with open(args.a, encoding="utf-8", errors="replace") as f:
        fa = functions(f.read())
    with open(args.b, encoding="utf-8", errors="replace") as f:
        fb = functions(f.read())
    if not fa or not fb:
        print("no function in %s" % (args.a if not fa else args.b), file=sys.stderr)
        return 2

    def renamed(n):
        for x, y in maps:
            n = n.replace(x, y)
        return n

    def table(funcs, rename):
        return {_normal(rename(n)): [_normal(l, n, args.ignore_symbols) for l in body] for n, body in funcs}

    da = table(fa, renamed)
    db = table(fb, lambda n: n)
    names = sorted(n for n in (set(da) & set(db) if args.common else set(da) | set(db)) if args.kernel in n)

    def delta(a, b):
        return list(difflib.unified_diff(a, b, "a", "b", n=0, lineterm=""))

    def lines_delta(a, b):
        d = delta(a, b)
        minus = sum(1 for l in d if l.startswith("-") and not l.startswith("---"))
        plus = sum(1 for l in d if l.startswith("+") and not l.startswith("+++"))
        return "-%d +%d lines" % (minus, plus)

    return report(da, db, names, lines_delta, args.only_diff,
                  (lambda a, b: print("\n".join(delta(a, b)))) if args.diff else None)


if __name__ == "__main__":
    sys.exit(main())
