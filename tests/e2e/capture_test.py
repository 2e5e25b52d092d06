#!/usr/bin/python3
"""dmi-run capture files, read back with python3-h5py and checked against
scripts/dmi_reference.py (Hugging Face semantics) and against each other.

  capture_test.py DMI_RUN TEST_MODELS CASE [MODEL]
"""
import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import torch

from scratch import scratch_dir

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import dmi_reference as ref  # noqa: E402
from capture_util import reference_row, rel_err, rows_by_key  # noqa: E402

dmi_run, models, case = sys.argv[1], sys.argv[2], sys.argv[3]
model_name = sys.argv[4] if len(sys.argv) > 4 else "qwen3-qknorm-bf16-misaligned"
MODEL = os.path.join(models, model_name)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11, 64, 128, 1, 33], [9, 8, 7], [200], [60, 61, 62, 63, 64, 65, 66]]
N_NEW = 5
tmp = scratch_dir("dmi-cap-")


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def run(out, *extra, prompts=PROMPTS, batch=4, expect_rc=0, model=MODEL):
    args = [dmi_run, "-q", "--model", model, "-n", str(N_NEW), "--batch-size", str(batch), "-o", out, "--overwrite",
            "--json"]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    r = subprocess.run(args + list(extra), capture_output=True, text=True, timeout=600)
    if r.returncode != expect_rc:
        fail(f"{' '.join(args + list(extra))}: exit {r.returncode}, want {expect_rc}: {r.stderr}")
    return json.loads(r.stdout) if r.stdout else None




def reference_sites(tokens, n_fed):
    """Every intermediate of the reference for the first n_fed tokens."""
    cfg_d, w = ref.load_model_dir(MODEL)
    cfg = ref.Config(cfg_d)
    rec = {}
    ref.forward(cfg, w, tokens[:n_fed], torch.float32, record=lambda n, t: rec.__setitem__(n, t.detach().numpy()))
    return rec


if case == "reference":
    # Every site of the model, fp32, mixed-length batch: each row equals the
    # reference's intermediate for that sequence and position.
    out = os.path.join(tmp, "full.h5")
    summary = run(out, "--hooks", "full", "--dtype", "float32", "--capture-dtype", "float32")
    f = h5py.File(out, "r")
    if f.attrs["format"] != "dmi-capture" or f.attrs["format_version"] != 2 or f.attrs["status"] != "complete":
        fail("root attributes")
    cfg = ref.Config(json.loads(f.attrs["model_config"]))
    width = int(f.attrs["attention_width"])
    tokens, offsets, plen = f["sequences/tokens"][:], f["sequences/offsets"][:], f["sequences/prompt_lengths"][:]
    n_sites = 3 + cfg.n_layers * (18 + (2 if cfg.qk_norm else 0))
    if len(f["sites"]) != n_sites:
        fail(f"{len(f['sites'])} sites, want {n_sites}")
    shapes = {"hook_q": (cfg.n_heads, cfg.head_dim), "hook_k": (cfg.n_kv, cfg.head_dim),
              "hook_rot_k": (cfg.n_kv, cfg.head_dim), "mlp.hook_post": (cfg.intermediate_size,),
              "hook_pattern": (cfg.n_heads, width), "unembed.hook_out": (cfg.vocab_size,),
              "hook_resid_post": (cfg.hidden_size,)}
    worst = {}
    fed_total = 0
    for s in range(len(PROMPTS)):
        toks = tokens[offsets[s]:offsets[s + 1]].tolist()
        n_fed = len(toks) - 1  # the last generated token is never fed back
        fed_total += n_fed
        refs = reference_sites(toks, n_fed)
        for name in f["sites"]:
            rows = rows_by_key(f, name)
            for suffix, shp in shapes.items():
                if name.endswith(suffix) and rows and next(iter(rows.values())).shape != shp:
                    fail(f"{name}: row shape {next(iter(rows.values())).shape}, want {shp}")
            for p in range(n_fed):
                if (s, p) not in rows:
                    fail(f"{name}: no row for sequence {s} position {p}")
                e = rel_err(rows[(s, p)], reference_row(name, refs[name], p, width))
                worst[name] = max(worst.get(name, 0.0), e)
    for name in f["sites"]:
        if len(f["sites"][name]["seq"]) != fed_total:
            fail(f"{name}: {len(f['sites'][name]['seq'])} rows, want {fed_total}")
    bad = {k: v for k, v in worst.items() if not v <= 1e-5}
    by_kind = {}
    for k, v in worst.items():
        kind = k.split(".", 2)[-1] if k.startswith("blocks.") else k
        by_kind[kind] = max(by_kind.get(kind, 0.0), v)
    print("per-site max relative error vs reference:")
    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:32s} {v:.2e}")
    if bad:
        fail(f"sites beyond 1e-5 relative: {bad}")
    # Lossless block mode: one record per site per forward pass.
    out_lens = [offsets[s + 1] - offsets[s] - plen[s] for s in range(len(PROMPTS))]
    forwards = max(out_lens)  # prefill + (longest output - 1) decode steps
    if f.attrs["records_written"] != n_sites * forwards or f.attrs["records_dropped"] != 0:
        fail(f"records_written {f.attrs['records_written']}, want {n_sites * forwards}")
    if summary["capture"]["records_written"] != n_sites * forwards:
        fail("--json records_written")
elif case == "batch-invariance":
    # The same prompts alone and in one mixed-length batch: every row of every
    # site holds that sequence's values.
    a, b = os.path.join(tmp, "alone.h5"), os.path.join(tmp, "batched.h5")
    run(a, "--hooks", "full", "--dtype", "float32", batch=1)
    run(b, "--hooks", "full", "--dtype", "float32", batch=4)
    fa, fb = h5py.File(a, "r"), h5py.File(b, "r")
    if not np.array_equal(fa["sequences/tokens"][:], fb["sequences/tokens"][:]):
        fail("tokens differ alone vs batched")
    worst = 0.0
    for name in fa["sites"]:
        ra, rb = rows_by_key(fa, name), rows_by_key(fb, name)
        if ra.keys() != rb.keys():
            fail(f"{name}: rows differ: {sorted(set(ra) ^ set(rb))[:5]}")
        for k in ra:
            worst = max(worst, rel_err(rb[k], ra[k]))
    print(f"worst relative difference alone vs batched over all sites: {worst:.2e}")
    if not worst <= 1e-5:
        fail("batch changes captured rows")
elif case == "determinism":
    a, b = os.path.join(tmp, "a.h5"), os.path.join(tmp, "b.h5")
    for out in (a, b):
        run(out, "--hooks", "full", "--logits", "topk:7", "--temperature", "0.9", "--seed", "3")
    fa, fb = h5py.File(a, "r"), h5py.File(b, "r")
    n = 0

    def visit(name, obj):
        global n
        if isinstance(obj, h5py.Dataset):
            n += 1
            if not np.array_equal(obj[()], fb[name][()]):
                fail(f"{name} differs between identical runs")
    fa.visititems(visit)
    print(f"{n} datasets identical")
elif case == "dtypes":
    # bf16 and fp16 files read back by h5py equal the fp32 capture rounded.
    base = os.path.join(tmp, "f32.h5")
    run(base, "--hooks", "resid_post,pattern,logits", "--capture-dtype", "float32")
    f32 = h5py.File(base, "r")
    for dt, tdt in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        out = os.path.join(tmp, dt + ".h5")
        run(out, "--hooks", "resid_post,pattern,logits", "--capture-dtype", dt)
        f = h5py.File(out, "r")
        if f.attrs["capture_dtype"] != dt:
            fail("capture_dtype attribute")
        for name in f32["sites"]:
            want = torch.from_numpy(f32["sites"][name]["data"][:]).to(tdt).float().numpy()
            got = f["sites"][name]["data"][:].astype(np.float32)
            if not np.array_equal(got, want, equal_nan=True):
                fail(f"{dt} {name}: h5py values differ from the fp32 capture rounded to {dt}")
        print(f"{dt}: {len(f['sites'])} sites equal the rounded fp32 values")
    # h5dump prints the bf16 custom float type.
    dump = subprocess.run(["h5dump", "-d", "/sites/blocks.0.hook_resid_post/data", "-c", "1,4",
                           os.path.join(tmp, "bfloat16.h5")], capture_output=True, text=True)
    if dump.returncode != 0 or "H5T_FLOAT" not in dump.stdout and "16-bit" not in dump.stdout:
        fail("h5dump cannot print the bf16 dataset: " + dump.stdout[:400] + dump.stderr[:400])
elif case == "policies":
    out = os.path.join(tmp, "p.h5")
    expect = {"prompt": lambda s, p, pl, n: p < pl, "generated": lambda s, p, pl, n: p >= pl,
              "last-prompt": lambda s, p, pl, n: p == pl - 1}
    for pol, pred in expect.items():
        run(out, "--hooks", "resid_post", "--tokens", pol)
        f = h5py.File(out, "r")
        pl = f["sequences/prompt_lengths"][:]
        off = f["sequences/offsets"][:]
        rows = set(rows_by_key(f, "blocks.0.hook_resid_post"))
        want = {(s, p) for s in range(len(pl)) for p in range(off[s + 1] - off[s] - 1) if pred(s, p, pl[s], 0)}
        if rows != want:
            fail(f"--tokens {pol}: rows {sorted(rows)[:8]} want {sorted(want)[:8]}")
        f.close()
    run(out, "--hooks", "resid_post", "--tokens", "generated", "--every", "2")
    f = h5py.File(out, "r")
    pl = f["sequences/prompt_lengths"][:]
    for (s, p) in rows_by_key(f, "blocks.0.hook_resid_post"):
        if (p - pl[s]) % 2:
            fail(f"--every 2 captured decode step {p - pl[s]}")
    print("token policies ok")
elif case == "file-size":
    # Chunks hold no more rows than a site will get (the prompts and -n bound them), so a small
    # capture is about its data's size; a large one keeps ~128 KiB chunks.
    out = os.path.join(tmp, "s.h5")
    for pol, every in (("all", 1), ("prompt", 1), ("generated", 1), ("last-prompt", 1), ("all", 2), ("generated", 3)):
        run(out, "--hooks", "resid_post,pattern,logits", "--tokens", pol, "--every", str(every), "--ignore-eos")
        with h5py.File(out, "r") as f:
            for name, g in f["sites"].items():
                rows = g["data"].shape[0]
                for d in ("data", "seq", "pos"):
                    if g[d].chunks[0] != rows:
                        fail(f"--tokens {pol} --every {every}: {name}/{d} chunks of {g[d].chunks[0]} rows for "
                             f"{rows} rows (one chunk of exactly its rows expected)")
            n_tokens = f["token_log/token"].shape[0]
            if f["token_log/token"].chunks[0] != n_tokens:
                fail(f"token_log: chunks of {f['token_log/token'].chunks[0]} rows for {n_tokens} tokens")
    default_model = os.path.join(ROOT, "data", "default-model")
    sizes = []
    for n_new, hooks in ((4, "resid_post,pattern,logits"), (64, "resid_post,logits")):
        args = [dmi_run, "-q", "--model", default_model, "-n", str(n_new), "--ignore-eos", "--hooks", hooks,
                "-o", out, "--overwrite", "--prompt", "The cat sat", "--prompt", "Hello world, this is"]
        r = subprocess.run(args, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            fail(f"{args}: {r.stderr}")
        with h5py.File(out, "r") as f:
            raw = sum(g[d].size * g[d].dtype.itemsize for g in f["sites"].values() for d in ("data", "seq", "pos"))
            for n, g in f["sites"].items():
                row_bytes = int(np.prod(g["data"].shape[1:])) * g["data"].dtype.itemsize
                cap, n = (128 << 10) // row_bytes, g["data"].shape[0]
                want = -(-n // -(-n // cap))  # the rows split evenly into chunks of at most ~128 KiB
                if g["data"].chunks[0] != want:
                    fail(f"-n {n_new}: {n}: chunks of {g['data'].chunks[0]} rows of {row_bytes} bytes, want {want}")
        size = os.path.getsize(out)
        sizes.append(f"-n {n_new} --hooks {hooks}: {size} bytes on disk for {raw} bytes of rows ({size / raw:.2f}x)")
        if size > 2 * raw:
            fail(sizes[-1] + ": more than twice its data")
    print("chunks sized to the rows; " + "; ".join(sizes))
elif case == "drop":
    # A tiny ring in drop mode: records are dropped and counted, never a hang.
    out = os.path.join(tmp, "drop.h5")
    t0 = time.time()
    summary = run(out, "--hooks", "full", "--ring-mb", "0.02", "--on-full", "drop")
    f = h5py.File(out, "r")
    dropped = int(f.attrs["records_dropped"])
    per_site = {n: int(f["sites"][n].attrs["records_dropped"]) for n in f["sites"]}
    if dropped == 0 or sum(per_site.values()) != dropped or sum(f.attrs["records_dropped_per_site"]) != dropped:
        fail(f"drops not recorded: total {dropped}, per site sum {sum(per_site.values())}")
    if f.attrs["status"] != "complete" or summary["capture"]["records_dropped"] != dropped:
        fail("status / --json drops")
    print(f"dropped {dropped} records of {dropped + int(f.attrs['records_written'])} in {time.time() - t0:.1f}s")
    f.close()
    # The same tiny ring in block mode: a record larger than the arena is an
    # error naming --ring-mb; the file is left readable with status failed.
    r = subprocess.run([dmi_run, "-q", "--model", MODEL, "--prompt-ids", "1,2,3", "-n", "3", "--hooks", "full",
                        "--ring-mb", "0.001", "-o", out, "--overwrite"], capture_output=True, text=True, timeout=120)
    if r.returncode != 2 or "--ring-mb" not in r.stderr:
        fail(f"block mode with an arena too small: exit {r.returncode}: {r.stderr}")
    if h5py.File(out, "r").attrs["status"] != "failed":
        fail("status after a failed run")
    # Block mode with a small ring that fits every record: lossless.
    summary = run(out, "--hooks", "full", "--ring-mb", "0.05")
    if summary["capture"]["records_dropped"] != 0 or h5py.File(out, "r").attrs["records_dropped"] != 0:
        fail("block mode dropped records")
elif case == "disk-full":
    # A capture onto a small tmpfs: one line naming the file and the
    # condition, exit 2 (no crash), and a file that opens with status failed,
    # its sequences, and data/seq/pos of equal length as dmi reads them.
    mnt = os.path.join(tmp, "small")
    os.mkdir(mnt)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mnt], capture_output=True).returncode != 0:
        print("skipped: cannot mount a tmpfs here (needs root)")
        sys.exit(77)
    try:
        out = os.path.join(mnt, "full.h5")
        dm = os.path.join(ROOT, "data", "default-model")
        r = subprocess.run([dmi_run, "-q", "--model", dm, "-n", "60", "--ignore-eos", "--hooks", "full", "-o", out,
                            "--prompt", "LOVE, n.", "--prompt", "WAR, n."], capture_output=True, text=True, timeout=300)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        if r.returncode != 2 or len(lines) != 1 or "disk full" not in lines[0] or out not in lines[0]:
            fail(f"disk full: exit {r.returncode}, stderr {r.stderr!r}")
        f = h5py.File(out, "r")
        reasons = [x.decode() if isinstance(x, bytes) else x for x in f["sequences/finish_reason"][:]]
        if f.attrs["status"] != "failed" or not reasons or len(f["sites"]) == 0:
            fail(f"disk full: status {f.attrs['status']}, reasons {reasons}")
        rows = 0
        for name, g in f["sites"].items():
            g["data"][:]
            rows += g["data"].shape[0]
        f.close()
        if rows == 0:
            fail("disk full: no data row survived")
        d = subprocess.run([os.path.join(os.path.dirname(dmi_run), "dmi-inspect"), out, "stats", "*", "--json"],
                           capture_output=True, text=True)
        if d.returncode != 0:
            fail(f"dmi-inspect on the failed file: {d.stderr}")
        print(f"disk full: exit 2, '{lines[0]}'; file readable, status failed, {len(reasons)} sequences "
              f"({reasons}), {rows} data rows kept")
    finally:
        subprocess.run(["umount", mnt], capture_output=True)
elif case == "sigint":
    out = os.path.join(tmp, "int.h5")
    dm = os.path.join(ROOT, "data", "default-model")
    args = [dmi_run, "-q", "--model", dm, "-n", "400", "--ignore-eos", "--batch-size", "4", "--hooks", "full",
            "-o", out] + sum([["--prompt", p] for p in ["LOVE, n.", "WAR, n.", "A", "THE"] * 16], [])
    # 16 batches of 400 tokens: far longer than the 0.3 s before the signal, on any machine
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        if os.path.exists(out) or p.poll() is not None:
            break
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    if p.returncode != 130:
        fail(f"exit {p.returncode} after SIGINT, want 130 (did it finish first?): {stderr}")
    f = h5py.File(out, "r")
    if f.attrs["status"] != "interrupted":
        fail(f"status {f.attrs['status']}")
    reasons = [x.decode() if isinstance(x, bytes) else x for x in f["sequences/finish_reason"][:]]
    if "interrupted" not in reasons:
        fail(f"finish reasons {reasons}")
    n = len(f["sites/blocks.0.hook_resid_post/seq"])
    counts = {r: reasons.count(r) for r in sorted(set(reasons))}
    print(f"interrupted file readable: {n} rows of blocks.0.hook_resid_post, finish reasons {counts}")
else:
    fail(f"unknown case {case}")
print("ok")
