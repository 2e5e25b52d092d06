#!/usr/bin/env bash
# Stops the cluster scripts/slurm/slurm-up.sh DIR started: cancels its jobs
# (stopping slurmd does not stop running job steps), then stops slurmd,
# slurmctld and munged and waits until they are gone. Leaves DIR (logs).
set -uo pipefail
dir="${1:?usage: slurm-down.sh DIR}"
export SLURM_CONF="$dir/slurm.conf"
[ -f "$SLURM_CONF" ] && scancel --quiet --full $(squeue -h -o %A 2>/dev/null | sort -u) 2>/dev/null
# A process is gone when it no longer exists or is a zombie (the container's
# PID 1 may reap exited daemons late).
alive() { local s; s="$(ps -o stat= -p "$1" 2>/dev/null)" && [ -n "$s" ] && [ "${s:0:1}" != Z ]; }
for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
  [ -f "$pidfile" ] || continue
  pid="$(cat "$pidfile")"
  alive "$pid" || continue
  kill "$pid" 2>/dev/null
  for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
  alive "$pid" && kill -9 "$pid" 2>/dev/null
done
exit 0
