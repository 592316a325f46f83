#!/usr/bin/env bash
# Developer helper: build here, then pack the executables that run on the lent H200 into
# .gpu/bins.tar.xz (stripped and xz-compressed: unpacked they are ~150 MB, over the device tool's
# 64 MiB carry cap; packed ~30 MB) beside .gpu/gpu_run.sh, which unpacks them on the GPU machine.
# .gpu/ is ignored by git (add `/.gpu/` to .git/info/exclude); name it in the device call's carry.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${V4ATTN_BUILD_DIR:-build}
cmake --build "$build" --parallel "$(nproc)"
rm -rf .gpu && mkdir -p .gpu/bin
for f in v4attn v4attn_gpu_tests v4attn_tests "$build"/bench_*; do
  f=${f#"$build"/}
  [[ -x $build/$f ]] && cp "$build/$f" .gpu/bin/ && strip .gpu/bin/"$f"
done
tar -C .gpu -cf - bin | xz -T0 -6 > .gpu/bins.tar.xz
rm -rf .gpu/bin
cp scripts/gpu_run.sh .gpu/
du -sh .gpu
