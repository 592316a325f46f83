#!/usr/bin/env bash
# The README's main command: set-up, build, then the main job (`v4attn main`): on a GPU a
# target-verify cycle of the V4.1-Flash prepare stack; without one the CPU reference on a
# reduced config (it says which it ran).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup.sh
build=${V4ATTN_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" --parallel "$(nproc)" --target v4attn
exec "$build/v4attn" main "$@"
