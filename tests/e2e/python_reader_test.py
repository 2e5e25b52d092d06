#!/usr/bin/python3
"""scripts/dmi_capture.py (the Python reader) against dmi-inspect's own output:
every site, every sequence, bit for bit (dmi-inspect show --npy, text --json,
summary --json).

  python_reader_test.py BIN_DIR CASE     CASE: dtypes | killed | readme
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import h5py
import numpy as np

from scratch import scratch_dir

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import dmi_capture  # noqa: E402

bin_dir, case = os.path.abspath(sys.argv[1]), sys.argv[2]
DMI_RUN, DMI_INSPECT = os.path.join(bin_dir, "dmi-run"), os.path.join(bin_dir, "dmi-inspect")
tmp = scratch_dir("dmi-pyreader-")


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def sh(args, **kw):
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, **kw)
    if r.returncode != 0:
        fail(f"{' '.join(args)}: exit {r.returncode}: {r.stderr}")
    return r


def inspect_json(path, *args):
    return json.loads(sh([DMI_INSPECT, path, *args, "--json"]).stdout)


def inspect_rows(path, site, seq):
    npy = os.path.join(tmp, "rows.npy")
    sh([DMI_INSPECT, path, "show", site, "--npy", npy] + ([] if seq is None else ["--seq", str(seq)]))
    return np.load(npy)


def compare(path, expect_status):
    """Everything the reader returns for a capture equals what dmi-inspect says of it."""
    c = dmi_capture.open(path)
    summary = inspect_json(path, "summary")
    if c.attrs["status"] != summary["status"] and not (summary["status"] == "killed" and
                                                       c.attrs["status"] == "running"):
        fail(f"status: reader {c.attrs['status']}, dmi-inspect {summary['status']}")
    if summary["status"] != expect_status:
        fail(f"dmi-inspect status {summary['status']}, expected {expect_status}")
    by_name = {s["name"]: s for s in summary["sites"]}
    if sorted(c.sites()) != sorted(by_name):
        fail(f"sites: reader {c.sites()}, dmi-inspect {sorted(by_name)}")
    text = inspect_json(path, "text")
    if c.n_sequences != len(text) or c.n_sequences != summary["sequences"]:
        fail(f"sequences: reader {c.n_sequences}, dmi-inspect {len(text)}/{summary['sequences']}")
    values = 0
    for t in text:
        s = t["seq"]
        if [int(x) for x in c.tokens(s)] != [x["id"] for x in t["tokens"]]:
            fail(f"sequence {s}: tokens {list(c.tokens(s))} vs {[x['id'] for x in t['tokens']]}")
        if c.prompt_length(s) != sum(1 for x in t["tokens"] if x["prompt"]):
            fail(f"sequence {s}: prompt length {c.prompt_length(s)}")
        if expect_status == "complete" and c.text(s) != t["prompt"] + t["generated"]:
            fail(f"sequence {s}: text {c.text(s)!r} vs {t['prompt'] + t['generated']!r}")
        if c.finish_reason(s) != t["finish_reason"] and expect_status == "complete":
            fail(f"sequence {s}: finish reason {c.finish_reason(s)} vs {t['finish_reason']}")
    for name in c.sites():
        all_rows = c[name]
        if all_rows.shape[0] != by_name[name]["rows"] or list(all_rows.shape[1:]) != by_name[name]["shape"]:
            fail(f"{name}: shape {all_rows.shape}, dmi-inspect rows {by_name[name]['rows']} x {by_name[name]['shape']}")
        if all_rows.dtype != np.float32:
            fail(f"{name}: reader dtype {all_rows.dtype} (a {by_name[name]['dtype']} capture reads as float32)")
        # dmi-inspect show writes a site's rows ordered by (seq, pos): the reader's rows() of each
        # sequence in turn must be the same bytes. One site is also read sequence by sequence (--seq).
        mine = [c.rows(name, seq=t["seq"]) for t in text]
        theirs = inspect_rows(path, name, None)
        if np.concatenate(mine).tobytes() != theirs.astype(np.float32).tobytes():
            fail(f"{name}: reader rows {[m.shape for m in mine]} differ from dmi-inspect's {theirs.shape}")
        for t, m in zip(text, mine):
            pos = c.positions(name, seq=t["seq"])
            if list(pos) != sorted(pos) or len(pos) != m.shape[0]:
                fail(f"{name} seq {t['seq']}: positions {list(pos)}")
            if name == c.sites()[-1] and m.shape[0]:
                if m.tobytes() != inspect_rows(path, name, t["seq"]).tobytes():
                    fail(f"{name} seq {t['seq']}: reader differs from dmi-inspect show --seq")
            values += m.size
    c.close()
    return summary, values


if case == "dtypes":
    report = []
    for dtype in ("float32", "bfloat16", "float16"):
        out = os.path.join(tmp, f"{dtype}.h5")
        sh([DMI_RUN, "-q", "--prompt", "The cat sat on", "--prompt", "A dog", "--prompt-ids", "5,6,7", "-n", "5",
            "--batch-size", "2", "--hooks", "blocks.1.hook_resid_post,blocks.2.attn.hook_pattern,blocks.0.attn.hook_z,logits", "--capture-dtype", dtype,
            "-o", out])
        summary, values = compare(out, "complete")
        report.append(f"{dtype}: {len(summary['sites'])} sites x 3 sequences, {values} values")
        # Keys in TransformerLens' forms name the same rows.
        c = dmi_capture.open(out)
        for key, name in ((("resid_post", 1), "blocks.1.hook_resid_post"), (("pattern", 2), "blocks.2.attn.hook_pattern"),
                          (("attn", 2), "blocks.2.attn.hook_pattern"), (("z", 0), "blocks.0.attn.hook_z"),
                          ("logits", "unembed.hook_out")):
            if c.site(key) != name or c[key].tobytes() != c[name].tobytes():
                fail(f"key {key} does not read {name}")
        if c.rows("resid_post", 1, seq=1).tobytes() != c.rows("blocks.1.hook_resid_post", seq=1).tobytes():
            fail("rows('resid_post', 2, seq=1) differs from rows('blocks.2.hook_resid_post', seq=1)")
        # Rows in file order agree with h5py's plain reading of the file.
        with h5py.File(out, "r") as f:
            raw = f["sites/blocks.0.attn.hook_z/data"][:].astype(np.float32)
            if raw.tobytes() != c["z", 0].tobytes():
                fail("c['z', 0] differs from h5py's reading")
        t = c.to_torch(["logits", ("resid_post", 1)], seq=2)
        if sorted(t) != ["blocks.1.hook_resid_post", "unembed.hook_out"] or \
                not np.array_equal(t["unembed.hook_out"].numpy(), c.rows("logits", seq=2)):
            fail("to_torch(seq=2) differs from rows()")
        # Mistakes name what is wrong.
        for bad, words in ((("resid_pre", 0), "blocks.0.hook_resid_pre' is not in this capture"),
                           ("resid_post", "needs a layer"), (("blocks.0.hook_resid_post", 1), "without a layer"), (("normalized", 1), "'ln1' or 'ln2'")):
            try:
                c[bad]
                fail(f"c[{bad!r}] did not raise")
            except KeyError as e:
                if words not in str(e):
                    fail(f"c[{bad!r}]: {e}")
        try:
            c.tokens(3)
            fail("c.tokens(3) of a 3-sequence capture did not raise")
        except IndexError as e:
            if "out of range" not in str(e):
                fail(str(e))
        c.close()
    other = os.path.join(tmp, "other.h5")
    with h5py.File(other, "w") as f:
        f.attrs["format"] = "something-else"
    try:
        dmi_capture.open(other)
        fail("a non-capture HDF5 file opened")
    except ValueError as e:
        if "not a dmi capture" not in str(e):
            fail(str(e))
    print("reader == dmi-inspect (show --npy, text --json, summary --json), bit for bit: " + "; ".join(report))
elif case == "killed":
    # A run killed mid-way (kill -9): no /sequences, tokens from the token log, status killed.
    out = os.path.join(tmp, "killed.h5")
    args = [DMI_RUN, "-q", "-n", "480", "--ignore-eos", "--batch-size", "2", "--hooks", "resid_post,logits",
            "--logits", "topk:4", "--flush-every", "0.2", "-o", out]
    for i in range(8):  # 4 batches: the kill lands in the first or second on any machine
        args += ["--prompt-ids", f"5,6,{10 + i}"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while time.time() - t0 < 120:
        if p.poll() is not None:
            fail(f"the run ended before the kill (exit {p.returncode}): make it longer")
        try:
            with h5py.File(out, "r", swmr=True) as f:
                if f["sites/blocks.3.hook_resid_post/data"].shape[0] >= 40:
                    break
        except (OSError, KeyError):
            pass
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    c = dmi_capture.open(out)
    if c.attrs["status"] != "running" or c.finish_reason(0) != "running":
        fail(f"killed file: status {c.attrs['status']}, finish reason {c.finish_reason(0)}")
    ids = c.topk_ids(seq=1)
    if ids.shape[1] != 4 or ids.shape[0] != c.rows("logits", seq=1).shape[0]:
        fail(f"topk ids {ids.shape}")
    c.close()
    summary, values = compare(out, "killed")
    print(f"killed run: reader == dmi-inspect on {summary['sequences']} sequences (tokens from the token log), "
          f"{values} values bit for bit")
elif case == "readme":
    # The README's example runs as written and prints what it says.
    readme = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(r"<!-- python-example -->\s*```sh\n(.*?)```\s*```python\n(.*?)```\s*Output:\s*```\n(.*?)```", readme,
                  re.S)
    if not m:
        fail("README.md has no python-example block (```sh, ```python, Output: ```)")
    cmd, code, expected = m.group(1).replace("build/bin/", bin_dir + "/"), m.group(2), m.group(3)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], PYTHONPATH=os.path.join(ROOT, "scripts"))
    sh(["bash", "-ec", cmd], cwd=tmp, env=env)
    r = sh(["/usr/bin/python3", "-c", code], cwd=tmp, env=env)
    if r.stdout != expected:
        fail(f"README example printed:\n{r.stdout}\nthe README says:\n{expected}")
    if len(code.strip().splitlines()) > 12:
        fail(f"the README example has {len(code.strip().splitlines())} lines")
    print("README python example: ran, output as documented:\n" + r.stdout)
else:
    fail(f"unknown case {case}")
