#!/usr/bin/python3
"""Scale-out: dmi-run --shard, dmi-inspect merge and dmi-run --plan, checked
with h5py against a single-process capture of the same prompts.

  scaleout_test.py BIN_DIR TEST_MODELS CASE    (merge, batched, bad-input, plan)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capture_util import compare_captures  # noqa: E402

bin_dir, models, case = sys.argv[1], sys.argv[2], sys.argv[3]
MODEL = os.path.join(models, "qwen3-untied-f32")
OTHER = os.path.join(models, "llama-gqa-f32")
PROMPTS = ["The cat sat on the mat", "Hello", "Once upon a time there was", "A", "B C D E F G H I J K",
           "In the beginning", "What is", "xyz xyz xyz", "Tell me about the sea and the sky"]
HOOKS = ["--hooks", "resid_post,pattern,rot_k,logits", "--logits", "topk:4"]
tmp = tempfile.mkdtemp(prefix="dmi-scaleout-")
prompts_file = os.path.join(tmp, "prompts.txt")
with open(prompts_file, "w") as f:
    f.write("\n".join(PROMPTS) + "\n")


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def tool(name, *args, expect_rc=0, env=None, cwd=None):
    r = subprocess.run([os.path.join(bin_dir, name), *args], capture_output=True, text=True, timeout=600,
                       env=env, cwd=cwd)
    if expect_rc is not None and r.returncode != expect_rc:
        fail(f"{name} {' '.join(args)}: exit {r.returncode}, want {expect_rc}\nstdout: {r.stdout[-2000:]}\n"
             f"stderr: {r.stderr[-2000:]}")
    return r


def bad(name, *args, want):
    """Bad input: exit status 2, one line on stderr naming the problem."""
    r = tool(name, *args, expect_rc=2)
    lines = r.stderr.strip().splitlines()
    if len(lines) != 1 or want not in lines[0]:
        fail(f"{name} {' '.join(args)}: want one line containing {want!r}, got {r.stderr!r}")
    print(f"ok: {lines[0]}")


def run(out, *extra, batch=1, model=MODEL, n=5):
    tool("dmi-run", "-q", "--model", model, "--prompts", prompts_file, "-n", str(n), "-b", str(batch), *HOOKS,
         "-o", out, *extra)


def shards(directory, count, batch=1, **kw):
    os.makedirs(directory, exist_ok=True)
    for k in range(count):
        run(os.path.join(directory, "part-{shard}-of-{shards}.h5"), "--shard", f"{k}/{count}", batch=batch, **kw)
    return [os.path.join(directory, f"part-{k}-of-{count}.h5") for k in range(count)]


if case == "merge":
    single = os.path.join(tmp, "single.h5")
    run(single)
    parts = shards(os.path.join(tmp, "parts"), 4)
    single_size = os.path.getsize(single)
    for p in parts:
        with h5py.File(p, "r") as f:
            rec = json.loads(f.attrs["shard"])
            reasons = [x.decode() for x in f["sequences/finish_reason"][:]]
        mine = [r != "skipped" for r in reasons]
        if mine != [rec["begin"] <= i < rec["end"] for i in range(len(PROMPTS))]:
            fail(f"{p}: runs {mine}, its record says {rec['begin']}..{rec['end']}")
        if os.path.getsize(p) >= single_size:
            fail(f"{p}: {os.path.getsize(p)} bytes, not smaller than the whole capture ({single_size})")
    out_dir = os.path.join(tmp, "out")
    os.makedirs(out_dir)
    merged = os.path.join(out_dir, "merged.h5")
    copied = os.path.join(out_dir, "copied.h5")
    r = tool("dmi-inspect", "merge", merged, *reversed(parts), "--json")
    if json.loads(r.stdout)["shards"] != 4:
        fail(f"merge --json: {r.stdout}")
    tool("dmi-inspect", "merge", "--copy", copied, *parts)
    n, _ = compare_captures(merged, single)
    compare_captures(copied, single)
    print(f"ok: merged (virtual) and copied captures of 4 shards equal the single capture bit for bit ({n} rows)")
    with h5py.File(merged, "r") as f, h5py.File(copied, "r") as g:
        if not f["sites/blocks.0.hook_resid_post/data"].is_virtual or g["sites/blocks.0.hook_resid_post/data"].is_virtual:
            fail("merge should map (virtual datasets), --copy should copy")
        batches = f["sequences/batch"][:]
        if len(set(batches.tolist())) != len(PROMPTS):
            fail(f"merged batches are not distinct per sequence at batch size 1: {batches}")
        m = json.loads(f.attrs["merged"])
        if m["count"] != 4 or [s["index"] for s in m["shards"]] != [0, 1, 2, 3] or m["missing"]:
            fail(f"merged record: {m}")
        if f.attrs["status"] != "complete" or "shard" in f.attrs:
            fail("merged status / shard attribute")
    summary = json.loads(tool("dmi-inspect", merged, "summary", "--json").stdout)
    if summary["sequences"] != len(PROMPTS) or summary["merged"]["count"] != 4 or summary["status"] != "complete":
        fail(f"summary of the merged capture: {summary}")
    tool("dmi-diff", merged, single)
    r = tool("dmi-run", "--replay", merged, "--verify", "-q")
    if "bit for bit" not in r.stdout:
        fail(f"replay of the merged capture: {r.stdout}")
    r = tool("dmi-run", "--replay", parts[1], "--verify", "-q", "--json")
    rep = json.loads(r.stdout)["replay"]
    with h5py.File(parts[1], "r") as f:
        rec = json.loads(f.attrs["shard"])
    if rep["sequences"] != list(range(rec["begin"], rec["end"])) or not rep["verify"]["bitwise"]:
        fail(f"replay of shard 1: {rep}")
    print("ok: dmi-inspect summary, dmi-diff and dmi-run --replay --verify (bit for bit) read the merged capture; "
          "a shard replays its own sequences")
    # h5py from another directory, and the merged file moved with its shards.
    code = ("import h5py,sys; f=h5py.File(sys.argv[1]); d=f['sites/blocks.1.hook_resid_post/data'][:]; "
            "import numpy as np; assert np.isfinite(d).all() and len(d) > 0; print(len(d))")
    r = subprocess.run([sys.executable, "-c", code, merged], cwd="/", capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"h5py from / : {r.stderr}")
    moved = os.path.join(tmp, "moved")
    shutil.copytree(out_dir, os.path.join(moved, "out"))
    shutil.copytree(os.path.join(tmp, "parts"), os.path.join(moved, "parts"))
    compare_captures(os.path.join(moved, "out", "merged.h5"), single)
    print("ok: h5py reads it from another directory; moved together with its shards it still reads")
    os.remove(os.path.join(moved, "parts", "part-2-of-4.h5"))
    bad("dmi-inspect", os.path.join(moved, "out", "merged.h5"), "summary", want="part-2-of-4.h5")
    compare_captures(copied, single)
    print("ok: a missing shard file is an error naming it; the --copy capture needs none")

elif case == "batched":
    single = os.path.join(tmp, "single.h5")
    run(single, batch=3)
    parts = shards(os.path.join(tmp, "parts"), 4, batch=3)
    merged = os.path.join(tmp, "merged.h5")
    tool("dmi-inspect", "merge", merged, *parts)
    n, worst = compare_captures(merged, single, bitwise=False, rtol=1e-5)
    print(f"ok: batch size 3, 4 shards vs one process: {n} rows, max relative error {worst:.3g} (bound 1e-5)")

elif case == "bad-input":
    bad("dmi-run", "--shard", "4/4", want="--shard 4/4")
    bad("dmi-run", "--shard", "x", want="--shard 'x'")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI_"))}
    r = tool("dmi-run", "--shard", "auto", expect_rc=2, env=env)
    if "no Slurm array task or MPI rank" not in r.stderr:
        fail(f"--shard auto without a scheduler: {r.stderr}")
    bad("dmi-run", "--replay", "x.h5", "--shard", "0/2", want="--shard cannot be combined with --replay")
    parts = shards(os.path.join(tmp, "parts"), 3, n=2)
    out = os.path.join(tmp, "m.h5")
    bad("dmi-inspect", "merge", out, parts[0], parts[2], want="shard 1 of 3 is missing")
    bad("dmi-inspect", "merge", out, parts[0], parts[0], parts[1], parts[2], want="both shard 0 of 3")
    other_model = os.path.join(tmp, "other-model.h5")
    run(other_model, "--shard", "1/3", model=OTHER, n=2)
    bad("dmi-inspect", "merge", out, parts[0], other_model, parts[2], want="differ in")
    other_sel = os.path.join(tmp, "other-sel.h5")
    tool("dmi-run", "-q", "--model", MODEL, "--prompts", prompts_file, "-n", "2", "--hooks", "resid_post",
         "--shard", "1/3", "-o", other_sel)
    bad("dmi-inspect", "merge", out, parts[0], other_sel, parts[2], want="differ in selection")
    four = os.path.join(tmp, "part-1-of-4.h5")
    run(four, "--shard", "1/4", n=2)
    bad("dmi-inspect", "merge", out, parts[0], four, want="not shards of one run")
    # A forged record: shard 1 claiming shard 0's prompts.
    forged = os.path.join(tmp, "forged.h5")
    shutil.copy(parts[1], forged)
    with h5py.File(forged, "r+") as f:
        rec = json.loads(f.attrs["shard"])
        rec["begin"], rec["end"] = 0, rec["end"]
        f.attrs["shard"] = json.dumps(rec)
    bad("dmi-inspect", "merge", out, parts[0], forged, parts[2], want="forged.h5")
    # A forged row: shard 1 holding a row of sequence 0.
    stray = os.path.join(tmp, "stray.h5")
    shutil.copy(parts[1], stray)
    with h5py.File(stray, "r+") as f:
        d = f["sites/blocks.0.hook_resid_post/seq"]
        v = d[:]
        v[0] = 0
        d[...] = v
    bad("dmi-inspect", "merge", out, parts[0], stray, parts[2], want="rows of sequence 0, outside its shard")
    single = os.path.join(tmp, "single.h5")
    run(single, n=2)
    bad("dmi-inspect", "merge", out, single, want="not a shard")
    bad("dmi-inspect", "merge", parts[0], parts[1], want="exists")
    bad("dmi-inspect", "merge", out, os.path.join(tmp, "nope.h5"), want="nope.h5")
    if os.path.exists(out) or os.path.exists(out + ".partial"):
        fail("a failed merge left a file behind")

elif case == "plan":
    # --plan's rows per site must be what the run writes (--ignore-eos: every
    # sequence makes all its tokens), its file size close to the real one.
    print(f"{'selection':<24} {'plan bytes':>12} {'file bytes':>12} {'ratio':>6}")
    for hooks in ["resid_post", "attention", "full"]:
        args = ["--model", MODEL, "--prompts", prompts_file, "-n", "12", "-b", "2", "--ignore-eos", "--hooks", hooks,
                "--capture-dtype", "bfloat16"]
        plan = json.loads(tool("dmi-run", *args, "--plan", "--json").stdout)
        out = os.path.join(tmp, f"{hooks}.h5")
        tool("dmi-run", "-q", *args, "-o", out)
        with h5py.File(out, "r") as f:
            real = {s: len(g["seq"]) for s, g in f["sites"].items()}
            records = int(f.attrs["records_written"])
        planned = {s["site"]: s["rows"] for s in plan["sites"]}
        if planned != real:
            fail(f"--hooks {hooks}: planned rows {planned} but the file has {real}")
        if plan["records"] != records:
            fail(f"--hooks {hooks}: planned {plan['records']} records, the run wrote {records}")
        size = os.path.getsize(out)
        ratio = plan["file_bytes"] / size
        print(f"{hooks:<24} {plan['file_bytes']:>12} {size:>12} {ratio:>6.3f}")
        if not 0.9 <= ratio <= 1.1:
            fail(f"--hooks {hooks}: planned {plan['file_bytes']} bytes, the file has {size}")
        if plan["records_per_second"] <= 0 or plan["decode_floor_ms"] <= 0:
            fail(f"no rates: {plan}")
    r = tool("dmi-run", "--model", MODEL, "--prompts", prompts_file, "--hooks", "resid_post", "--shard", "1/4",
             "--plan", "--json", "-q")
    p = json.loads(r.stdout)
    if p["prompts"] != len(PROMPTS) or not 0 < p["running"] < len(PROMPTS):
        fail(f"--plan with --shard 1/4: {p}")
    bad("dmi-run", "--plan", want="--plan estimates a capture")
    bad("dmi-run", "--replay", "x.h5", "--plan", want="--plan does not apply to --replay")
    print("ok: --plan's rows and records equal the runs', file sizes within 10 %")
else:
    fail(f"unknown case {case}")
shutil.rmtree(tmp, ignore_errors=True)
print("PASS")
