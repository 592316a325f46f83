#!/usr/bin/env python3
"""A stand-in for `v4attn bench --json F ...` in the CI tests of scripts/ab_cycles.py (no GPU): writes
the fields ab_cycles reads. The cycle median is 1000 us plus --fake-us (default 0) plus 0.5 us per call
already made in this directory's counter file (so that runs differ and their median is checked);
--fake-digest sets the digest (default d0), --fake-no-build leaves out the "build" and "floor" objects (as
binaries before session 37 did), --fake-fail exits 1, --fake-no-json exits 0 without writing the file."""
import json
import os
import sys

a = sys.argv[1:]
if "--fake-fail" in a:
    print("fake bench: failing as asked", file=sys.stderr)
    sys.exit(1)
out = a[a.index("--json") + 1]
if "--fake-no-json" in a:
    sys.exit(0)
counter = os.path.join(os.path.dirname(os.path.abspath(out)), "fake_calls")
n = int(open(counter).read()) if os.path.exists(counter) else 0
open(counter, "w").write(str(n + 1))
us = 1000.0 + (float(a[a.index("--fake-us") + 1]) if "--fake-us" in a else 0.0) + 0.5 * n
doc = {"build": {"version": "0.1.0", "commit": "0123456789ab", "modified": False}, "floor": {"us": 500.0},
       "schedules": [{"schedule": "three-lane", "cycle_us": {"median": us},
                      "digest": a[a.index("--fake-digest") + 1] if "--fake-digest" in a else "d0"}]}
if "--fake-no-build" in a:
    del doc["build"]
    del doc["floor"]
with open(out, "w", encoding="utf-8") as f:
    json.dump(doc, f)
