#!/usr/bin/env bash
# Starts a single-node Slurm cluster (Debian's slurmctld, slurmd and munge,
# run as root) whose configuration, state, logs and sockets all live in DIR;
# scripts/slurm/slurm-down.sh DIR stops it. For tests and trying the job
# scripts on one machine; a real cluster has its own configuration.
#
#   scripts/slurm/slurm-up.sh DIR [PORT]      (ports PORT and PORT+1; default 16817)
#   export SLURM_CONF=DIR/slurm.conf          then sbatch, squeue, scancel talk to it
#
# Packages: slurmd slurmctld slurm-client munge (scripts/setup.sh --with-tests).
# Prints the reason and exits 1 when the cluster cannot start.
set -euo pipefail
dir="${1:?usage: slurm-up.sh DIR [PORT]}"
port="${2:-16817}"
[ "$(id -u)" -eq 0 ] || { echo "slurm-up: needs root (slurmd runs jobs as their users)" >&2; exit 1; }
for cmd in slurmctld slurmd munged mungekey sbatch squeue scontrol; do
  command -v "$cmd" >/dev/null || { echo "slurm-up: $cmd not found (scripts/setup.sh --with-tests installs Slurm and munge)" >&2; exit 1; }
done
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/munge"
# The munge user must reach DIR/munge (its socket, key and log).
chmod 0755 "$dir"
runuser -u munge -- test -x "$dir" || { echo "slurm-up: the munge user cannot enter $dir: make it and its parents traversable (chmod o+x)" >&2; exit 1; }

# munge: its own key, socket and pid file in DIR, run as the munge user
# (munged refuses root); the directory must be its own, readable by all
# (clients reach the socket) and writable by nobody else.
chown munge: "$dir/munge"
chmod 0755 "$dir/munge"
[ -f "$dir/munge/munge.key" ] || runuser -u munge -- mungekey --create --keyfile="$dir/munge/munge.key" >/dev/null
runuser -u munge -- munged --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
  --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"

cpus="$(nproc)"
cat > "$dir/slurm.conf" <<CONF
ClusterName=dmi-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=1,batch_sched_delay=0
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
ReturnToService=2
MailProg=/bin/true
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF" -c
slurmd -f "$SLURM_CONF" -N localhost

# Up when the node is idle (at most 30 s).
for _ in $(seq 150); do
  state="$(sinfo -h -N -o %t 2>/dev/null || true)"
  [ "$state" = "idle" ] && { echo "slurm-up: cluster up in $dir (SLURM_CONF=$SLURM_CONF)" >&2; exit 0; }
  sleep 0.2
done
echo "slurm-up: the node did not come up (state '${state:-none}'); logs in $dir/log: $(tail -n 3 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" 2>/dev/null | tr '\n' ' ')" >&2
exit 1
