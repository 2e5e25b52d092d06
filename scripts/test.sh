#!/usr/bin/env bash
# The whole test suite from a fresh Debian 12 machine (as root): install
# build and test dependencies, build, run every CTest test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh" --with-tests
"$root/scripts/build.sh"
cd "$root/build"
ctest --output-on-failure -j"$(nproc)" "$@"
