#!/usr/bin/python3
"""dmi on x86-64 CPUs older than this machine's, run for real: the binaries
under qemu-x86_64 (user mode), whose emulated CPUID reports the named model
and which raises SIGILL for any instruction that model lacks (an AVX2
instruction under Ivy Bridge, an AVX one under Core 2).

  older_cpus_test.py BIN_DIR TEST_MODELS CASE

unit-<Model>   the numerics' unit tests (kernels, ops, model references,
               batch invariance) under qemu's <Model>: Conroe (Core 2: SSSE3,
               no SSE4.1, no AVX) or IvyBridge (AVX without AVX2 and FMA).
capture-replay dmi-run captures under Conroe (fp32 and bf16 models) and Ivy
               Bridge (fp32) record the sse2 or avx kernels, ATen's portable
               ones and the emulated CPU; replayed here with this CPU's
               defaults they differ and the warnings name the variables
               that select the recorded kernels; with those variables they
               replay bit for bit (the Ivy Bridge one on sse2 too). A
               capture under oneDNN capped at AVX: the warning names
               ONEDNN_MAX_CPU_ISA=AVX.

dmi-run re-executes itself through /proc/self/exe to set its environment
(engine/runtime.cpp); qemu-user would hand that exec to the host kernel,
which runs the binary natively, so the qemu runs set DMI_ENV_READY=1.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import h5py

bin_dir, models, case = sys.argv[1], sys.argv[2], sys.argv[3]
QEMU = shutil.which("qemu-x86_64")
NUMERICS = "kernels:*,ops:*,reference:*,forward:*,batch invariance:*"
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [9, 8, 7], [200]]


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


if QEMU is None:
    fail("qemu-x86_64 not found: scripts/setup.sh --with-tests installs it (Debian's qemu-user)")


def run(cmd, env=None, expect_rc=0, timeout=900):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if expect_rc is not None and r.returncode != expect_rc:
        fail(f"{' '.join(cmd)}: exit {r.returncode}, want {expect_rc}\nstdout: {r.stdout[-3000:]}\n"
             f"stderr: {r.stderr[-3000:]}")
    return r


SELECTORS = ("DMI_KERNELS", "ATEN_CPU_CAPABILITY", "OPENBLAS_CORETYPE", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
             "DMI_ENV_READY")


def native_env(**extra):
    """This machine's defaults, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in SELECTORS}
    env.update(extra)
    return env


def emulated_env(**extra):
    return native_env(DMI_ENV_READY="1", **extra)


def qemu_refuses_avx2(model):
    """The emulation is real: an AVX2 instruction in a tiny program dies with
    SIGILL under `model` (and runs under qemu's Haswell)."""
    tmp = tempfile.mkdtemp(prefix="dmi-oldcpu-")
    src = os.path.join(tmp, "avx2.c")
    with open(src, "w") as f:
        f.write('int main(void) { __asm__ volatile("vpaddd %%ymm0, %%ymm0, %%ymm0" ::: "xmm0"); return 0; }\n')
    exe = os.path.join(tmp, "avx2")
    run(["cc", src, "-o", exe])
    control = subprocess.run([QEMU, "-cpu", "Haswell", exe], capture_output=True, text=True, timeout=60)
    r = subprocess.run([QEMU, "-cpu", model, exe], capture_output=True, text=True, timeout=60)
    shutil.rmtree(tmp, ignore_errors=True)
    if control.returncode != 0:
        fail(f"qemu -cpu Haswell refused an AVX2 instruction: {control.stderr.strip()}")
    return r.returncode != 0 and "Illegal instruction" in r.stderr


def rep_env_now(rep, key):
    """This machine's value of an environment field, from the replay's own
    output file (engine/runtime.cpp records it in every capture)."""
    with h5py.File(rep["capture"]["output"], "r") as f:
        return json.loads(f.attrs["environment"])[key]


if case.startswith("unit-"):
    model = case[len("unit-"):]
    if not qemu_refuses_avx2(model):
        fail(f"qemu -cpu {model} ran an AVX2 instruction: the emulated CPU would not test anything")
    r = run([QEMU, "-cpu", model, os.path.join(bin_dir, "dmi_unit"), f"--test-case={NUMERICS}"],
            env=emulated_env(DMI_TEST_MODELS=models), expect_rc=None)
    tail = r.stdout[-3000:] + r.stderr[-3000:]
    if r.returncode != 0 or "Status: SUCCESS!" not in r.stdout:
        fail(f"dmi_unit under qemu -cpu {model}: exit {r.returncode}\n{tail}")
    counts = [line for line in r.stdout.splitlines() if line.startswith("[doctest] test cases:")]
    if not counts or " 0 passed" in counts[0]:
        fail(f"dmi_unit under qemu -cpu {model} ran no test: {counts}")
    print(f"qemu -cpu {model}: {counts[0]}")

elif case == "capture-replay":
    for cpu in ("Conroe", "IvyBridge"):
        if not qemu_refuses_avx2(cpu):
            fail(f"qemu -cpu {cpu} ran an AVX2 instruction: the emulated CPU would not test anything")
    tmp = tempfile.mkdtemp(prefix="dmi-oldcpu-")
    dmi_run = os.path.join(bin_dir, "dmi-run")
    with open("/proc/cpuinfo") as f:
        native_has_avx2 = any(line.startswith("flags") and " avx2" in line for line in f)
    # (emulated CPU, model, the kernels and flags it must record)
    runs = [("Conroe", "qwen3-untied-f32", "sse2", []), ("Conroe", "qwen3-qknorm-bf16-misaligned", "sse2", []),
            ("IvyBridge", "qwen3-untied-f32", "avx", ["avx", "f16c"])]
    for cpu, model_name, kernels, flags in runs:
        selecting = {"DMI_KERNELS": kernels, "ATEN_CPU_CAPABILITY": "default"}
        src = os.path.join(tmp, f"{cpu}-{model_name}.h5")
        args = ["-q", "--model", os.path.join(models, model_name), "-n", "5", "--batch-size", "3",
                "--hooks", "full", "-o", src]
        for p in PROMPTS:
            args += ["--prompt-ids", ",".join(map(str, p))]
        run([QEMU, "-cpu", cpu, dmi_run, *args], env=emulated_env())
        with h5py.File(src, "r") as f:
            recorded = json.loads(f.attrs["environment"])
        # The record describes the CPU the run saw (CPUID), not the host's
        # /proc/cpuinfo, which qemu-user passes through.
        if (recorded["dmi_kernels"] != kernels or recorded["aten_cpu_capability"] not in ("NO AVX", "DEFAULT")
                or recorded["cpu_flags"] != flags or cpu.replace("IvyBridge", "Ivy Bridge") not in recorded["cpu_model"]):
            fail(f"{model_name}: under {cpu} the capture records {recorded}")

        # This CPU's defaults: other kernels, so other bits, and warnings that
        # name the way to the recorded ones.
        # (Where this CPU has AVX2, as every machine this suite has run on.)
        if native_has_avx2:
            r = run([dmi_run, "--replay", src, "--verify", "--json", "-o", os.path.join(tmp, f"{cpu}-{model_name}-default.h5")],
                    env=native_env(), expect_rc=None)
            rep = json.loads(r.stdout)
            if r.returncode != 1 or rep["replay"]["verify"]["equal"]:
                fail(f"{model_name}: replayed on this CPU's defaults, exit {r.returncode}: expected other bits")
            hints = [w for w in rep["replay"]["warnings"] if w.startswith("environment differs")]
            missing = [f"{k}={v} selects the recorded" for k, v in selecting.items()]
            if recorded["openblas_core"] != rep_env_now(rep, "openblas_core"):
                missing.append(f"OPENBLAS_CORETYPE={recorded['openblas_core']} selects the recorded one")
            missing = [m for m in missing if not any(m in h for h in hints)]
            if missing:
                fail(f"{model_name}: warnings {hints} do not name {missing}")

        # The variables the warnings named: bit for bit.
        r = run([dmi_run, "--replay", src, "--verify", "--json", "-o", os.path.join(tmp, f"{cpu}-{model_name}-selected.h5")],
                env=native_env(**selecting), expect_rc=None)
        rep = json.loads(r.stdout)
        v = rep["replay"]["verify"]
        if r.returncode != 0 or not (v["equal"] and v["bitwise"]):
            bad = [s["site"] for s in v["sites"] if s["mismatches"]]
            fail(f"{model_name}: replay under {selecting}: exit {r.returncode}, equal {v['equal']}, "
                 f"bitwise {v['bitwise']}, sites differing {bad[:5]}")
        if any("dmi_kernels" in w or "aten_cpu_capability" in w for w in rep["replay"]["warnings"]):
            fail(f"{model_name}: warnings left under {selecting}: {rep['replay']['warnings']}")
        if kernels == "avx":
            # sse2 computes avx's bits: the same replay on it.
            r = run([dmi_run, "--replay", src, "--verify", "--json", "-o", os.path.join(tmp, f"{cpu}-on-sse2.h5")],
                    env=native_env(DMI_KERNELS="sse2", ATEN_CPU_CAPABILITY="default"), expect_rc=None)
            v = json.loads(r.stdout)["replay"]["verify"]
            if r.returncode != 0 or not (v["equal"] and v["bitwise"]):
                fail(f"{model_name}: the {cpu} capture on sse2: exit {r.returncode}, equal {v['equal']}")
        print(f"{model_name}: captured under {cpu} ({recorded['dmi_kernels']}, ATen {recorded['aten_cpu_capability']},"
              f" OpenBLAS {recorded['openblas_core']}); replayed bit for bit under {selecting}; "
              f"{len(v['sites'])} sites")

    # oneDNN's ISA, capped here as an AVX-only CPU would have it: the warning
    # names the cap, and under it the warning goes.
    src = os.path.join(tmp, "onednn-avx.h5")
    args = ["-q", "--model", os.path.join(models, "qwen3-qknorm-bf16-misaligned"), "-n", "2", "--hooks",
            "resid_post", "-o", src, "--prompt-ids", "5,17,42"]
    run([dmi_run, *args], env=native_env(ONEDNN_MAX_CPU_ISA="AVX"))
    r = run([dmi_run, "--replay", src, "--json", "-o", os.path.join(tmp, "onednn-default.h5")], env=native_env())
    warnings = json.loads(r.stdout)["replay"]["warnings"]
    onednn = [w for w in warnings if "onednn_isa" in w]
    if native_has_avx2 and not (len(onednn) == 1 and "ONEDNN_MAX_CPU_ISA=AVX selects the recorded one" in onednn[0]):
        fail(f"capture under ONEDNN_MAX_CPU_ISA=AVX replayed on the defaults: warnings {warnings}")
    r = run([dmi_run, "--replay", src, "--json", "-o", os.path.join(tmp, "onednn-avx-again.h5")],
            env=native_env(ONEDNN_MAX_CPU_ISA="AVX"))
    warnings = json.loads(r.stdout)["replay"]["warnings"]
    if any("onednn_isa" in w for w in warnings):
        fail(f"replayed under ONEDNN_MAX_CPU_ISA=AVX: warnings {warnings}")
    print("oneDNN: the warning names ONEDNN_MAX_CPU_ISA=AVX, and is gone under it")
    shutil.rmtree(tmp, ignore_errors=True)

else:
    fail(f"unknown case {case}")
