#!/usr/bin/env python3
"""Summarise the SASS source view of one Nsight Compute profile: where a kernel's instructions and
its warp stalls go, per opcode and per instruction.

Export the view on the machine that has ncu (the profile needs `--import-source yes`), e.g.
    ncu --kernel-name regex:indexer_scores_kernel --launch-skip 3 --launch-count 1 --set full \\
        --import-source yes -o sc bench_indexer --T 32 --clen 65536 --shape decode --only scores:auto
    ncu -i sc.ncu-rep --page source --csv --print-source sass > sc_sass.csv
then, anywhere:
    scripts/ncu_sass_summary.py sc_sass.csv --per 65536 --top 30
`--per N` divides the instruction counts by N (e.g. the warp steps of a kernel: 32 rows x 65536 / 32
positions = 65536 for the scores kernel at 32 rows x 64K), so a kernel's "instructions per unit of
work" can be compared across versions. Stall shares are of all the warp-state samples of the
profile ("Warp Stall Sampling (All Samples)"); the hottest instructions come with their address,
their execution count per unit and their samples, in the order of their samples.

`--regions` groups the instructions by how often each ran: the straight-line code of one region (a
loop body, a prologue run once per warp) shares one execution count, so the table says where the
samples are by region -- e.g. session 30's v2 GEMM at 32 rows: 832 instructions ran 5120 times (its
consumers' pair body, 48 % of the samples). `--count N` then restricts every table to the
instructions that ran exactly N times (raw counts, before --per). Where the export has the per-reason
columns (stall_long_sb, stall_wait, ...: `--set full`), the stall reasons of the selection follow.
"""
import argparse
import collections
import csv
import re
import sys


def read_rows(path):
    """(address, source, executions, samples, {stall reason: samples}) per instruction."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    # The export starts with a "Kernel Name" line, then the header.
    start = 1 if rows and rows[0] and rows[0][0].startswith("Kernel Name") else 0
    header, data = rows[start], rows[start + 1:]
    need = ["Address", "Source", "Instructions Executed", "Warp Stall Sampling (All Samples)"]
    missing = [c for c in need if c not in header]
    if missing:
        sys.exit(f"{path}: not an ncu SASS source export (missing columns: {', '.join(missing)})")
    idx = {c: header.index(c) for c in need}
    reasons = {c[len("stall_"):]: i for i, c in enumerate(header) if c.startswith("stall_") and "Not Issued" not in c}
    out = []
    for r in data:
        if len(r) <= max([*idx.values(), *reasons.values()]):
            continue
        try:
            n = float(r[idx["Instructions Executed"]] or 0)
            s = float(r[idx["Warp Stall Sampling (All Samples)"]] or 0)
            st = {k: float(r[i] or 0) for k, i in reasons.items()}
        except ValueError:
            continue
        out.append((r[idx["Address"]], r[idx["Source"]].strip(), n, s, st))
    return out


def opcode(src):
    # "@!P2  BRA 0x..." -> "BRA"; "IMAD.MOV.U32 R1, ..." -> "IMAD.MOV.U32"
    return re.sub(r"^@!?U?P\w+\s+", "", src).split(" ")[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass export")
    ap.add_argument("--per", type=float, default=1.0, help="divide instruction counts by this (units of work)")
    ap.add_argument("--ops", type=int, default=30, help="opcodes to list (default 30)")
    ap.add_argument("--top", type=int, default=20, help="hottest instructions by stall samples (default 20)")
    ap.add_argument("--regions", action="store_true",
                    help="the execution counts with the most samples: instructions, share of the warp "
                         "instructions and of the samples, top stall reasons")
    ap.add_argument("--region-rows", type=int, default=12, help="regions to list with --regions (default 12)")
    ap.add_argument("--count", type=float, default=None,
                    help="only the instructions executed exactly this many times (one region)")
    a = ap.parse_args()
    if a.per <= 0:
        sys.exit("--per must be positive")
    rows = read_rows(a.csv)
    if sum(r[2] for r in rows) == 0:
        sys.exit(f"{a.csv}: no executed instructions in the export")
    if a.regions:
        print_regions(rows, a.region_rows)
    if a.count is not None:
        rows = [r for r in rows if r[2] == a.count]
        if not rows:
            sys.exit(f"{a.csv}: no instruction ran exactly {a.count:g} times")
        print(f"only the {len(rows)} instructions executed {a.count:g} times:")
    total_n = sum(r[2] for r in rows)
    total_s = sum(r[3] for r in rows)
    by_n, by_s = collections.Counter(), collections.Counter()
    for _, src, n, s, _ in rows:
        by_n[opcode(src)] += n
        by_s[opcode(src)] += s
    print(f"{total_n:.0f} warp instructions ({total_n / a.per:.1f} per unit), {total_s:.0f} stall samples")
    print(f"{'opcode':<24} {'per unit':>10} {'instr %':>8} {'stall %':>8}")
    for op, n in by_n.most_common(a.ops):
        stall = 100.0 * by_s[op] / total_s if total_s else 0.0
        print(f"{op:<24} {n / a.per:>10.1f} {100.0 * n / total_n:>7.1f}% {stall:>7.1f}%")
    if a.top > 0 and total_s > 0:
        print(f"\nhottest instructions (stall samples):\n{'address':<18} {'per unit':>9} {'samples':>8}  source")
        for addr, src, n, s, _ in sorted(rows, key=lambda r: -r[3])[:a.top]:
            print(f"{addr:<18} {n / a.per:>9.2f} {s:>8.0f}  {src}")
    reasons = stall_reasons(rows)
    if reasons:
        tot = sum(reasons.values())
        print("\nstall reasons (samples): " + ", ".join(f"{k} {100.0 * v / tot:.1f}%" for k, v in reasons.most_common(10)))


def stall_reasons(rows):
    c = collections.Counter()
    for *_, st in rows:
        c.update(st)
    return collections.Counter({k: v for k, v in c.items() if v > 0})


def print_regions(rows, top):
    total_n = sum(r[2] for r in rows)
    total_s = sum(r[3] for r in rows) or 1.0
    groups = collections.defaultdict(list)
    for r in rows:
        if r[2] > 0:
            groups[r[2]].append(r)
    print(f"regions by execution count (the {top} with the most samples):")
    print(f"{'executed':>10} {'instrs':>7} {'instr %':>8} {'samples %':>9}  top stall reasons")
    for count, rs in sorted(groups.items(), key=lambda kv: -sum(r[3] for r in kv[1]))[:top]:
        n, s = sum(r[2] for r in rs), sum(r[3] for r in rs)
        reasons = stall_reasons(rs)
        tot = sum(reasons.values()) or 1.0
        top3 = ", ".join(f"{k} {100.0 * v / tot:.0f}%" for k, v in reasons.most_common(3))
        print(f"{count:>10.0f} {len(rs):>7} {100.0 * n / total_n:>7.1f}% {100.0 * s / total_s:>8.1f}%  {top3}")
    print()


if __name__ == "__main__":
    main()
