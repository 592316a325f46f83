#!/usr/bin/env bash
# The pending device run: what the last session built and could not run, in one call (each session
# that changes the pending list keeps this file current; docs/perf.md's latest section says why each
# step is here). On this machine: `scripts/gpu_stage.sh --base bb4a38e` (it copies this file to
# .gpu/next_run.sh), then one device call with carry [".gpu"] and the command `.gpu/next_run.sh`.
# Logs go to $OUT (one archive, logs.tgz); a short table is printed last. Steps, in order of value
# (a step that a 10-minute call would not reach should move to a second call):
#  1. the GPU tests of the session-36 window exchange and the stack with it; memcheck of its kernels;
#  2. bench_indexer selection rows (v3 / v3w, masked, pair) at 1 / 6 / 24 / 32 rows;
#  3. cycles with and without --select-window, interleaved, same binary (scripts/ab_cycles.py);
#  4. session 35's open confirmation of 1cd682d (v3 with three block-sum sets at MT 1, NP <= 32):
#     the v3 GEMM tests, bench_gemm wq_a|wkv / idx_wq_b at 16-64 rows, and cycles of HEAD against a
#     bb4a38e build (.gpu/base-bb4a38e/v4attn, packed by gpu_stage.sh --base bb4a38e);
#  5. the whole GPU suite (every test: the final word on the tree that was staged).
set -uo pipefail
cd "$(dirname "$0")/.."
.gpu/gpu_run.sh unpack || exit 1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda/extras/CUPTI/lib64:${LD_LIBRARY_PATH:-}
FINAL_OUT=${OUT:-/tmp/v4attn_out}
mkdir -p "$FINAL_OUT"
log=$(mktemp -d)
summary=()
step() {  # name, log file, command...
  local name=$1 f=$2; shift 2
  local t0=$SECONDS
  echo "[next_run] $name" >&2
  "$@" >"$log/$f" 2>&1; local rc=$?
  summary+=("$(printf '%-30s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -E 'PASSED|FAILED|ERROR SUMMARY' "$log/$f" | tail -2 | tr '\n' ' ' | cut -c1-80)")")
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >"$log/gpu.txt" 2>&1
.gpu/v4attn --version >>"$log/gpu.txt" 2>&1
[[ -x .gpu/base-bb4a38e/v4attn ]] && .gpu/base-bb4a38e/v4attn --version >>"$log/gpu.txt" 2>&1

step "window tests" window_tests.log .gpu/v4attn_gpu_tests --gtest_brief=1 \
  --gtest_filter='GpuIndexerSelectV3.*:GpuStackSchedules*'
step "window memcheck" window_memcheck.log compute-sanitizer --tool memcheck --error-exitcode 9 \
  .gpu/v4attn_gpu_tests --gtest_brief=1 --gtest_filter='GpuIndexerSelectV3.*Window*'
step "bench_indexer select" bench_indexer.log .gpu/bench_indexer --T 1 6 24 32 --select-only \
  --json "$log/bench_indexer.json"
step "cycles window A/B" ab_window.log python3 scripts/ab_cycles.py --bin .gpu/v4attn --variant base= \
  --variant win=--select-window --shape decode:1 --shape verify:1 --shape verify:4 --shape decode:32 \
  --shape decode:8 --reps 2 --json "$log/ab_window.json"
step "v3 GEMM tests" v3_tests.log .gpu/v4attn_gpu_tests --gtest_brief=1 \
  --gtest_filter='GpuGemm.Fp8WgmmaPipelined*:GpuGemmV3FusedQuant.*:*Fp8SubnormalCodesExact*:*Fp8RealShapesExact*'
step "bench_gemm v3 rows" bench_gemm.log .gpu/bench_gemm --shapes wq_a_wkv idx_wq_b --m 16 24 32 48 64 \
  --no-v0 --no-peer --reps 200 --json "$log/bench_gemm.json"
if [[ -x .gpu/base-bb4a38e/v4attn ]]; then
  step "cycles HEAD vs bb4a38e" ab_base.log python3 scripts/ab_cycles.py --bin .gpu/v4attn \
    --variant bb4a38e@.gpu/base-bb4a38e/v4attn= --variant head= --shape verify:2 --shape verify:4 \
    --shape decode:16 --shape decode:24 --shape decode:32 --shape decode:48 --reps 2 --json "$log/ab_base.json"
else
  summary+=("cycles HEAD vs bb4a38e        skipped: no .gpu/base-bb4a38e/v4attn (gpu_stage.sh --base bb4a38e)")
fi
step "whole GPU suite" gpu_tests.log .gpu/v4attn_gpu_tests --gtest_brief=1

echo "== $(tr '\n' ' ' <"$log/gpu.txt")"
for f in ab_window ab_base; do
  [[ -f $log/$f.log ]] && { echo "== $f"; grep -vE '^\[ab\]' "$log/$f.log" | tail -20; }
done
echo "== bench_indexer (select rows)"; grep -E 'topk|mask|pair' "$log/bench_indexer.log" | tail -24
echo "== bench_gemm"; grep -E 'v3|wq_a|idx' "$log/bench_gemm.log" | tail -16
echo "== failures"; grep -hE '^\[  FAILED|FAILED TEST' "$log"/*tests.log 2>/dev/null | sort -u | head -30
echo "== summary"; printf '%s\n' "${summary[@]}"
tar -C "$log" -czf "$FINAL_OUT/logs.tgz" . && rm -rf "$log"
