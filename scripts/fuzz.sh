#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, ASan + UBSan, clang) in
# build-fuzz/ and runs them: every target, or the ones named.
#
#   scripts/fuzz.sh --seconds 60                 each target for 60 s
#   scripts/fuzz.sh --seconds 600 capture hooks  only these
#   scripts/fuzz.sh --regress                    each target once over its seeds (tests/data/fuzz/<target>)
#
# Each target starts from its seeds and a working corpus in
# build-fuzz/corpus/<target> (kept between runs). Any crash, sanitizer
# report, leak, uncaught exception, input slower than 1 s (-timeout=1) or
# more than 2.5 GB of memory stops that target; its input is written to
# build-fuzz/findings/ and the script exits 1 after the summary. Copy a
# finding into tests/data/fuzz/<target>/ once fixed: the seeds are the
# regression suite (--regress runs them, and CI runs it).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
all=(safetensors weight_index config tokenizer_json tokenizer_text prompts hooks vectors capture)
seconds=0
regress=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="${2:?--seconds needs a number}"; shift 2 ;;
    --regress) regress=1; shift ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if [ $regress = 0 ] && ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: give --seconds N (N >= 1) or --regress (see --help)" >&2
  exit 2
fi
[ ${#targets[@]} -eq 0 ] && targets=("${all[@]}")
for t in "${targets[@]}"; do
  [[ " ${all[*]} " == *" $t "* ]] || { echo "fuzz.sh: unknown target '$t' (one of: ${all[*]})" >&2; exit 2; }
done

"$root/scripts/setup.sh" --with-tests
build="$root/build-fuzz"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DDMI_FUZZ=ON -DDMI_BUILD_TESTS=OFF >/dev/null
ninja -C "$build" $(printf 'fuzz_%s ' "${targets[@]}")

# LibTorch keeps process-wide allocations reachable (not leaks); HDF5 and
# the parsers must not leak per input.
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:allocator_may_return_null=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
# HDF5's own leaks on corrupt files: tests/fuzz/lsan.supp says why.
export LSAN_OPTIONS="suppressions=$root/tests/fuzz/lsan.supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
mkdir -p "$build/findings"
failed=()
summary=()
for t in "${targets[@]}"; do
  seeds="$root/tests/data/fuzz/$t"
  log="$build/fuzz_$t.log"
  if [ $regress = 1 ]; then
    args=(-runs=0 "$seeds")
  else
    mkdir -p "$build/corpus/$t"
    args=(-max_total_time="$seconds" -print_final_stats=1 "$build/corpus/$t" "$seeds")
  fi
  echo "== fuzz_$t ($([ $regress = 1 ] && echo "seeds once" || echo "${seconds} s"))" >&2
  if "$build/bin/fuzz_$t" -timeout=1 -rss_limit_mb=2560 -max_len=65536 \
       -artifact_prefix="$build/findings/$t-" "${args[@]}" >"$log" 2>&1; then
    status=ok
  else
    status=FAILED
    failed+=("$t")
    grep -E "ERROR|SUMMARY|Test unit written|uncaught|deadly|timeout" "$log" | head -8 >&2 || true
  fi
  execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' || true)
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -1 || true)
  [ -z "$execs" ] && execs=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#' || true)
  summary+=("$(printf '%-16s %-7s %12s execs  %s  corpus %s' "$t" "$status" "${execs:-?}" "${cov:-cov: ?}" \
    "$(ls "$build/corpus/$t" 2>/dev/null | wc -l)")")
done
printf '%s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: findings in: ${failed[*]} (inputs in $build/findings/, logs in $build/fuzz_<target>.log)" >&2
  exit 1
fi
