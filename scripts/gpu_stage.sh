#!/usr/bin/env bash
# Developer helper: build here, then pack the executables that run on the lent H200 into
# .gpu/bins.tar.xz (stripped and xz-compressed: unpacked they are ~150 MB, over the device tool's
# 64 MiB carry cap; packed ~30 MB) beside .gpu/gpu_run.sh, which unpacks them on the GPU machine.
# .gpu/ is ignored by git (add `/.gpu/` to .git/info/exclude); name it in the device call's carry.
#
#   scripts/gpu_stage.sh [--base REV]...
# --base REV also builds the `v4attn` executable of revision REV (a detached git worktree under
# ${V4ATTN_BASE_DIR:-/tmp/v4attn-base}/<short hash>, with this checkout's CUTLASS headers) and packs it
# as .gpu/base-<short hash>/v4attn: a same-run baseline for scripts/ab_cycles.py
# (`--variant NAME@.gpu/base-<hash>/v4attn=ARGS`), so that a change is timed against the commit before
# it on the same card and lease.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${V4ATTN_BUILD_DIR:-build}
bases=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --base) [[ $# -ge 2 ]] || { echo "gpu_stage: --base needs a revision" >&2; exit 2; }
            rev=$(git rev-parse --verify --quiet "$2^{commit}") || { echo "gpu_stage: unknown revision '$2'" >&2; exit 2; }
            bases+=("$rev"); shift 2 ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_stage: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
cmake --build "$build" --parallel "$(nproc)"
# The baselines first: a failed base build then leaves the previous .gpu/ as it was.
base_bins=()
for rev in "${bases[@]}"; do
  short=$(git rev-parse --short=7 "$rev")
  wt=${V4ATTN_BASE_DIR:-/tmp/v4attn-base}/$short
  if [[ ! -d $wt ]]; then
    git worktree prune  # a worktree of an earlier session whose folder is gone
    git worktree add --detach "$wt" "$rev" >/dev/null
  fi
  echo "gpu_stage: building v4attn at $short in $wt"
  cmake -S "$wt" -B "$wt/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DV4ATTN_CUTLASS_INCLUDE="$root/.deps/cutlass/include" >/dev/null
  cmake --build "$wt/build" --parallel "$(nproc)" --target v4attn
  base_bins+=("$short:$wt/build/v4attn")
done
rm -rf .gpu && mkdir -p .gpu/bin
for f in v4attn v4attn_gpu_tests v4attn_tests "$build"/bench_*; do
  f=${f#"$build"/}
  [[ -x $build/$f ]] && cp "$build/$f" .gpu/bin/ && strip .gpu/bin/"$f"
done
for b in "${base_bins[@]}"; do
  mkdir -p ".gpu/bin/base-${b%%:*}"
  cp "${b#*:}" ".gpu/bin/base-${b%%:*}/v4attn" && strip ".gpu/bin/base-${b%%:*}/v4attn"
done
tar -C .gpu -cf - bin | xz -T0 -6 > .gpu/bins.tar.xz
rm -rf .gpu/bin
cp scripts/gpu_run.sh scripts/next_run.sh .gpu/
du -sh .gpu
