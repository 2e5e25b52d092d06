#!/usr/bin/python3
"""Every input the fuzzers found (tests/data/fuzz/<target>/regression-*),
fed to the real tools of the normal build, as a user would: each must end in
exit status 0 or 2 (bad input: one line on stderr), within 30 s, and never
in a crash or an internal error. (scripts/fuzz.sh --regress replays the same
files under ASan/UBSan in the fuzz build.)

  fuzz_regressions.py BIN_DIR
"""
import glob
import os
import shutil
import subprocess
import sys

from scratch import scratch_dir

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
bin_dir = sys.argv[1]
MODEL = os.path.join(ROOT, "data", "default-model")
run, inspect = os.path.join(bin_dir, "dmi-run"), os.path.join(bin_dir, "dmi-inspect")

tmp = scratch_dir("dmi-fuzzreg-")


def model_with(name, path):
    """The default model with one of its files replaced by the input."""
    d = os.path.join(tmp, os.path.basename(path))
    shutil.copytree(MODEL, d)
    if name == "model.safetensors.index.json":
        os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "model-00001-of-00001.safetensors"))
    shutil.copy(path, os.path.join(d, name))
    return [run, "-q", "--model", d, "--prompt", "x", "-n", "1"]


# How each target's input reaches a tool.
commands = {
    "tokenizer_json": lambda f: [run, "-q", "--model", MODEL, "--tokenizer", f, "--prompt", "x", "-n", "1"],
    "tokenizer_text": lambda f: [run, "-q", "--model", MODEL, "--prompts", f, "-n", "1"],
    "prompts": lambda f: [run, "-q", "--model", MODEL, "--prompts", f, "-n", "1"],
    "vectors": lambda f: [inspect, "steer-vector", "show", f],
    "capture": lambda f: [inspect, f, "summary"],
    "config": lambda f: model_with("config.json", f),
    "safetensors": lambda f: model_with("model.safetensors", f),
    "weight_index": lambda f: model_with("model.safetensors.index.json", f),
    "hooks": None,
}

failures, checked = [], 0
for path in sorted(glob.glob(os.path.join(ROOT, "tests", "data", "fuzz", "*", "regression-*"))):
    target = os.path.basename(os.path.dirname(path))
    if path.endswith(".bin"):
        continue  # encoded for its fuzz target (a selector byte, or h5_builder.h input): fuzz.sh --regress replays it
    make = commands.get(target)
    if make is None:
        failures.append(f"{path}: no command for target '{target}' (add one here)")
        continue
    r = subprocess.run(make(path), capture_output=True, text=True, timeout=30)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    ok = r.returncode == 0 or (r.returncode == 2 and len(lines) >= 1 and "internal error" not in r.stderr)
    print(f"{os.path.relpath(path, ROOT)}: exit {r.returncode}: {lines[-1] if lines else ''}")
    if not ok:
        failures.append(f"{path}: exit {r.returncode}: {r.stderr[-400:]}")
    checked += 1
if checked == 0:
    failures.append("no regression inputs found")
for f in failures:
    print("FAIL: " + f)
sys.exit(1 if failures else 0)
