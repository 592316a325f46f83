#!/usr/bin/env python3
"""Issue 6's scoreboard from the benchmarks' JSON files: the GEMM targets (wq_b and wq_a|wkv at M = 1, 6,
8, 24, 48, 64: >= 85 % of the bytes floor) with the cuBLASLt peers beside them, and the cycle targets
(<= 1.3x the cycle's bytes floor; >= 8x faster than the issue's plain-PyTorch figure where it has one; its
four cycles with PyTorch figures always listed, "not measured" when no file gives them),
as markdown tables for docs/perf.md and a count of the targets met.

  scripts/issue6_report.py --gemm bench_gemm.json --cycle verify1.json --cycle decode32.json ... [--json F]

--gemm: `bench_gemm --shapes wq_b wq_a_wkv --m 1 6 8 24 48 64 --json F`; per shape and m the fastest of our
exact versions (v1 / v2 / v3 / v6, valid rows) in the graph + PDL column, its share of the floor and the
fraction of outputs 1 ulp off the reference (the exactness contract), the peers' graph figures.
--cycle: `v4attn bench --mode M --bs B --schedule three-lane --json F` (each file one cycle; builds since
session 37 report the floor and the PyTorch figure); the three-lane schedule's median, else the first.
Exit status 0 (a report, whether or not targets are met); 1 when an input is missing or malformed; 2 on
bad usage.
"""
import argparse
import json
import re
import sys

GEMM_SHAPES = ("wq_b", "wq_a_wkv")
GEMM_M = (1, 6, 8, 24, 48, 64)
GEMM_TARGET_PCT = 85.0
CYCLE_TARGET_RATIO = 1.3
CYCLE_TARGET_SPEEDUP = 8.0
OURS = re.compile(r"^v[1-9]\b")  # our exact versions (v0 is the slow reference kernel)


class InputError(Exception):
    """An input file that is missing or not what its option expects (exit status 1)."""


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read {path}: {e}")


def us_of(row):
    """The graph + PDL figure, else graph, else event (older or partial rows); None when none."""
    for key in ("graph_pdl_us", "graph_us", "median_us"):
        v = row.get(key) or 0.0
        if v > 0:
            return float(v)
    return None


def differ_fraction(note):
    m = re.search(r"([0-9.]+)% differ", note or "")
    return float(m.group(1)) if m else None


def gemm_table(rows):
    out, met, total = [], 0, 0
    out.append("| shape | m | ours (version) | us | % of floor (target >= 85) | 1-ulp outputs | cuBLASLt bf16 (2x bytes) | cuBLASLt fp8 blk128 (inexact) |")
    out.append("|---|---|---|---|---|---|---|---|")
    for shape in GEMM_SHAPES:
        for m in GEMM_M:
            cands = [r for r in rows if r.get("shape") == shape and r.get("m") == m]
            total += 1
            if not cands:  # a target the file does not measure counts as not met
                out.append(f"| {shape} | {m} | not measured | - | - | - | - | - |")
                continue
            ours = []
            for r in cands:
                us = us_of(r)
                if OURS.match(str(r.get("version", ""))) and r.get("valid") and us:
                    ours.append((us, r))
            if not ours:
                out.append(f"| {shape} | {m} | none valid | - | - | - | - | - |")
                continue
            # The target is the share of the floor: the best row by it (the +quant / fused-quant rows move
            # other bytes, so the fastest row need not be the one closest to its floor).
            us, best = max(ours, key=lambda x: float(x[1].get("floor_us") or 0.0) / x[0])
            pct = 100.0 * float(best["floor_us"]) / us if best.get("floor_us") else None
            ok = pct is not None and pct >= GEMM_TARGET_PCT
            met += ok
            frac = differ_fraction(best.get("note"))

            def peer(prefix):
                for r in cands:
                    if str(r.get("version", "")).startswith(prefix):
                        pu = us_of(r)
                        return "%.2f" % pu if r.get("valid") and pu else "no algorithm" if "algorithm" in str(r.get("note", "")) else "-"
                return "-"
            out.append("| %s | %d | %s | %.2f | %s %s | %s | %s | %s |" % (
                shape, m, best["version"], us, "%.1f %%" % pct if pct is not None else "-", "(met)" if ok else "(not met)",
                "%.3f %%" % frac if frac is not None else "-", peer("cublasLt bf16"), peer("cublasLt fp8")))
    return out, met, total


def cycle_row(doc, path):
    scheds = doc.get("schedules") or []
    if not scheds:
        raise InputError(f"{path}: no schedules")
    s = next((x for x in scheds if x.get("schedule") == "three-lane"), scheds[0])
    med = float(s["cycle_us"]["median"])
    floor = doc.get("floor", {}).get("us")
    torch = doc.get("pytorch_reference_us")
    return {"mode": doc.get("mode"), "bs": doc.get("bs"), "rows": doc.get("rows"), "context": doc.get("context"),
            "schedule": s.get("schedule"), "median_us": med, "floor_us": floor,
            "ratio": med / floor if floor else None, "pytorch_us": torch,
            "speedup": torch / med if torch else None, "digest": s.get("digest"),
            "build": (doc.get("build") or {}).get("commit")}


# The cycles issue 6 has PyTorch figures for (mode, bs): each counts its two targets, measured or not.
ISSUE_CYCLES = (("verify", 1), ("decode", 1), ("decode", 32), ("verify", 4))


def cycle_table(cycles):
    out, met, total = [], 0, 0
    measured = {(c["mode"], c["bs"]) for c in cycles}
    missing = [mb for mb in ISSUE_CYCLES if mb not in measured]
    out.append("| cycle | rows | floor | time | ratio (target <= 1.3) | PyTorch | speed-up (target >= 8) |")
    out.append("|---|---|---|---|---|---|---|")
    for c in cycles:
        total += 1
        ok_ratio = c["ratio"] is not None and c["ratio"] <= CYCLE_TARGET_RATIO
        met += ok_ratio
        ratio = "%.2fx %s" % (c["ratio"], "(met)" if ok_ratio else "(not met)") if c["ratio"] is not None else "-"
        speed = "-"
        if c["speedup"] is not None:
            total += 1
            ok_speed = c["speedup"] >= CYCLE_TARGET_SPEEDUP
            met += ok_speed
            speed = "%.2fx %s" % (c["speedup"], "(met)" if ok_speed else "(not met)")
        out.append("| %s bs %s | %s | %s | %.1f us (%s) | %s | %s | %s |" % (
            c["mode"], c["bs"], c["rows"], "%.1f us" % c["floor_us"] if c["floor_us"] else "-", c["median_us"],
            c["schedule"], ratio, "%.2f ms" % (c["pytorch_us"] / 1000.0) if c["pytorch_us"] else "-", speed))
    for mode, bs in missing:  # a target the files do not measure counts as not met
        total += 2
        out.append("| %s bs %d | - | - | not measured | - | - | - |" % (mode, bs))
    return out, met, total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gemm", metavar="F", help="bench_gemm --json output")
    ap.add_argument("--cycle", metavar="F", action="append", default=[], help="v4attn bench --json output (repeat)")
    ap.add_argument("--json", metavar="F", help="also write the scoreboard as JSON")
    args = ap.parse_args()
    if not args.gemm and not args.cycle:
        ap.error("give --gemm and / or --cycle files")
    try:
        report, met, total, doc = [], 0, 0, {}
        if args.gemm:
            rows = load(args.gemm)
            if not isinstance(rows, list):
                raise InputError(f"{args.gemm}: not a bench_gemm row list")
            lines, m, t = gemm_table(rows)
            report += ["GEMMs (graph + PDL, us; % of the fp8 bytes floor):"] + lines + [""]
            met, total = met + m, total + t
            doc["gemm"] = {"met": m, "targets": t}
        cycles = [cycle_row(load(p), p) for p in args.cycle]
        if cycles or args.gemm:
            lines, m, t = cycle_table(cycles)
            report += ["Cycles (graph, PDL, medians):"] + lines + [""]
            met, total = met + m, total + t
            doc["cycles"] = cycles
        report.append("issue 6 targets met: %d of %d" % (met, total))
        print("\n".join(report))
        if args.json:
            doc.update({"met": met, "targets": total})
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=2)
        return 0
    except (InputError, KeyError, TypeError, ValueError) as e:
        print("issue6_report: %s" % e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
