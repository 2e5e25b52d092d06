#!/usr/bin/python3
"""A real single-node Slurm cluster (scripts/slurm/slurm-up.sh: slurmctld,
slurmd and munge in a temp dir) runs a 4-task job array of dmi-run --shard
auto and the merge job (scripts/slurm/submit.sh); the merged capture must
equal a single-process capture of the same prompts bit for bit. The cluster
is stopped at the end, and nothing of it may be left running.

Exit 77 (CTest: skipped) with the reason when the cluster cannot start here.

  slurm_test.py BIN_DIR TEST_MODELS
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capture_util import compare_captures  # noqa: E402

bin_dir, models = os.path.abspath(sys.argv[1]), sys.argv[2]
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SLURM = os.path.join(ROOT, "scripts", "slurm")
MODEL = os.path.join(models, "qwen3-untied-f32")
PROMPTS = ["The cat sat on the mat", "Hello", "Once upon a time there was", "A", "B C D E F G H I J K",
           "In the beginning", "What is", "xyz xyz xyz", "Tell me about the sea and the sky", "Why"]
FLAGS = ["--model", MODEL, "-n", "6", "-b", "1", "-t", "1", "-q", "--hooks", "resid_post,pattern,logits",
         "--logits", "topk:4"]
SHARDS = 4


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def skip(msg):
    print("SKIP: " + msg)
    sys.exit(77)


def free_port_pair():
    """A port p with p and p + 1 free on 127.0.0.1 (slurmctld, slurmd)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + 1 >= 65536:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    skip("no two adjacent free TCP ports on 127.0.0.1")


if os.geteuid() != 0:
    skip("needs root: slurmd runs the jobs and munged runs as the munge user")
for cmd in ("slurmctld", "slurmd", "munged", "sbatch", "squeue"):
    if not shutil.which(cmd):
        skip(f"{cmd} is not installed (scripts/setup.sh --with-tests installs slurmd slurmctld slurm-client munge)")

tmp = tempfile.mkdtemp(prefix="dmi-slurm-")
os.chmod(tmp, 0o755)  # the munge user must reach the cluster's socket below it
cluster = os.path.join(tmp, "cluster")
env = dict(os.environ, SLURM_CONF=os.path.join(cluster, "slurm.conf"), DMI_BIN=bin_dir)
for k in list(env):
    if k.startswith(("SLURM_ARRAY", "SLURM_JOB", "SLURM_PROCID", "OMPI_", "PMI_")):
        del env[k]
t0 = time.time()
up = subprocess.run([os.path.join(SLURM, "slurm-up.sh"), cluster, str(free_port_pair())], capture_output=True,
                    text=True, timeout=120)
if up.returncode != 0:
    subprocess.run([os.path.join(SLURM, "slurm-down.sh"), cluster], capture_output=True, timeout=60)
    skip(f"the Slurm cluster did not start: {up.stderr.strip()}")
print(f"cluster up in {time.time() - t0:.1f} s")
try:
    prompts = os.path.join(tmp, "prompts.txt")
    with open(prompts, "w") as f:
        f.write("\n".join(PROMPTS) + "\n")
    single = os.path.join(tmp, "single.h5")
    r = subprocess.run([os.path.join(bin_dir, "dmi-run"), "--prompts", prompts, *FLAGS, "-o", single],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        fail(f"single-process capture: {r.stderr}")
    out = os.path.join(tmp, "caps")
    t0 = time.time()
    r = subprocess.run([os.path.join(SLURM, "submit.sh"), str(SHARDS), out, prompts, *FLAGS], env=env,
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        fail(f"submit.sh: {r.stderr}")
    m = re.match(r"array (\d+) merge (\d+)", r.stdout)
    if not m:
        fail(f"submit.sh printed {r.stdout!r}")
    array, merge = m.group(1), m.group(2)
    print(f"submitted: array job {array} ({SHARDS} tasks), merge job {merge}")
    # squeue every 0.2 s (sbatch --wait polls slowly), at most 5 minutes.
    while True:
        q = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=env, capture_output=True, text=True)
        if q.returncode == 0 and not q.stdout.strip():
            break
        if time.time() - t0 > 300:
            fail(f"jobs still queued after 300 s: {q.stdout}")
        time.sleep(0.2)
    wall = time.time() - t0
    # One jobcomp line per finished task: state, exit code, start and end.
    tasks = {}
    with open(os.path.join(cluster, "log", "jobcomp.log")) as f:
        for line in f:
            rec = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            tasks[rec["JobId"]] = rec
    captures = [t for t in tasks.values() if t.get("ArrayJobId") == array]
    merges = [t for t in tasks.values() if t["JobId"] == merge]
    logs = os.path.join(out, "logs")
    if len(captures) != SHARDS or any(t["JobState"] != "COMPLETED" for t in captures + merges) or len(merges) != 1:
        detail = {n: open(os.path.join(logs, n)).read()[-500:] for n in sorted(os.listdir(logs))} \
            if os.path.isdir(logs) else {}
        fail(f"jobs: {json.dumps(list(tasks.values()), indent=1)}\nlogs: {json.dumps(detail, indent=1)}")
    # Per task wall time: the task's own log has its start; jobcomp has
    # start and end to the second.
    for t in sorted(captures, key=lambda t: int(t["ArrayTaskId"])):
        print(f"task {array}_{t['ArrayTaskId']} (job {t['JobId']}): {t['JobState']} exit {t['ExitCode']}, "
              f"{t['StartTime']} .. {t['EndTime']}")
    print(f"merge job {merge}: {merges[0]['JobState']}, {merges[0]['StartTime']} .. {merges[0]['EndTime']}")
    print(f"submit to merged file: {wall:.1f} s")
    merged = os.path.join(out, "merged.h5")
    n, _ = compare_captures(merged, single)
    print(f"ok: the merged capture of the {SHARDS}-task array equals the single-process capture bit for bit "
          f"({n} rows)")
    s = subprocess.run([os.path.join(bin_dir, "dmi-inspect"), merged, "summary"], capture_output=True, text=True)
    if s.returncode != 0 or f"{SHARDS} of {SHARDS} shards" not in s.stdout:
        fail(f"dmi-inspect summary: {s.stdout} {s.stderr}")
    print(s.stdout)
finally:
    subprocess.run([os.path.join(SLURM, "slurm-down.sh"), cluster], capture_output=True, timeout=120)
    # Nothing of this cluster may be left running (zombies awaiting PID 1 are gone).
    deadline = time.time() + 10
    while True:
        ps = subprocess.run(["ps", "-eo", "pid=,stat=,args="], capture_output=True, text=True).stdout
        left = [l for l in ps.splitlines() if cluster in l and not l.split()[1].startswith("Z")]
        if not left or time.time() > deadline:
            break
        time.sleep(0.2)
    if left:
        fail(f"left running after slurm-down.sh: {left}")
shutil.rmtree(tmp, ignore_errors=True)
print("PASS")
