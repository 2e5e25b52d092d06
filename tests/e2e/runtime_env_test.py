#!/usr/bin/python3
"""dmi-run's restart that sets OPENBLAS_CORETYPE and OMP_WAIT_POLICY before
the libraries that read them load (engine/runtime.h).

  runtime_env_test.py DMI_RUN DMI_OPENBLAS_CORE TEST_MODELS CASE

CASE: restart (nothing set: one restart; OpenBLAS runs the CPU's core),
preset (OPENBLAS_CORETYPE already set, as the test suite does: no restart),
openblas-owner (float32 on ATen's GEMM: a restart for OMP_WAIT_POLICY even
with OPENBLAS_CORETYPE set), user-wins (the user's OPENBLAS_CORETYPE is the
one OpenBLAS runs).

Whether dmi-run restarted is read from /proc/PID/environ, the environment its
current program image started with: a restart's variables appear there, a
setenv() without one does not. dmi-run reads its prompts from a FIFO, which
it opens only after the restart, so the check runs while it waits there.
"""
import errno
import json
import os
import subprocess
import sys
import time

import h5py

from scratch import scratch_dir

dmi_run, core_tool, models, case = sys.argv[1:5]
MODEL = os.path.join(models, "llama-gqa-f32")
VARS = ("OPENBLAS_CORETYPE", "OMP_WAIT_POLICY", "DMI_ENV_READY", "DMI_KERNELS")
tmp = scratch_dir("dmi-env-")


def fail(msg):
    sys.exit("FAIL: " + msg)


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env.update(extra)
    return env


def run(env, *args):
    """dmi-run with its prompts from a FIFO; returns (the environment its
    program image started with, once it opens the FIFO; the capture's
    environment record)."""
    fifo = os.path.join(tmp, "prompts")
    out = os.path.join(tmp, "out.h5")
    for p in (fifo, out):
        if os.path.exists(p):
            os.remove(p)
    os.mkfifo(fifo)
    p = subprocess.Popen([dmi_run, "--model", MODEL, "--prompts", fifo, "-n", "1", "-q", "--hooks", "logits",
                          "-o", out, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    fd = None
    while fd is None:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO until a reader has it open
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            if p.poll() is not None:
                fail(f"dmi-run exited {p.returncode} before reading its prompts: {p.stderr.read()}")
            if time.monotonic() > deadline:
                p.kill()
                fail("dmi-run never opened its prompts FIFO")
            time.sleep(0.01)
    with open(f"/proc/{p.pid}/environ", "rb") as f:
        started = dict(e.decode().split("=", 1) for e in f.read().split(b"\0") if b"=" in e)
    os.write(fd, b"The cat\n")
    os.close(fd)
    stdout, stderr = p.communicate(timeout=300)
    if p.returncode != 0:
        fail(f"dmi-run exited {p.returncode}: {stderr}")
    with h5py.File(out, "r") as f:
        record = json.loads(f.attrs["environment"])
    return started, record


core = subprocess.run([core_tool], capture_output=True, text=True, check=True).stdout.strip()

if case == "restart":
    started, record = run(clean_env())
    if not core:
        if "DMI_ENV_READY" in started:
            fail("restarted on a CPU whose OpenBLAS core dmi leaves alone")
        print("no OPENBLAS_CORETYPE for this CPU: no restart")
        sys.exit(0)
    if started.get("DMI_ENV_READY") != "1" or started.get("OPENBLAS_CORETYPE") != core:
        fail(f"no restart with OPENBLAS_CORETYPE={core}: started with "
             f"{ {k: started.get(k) for k in VARS} }")
    if "OMP_WAIT_POLICY" in started:
        fail("OMP_WAIT_POLICY set for dmi's kernels (OpenMP owns the cores)")
    if record["openblas_core"].lower() != core.lower():
        fail(f"OpenBLAS runs {record['openblas_core']}, not {core}")
    print(f"one restart; OpenBLAS runs {record['openblas_core']}")
elif case == "preset":
    if not core:
        print("no OPENBLAS_CORETYPE for this CPU")
        sys.exit(77)
    started, record = run(clean_env(OPENBLAS_CORETYPE=core))
    if "DMI_ENV_READY" in started:
        fail("restarted although nothing needed setting")
    if record["openblas_core"].lower() != core.lower():
        fail(f"OpenBLAS runs {record['openblas_core']}, not {core}")
    print(f"OPENBLAS_CORETYPE={core} set: no restart")
elif case == "openblas-owner":
    started, record = run(clean_env(DMI_KERNELS="aten", **({"OPENBLAS_CORETYPE": core} if core else {})),
                          "--dtype", "float32")
    if started.get("DMI_ENV_READY") != "1" or started.get("OMP_WAIT_POLICY") != "PASSIVE":
        fail(f"float32 on ATen did not restart with OMP_WAIT_POLICY=PASSIVE: "
             f"{ {k: started.get(k) for k in VARS} }")
    print("float32 on ATen's GEMM: restarted with OMP_WAIT_POLICY=PASSIVE")
elif case == "user-wins":
    if core not in ("SkylakeX", "Haswell"):
        print(f"needs an AVX2 CPU (dmi's core here: {core or 'none'})")
        sys.exit(77)
    started, record = run(clean_env(OPENBLAS_CORETYPE="Haswell"))
    if started.get("OPENBLAS_CORETYPE") != "Haswell" or record["openblas_core"].lower() != "haswell":
        fail(f"the user's OPENBLAS_CORETYPE=Haswell lost: OpenBLAS runs {record['openblas_core']}")
    print("the user's OPENBLAS_CORETYPE=Haswell kept")
else:
    fail(f"unknown case {case}")
