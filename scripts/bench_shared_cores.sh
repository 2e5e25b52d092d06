#!/usr/bin/env bash
# Wall time of a small dmi-run job alone and beside a second copy of itself,
# for each dmi-run binary given, alternating, ROUNDS rounds: how much two
# processes on the same cores slow each other (docs/benchmarks.md, "small
# models on shared cores").
#
#   scripts/bench_shared_cores.sh [-r ROUNDS] DMI_RUN [DMI_RUN ...]
#   scripts/bench_shared_cores.sh -r 3 build/before/dmi-run build/bin/dmi-run
#
# The job: the embedded default model (4 layers), 6 prompts one at a time,
# 160 tokens each, --hooks residual, written to a temporary directory.
# Extra dmi-run flags (e.g. -t 1) go in $DMI_RUN_FLAGS.
set -euo pipefail
rounds=3
if [ "${1:-}" = "-r" ]; then rounds="$2"; shift 2; fi
if [ $# -eq 0 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
for bin in "$@"; do
  [ -x "$bin" ] || { echo "bench_shared_cores: $bin is not an executable" >&2; exit 2; }
done
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
args=(--hooks residual -n 160 --ignore-eos --batch-size 1)
for i in 0 1 2 3 4 5; do args+=(--prompt "prompt number $i"); done
# shellcheck disable=SC2086
job() { "$1" -q --overwrite ${DMI_RUN_FLAGS:-} -o "$tmp/$2.h5" "${args[@]}" >/dev/null; }
now() { date +%s.%N; }
printf '%-5s  %-40s  %8s  %12s\n' round binary "alone s" "two at once s"
for ((r = 1; r <= rounds; r++)); do
  for bin in "$@"; do
    t0=$(now); job "$bin" a; t1=$(now)
    job "$bin" a & p=$!; job "$bin" b; wait "$p"; t2=$(now)
    awk -v r="$r" -v b="$bin" -v t0="$t0" -v t1="$t1" -v t2="$t2" \
      'BEGIN { printf "%-5s  %-40s  %8.2f  %12.2f\n", r, b, t1 - t0, t2 - t1 }'
  done
done
