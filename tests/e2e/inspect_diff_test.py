#!/usr/bin/python3
"""dmi-inspect and dmi-diff end to end: every command's output against values
read independently with python3-h5py; diff verdicts and exit statuses.

  inspect_diff_test.py BIN_DIR TEST_MODELS CASE
"""
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np

from scratch import scratch_dir

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capture_util import check_heatmap  # noqa: E402

bindir, models, case = sys.argv[1], sys.argv[2], sys.argv[3]
RUN, INSPECT, DIFF = (os.path.join(bindir, b) for b in ("dmi-run", "dmi-inspect", "dmi-diff"))
MODEL = os.path.join(models, "qwen3-qknorm-bf16-misaligned")
tmp = scratch_dir("dmi-insp-")
PROMPTS = ["LOVE, n.", "WAR", "A man who", "x"]


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def capture(out, *extra, model=MODEL):
    args = [RUN, "-q", "--model", model, "-n", "6", "-b", "4", "-o", out] + sum([["--prompt", p] for p in PROMPTS], [])
    r = subprocess.run(args + list(extra), capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        fail(f"dmi-run: {r.stderr}")
    return out


def tool(binary, *args, rc=0):
    r = subprocess.run([binary] + list(args), capture_output=True, text=True, timeout=300)
    if r.returncode != rc:
        fail(f"{os.path.basename(binary)} {' '.join(args)}: exit {r.returncode}, want {rc}: {r.stderr}{r.stdout[:500]}")
    return r


def close(a, b, tol=1e-6):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and np.allclose(a, b, rtol=tol, atol=tol, equal_nan=True)


full = capture(os.path.join(tmp, "full.h5"), "--hooks", "full")
h = h5py.File(full, "r")

if case == "summary-sites-text":
    j = json.loads(tool(INSPECT, full, "summary", "--json").stdout)
    if j["status"] != "complete" or j["sequences"] != len(PROMPTS) or j["records_written"] != h.attrs["records_written"]:
        fail("summary header")
    if [s["name"] for s in j["sites"]][0] != "hook_embed" or j["sites"][-1]["name"] != "unembed.hook_out":
        fail("summary sites not in forward order")
    for s in j["sites"]:
        d = h["sites"][s["name"]]["data"]
        if s["rows"] != d.shape[0] or s["shape"] != list(d.shape[1:]):
            fail(f"summary {s['name']}: rows/shape")
    text = tool(INSPECT, full, "summary").stdout
    if "status       complete" not in text or "blocks.1" not in text:
        fail("summary table")
    names = json.loads(tool(INSPECT, full, "sites", "--match", "blocks.*.hook_resid_post", "--json").stdout)
    if names != [f"blocks.{i}.hook_resid_post" for i in range(2)]:
        fail(f"sites --match: {names}")
    t = json.loads(tool(INSPECT, full, "text", "--seq", "2", "--json").stdout)[0]
    off = h["sequences/offsets"][:]
    if [x["id"] for x in t["tokens"]] != h["sequences/tokens"][off[2]:off[3]].tolist():
        fail("text token ids")
    if t["prompt"] != "A man who" or sum(x["prompt"] for x in t["tokens"]) != h["sequences/prompt_lengths"][2]:
        fail("text prompt")
elif case == "show":
    site = "blocks.1.attn.hook_z"
    g = h["sites"][site]
    seq, pos, data = g["seq"][:], g["pos"][:], g["data"][:]
    want_rows = [i for i in np.lexsort((pos, seq)) if seq[i] == 1 and 1 <= pos[i] < 4]
    j = json.loads(tool(INSPECT, full, "show", site, "--seq", "1", "--pos", "1:4", "--format", "json").stdout)
    if [(r["seq"], r["pos"]) for r in j["rows"]] != [(1, p) for p in (1, 2, 3)]:
        fail("show rows")
    if not close([r["values"] for r in j["rows"]], data[want_rows]):
        fail("show values differ from h5py")
    j = json.loads(tool(INSPECT, full, "show", site, "--seq", "1", "--pos", "2", "--index", "3,0:5", "--json").stdout)
    if not close(j["rows"][0]["values"], data[want_rows[1]][3, 0:5]):
        fail("show --index")
    csv = tool(INSPECT, full, "show", site, "--seq", "1", "--format", "csv").stdout.strip().splitlines()
    vals = np.array([[float(v) for v in line.split(",")[2:]] for line in csv[1:]])
    want = data[[i for i in np.lexsort((pos, seq)) if seq[i] == 1]].reshape(len(vals), -1)
    if not close(vals, want):
        fail("show csv")
    npy = os.path.join(tmp, "z.npy")
    tool(INSPECT, full, "show", site, "--npy", npy)
    arr = np.load(npy)
    if not close(arr, data[np.lexsort((pos, seq))]):
        fail("show --npy")
    table = tool(INSPECT, full, "show", site, "--seq", "0", "--pos", "0").stdout
    if "seq   0 pos    0" not in table:
        fail("show table")
elif case == "stats":
    j = json.loads(tool(INSPECT, full, "stats", "blocks.*.hook_resid_post", "--by", "layer", "--json").stdout)
    for line in j:
        layer = int(line["group"].split()[1])
        x = h["sites"][f"blocks.{layer}.hook_resid_post"]["data"][:].astype(np.float64)
        s = line["stats"]
        if s["count"] != x.size or not close([s["mean"], s["std"], s["rms"], s["min"], s["max"]],
                                            [x.mean(), x.std(), np.sqrt((x ** 2).mean()), x.min(), x.max()], 1e-9):
            fail(f"stats layer {layer}: {s}")
    j = json.loads(tool(INSPECT, full, "stats", "blocks.0.attn.hook_attn_scores", "--by", "seq", "--json").stdout)
    g = h["sites/blocks.0.attn.hook_attn_scores"]
    seq, pos, data = g["seq"][:], g["pos"][:], g["data"][:].astype(np.float64)
    for line in j:
        s_ = int(line["group"].split()[1])
        vals = np.concatenate([data[i][:, : pos[i] + 1].ravel() for i in range(len(seq)) if seq[i] == s_])
        if line["stats"]["count"] != vals.size or not close(line["stats"]["mean"], vals.mean(), 1e-9):
            fail(f"stats attention seq {s_}: {line}")
    if "layer" not in tool(INSPECT, full, "stats", "blocks.*.hook_resid_post", "--by", "layer").stdout:
        fail("stats table")
elif case == "attention-logits":
    g = h["sites/blocks.1.attn.hook_pattern"]
    seq, pos, data = g["seq"][:], g["pos"][:], g["data"][:]
    row = [i for i in range(len(seq)) if seq[i] == 0 and pos[i] == 5][0]
    j = json.loads(tool(INSPECT, full, "attention", "--layer", "1", "--seq", "0", "--pos", "5", "--top", "3", "--json").stdout)
    for hd in j["heads"]:
        want = np.argsort(-data[row, hd["head"], :6], kind="stable")[:3]
        if [k["pos"] for k in hd["top"]] != want.tolist() or not close([k["weight"] for k in hd["top"]],
                                                                       data[row, hd["head"], want]):
            fail(f"attention head {hd['head']}")
    # The labelled heatmap of head 2: every cell is h5py's value on the colour
    # map, tokens label both axes, the title names file, site, head, sequence.
    png, svg = os.path.join(tmp, "a.png"), os.path.join(tmp, "a.svg")
    geo = json.loads(tool(INSPECT, full, "attention", "--layer", "1", "--head", "2", "--seq", "0", "--png", png,
                          "--svg", svg, "--json").stdout)
    rows0 = sorted((pos[i], i) for i in range(len(seq)) if seq[i] == 0)
    want = np.stack([data[i, 2, : rows0[-1][0] + 1] for _, i in rows0]).astype(np.float64)
    tokens0 = h["sequences/tokens"][h["sequences/offsets"][0]:h["sequences/offsets"][1]]
    texts = ["full.h5: blocks.1.attn.hook_pattern, head 2, sequence 0", "attention weight", "query", "key"]
    for path, g_ in zip((png, svg), geo):
        err = check_heatmap(path, g_, want, "sequential", texts)
        if err:
            fail(err)
    if geo[0]["queries"] != len(rows0) or geo[0]["keys"] != len(tokens0) - 1:
        fail(f"attention --png geometry {geo[0]}")
    print(f"ok: attention --png/--svg: {len(rows0)}x{want.shape[1]} cells equal h5py's values, labelled")
    g = h["sites/unembed.hook_out"]
    seq, pos, data = g["seq"][:], g["pos"][:], g["data"][:].astype(np.float64)
    row = [i for i in range(len(seq)) if seq[i] == 2 and pos[i] == 4][0]
    p = np.exp(data[row] - data[row].max())
    p /= p.sum()
    j = json.loads(tool(INSPECT, full, "logits", "--seq", "2", "--pos", "4", "--top", "5", "--json").stdout)
    want = np.argsort(-data[row], kind="stable")[:5]
    if [t["id"] for t in j["top"]] != want.tolist() or not close([t["prob"] for t in j["top"]], p[want], 1e-6):
        fail("logits top-5")
    topk = capture(os.path.join(tmp, "topk.h5"), "--hooks", "logits", "--logits", "topk:5")
    j2 = json.loads(tool(INSPECT, topk, "logits", "--seq", "2", "--pos", "4", "--json").stdout)
    if [t["id"] for t in j2["top"]] != want.tolist():
        fail("logits from a topk capture")
elif case == "diff":
    copy = os.path.join(tmp, "copy.h5")
    shutil.copy(full, copy)
    j = json.loads(tool(DIFF, full, copy, "--json").stdout)
    if not j["equal"] or any(not s["equal"] for s in j["sites"]):
        fail("identical files differ")
    # Perturb one element of one row: exit 1, that site, sequence and position.
    with h5py.File(copy, "r+") as f:
        g = f["sites/blocks.1.hook_mlp_out"]
        r = 7
        s_, p_ = int(g["seq"][r]), int(g["pos"][r])
        d = g["data"][r]
        d[3] += 0.5
        g["data"][r] = d
    r = tool(DIFF, full, copy, "--json", rc=1)
    j = json.loads(r.stdout)
    bad = [s for s in j["sites"] if not s["equal"]]
    if [s["site"] for s in bad] != ["blocks.1.hook_mlp_out"] or bad[0]["first_mismatch"] != {"seq": s_, "pos": p_}:
        fail(f"perturbed diff: {bad}")
    if not close(bad[0]["max_abs"], 0.5, 1e-6):
        fail("max_abs of the perturbation")
    out = tool(DIFF, full, copy, rc=1).stdout
    if f"first at seq {s_} pos {p_}" not in out or "different" not in out:
        fail("diff table")
    tool(DIFF, full, copy, "--atol", "0.6")  # within tolerance: exit 0
    tool(DIFF, full, copy, "--sites", "blocks.0.*")  # the perturbed site is not compared
    # Different capture dtypes compare in float32; different tokens are reported.
    bf = capture(os.path.join(tmp, "bf16.h5"), "--hooks", "full", "--capture-dtype", "bfloat16")
    j = json.loads(tool(DIFF, full, bf, "--json", rc=1).stdout)
    if any(s["cosine"] < 0.999 for s in j["sites"] if s["site"] != "unembed.hook_out"):
        fail("bf16 vs fp32 capture cosine")
    tool(DIFF, full, bf, "--atol", "0.1", "--rtol", "0.02", "--sites", "blocks.*.hook_resid_post")
    other = capture(os.path.join(tmp, "sampled.h5"), "--hooks", "resid_post", "--temperature", "1.5", "--seed", "9")
    j = json.loads(tool(DIFF, full, other, "--json", rc=1).stdout)
    if not any("first_diverging_generated_token" in s for s in j["sequences"]):
        fail("diverging tokens not reported")
    if len(j["sites_only_a"]) != len(h["sites"]) - 2:
        fail("sites only in A not listed")
elif case == "bad-files":
    not_h5 = os.path.join(tmp, "x.h5")
    open(not_h5, "w").write("hello")
    for binary, args, expect in [
        (INSPECT, [os.path.join(tmp, "missing.h5"), "summary"], "no such file"),
        (INSPECT, [not_h5, "summary"], "not an HDF5 file"),
        (DIFF, [full, not_h5], "not an HDF5 file"),
        (INSPECT, [full, "show", "blocks.1.hook_resid_pots"], "no site 'blocks.1.hook_resid_pots'"),
        (INSPECT, [full, "show", "blocks.1.hook_resid_post", "--seq", "99"], "no rows"),
        (INSPECT, [full, "bogus"], "error"),
    ]:
        r = tool(binary, *args, rc=2)
        if expect not in r.stderr or len(r.stderr.strip().splitlines()) != 1:
            fail(f"{args}: stderr {r.stderr!r} lacks {expect!r}")
    other = os.path.join(tmp, "other.h5")
    with h5py.File(other, "w") as f:
        f.attrs["format"] = "something-else"
    if "not a dmi capture" not in tool(INSPECT, other, "summary", rc=2).stderr:
        fail("foreign HDF5 file")
    v3 = os.path.join(tmp, "v3.h5")
    shutil.copy(full, v3)
    with h5py.File(v3, "r+") as f:
        f.attrs["format_version"] = 3
    if "version 3 is not supported" not in tool(INSPECT, v3, "summary", rc=2).stderr:
        fail("format version")
    trunc = os.path.join(tmp, "trunc.h5")
    raw = open(full, "rb").read()
    open(trunc, "wb").write(raw[: len(raw) // 3])
    if "truncated or corrupt" not in tool(INSPECT, trunc, "summary", rc=2).stderr:
        fail("truncated file")
    # Inconsistent tables (found by fuzz_capture): refused naming the part,
    # never read out of bounds.
    for what, edit in [("offsets", lambda f: (f["sequences"].__delitem__("offsets"),
                                              f["sequences"].create_dataset("offsets", data=np.zeros(0, np.int64)))),
                       ("offsets", lambda f: f["sequences/offsets"].__setitem__(slice(None), f["sequences/offsets"][:][::-1].copy())),
                       ("prompt length", lambda f: f["sequences/prompt_lengths"].__setitem__(0, 10 ** 6)),
                       ("layout", lambda f: f["sites/blocks.1.hook_resid_post"].attrs.__setitem__("layout", "topk")),
                       ("seq", lambda f: f["sites/blocks.1.hook_resid_post"].__delitem__("seq"))]:
        broken = os.path.join(tmp, "broken.h5")
        shutil.copy(full, broken)
        with h5py.File(broken, "r+") as f:
            edit(f)
        r = tool(INSPECT, broken, "text", rc=2)
        if "corrupt capture" not in r.stderr or len(r.stderr.strip().splitlines()) != 1:
            fail(f"broken {what}: {r.stderr!r}")
    interrupted = os.path.join(tmp, "int.h5")
    shutil.copy(full, interrupted)
    with h5py.File(interrupted, "r+") as f:
        f.attrs["status"] = "interrupted"
    r = tool(INSPECT, interrupted, "summary")
    if "warning" not in r.stderr or "interrupted" not in r.stderr or "sites" not in r.stdout:
        fail("interrupted file: warning then data")
else:
    fail("unknown case " + case)
print("ok")
