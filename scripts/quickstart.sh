#!/usr/bin/env bash
# The main job from a fresh Debian 12 machine (as root): install what dmi
# needs, build, and generate text with the embedded default model.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
"$root/build/bin/dmi-run" "$@"
