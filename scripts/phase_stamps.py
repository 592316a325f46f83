#!/usr/bin/env python3
"""Summarise the phase stamps of a measurement build (src/runtime/phase_stamps.cuh).

Build with -DV4ATTN_PHASE_STAMPS=ON, run e.g.
    V4ATTN_STAMPS_OUT=st v4attn bench --mode verify --bs 1 --schedule three-lane --trace-cycles 0
and pass the written file (st.three-lane, optionally gzipped). Prints one line per kernel launch of
the recorded cycle, in time order: the earliest / latest value over the launch's CTAs of each phase,
in microseconds from the cycle's first stamp. Phases: 0 CTA start, 1 after griddepcontrol.wait,
2 (GEMM v2) first stage ready for the consumers / (rmsnorm) sum of squares done, 5 (GEMM v3) scale
tables in shared memory, 3 consumer loop done, 6 (v3) partials written (cluster barrier), 4 end;
10 / 11 (GEMM v2 with the distributed q_norm, session 25) the CTA's rows written / every row seen
(--intervals v2 walks them between the wait and the first stage, session 29).
Per-stage phases are recorded for CTAs 0 and 1 only (GEMM v2 / v3: 16+ consumer stage or iteration start,
64+ converter stage done, 96+ stage data landed, 112+ its f16 slot free); --cta prints those records.

Files from session 10 on start with a "# v4attn phase stamps v2" line and carry each launch's
%gridid in the second column: CTAs are then grouped into launches exactly (older files: by start
time under each launch's CTA (0, 0), which mis-assigns CTAs that start before it). --handoff prints,
for each launch after the first, when its CTAs entered (phase 14 where stamped, else phase 0) and
returned from their PDL wait, relative to the end of the launch before it (its latest stamp).
--intervals KIND (v2 files) gives, over every CTA of KIND's launches, the time between consecutive
phases (p10 / median / p90 / max) and each phase's time after the previous launch's end: where a
layer's time goes, phase by phase (session 16's view of the fused chain); --followed-by KIND /
--not-followed-by KIND keep only the launches whose next launch is / is not of KIND (session 22: the
reindex layers' fused chains, followed by their top-k, apart from the plain layers'). The selection kinds
topk_v3 / mask_v3 (session 18) follow their own path: 0 entry, 1 wait, 2 keys compacted, per radix
pass p 4+4p histogram, 5+4p the cluster's histograms received, 6+4p digit chosen, 20 output written,
21 end; the window exchange (--select-window, session 37) 22 / 23 / 24 before the passes it leaves. bench_indexer writes such a file too (V4ATTN_STAMPS_OUT=st bench_indexer --only topk:v3 ...).
The index tail's other kernels (session 24) stamp 0 entry, 1 after the PDL wait, 4 end: gemv (GEMM v6,
the indexer's wq_b at <= 16 rows), q_pack, scores -- with the selection's stamps, a reindex layer's
whole tail after its fused chain, kernel by kernel (--handoff, --intervals gemv / q_pack / scores).
"""
import argparse
import bisect
import collections
import gzip
import statistics

KINDS = {1: "v2", 2: "v3", 3: "rmsnorm", 4: "act_quant", 5: "q_rope_store", 6: "qchain",
         7: "topk_v3", 8: "mask_v3", 9: "gemv", 10: "q_pack", 11: "scores"}
# The fused Q chain (gemm_qchain.cu): start, wait, act quant, QA weights, QA loop, partial counted,
# tile reduced, q tiles all counted, q_norm done, first wq_b stage, wq_b loop, end, kv counted, window-K.
# Phase 14 (v2 files): the CTA's first instruction; 48 / 49: q_norm's sums / row passes done.
QCHAIN_COLS = [(14, min), (14, max), (0, min), (0, max), (1, min), (1, max), (2, max), (3, max), (4, max), (5, max),
               (6, max), (7, min), (7, max), (48, max), (49, max), (8, max), (9, max), (10, min), (10, max), (11, max),
               (12, max), (13, max)]
HEADER_V2 = "# v4attn phase stamps v2"
COLS = [(0, min), (0, max), (1, min), (1, max), (2, min), (2, max), (5, max), (3, min), (3, max), (6, max), (4, min), (4, max)]


def load(path):
    """(entries, v2): the stamp lines as int tuples, and whether the file carries %gridid."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = [line for line in f if line.strip()]
    v2 = bool(lines) and lines[0].startswith(HEADER_V2)
    return [tuple(map(int, line.split())) for line in lines if not line.startswith("#")], v2


def launches_by_gridid(entries):
    """[(first stamp, kind, [per-CTA {phase: ns}])], exact: a launch is (gridid, kind)."""
    ctas = collections.defaultdict(dict)
    for g, grid, kind, _sm, x, y, phase, _rec in entries:
        ph = ctas[(grid, kind, x, y)]
        ph[phase] = min(g, ph.get(phase, g))
    groups = collections.defaultdict(list)
    for (grid, kind, _x, _y), ph in ctas.items():
        groups[(grid, kind)].append(ph)
    return sorted((min(min(ph.values()) for ph in g), kind, g) for (_grid, kind), g in groups.items())


def print_handoff(launches, t0):
    print("%-12s %4s %9s %9s %9s %9s %9s %9s" % ("kernel", "ctas", "at_us", "entry_mn", "entry_mx", "wait_mn",
                                                  "wait_mx", "dur"))
    prev_end = None
    per_kind = collections.defaultdict(list)  # kind -> [(last wait after the previous end, duration)]
    for _, kind, g in launches:
        entry = [c.get(14, c.get(0)) for c in g if 14 in c or 0 in c]
        wait = [c[1] for c in g if 1 in c]
        end = max(max(c.values()) for c in g)
        if prev_end is not None and entry:
            rel = lambda v: "%9.2f" % ((v - prev_end) / 1000) if v is not None else "        -"
            print("%-12s %4d %9.1f %s %s %s %s %9.2f" % (
                KINDS.get(kind, kind), len(g), (prev_end - t0) / 1000, rel(min(entry)), rel(max(entry)),
                rel(min(wait) if wait else None), rel(max(wait) if wait else None), (end - min(entry)) / 1000))
            if wait:
                per_kind[kind].append(((max(wait) - prev_end) / 1000, (end - min(entry)) / 1000))
        prev_end = end
    # Medians per kernel kind: when the launch's last CTA left its PDL wait after the previous
    # launch's end (the hand-off's cost on the critical path), and the launch's length.
    for kind in sorted(per_kind):
        v = per_kind[kind]
        print("median %-12s %4d launches: last wait %.2f us after the previous end, length %.2f us" % (
            KINDS.get(kind, kind), len(v), statistics.median(x for x, _ in v), statistics.median(d for _, d in v)))


# Phase paths of a kind for --intervals: the fused chain's main path (entry, wait, act quant, QA
# weights, QA loop, partial counted, tile reduced, q tiles counted, q_norm sums / passes / done,
# first wq_b stage, wq_b loop, end) and its helpers' window-K branch after q_norm (kv counted,
# window-K done); the other kinds: the order of COLS (start, wait, 2, 5, loop, 6, end; 16 and up
# are per-stage records, 15 a consumer record's start).
QCHAIN_PATHS = [[14, 0, 1, 2, 3, 4, 5, 6, 7, 48, 49, 8, 9, 10, 11], [8, 12, 13]]
OTHER_PATH = [14, 0, 1, 2, 5, 3, 6, 4]
# GEMM v2 with the distributed q_norm (kQDist, `--qnorm-dist on`): wait, rows written (10), every row seen
# (11), then the first stage ready (2) and the loop (3); 10 / 11 are absent in the other forms.
V2_PATH = [14, 0, 1, 10, 11, 2, 5, 3, 6, 4]
# The v3 selections (indexer_select_v3.cu): entry, wait, keys ready, per radix pass p histogram /
# cluster's histograms received / digit chosen (4+4p, 5+4p, 6+4p), compaction done, end.
# The window exchange (window kernels) stamps 22 / 23 / 24 (histogram, received, prefix chosen) first.
SELECT_PATH = [0, 1, 2, 22, 23, 24] + [4 * p + d for p in range(1, 5) for d in range(3)] + [20, 21]


def phase_paths(kind, present):
    paths = (QCHAIN_PATHS if kind == 6 else [SELECT_PATH] if kind in (7, 8) else [V2_PATH] if kind == 1 else
             [OTHER_PATH])
    return [[p for p in path if p in present] for path in paths]


def quantile(v, f):
    v = sorted(v)
    return v[min(len(v) - 1, int(f * len(v)))]


def print_intervals(launches, kind_name, followed_by=None, not_followed_by=None):
    """Per CTA of every launch of one kind: the time between consecutive phases (in the kind's phase
    order), as p10 / median / p90 / max over all those CTAs; then, for the launches after the
    cycle's first, each phase's time after the previous launch's end (its latest stamp) -- which
    phases sit on a layer's critical path. Session 16 found the fused chain's q_norm passes and its
    phase 0 this way. followed_by / not_followed_by: only the launches whose next launch (in time
    order; none after the last) is / is not of that kind -- e.g. the fused chains of the reindex
    layers (followed by their top-k) apart from the plain layers' (session 22)."""
    kinds = {v: k for k, v in KINDS.items()}
    for name in (kind_name, followed_by, not_followed_by):
        if name is not None and name not in kinds:
            raise SystemExit("--intervals: unknown kind %r (one of %s)" % (name, ", ".join(sorted(kinds))))
    kind = kinds[kind_name]

    def next_kind(i):
        return launches[i + 1][1] if i + 1 < len(launches) else None

    ours = [(i, g) for i, (_, k, g) in enumerate(launches) if k == kind and
            (followed_by is None or next_kind(i) == kinds[followed_by]) and
            (not_followed_by is None or next_kind(i) != kinds[not_followed_by])]
    if not ours:
        raise SystemExit("--intervals: no %s launch in the file%s" % (
            kind_name, " with that next launch" if followed_by or not_followed_by else ""))
    present = {p for _, g in ours for c in g for p in c}
    paths = phase_paths(kind, present)
    order = []
    for path in paths:
        order += [p for p in path if p not in order]
    gaps, after = {}, collections.defaultdict(list)
    for i, g in ours:
        prev_end = max(max(c.values()) for c in launches[i - 1][2]) if i > 0 else None
        for c in g:
            for path in paths:
                seq = [p for p in path if p in c]
                for p, q in zip(seq, seq[1:]):
                    gaps.setdefault((p, q), []).append((c[q] - c[p]) / 1000)
            if prev_end is not None:
                for p in order:
                    if p in c:
                        after[p].append((c[p] - prev_end) / 1000)
    print("%s: %d launches, %d CTAs" % (kind_name, len(ours), sum(len(g) for _, g in ours)))
    print("interval      ctas     p10     med     p90     max   (us)")
    for (p, q), v in gaps.items():  # path by path, in order
        print("%3d -> %3d %6d %7.2f %7.2f %7.2f %7.2f" % (p, q, len(v), quantile(v, 0.1), statistics.median(v),
                                                          quantile(v, 0.9), max(v)))
    if after:
        print("phase after the previous launch's end: ctas     p10     med     p90     max")
        for p in order:
            v = after.get(p)
            if v:
                print("%5d %33d %7.2f %7.2f %7.2f %7.2f" % (p, len(v), quantile(v, 0.1), statistics.median(v),
                                                             quantile(v, 0.9), max(v)))


def print_stages(launches, t0):
    """Per v2 / v3 launch: the per-stage records of its first stamped CTA -- when its converters
    saw each stage's data (96 + it: the later of the data landing and the converters finishing the
    stage before), its f16 slot free (112 + it) and the stage converted (64 + it) -- relative to the
    launch's first stamp, then per kind the medians of the interval between consecutive stages'
    data and of the conversion (done - slot free). Caution (session 13): these stamps slow the
    converter that takes them (three per stage; ~1 us per launch in all), and a stage is seen on
    the converter's schedule, so "data seen ~0.4 us after the previous conversion" also appears
    when the data landed long before (v3 with the fused x quant): read the gaps as the converter's
    pace unless bench_tma_probe says the stream is slower."""
    gaps, convs = collections.defaultdict(list), collections.defaultdict(list)
    for first, kind, g in launches:
        if kind not in (1, 2):
            continue
        ctas = [c for c in g if any(96 <= p < 128 for p in c)]
        if not ctas:
            continue
        c = min(ctas, key=lambda c: min(c.values()))
        stages = sorted(p - 96 for p in c if 96 <= p < 112)
        cells = []
        for it in stages:
            data, slot, done = c.get(96 + it), c.get(112 + it), c.get(64 + it)
            f = lambda v: "%.2f" % ((v - first) / 1000) if v is not None else "-"
            cells.append("%d:%s/%s/%s" % (it, f(data), f(slot), f(done)))
            if slot is not None and done is not None:
                convs[kind].append((done - slot) / 1000)
            if it > 0 and 96 + it - 1 in c:
                gaps[kind].append((data - c[96 + it - 1]) / 1000)
        loop = "%.2f" % ((c[3] - first) / 1000) if 3 in c else "-"
        print("%-4s at %9.1f us: stage data/slot/done %s; loop done %s" % (
            KINDS[kind], (first - t0) / 1000, " ".join(cells), loop))
    for kind in sorted(gaps):
        print("median %-4s: data %.2f us after the previous stage's (%d intervals), conversion %.2f us" % (
            KINDS[kind], statistics.median(gaps[kind]), len(gaps[kind]),
            statistics.median(convs[kind]) if convs[kind] else float("nan")))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stamps")
    ap.add_argument("--launches", type=int, default=60, help="launches to print (default 60)")
    ap.add_argument("--cta", nargs=2, type=float, metavar=("FROM_US", "TO_US"),
                    help="instead: the per-stage records of CTAs 0 and 1 that start in this window")
    ap.add_argument("--stages", action="store_true",
                    help="instead: per GEMM v2 / v3 launch, when each stage's data landed, its slot was free and "
                         "its conversion done (its first stamped CTA; needs a v2 file from session 12 on)")
    ap.add_argument("--intervals", metavar="KIND",
                    help="instead: per-CTA intervals between consecutive phases of the launches of KIND (qchain, v2, "
                         "v3, ...), and each phase after the previous launch's end (needs a v2 file)")
    ap.add_argument("--followed-by", metavar="KIND",
                    help="with --intervals: only the launches whose next launch is of KIND (e.g. topk_v3: the "
                         "reindex layers' fused chains)")
    ap.add_argument("--not-followed-by", metavar="KIND",
                    help="with --intervals: only the launches whose next launch is not of KIND")
    ap.add_argument("--handoff", action="store_true",
                    help="instead: per launch, its CTAs' entry and PDL-wait times after the previous launch's end "
                         "(needs a v2 file)")
    a = ap.parse_args()
    if (a.followed_by or a.not_followed_by) and not a.intervals:
        raise SystemExit("--followed-by / --not-followed-by go with --intervals")
    entries, v2 = load(a.stamps)
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
    if (a.handoff or a.stages or a.intervals) and not v2:
        raise SystemExit("--handoff, --stages and --intervals need a file with launch ids (written from session 10 on)")
    if v2:
        launches = launches_by_gridid(entries)
        if a.intervals:
            print_intervals(launches, a.intervals, a.followed_by, a.not_followed_by)
            return
        if a.stages:
            print_stages(launches, t0)
            return
        if a.handoff:
            print_handoff(launches[:a.launches], t0)
            return
        print_launches(launches[:a.launches], t0)
        return
    # Older files: a CTA's records (thread 0, the consumers, a converter) merge into its thread-0
    # record (phase 0).
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
    print_launches(launches[:a.launches], t0)


def print_launches(launches, t0):
    print("%-12s %4s " % ("kernel", "ctas") + " ".join("%7s" % h for h in (
        "start", "st_max", "wait", "wt_max", "ph2", "ph2_mx", "ph5_mx", "loop", "lp_max", "ph6_mx", "end", "end_max")))
    for _, kind, g in launches:
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
