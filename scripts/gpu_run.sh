#!/usr/bin/env bash
# Runs on the lent GPU machine from the repo root with the binaries scripts/gpu_stage.sh packed into
# .gpu/bins.tar.xz (unpacked here into .gpu/): every GPU test, compute-sanitizer memcheck +
# racecheck, then the benchmarks. Logs go to $OUT (logs.tgz, rewritten after every step); a short
# table is printed last. Every step runs under `timeout ${STEP_LIMIT:-540}` seconds.
# Usage: .gpu/gpu_run.sh [tests|sanitize|bench|main|stack|unpack]...
# (`unpack` only unpacks, for a command that runs its own steps next, e.g. scripts/ab_cycles.py over
# .gpu/v4attn and a baseline .gpu/base-<hash>/v4attn that scripts/gpu_stage.sh --base REV packed.)
set -uo pipefail
steps=("$@"); [[ ${#steps[@]} -eq 0 ]] && steps=(tests sanitize bench)
for s in "${steps[@]}"; do
  case $s in tests|sanitize|bench|main|stack|unpack) ;; *) echo "gpu_run: unknown step '$s'" >&2; exit 2 ;; esac
done
if [[ -f .gpu/bins.tar.xz && ! -x .gpu/v4attn ]]; then
  tar -C .gpu -xJf .gpu/bins.tar.xz && mv .gpu/bin/* .gpu/ && rmdir .gpu/bin || { echo "gpu_run: cannot unpack .gpu/bins.tar.xz" >&2; exit 1; }
fi
[[ ${steps[*]} == unpack ]] && exit 0
FINAL_OUT=${OUT:-/tmp/v4attn_out}
OUT=$(mktemp -d)  # logs land here, then go back as one archive (the device tool returns <= 8 files)
mkdir -p "$FINAL_OUT"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/extras/CUPTI/lib64:${LD_LIBRARY_PATH:-}
summary=()
run() {  # name, log, command...
  local name=$1 log=$2; shift 2
  local t0=$(date +%s.%N)
  timeout -k 5 "${STEP_LIMIT:-540}" "$@" >"$OUT/$log" 2>&1; local rc=$?  # rc 124: the step hit STEP_LIMIT
  local dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')
  summary+=("$(printf '%-34s rc=%-3s %7.1fs  %s' "$name" "$rc" "$dt" "$(grep -E 'PASSED|FAILED|ERROR SUMMARY|passed|failed' "$OUT/$log" | tail -2 | tr '\n' ' ' | cut -c1-90)")")
  tar -C "$OUT" -czf "$FINAL_OUT/logs.tgz" .  # after every step: a call cut short still returns its logs
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader > "$OUT/gpu.txt" 2>&1
for s in "${steps[@]}"; do
  case $s in
    tests) run "gpu tests" gpu_tests.log .gpu/v4attn_gpu_tests --gtest_brief=1
           run "cpu tests" cpu_tests.log .gpu/v4attn_tests --gtest_brief=1 ;;
    sanitize)
      run "memcheck gpu tests" memcheck.log compute-sanitizer --tool memcheck --error-exitcode 9 .gpu/v4attn_gpu_tests --gtest_brief=1 ${SAN_FILTER:+--gtest_filter=$SAN_FILTER}
      run "racecheck gpu tests" racecheck.log compute-sanitizer --tool racecheck --error-exitcode 9 .gpu/v4attn_gpu_tests --gtest_brief=1 ${SAN_FILTER:+--gtest_filter=$SAN_FILTER} ;;
    bench)
      for b in .gpu/bench_*; do n=$(basename "$b"); run "$n" "$n.log" "$b" --json "$OUT/$n.json"; done ;;
    main) run "v4attn main" main.log .gpu/v4attn main ;;
    unpack) ;;
    stack)
      for cfg in "verify 1" "verify 4" "decode 1" "decode 8" "decode 32"; do
        set -- $cfg
        run "stack $1 bs $2" "stack_$1_$2.log" .gpu/v4attn bench --mode "$1" --bs "$2" --cycles 20 --trace-cycles 3 \
          --json "$OUT/stack_$1_$2.json"
      done
      run "stack verify 1 pdl off" stack_verify_1_nopdl.log .gpu/v4attn bench --mode verify --bs 1 --cycles 20 \
        --trace-cycles 3 --pdl off --json "$OUT/stack_verify_1_nopdl.json"
      run "stack verify 1 trace" stack_trace.log .gpu/v4attn bench --schedule three-lane --cycles 5 --trace "$OUT/trace_three_lane.json" ;;
  esac
done
echo "== $(cat "$OUT/gpu.txt")"
for b in "$OUT"/bench_*.log; do [[ -f $b ]] && { echo "== $(basename "$b")"; grep -vE '^\s*$' "$b" | tail -40; }; done
echo "== failures"; grep -hE '^\[  FAILED|FAILED TEST' "$OUT"/gpu_tests.log "$OUT"/cpu_tests.log 2>/dev/null | head -30
for f in "$OUT"/stack_*.log; do [[ -f $f ]] && { echo "== $(basename "$f")"; grep -E "distinct|on the q_rope|spacing|gap wq_b|^  (serial|sources-side|three-lane) |byte-identical" "$f"; }; done
echo "== summary"; printf '%s\n' "${summary[@]}"
tar -C "$OUT" -czf "$FINAL_OUT/logs.tgz" . && rm -rf "$OUT"
