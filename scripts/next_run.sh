#!/usr/bin/env bash
# The pending device run: what the last sessions built and could not run (each session that changes
# the pending list keeps this file current; docs/perf.md's latest section says why each step is here).
# On this machine: `scripts/gpu_stage.sh --base bb4a38e` (it copies this file to .gpu/next_run.sh),
# then device calls with carry [".gpu"] and the commands
#   .gpu/next_run.sh window       (~6-8 min: the window exchange's tests, memcheck, bench rows, A/B)
#   .gpu/next_run.sh v3 suite     (~8-9 min: session 35's v3 confirmation, then the whole GPU suite)
#   .gpu/next_run.sh scoreboard   (~4 min: issue 6's table, whenever the tree's figures are wanted)
# (no argument: window, v3, suite; more than one 10-minute call holds). Groups:
#  window: the GPU tests of the session-36 window exchange (its path records first, without
#          --gtest_brief, so that a hang names its test), the selection and stack tests, memcheck of
#          the window tests, bench_indexer selection rows (v3 / v3w, masked, pair) at 1 / 6 / 24 / 32
#          rows, and cycles with and without --select-window, interleaved, same binary;
#  v3:     session 35's open confirmation of 1cd682d (v3 with three block-sum sets at MT 1, NP <= 32):
#          the v3 GEMM tests, bench_gemm wq_a|wkv / idx_wq_b at 16-64 rows, and cycles of HEAD against
#          a bb4a38e build (.gpu/base-bb4a38e/v4attn, packed by gpu_stage.sh --base bb4a38e);
#  suite:  the whole GPU suite (the final word on the tree that was staged);
#  scoreboard: bench_gemm at issue 6's GEMM targets and its four PyTorch-figure cycles, then
#          scripts/issue6_report.py's tables (the floor, the ratio, the speed-up, targets met).
# Every step runs under a time limit (new barrier code fails by hanging, and a hung step would take the
# whole call; rc 124 = it hit the limit), and the logs are packed into $OUT/logs.tgz after every step,
# so that a call cut short still returns what ran. A short table is printed last; the exit status is 1
# when any step failed. The HEAD-vs-bb4a38e A/B insists on equal digests: 1cd682d and session 36 kept
# the bytes by design (session 35 run 9; the same PTX), so a difference there is a finding.
set -uo pipefail
cd "$(dirname "$0")/.."
groups=("$@"); [[ ${#groups[@]} -eq 0 ]] && groups=(window v3 suite)
for g in "${groups[@]}"; do
  case $g in window|v3|suite|scoreboard) ;; *) echo "next_run: unknown group '$g' (window, v3, suite, scoreboard)" >&2; exit 2 ;; esac
done
.gpu/gpu_run.sh unpack || exit 1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/extras/CUPTI/lib64:${LD_LIBRARY_PATH:-}
FINAL_OUT=${OUT:-/tmp/v4attn_out}
mkdir -p "$FINAL_OUT"
log=$(mktemp -d)
summary=()
failed=0  # steps with a nonzero status: the script's exit status is 1 when any failed
step() {  # name, limit (s), log file, command...
  local name=$1 limit=$2 f=$3; shift 3
  local t0=$SECONDS
  echo "[next_run] $name (limit ${limit} s)" >&2
  timeout -k 5 "$limit" "$@" >"$log/$f" 2>&1; local rc=$?
  [[ $rc -ne 0 ]] && failed=$((failed + 1))
  summary+=("$(printf '%-28s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E 'PASSED|FAILED|ERROR SUMMARY' "$log/$f" | tail -2 | tr '\n' ' ' | cut -c1-80)")")
  printf '%s\n' "${summary[@]}" >"$log/summary.txt"
  tar -C "$log" -czf "$FINAL_OUT/logs.tgz" .
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  .gpu/v4attn --version
  [[ -x .gpu/base-bb4a38e/v4attn ]] && .gpu/base-bb4a38e/v4attn --version; } >"$log/gpu.txt" 2>&1
T=.gpu/v4attn_gpu_tests

group_window() {
  step "window path tests" 120 window_paths.log $T --gtest_filter='GpuIndexerSelectV3.*Window*'
  step "selection + stack tests" 300 window_tests.log $T --gtest_brief=1 \
    --gtest_filter='GpuIndexerSelectV3.*:*GpuStackSchedules*'
  step "window memcheck" 300 window_memcheck.log compute-sanitizer --tool memcheck --error-exitcode 9 \
    $T --gtest_brief=1 --gtest_filter='GpuIndexerSelectV3.*Window*'
  step "bench_indexer select" 180 bench_indexer.log .gpu/bench_indexer --T 1 6 24 32 --select-only \
    --json "$log/bench_indexer.json"
  step "cycles window A/B" 300 ab_window.log python3 scripts/ab_cycles.py --bin .gpu/v4attn --variant base= \
    --variant win=--select-window --shape decode:1 --shape verify:1 --shape verify:4 --shape decode:32 \
    --shape decode:8 --reps 2 --json "$log/ab_window.json"
}
group_v3() {
  step "v3 GEMM tests" 180 v3_tests.log $T --gtest_brief=1 \
    --gtest_filter='GpuGemm.Fp8WgmmaPipelined*:GpuGemmV3FusedQuant.*:*Fp8SubnormalCodesExact*:*Fp8RealShapesExact*'
  step "bench_gemm v3 rows" 180 bench_gemm.log .gpu/bench_gemm --shapes wq_a_wkv idx_wq_b --m 16 24 32 48 64 \
    --no-v0 --no-peer --reps 200 --json "$log/bench_gemm.json"
  if [[ -x .gpu/base-bb4a38e/v4attn ]]; then
    step "cycles HEAD vs bb4a38e" 420 ab_base.log python3 scripts/ab_cycles.py --bin .gpu/v4attn \
      --variant bb4a38e@.gpu/base-bb4a38e/v4attn= --variant head= --shape verify:2 --shape verify:4 \
      --shape decode:16 --shape decode:24 --shape decode:32 --shape decode:48 --reps 2 --json "$log/ab_base.json"
  else
    summary+=("cycles HEAD vs bb4a38e      skipped: no .gpu/base-bb4a38e/v4attn (gpu_stage.sh --base bb4a38e)")
  fi
}
group_suite() { step "whole GPU suite" 300 gpu_tests.log $T --gtest_brief=1; }
# Issue 6's scoreboard on the staged tree: the GEMM targets with their peers and the four cycles the
# issue has PyTorch figures for, reported by scripts/issue6_report.py (markdown for docs/perf.md).
group_scoreboard() {
  step "bench_gemm targets" 240 board_gemm.log .gpu/bench_gemm --shapes wq_b wq_a_wkv --m 1 6 8 24 48 64 \
    --no-v0 --reps 200 --json "$log/board_gemm.json"
  local cyc=()
  for mb in verify:1 decode:1 verify:4 decode:32; do
    step "cycle ${mb/:/ bs }" 120 "board_${mb/:/_}.log" .gpu/v4attn bench --mode "${mb%%:*}" --bs "${mb##*:}" \
      --cycles 20 --trace-cycles 0 --schedule three-lane --json "$log/board_${mb/:/_}.json"
    [[ -f $log/board_${mb/:/_}.json ]] && cyc+=(--cycle "$log/board_${mb/:/_}.json")
  done
  step "issue 6 report" 30 issue6_report.md python3 scripts/issue6_report.py --gemm "$log/board_gemm.json" "${cyc[@]}" \
    --json "$log/issue6_report.json"
}
for g in "${groups[@]}"; do "group_$g"; done

echo "== $(tr '\n' ' ' <"$log/gpu.txt")"
for f in ab_window ab_base; do
  [[ -f $log/$f.log ]] && { echo "== $f"; grep -vE '^\[ab\]' "$log/$f.log" | tail -20; }
done
[[ -f $log/bench_indexer.log ]] && { echo "== bench_indexer (select rows)"; grep -E 'topk|mask|pair' "$log/bench_indexer.log" | tail -24; }
[[ -f $log/bench_gemm.log ]] && { echo "== bench_gemm"; grep -E 'v3|wq_a|idx' "$log/bench_gemm.log" | tail -16; }
[[ -f $log/issue6_report.md ]] && { echo "== issue 6"; cat "$log/issue6_report.md"; }
echo "== failures"; grep -hE '^\[  FAILED|FAILED TEST' "$log"/*.log 2>/dev/null | sort -u | head -30
echo "== summary"; printf '%s\n' "${summary[@]}"
rm -rf "$log"
exit $((failed > 0))
