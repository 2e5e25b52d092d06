#!/usr/bin/env bash
# Submits a sharded capture to Slurm: a job array of N dmi-run tasks, one
# shard each, and a merge job that runs when all of them succeeded. Prints
# the two job ids. Logs go to OUTDIR/logs/.
#
#   scripts/slurm/submit.sh N OUTDIR PROMPTS [dmi-run flags...]
#   scripts/slurm/submit.sh 16 caps prompts.jsonl --model ./Qwen3-0.6B --dtype bfloat16 --hooks residual -t 4
#
# Environment: DMI_BIN (the directory of dmi-run and dmi-inspect; default:
# PATH), SBATCH_* variables for sbatch (partition, account, time limit, ...),
# DMI_CPUS_PER_TASK (default 1), DMI_MERGE_FLAGS (e.g. --copy).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
n="${1:?usage: submit.sh N OUTDIR PROMPTS [dmi-run flags...]}"
out="${2:?usage: submit.sh N OUTDIR PROMPTS [dmi-run flags...]}"
prompts="${3:?usage: submit.sh N OUTDIR PROMPTS [dmi-run flags...]}"
shift 3
case "$n" in ''|*[!0-9]*|0) echo "submit: N must be a positive number of shards, not '$n'" >&2; exit 2 ;; esac
[ -f "$prompts" ] || { echo "submit: $prompts: no such prompts file" >&2; exit 2; }
mkdir -p "$out/logs"
out="$(cd "$out" && pwd)"
prompts="$(cd "$(dirname "$prompts")" && pwd)/$(basename "$prompts")"
array="$(sbatch --parsable --array="0-$((n - 1))" --cpus-per-task="${DMI_CPUS_PER_TASK:-1}" \
  --output="$out/logs/%x-%A_%a.out" "$here/capture-array.sbatch" "$out" "$prompts" "$@")"
array="${array%%;*}"
# shellcheck disable=SC2086
merge="$(sbatch --parsable --dependency="afterok:$array" --kill-on-invalid-dep=yes \
  --output="$out/logs/%x-%j.out" "$here/merge.sbatch" "$out" ${DMI_MERGE_FLAGS:-})"
merge="${merge%%;*}"
echo "array $array merge $merge"
