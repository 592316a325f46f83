#!/usr/bin/env python3
"""A / B of `v4attn bench` cycle times: one or more variants (extra bench arguments) per shape, run
interleaved (A B A B ...) so that drift of the card's clocks or heat lands on both alike, each run
the median of its --cycles graph replays; prints per shape and variant the runs' medians, their
median, and its change against the first variant, and whether the output digests agree (every
scheduling / launch knob must leave the same bytes; a GEMM-version knob may not: --allow-digest-change).

Usage (on the GPU machine, binaries unpacked by .gpu/gpu_run.sh or given with --bin):
  scripts/ab_cycles.py --bin .gpu/v4attn --variant base= --variant win=--select-window \\
      --shape verify:1 --shape decode:1 --shape verify:4 --shape decode:32 --reps 2 [--json F]
A variant is NAME=ARGS (ARGS split like a shell would; empty: the defaults), or NAME@BIN=ARGS to run
another executable for it (a baseline revision's build, e.g. the one `scripts/gpu_stage.sh --base REV`
packs as .gpu/base-<hash>/v4attn):
  scripts/ab_cycles.py --variant base@.gpu/base-bb4a38e/v4attn= --variant head= --shape verify:4
A shape is MODE:BS.
--dry-run prints the commands instead of running them (no GPU needed). Exit status 0; 1 when a run
fails or digests disagree (unless allowed); 2 on bad usage.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile


def parse_variant(text):
    """NAME=ARGS or NAME@BIN=ARGS -> (name, binary or None, [args])."""
    if "=" not in text:
        raise argparse.ArgumentTypeError("a variant is NAME=ARGS or NAME@BIN=ARGS, not %r" % text)
    head, args = text.split("=", 1)
    name, at, binary = head.partition("@")
    if not name:
        raise argparse.ArgumentTypeError("a variant needs a name: %r" % text)
    if at and not binary:
        raise argparse.ArgumentTypeError("NAME@BIN needs an executable after '@': %r" % text)
    return name, (binary or None), shlex.split(args)


def parse_shape(text):
    mode, _, bs = text.partition(":")
    if mode not in ("decode", "verify") or not bs.isdigit() or int(bs) < 1:
        raise argparse.ArgumentTypeError("a shape is decode:BS or verify:BS (BS >= 1), not %r" % text)
    return mode, int(bs)


def build_name(doc):
    """The commit a bench JSON says its binary was built from ("commit+modified"), or "?" (older builds)."""
    b = doc.get("build")
    if not isinstance(b, dict):
        return "?"
    return str(b.get("commit", "?")) + ("+modified" if b.get("modified") else "")


def bench_command(binary, mode, bs, cycles, extra, json_path):
    return [binary, "bench", "--mode", mode, "--bs", str(bs), "--cycles", str(cycles), "--trace-cycles", "0",
            "--schedule", "three-lane", "--json", json_path] + extra


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/v4attn", help="the v4attn executable (default build/v4attn)")
    ap.add_argument("--variant", action="append", type=parse_variant, required=True, metavar="NAME[@BIN]=ARGS",
                    help="a variant: its name, optionally its own executable, and its extra bench arguments "
                         "(repeat; the first is the reference)")
    ap.add_argument("--shape", action="append", type=parse_shape, required=True, metavar="MODE:BS")
    ap.add_argument("--reps", type=int, default=2, help="runs per shape and variant, interleaved (default 2)")
    ap.add_argument("--cycles", type=int, default=20, help="timed graph replays per run (default 20)")
    ap.add_argument("--allow-digest-change", action="store_true",
                    help="do not fail when variants' output digests differ (GEMM-version knobs)")
    ap.add_argument("--json", metavar="F", help="also write the results to F")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args()
    if args.reps < 1 or args.cycles < 1:
        ap.error("--reps and --cycles must be >= 1")
    names = [n for n, _, _ in args.variant]
    if len(set(names)) != len(names):
        ap.error("variant names must differ")

    failed = False
    rows = []
    builds = {}  # variant -> the builds its runs reported (bench --json "build"; older binaries: none)
    with tempfile.TemporaryDirectory() as tmp:
        jpath = os.path.join(tmp, "bench.json")
        for mode, bs in args.shape:
            runs = {n: [] for n in names}
            floor_us = None  # the cycle's bytes floor (bench --json "floor"; older builds: none)
            digests = {n: set() for n in names}
            for rep in range(args.reps):
                for name, binary, extra in args.variant:
                    cmd = bench_command(binary or args.bin, mode, bs, args.cycles, extra, jpath)
                    if args.dry_run:
                        print(" ".join(shlex.quote(c) for c in cmd))
                        continue
                    print("[ab] %s bs %d, %s, run %d/%d" % (mode, bs, name, rep + 1, args.reps), file=sys.stderr,
                          flush=True)
                    if os.path.exists(jpath):
                        os.remove(jpath)  # a run that writes no file must not be credited with the last one's
                    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                    if r.returncode != 0:
                        print("[ab] failed (exit %d): %s\n%s" % (r.returncode, " ".join(cmd), r.stderr[-2000:]),
                              file=sys.stderr)
                        failed = True
                        continue
                    try:
                        with open(jpath, encoding="utf-8") as f:
                            doc = json.load(f)
                        sched = doc["schedules"][0]
                    except (OSError, ValueError, KeyError, IndexError) as e:
                        print("[ab] no result from %s: %s" % (" ".join(cmd), e), file=sys.stderr)
                        failed = True
                        continue
                    runs[name].append(sched["cycle_us"]["median"])
                    # As it comes, so that a run cut off by a time limit still leaves its figures in the log.
                    print("[ab] %s bs %d, %s: %.1f us, digest %s" % (mode, bs, name, runs[name][-1], sched["digest"]),
                          file=sys.stderr, flush=True)
                    digests[name].add(sched["digest"])
                    builds.setdefault(name, set()).add(build_name(doc))
                    if isinstance(doc.get("floor"), dict) and doc["floor"].get("us"):
                        floor_us = float(doc["floor"]["us"])
            if args.dry_run:
                continue
            ref = statistics.median(runs[names[0]]) if runs[names[0]] else None
            all_digests = set().union(*digests.values())
            if len(all_digests) > 1 and not args.allow_digest_change:
                print("[ab] %s bs %d: the variants' output digests differ (%s); a scheduling or launch knob "
                      "must leave the same bytes (--allow-digest-change for GEMM versions)"
                      % (mode, bs, ", ".join(sorted(all_digests))), file=sys.stderr)
                failed = True
            for n in names:
                med = statistics.median(runs[n]) if runs[n] else None
                rows.append({"mode": mode, "bs": bs, "variant": n, "runs_us": runs[n], "median_us": med,
                             "vs_first_pct": None if med is None or not ref else 100.0 * (med - ref) / ref,
                             "floor_us": floor_us,
                             "x_floor": None if med is None or not floor_us else med / floor_us,
                             "digests": sorted(digests[n])})
    if args.dry_run:
        return 0
    print("%-10s %-14s %-28s %10s %9s %8s  %s" % ("shape", "variant", "runs (us)", "median", "vs first", "x floor",
                                                  "digest"))
    for r in rows:
        runs = " / ".join("%.1f" % v for v in r["runs_us"])
        med = "%.1f" % r["median_us"] if r["median_us"] is not None else "-"
        pct = "%+.2f %%" % r["vs_first_pct"] if r["vs_first_pct"] is not None else "-"
        xf = "%.2fx" % r["x_floor"] if r["x_floor"] is not None else "-"
        print("%-10s %-14s %-28s %10s %9s %8s  %s" % ("%s %d" % (r["mode"], r["bs"]), r["variant"], runs, med, pct, xf,
                                                      ",".join(r["digests"])))
    for n, binary, _ in args.variant:
        print("build of %s: %s (%s)" % (n, ", ".join(sorted(builds.get(n, {"-"}))), binary or args.bin))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"bin": args.bin, "cycles": args.cycles, "reps": args.reps,
                       "variants": [{"name": n, "bin": b or args.bin, "args": e,
                                     "builds": sorted(builds.get(n, set()))} for n, b, e in args.variant],
                       "rows": rows}, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
