#!/usr/bin/env bash
# The whole CTest suite under AddressSanitizer + UndefinedBehaviorSanitizer,
# in build-asan/ (a separate build tree; -DDMI_SANITIZE=ON). scripts/test.sh
# (CI) runs it last.
#
#   scripts/sanitize.sh            build, then run every test
#   scripts/sanitize.sh -R steer   extra arguments go to ctest
#
# LibTorch, OpenBLAS and HDF5 are not instrumented; ASan still checks every
# access dmi's code makes. Leak checking is off: LibTorch keeps process-wide
# allocations (thread pools, registries) alive until exit by design.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh" --with-tests
cmake -S "$root" -B "$root/build-asan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDMI_SANITIZE=ON >/dev/null
ninja -C "$root/build-asan"
cd "$root/build-asan"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
ctest --output-on-failure -j"$(nproc)" "$@"
