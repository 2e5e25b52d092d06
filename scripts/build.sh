#!/usr/bin/env bash
# Configures and builds dmi into build/ (Release, Ninja, ccache).
# Extra arguments go to cmake, e.g. scripts/build.sh -DDMI_WITH_CUDA=ON
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cmake -S "$root" -B "$root/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
ninja -C "$root/build"
