#!/usr/bin/env python3
"""Summarise the phase stamps of a measurement build (src/runtime/phase_stamps.cuh).

Build with -DV4ATTN_PHASE_STAMPS=ON, run e.g.
    V4ATTN_STAMPS_OUT=st v4attn bench --mode verify --bs 1 --schedule three-lane --trace-cycles 0
and pass the written file (st.three-lane, optionally gzipped). Prints one line per kernel launch of
the recorded cycle, in time order: the earliest / latest value over the launch's CTAs of each phase,
in microseconds from the cycle's first stamp. Phases: 0 CTA start, 1 after griddepcontrol.wait,
2 (GEMM v2) first stage ready for the consumers / (rmsnorm) sum of squares done, 5 (GEMM v3) scale
tables in shared memory, 3 consumer loop done, 6 (v3) partials written (cluster barrier), 4 end.
Per-stage phases (16+, 64+) are recorded for CTAs 0 and 1 only; --cta prints those records.
"""
import argparse
import bisect
import collections
import gzip

KINDS = {1: "v2", 2: "v3", 3: "rmsnorm", 4: "act_quant", 5: "q_rope_store", 6: "qchain"}
# The fused Q chain (gemm_qchain.cu): start, wait, act quant, QA weights, QA loop, partial counted,
# tile reduced, q tiles all counted, q_norm done, first wq_b stage, wq_b loop, end, kv counted, window-K.
QCHAIN_COLS = [(0, min), (0, max), (1, min), (1, max), (2, max), (3, max), (4, max), (5, max), (6, max), (7, min),
               (7, max), (8, max), (9, max), (10, min), (10, max), (11, max), (12, max), (13, max)]
COLS = [(0, min), (0, max), (1, min), (1, max), (2, min), (2, max), (5, max), (3, min), (3, max), (6, max), (4, min), (4, max)]


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [tuple(map(int, line.split())) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stamps")
    ap.add_argument("--launches", type=int, default=60, help="launches to print (default 60)")
    ap.add_argument("--cta", nargs=2, type=float, metavar=("FROM_US", "TO_US"),
                    help="instead: the per-stage records of CTAs 0 and 1 that start in this window")
    a = ap.parse_args()
    entries = load(a.stamps)
    if not entries:
        raise SystemExit("no stamps in " + a.stamps)
    t0 = min(e[0] for e in entries)
    recs, meta = collections.defaultdict(dict), {}
    for g, _clock, kind, sm, x, y, phase, rec in entries:
        recs[rec][phase] = g
        meta[rec] = (kind, x, y, sm)
    if a.cta:
        for rec, ph in sorted(recs.items(), key=lambda kv: min(kv[1].values())):
            kind, x, y, sm = meta[rec]
            t = (min(ph.values()) - t0) / 1000
            if x < 2 and a.cta[0] <= t <= a.cta[1]:
                print("%s cta(%d,%d) sm%d: " % (KINDS.get(kind, kind), x, y, sm) +
                      " ".join("%d:%.2f" % (p, (ph[p] - t0) / 1000) for p in sorted(ph)))
        return
    # A CTA's records (thread 0, the consumers, a converter) merge into its thread-0 record (phase 0).
    starts = collections.defaultdict(list)
    for rec, ph in recs.items():
        if 0 in ph:
            starts[meta[rec]].append((ph[0], rec))
    for v in starts.values():
        v.sort()
    merged = {rec: dict(recs[rec]) for v in starts.values() for _, rec in v}
    for rec, ph in recs.items():
        if 0 in ph:
            continue
        lst = starts.get(meta[rec], [])
        i = bisect.bisect_right([t for t, _ in lst], min(ph.values())) - 1
        if i >= 0:
            merged[lst[i][1]].update(ph)
    # Launches: the CTAs of one kind grouped under the latest CTA (0, 0) start before them.
    launches = []
    for kind in KINDS:
        roots = sorted((ph[0], r) for r, ph in merged.items() if meta[r][0] == kind and meta[r][1:3] == (0, 0))
        times = [t for t, _ in roots]
        groups = [[] for _ in roots]
        for r, ph in merged.items():
            if meta[r][0] == kind:
                i = bisect.bisect_right(times, ph[0] + 3000) - 1
                if i >= 0:
                    groups[i].append(ph)
        launches += [(t, kind, g) for (t, _), g in zip(roots, groups)]
    launches.sort()
    print("%-12s %4s " % ("kernel", "ctas") + " ".join("%7s" % h for h in (
        "start", "st_max", "wait", "wt_max", "ph2", "ph2_mx", "ph5_mx", "loop", "lp_max", "ph6_mx", "end", "end_max")))
    for _, kind, g in launches[:a.launches]:
        vals = []
        if kind == 6:
            print("%-12s %4d " % ("qchain", len(g)) + " ".join(
                "%d%s:%.1f" % (ph, fn.__name__[1], (fn([c[ph] for c in g if ph in c]) - t0) / 1000)
                for ph, fn in QCHAIN_COLS if any(ph in c for c in g)))
            continue
        for phase, fn in COLS:
            v = [ph[phase] for ph in g if phase in ph]
            vals.append("%7.1f" % ((fn(v) - t0) / 1000) if v else "      -")
        print("%-12s %4d " % (KINDS[kind], len(g)) + " ".join(vals))


if __name__ == "__main__":
    main()
