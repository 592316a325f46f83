#!/usr/bin/env python3
"""Per-layer view of one prepare cycle from the Chrome / Perfetto trace of `v4attn bench --trace F`.

A layer starts where its first main-lane kernel starts (its QA act quant, the QA GEMM that quantises
x itself, or its fused Q chain kernel) and ends where the next layer's starts (the last layer: at
the last kernel's end). Per layer it prints the time ("us", start to start), the main lane's time
("chain": its q_rope_store's -- or fused chain's, or RoPE-storing wq_b GEMM's -- end after the
previous layer's; use this one where kernels launched early under PDL start on free SMs long before
their predecessors end, as the fused chain does), when the main lane's q_rope_store (or its
stand-in) ends, when the layer's last kernel ends and which one that is, and the "tail": how long
the side lanes run past the q_rope_store (the index-source layers' selection, typically).
`--detail 20,24` lists every kernel of those layers (stream, start, end, relative to the layer's
start, and "own": its end after max(its start, the end of the previous kernel on its stream) -- the
time it took once its stream let it run, which shows a small kernel starved of SMs, e.g. a 1 us q
pack taking 7-18 us beside a GEMM that holds the SMs; a wait on another stream's event is not seen);
`--json F` writes the table. Times are those of the traced cycle (CUPTI tracing inflates them:
compare layers with each other, not with event-timed cycles).

    v4attn bench --mode verify --bs 1 --schedule three-lane --cycles 5 --trace-cycles 2 --trace t.json
    scripts/trace_layers.py t.json --detail 20,24
"""
import argparse
import gzip
import json
import re
import sys


def load_kernels(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return sorted((e for e in events if e.get("ph") == "X" and e.get("args", {}).get("kind", "kernel") == "kernel"),
                  key=lambda e: e["ts"])


def short_name(name):
    """'void v4attn::kernels::(anonymous namespace)::gemm_kernel<1, 8>(Params)' -> 'gemm_kernel<1, 8>'."""
    name = re.sub(r"^void ", "", name)
    name = name.replace("(anonymous namespace)::", "")
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # drop the parameter list: the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    return name[:cut].split("::")[-1]


def starts_layer(name):
    """A layer's first kernel on the main lane: its QA act quant; the wq_a|wkv v3 GEMM that quantises
    x itself (template flag kFused = true, `--fuse-x-quant`); or the fused Q chain
    (kernels/qchain.h), which is the whole layer's main lane and also plays q_rope_store's part."""
    return ("act_quant" in name or "qchain_fused" in name
            or re.search(r"gemm_fp8_wgmma3_kernel<\d+, \d+, true>", name) is not None)


def ends_chain(name):
    """A layer's last main-lane kernel: q_rope_store; the fused Q chain; or the wq_b GEMM that does
    the RoPE store itself (v2's kRope form, template flag true: `--fuse-rope-store`)."""
    return ("q_rope_store" in name or "qchain_fused" in name
            or re.search(r"gemm_fp8_wgmma_kernel<\d+, \d+, true>", name) is not None)


def own_times(kernels):
    """Per kernel (same order): its end minus max(its start, the previous end on its stream)."""
    last_end, own = {}, []
    for e in kernels:  # sorted by start
        end = e["ts"] + e["dur"]
        tid = e.get("tid")
        own.append(end - max(e["ts"], last_end.get(tid, e["ts"])))
        last_end[tid] = max(last_end.get(tid, end), end)
    return own


def layers_of(kernels):
    own = {id(e): t for e, t in zip(kernels, own_times(kernels))}
    starts = [e["ts"] for e in kernels if starts_layer(e["name"])]
    if not starts:
        raise ValueError("no act_quant, x-quantising QA GEMM or qchain_fused kernel in the trace: cannot find the layers")
    end_all = max(e["ts"] + e["dur"] for e in kernels)
    rows = []
    prev_chain_end = None
    for i, s in enumerate(starts):
        nxt = starts[i + 1] if i + 1 < len(starts) else end_all
        ks = [e for e in kernels if s <= e["ts"] < nxt]
        last = max(ks, key=lambda e: e["ts"] + e["dur"])
        rope = [e["ts"] + e["dur"] - s for e in ks if ends_chain(e["name"])]
        rope_end = max(rope) if rope else None
        last_end = last["ts"] + last["dur"] - s
        # The main lane's time for this layer: its chain's end (q_rope_store or fused chain) after
        # the previous layer's. Unlike "us" (start to start), it does not shrink when a kernel
        # launched early under PDL starts on a free SM long before its predecessor ends.
        chain_end = None if rope_end is None else s + rope_end
        chain = None
        if chain_end is not None:
            chain = chain_end - (prev_chain_end if prev_chain_end is not None else s)
            prev_chain_end = chain_end
        rows.append({
            "layer": i,
            "us": nxt - s,
            "chain_us": chain,
            "q_rope_store_end": rope_end,
            "last_end": last_end,
            "last_kernel": short_name(last["name"]),
            "tail": None if rope_end is None else max(0.0, last_end - rope_end),
            "kernels": [{"name": short_name(e["name"]), "stream": e.get("tid"), "start": e["ts"] - s,
                         "end": e["ts"] + e["dur"] - s, "own": own[id(e)]} for e in ks],
        })
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="the JSON written by `v4attn bench --trace` (optionally .gz)")
    ap.add_argument("--detail", default="", help="comma-separated layers whose kernels to list")
    ap.add_argument("--json", dest="json_out", help="also write the per-layer rows to this JSON file")
    args = ap.parse_args(argv)
    try:
        rows = layers_of(load_kernels(args.trace))
        detail = {int(x) for x in args.detail.split(",") if x.strip()}
    except (OSError, ValueError, KeyError) as err:
        print(f"trace_layers: {err}", file=sys.stderr)
        return 2
    fmt = lambda v: "-" if v is None else f"{v:.1f}"
    print(f"{'layer':>5} {'us':>8} {'chain':>7} {'q_rope_store end':>17} {'last end':>9} {'tail':>7}  last kernel")
    for r in rows:
        print(f"{r['layer']:>5} {r['us']:>8.1f} {fmt(r['chain_us']):>7} {fmt(r['q_rope_store_end']):>17} "
              f"{r['last_end']:>9.1f} {fmt(r['tail']):>7}  {r['last_kernel']}")
    total = sum(r["us"] for r in rows)
    tails = sum(r["tail"] or 0.0 for r in rows)
    print(f"{len(rows)} layers, {total:.1f} us; side lanes past q_rope_store: {tails:.1f} us in all")
    for r in rows:
        if r["layer"] not in detail:
            continue
        print(f"layer {r['layer']}:  stream, start .. end (after the layer's start), own")
        for k in r["kernels"]:
            print(f"  stream {k['stream']!s:>4} {k['start']:8.1f} .. {k['end']:8.1f} {k['own']:7.1f}  {k['name']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
