#!/usr/bin/python3
"""The fault matrix of a capture: each fault injected for real into a dmi-run
writing `--hooks residual,logits` (a full disk is a small tmpfs, a crash is
kill -9, a signal is a signal), then the file read back with h5py and
compared, row by row, with a complete run of the same settings (greedy:
identical numbers).

  scripts/fault_matrix.py [--bin build/bin] [--markdown]

Prints one line per fault: dmi-run's exit status, the file's status as
stored and as dmi reads it, rows recovered / rows of the complete run, and
whether every recovered row is bit-identical to the complete run's.
The tmpfs faults need root (mount); they are reported as skipped otherwise.
"""
import argparse
import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import h5py

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ap = argparse.ArgumentParser()
ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
ap.add_argument("--markdown", action="store_true")
args = ap.parse_args()
DMI_RUN, DMI_INSPECT = os.path.join(args.bin, "dmi-run"), os.path.join(args.bin, "dmi-inspect")
MODEL = os.path.join(ROOT, "data", "default-model")
tmp = tempfile.mkdtemp(prefix="dmi-faults-")
atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # its captures, when it exits
N_NEW = 300


def command(out, *extra):
    a = [DMI_RUN, "-q", "--model", MODEL, "-n", str(N_NEW), "--ignore-eos", "--batch-size", "2", "--hooks",
         "residual,logits", "--logits", "topk:8", "--flush-every", "0.2", "-o", out] + list(extra)
    for i in range(8):
        a += ["--prompt-ids", f"5,6,7,{10 + i}"]
    return a


def rows_of(path):
    """{(site, seq, pos): bytes} of every row all tables of its site hold;
    opened as an SWMR reader when the file is still flagged open."""
    try:
        f = h5py.File(path, "r")
    except OSError:
        f = h5py.File(path, "r", swmr=True)
    out = {}
    with f:
        status = f.attrs["status"]
        for name, g in f["sites"].items():
            n = min(g["data"].shape[0], g["seq"].shape[0], g["pos"].shape[0])
            seq, pos, data = g["seq"][:n], g["pos"][:n], g["data"][:n]
            for i in range(n):
                out[(name, int(seq[i]), int(pos[i]))] = data[i].tobytes()
    return status, out


def dmi_status(path):
    r = subprocess.run([DMI_INSPECT, path, "summary", "--json"], capture_output=True, text=True)
    return json.loads(r.stdout)["status"] if r.returncode == 0 else f"unreadable ({r.stderr.strip()[:60]})"


def wait_for(path, p, seconds):
    """Waits until the file has rows, then `seconds` more."""
    t0 = time.time()
    while time.time() - t0 < 120 and p.poll() is None:
        try:
            with h5py.File(path, "r", swmr=True) as f:
                if f["sites/blocks.0.hook_resid_pre/data"].shape[0] > 0:
                    break
        except (OSError, KeyError):
            pass
        time.sleep(0.05)
    time.sleep(seconds)


results = []


def record(fault, rc, path, reference, note=""):
    if path is None or not os.path.exists(path):
        results.append((fault, rc, "(no file)", "-", "-", "-", note))
        return
    stored, rows = rows_of(path)
    same = all(reference.get(k) == v for k, v in rows.items())
    results.append((fault, rc, stored, dmi_status(path), f"{len(rows)} / {len(reference)}",
                    "yes" if same else "NO", note))


# The complete run: the rows every fault is measured against.
ref_path = os.path.join(tmp, "complete.h5")
r = subprocess.run(command(ref_path), capture_output=True, text=True)
if r.returncode != 0:
    sys.exit(f"the complete run failed: {r.stderr}")
_, reference = rows_of(ref_path)
record("none (complete run)", r.returncode, ref_path, reference)

for sig, name in [(signal.SIGINT, "SIGINT (Ctrl-C)"), (signal.SIGTERM, "SIGTERM"), (signal.SIGKILL, "SIGKILL")]:
    out = os.path.join(tmp, f"{sig.name}.h5")
    p = subprocess.Popen(command(out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(out, p, 1.0)
    p.send_signal(sig)
    p.wait(timeout=120)
    record(name, p.returncode, out, reference)
    if sig == signal.SIGKILL:
        rc = subprocess.run([DMI_INSPECT, out, "recover"], capture_output=True).returncode
        stored, rows = rows_of(out)
        results[-1] = results[-1][:-1] + (f"dmi-inspect recover: exit {rc}, then status {stored}, {len(rows)} rows, "
                                          "opens in plain h5py",)

mnt = os.path.join(tmp, "small")
os.mkdir(mnt)
if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", mnt], capture_output=True).returncode == 0:
    try:
        out = os.path.join(mnt, "full.h5")
        r = subprocess.run(command(out), capture_output=True, text=True)
        record("disk full (6 MiB tmpfs)", r.returncode, out, reference, r.stderr.strip().splitlines()[-1][:90])
    finally:
        subprocess.run(["umount", mnt], capture_output=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", mnt], capture_output=True).returncode == 0:
        try:
            r = subprocess.run(command(os.path.join(mnt, "ro.h5")), capture_output=True, text=True)
            record("read-only file system", r.returncode, None, reference, r.stderr.strip()[:90])
        finally:
            subprocess.run(["umount", mnt], capture_output=True)
else:
    results.append(("disk full / read-only fs", "-", "skipped (mount needs root)", "-", "-", "-", ""))

r = subprocess.run(command(os.path.join(tmp, "missing-dir", "x.h5")), capture_output=True, text=True)
record("output directory missing", r.returncode, None, reference, r.stderr.strip()[:90])
before = os.path.getmtime(ref_path)
r = subprocess.run(command(ref_path), capture_output=True, text=True)
record("output exists (no --overwrite)", r.returncode, None, reference,
       ("existing file untouched; " if os.path.getmtime(ref_path) == before else "EXISTING FILE CHANGED; ") +
       r.stderr.strip()[:70])
out = os.path.join(tmp, "ring.h5")
r = subprocess.run(command(out, "--ring-mb", "0.001"), capture_output=True, text=True)
record("record larger than the ring (error mid-run)", r.returncode, out, reference, r.stderr.strip()[:90])

head = ("fault", "exit", "stored status", "dmi status", "rows kept / complete run", "bit-identical", "note")
if args.markdown:
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for row in results:
        print("| " + " | ".join(str(x).replace("|", "\\|") for x in row) + " |")
else:
    for row in results:
        print("  ".join(f"{str(x):<14}" for x in row))
