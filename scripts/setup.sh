#!/usr/bin/env bash
# One-time, idempotent set-up for v4attn on a fresh Debian/Ubuntu machine.
#  - installs the Debian packages the build needs (only when something is missing; needs root),
#  - downloads the pinned nvidia-cutlass wheel from PyPI and unpacks its CUTLASS/CuTe headers
#    into .deps/cutlass (never installed into the system; .deps/ is ignored by git).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

CUTLASS_VERSION=4.2.0.0
CUTLASS_SHA256=f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6
PKGS=(cmake ninja-build g++ libgtest-dev nlohmann-json3-dev libcli11-dev ccache python3-pip unzip)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: missing Debian packages: ${missing[*]}" >&2
    echo "setup: run this script as root (or: sudo apt-get install ${missing[*]})" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v nvcc >/dev/null 2>&1 && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "setup: the CUDA 13 toolkit (nvcc) was not found; install it to /usr/local/cuda" >&2
  exit 1
fi

stamp=.deps/cutlass/.version
if [[ ! -f $stamp || $(cat "$stamp") != "$CUTLASS_VERSION" ]]; then
  echo "setup: fetching nvidia-cutlass==$CUTLASS_VERSION headers"
  rm -rf .deps/cutlass .deps/wheel
  mkdir -p .deps/wheel
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
      "nvidia-cutlass==$CUTLASS_VERSION" -d .deps/wheel
  whl=$(ls .deps/wheel/nvidia_cutlass-"$CUTLASS_VERSION"-*.whl)
  echo "$CUTLASS_SHA256  $whl" | sha256sum -c --quiet - || {
    echo "setup: checksum mismatch for $whl" >&2; exit 1; }
  mkdir -p .deps/cutlass
  unzip -q "$whl" 'cutlass_library/source/include/*' -d .deps/wheel/x
  mv .deps/wheel/x/cutlass_library/source/include .deps/cutlass/include
  rm -rf .deps/wheel
  echo "$CUTLASS_VERSION" > "$stamp"
fi
