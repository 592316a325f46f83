#!/usr/bin/env bash
# Developer helper: build here, copy just the executables that run on the lent H200 into .gpu/
# (ignored by git; carried to the device machine), stripped of nothing but the build tree.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${V4ATTN_BUILD_DIR:-build}
cmake --build "$build" --parallel "$(nproc)"
rm -rf .gpu && mkdir -p .gpu
for f in v4attn v4attn_gpu_tests v4attn_tests "$build"/bench_*; do
  f=${f#"$build"/}
  [[ -x $build/$f ]] && cp "$build/$f" .gpu/
done
cp scripts/gpu_run.sh .gpu/
du -sh .gpu
