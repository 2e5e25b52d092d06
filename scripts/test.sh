#!/usr/bin/env bash
# The whole test suite from a fresh Debian 12 machine (as root): install
# build and test dependencies, build, run every CTest test, then every
# fuzz target over its seeds and briefly beyond (scripts/fuzz.sh: a separate
# clang ASan/UBSan build in build-fuzz/), then the whole CTest suite again
# under ASan+UBSan (scripts/sanitize.sh: build-asan/).
#
#   scripts/test.sh                          all of it (CI: 42-82 minutes on 2 cores until
#                                            2026-12-07, whose skipped restarts took ~11
#                                            minutes off the two CTest runs)
#   DMI_FUZZ_SECONDS=0 scripts/test.sh       without the fuzzers
#   DMI_SANITIZE_SUITE=0 scripts/test.sh        without the ASan+UBSan suite
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh" --with-tests
"$root/scripts/build.sh"
(cd "$root/build" && ctest --output-on-failure -j"$(nproc)" "$@")
seconds="${DMI_FUZZ_SECONDS:-10}"
if [ "$seconds" != 0 ]; then
  "$root/scripts/fuzz.sh" --seconds "$seconds"
fi
if [ "${DMI_SANITIZE_SUITE:-1}" != 0 ]; then
  "$root/scripts/sanitize.sh"
fi
