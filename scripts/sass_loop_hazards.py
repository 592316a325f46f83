#!/usr/bin/env python3
"""Find costly code shapes in compiled kernels (inside loops, or right after the PDL wait), from `cuobjdump -sass` output.

  integer division: I2F.RP / I2F.U32.RP (the start of the ~30-instruction sequence nvcc emits for `/`
      or `%` by a run-time value) between a backward branch's target and the branch. Session 31 found
      one before every stage's barrier wait of the GEMM ring loops (`it % ST` with a run-time ring
      depth): removing them was -0.2..-1.9 % per cycle (docs/perf.md).
  load then copy: a global load (LDG) whose destination register a MOV / IMAD.MOV reads within a
      few instructions, inside a loop. A value loaded "one step ahead" that ptxas copies into the
      loop-carried register at once waits for the load's whole latency there (session 31: the
      indexer scores' slot-table load, 13 % of the kernel's stall samples).

  after the PDL wait: an integer division (I2F*.RP) or a call of the 64-bit division routine (a CALL
      whose callee holds I2F.U64.RP) after the function's first ACQBULK (griddepcontrol.wait), outside
      loops: on the kernel's critical path when its operands were known before the wait. Session 32
      moved such divisions of launch constants before the wait (dev::pin_here): -0.6..-1.4 % per
      cycle. What remains is often a path the target shapes do not take; the report gives each one's
      distance from the wait.

A loop is the address range [target, branch] of a backward BRA; spin loops around a barrier try-wait
(SYNCS / a few instructions) count too, and a division inside one is still reported. Static only:
whether a hazard costs time is for a profile to say (scripts/ncu_sass_summary.py).

Usage: cuobjdump -sass build/.../file.cu.o > f.sass; scripts/sass_loop_hazards.py f.sass [--kernel SUBSTR]
Exit status 0 with a report (also when nothing is found); 2 when the file holds no function.
"""
import argparse
import re
import sys

INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRA = re.compile(r"\bBRA(?:\.\S+)?\s+(?:\S+,\s*)?(?:`\(\S+\)\s*)?0x([0-9a-f]+)")
DIV = re.compile(r"\bI2F(?:\.U32|\.U64)?\.RP\b")
DIV64 = re.compile(r"\bI2F\.U64\.RP\b")
CALL = re.compile(r"\bCALL\.REL(?:\.NOINC)?\s+0x([0-9a-f]+)")
LDG = re.compile(r"^(?:@!?U?P\w+\s+)?LDG\S*\s+(R\d+)")
MOV = re.compile(r"^(?:@!?U?P\w+\s+)?(?:IMAD\.MOV(?:\.U32)?|MOV)\s+R\d+,\s*(.*)$")


def functions(text):
    for chunk in text.split("Function : ")[1:]:
        name = chunk.split("\n", 1)[0].strip()
        ins = [(int(a, 16), s.strip()) for a, s in INS.findall(chunk)]
        if ins:
            yield name, ins


def loops_of(ins):
    out = []
    for addr, s in ins:
        m = BRA.search(s)
        if m:
            target = int(m.group(1), 16)
            if target <= addr:
                out.append((target, addr))
    return out


def innermost(loops, addr):
    best = None
    for lo, hi in loops:
        if lo <= addr <= hi and (best is None or hi - lo < best[1] - best[0]):
            best = (lo, hi)
    return best


def callees(ins):
    """{target: (start, end)} of every CALL.REL's callee: from the target to its first RET."""
    out = {}
    for _, s in ins:
        m = CALL.search(s)
        if m:
            t = int(m.group(1), 16)
            end = next((a for a, s2 in ins if a >= t and s2.split()[0].startswith("RET")), None)
            if end is not None:
                out[t] = (t, end)
    return out


def after_wait(ins):
    """Divisions and division-routine calls after the first ACQBULK, outside loops and callees."""
    wait = next((i for i, (_, s) in enumerate(ins) if "ACQBULK" in s), None)
    if wait is None:
        return []
    loops = loops_of(ins)
    calls = callees(ins)
    in_callee = lambda a: any(lo <= a <= hi for lo, hi in calls.values())
    found = []
    for i in range(wait + 1, len(ins)):
        addr, s = ins[i]
        if innermost(loops, addr) is not None or in_callee(addr):
            continue
        m = CALL.search(s)
        if m and int(m.group(1), 16) in calls:
            lo, hi = calls[int(m.group(1), 16)]
            if any(DIV64.search(s2) for a, s2 in ins if lo <= a <= hi):
                found.append(("division call", addr, s, ins[wait][0], i - wait))
        elif DIV.search(s):
            found.append(("division", addr, s, ins[wait][0], i - wait))
    return found


def hazards(ins, window):
    loops = loops_of(ins)
    found = []
    for i, (addr, s) in enumerate(ins):
        loop = innermost(loops, addr)
        if loop is None:
            continue
        if DIV.search(s):
            found.append(("integer division", addr, s, loop, None))
            continue
        m = LDG.match(s)
        if not m:
            continue
        reg = m.group(1)
        for j in range(i + 1, min(i + 1 + window, len(ins))):
            s2 = ins[j][1]
            mm = MOV.match(s2)
            if mm and re.search(r"\b%s\b" % reg, mm.group(1)):
                found.append(("load then copy", addr, s, loop, "%s (%d instructions later)" % (s2, j - i)))
                break
            if re.match(r"^(?:@!?U?P\w+\s+)?\S+\s+%s\b" % reg, s2):  # the register is written again
                break
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("sass", help="cuobjdump -sass output")
    ap.add_argument("--kernel", default="", help="only functions whose mangled name contains this")
    ap.add_argument("--window", type=int, default=24, help="instructions after a load to look for its copy (24)")
    a = ap.parse_args()
    text = open(a.sass, errors="replace").read()
    funcs = [(n, ins) for n, ins in functions(text) if a.kernel in n]
    if not funcs:
        print("sass_loop_hazards: no function%s in %s (cuobjdump -sass output expected)" %
              (" matching %r" % a.kernel if a.kernel else "", a.sass), file=sys.stderr)
        return 2
    total = 0
    for name, ins in funcs:
        found = hazards(ins, a.window)
        waited = after_wait(ins)
        total += len(found) + len(waited)
        print("%s: %d instructions, %d hazard%s in loops, %d after the PDL wait" %
              (name, len(ins), len(found), "" if len(found) == 1 else "s", len(waited)))
        for kind, addr, s, (lo, hi), extra in found:
            print("  %-16s 0x%04x  loop 0x%04x-0x%04x  %s%s" % (kind, addr, lo, hi, s, "  -> " + extra if extra else ""))
        for kind, addr, s, wait, dist in waited:
            print("  %-16s 0x%04x  wait 0x%04x +%-4d  %s" % (kind, addr, wait, dist, s))
    print("%d function%s, %d hazard%s" % (len(funcs), "" if len(funcs) == 1 else "s", total, "" if total == 1 else "s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
