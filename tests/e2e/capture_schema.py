#!/usr/bin/python3
"""Validates capture files against schemas/dmi-capture.schema.json.

  capture_schema.py DMI_RUN TEST_MODELS

Describes each file as JSON (attributes, datasets with dtype/rank/shape),
validates it with python3-jsonschema, and checks the row-count invariants the
schema cannot express.
"""
import json
import os
import subprocess
import sys

import h5py
import jsonschema
import numpy as np

from scratch import scratch_dir

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
dmi_run, models = sys.argv[1], sys.argv[2]
schema = json.load(open(os.path.join(ROOT, "schemas", "dmi-capture.schema.json")))


def dtype_name(d):
    if d.dtype.kind in "SOU" or h5py.check_string_dtype(d.dtype):
        return "string"
    t = d.id.get_type()
    if isinstance(t, h5py.h5t.TypeFloatID) and t.get_size() == 2:
        return "bfloat16" if t.get_fields()[2] == 8 else "float16"
    return str(d.dtype)


def attrs(obj):
    out = {}
    for k, v in obj.attrs.items():
        if isinstance(v, bytes):
            v = v.decode()
        elif isinstance(v, np.ndarray):
            v = v.tolist()
        elif isinstance(v, np.integer):
            v = int(v)
        out[k] = v
    return out


def describe(f):
    ds = lambda d: {"dtype": dtype_name(d), "rank": len(d.shape), "shape": list(d.shape)}  # noqa: E731
    return {
        "attributes": attrs(f),
        "sequences": {k: ds(v) for k, v in f["sequences"].items()},
        **({"token_log": {k: ds(v) for k, v in f["token_log"].items()}} if "token_log" in f else {}),
        **({"monitors": {name: dict({"attributes": attrs(g)}, **{k: ds(v) for k, v in g.items()})
                         for name, g in f["monitors"].items()}} if "monitors" in f else {}),
        "sites": {name: dict({"attributes": attrs(g)}, **{k: ds(v) for k, v in g.items()})
                  for name, g in f["sites"].items()},
    }


tmp = scratch_dir("dmi-schema-")
# A TorchScript export too (architecture "TorchScript/...", model_path a .pt file).
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import dmi_torchscript  # noqa: E402
ts_model = os.path.join(tmp, "llama.pt")
dmi_torchscript.export(os.path.join(models, "llama-gqa-f32"), ts_model)
heads = os.path.join(tmp, "heads.json")
with open(heads, "w") as f:
    json.dump([[0, 1], [1, 0]], f)
runs = [(ts_model, ["--hooks", "resid_post,pattern,logits", "--logits", "topk:3"]),
        ("qwen3-qknorm-bf16-misaligned", ["--hooks", "full", "--logits", "topk:5"]),
        ("llama-gqa-f32", ["--hooks", "residual,kv", "--capture-dtype", "bfloat16", "--compression", "shuffle+gzip:4"]),
        ("mistral-window-bf16-sharded", ["--hooks", "hf-hidden-states,pattern", "--capture-dtype", "float16",
                                         "--monitor", f"attn-tracker:heads={heads},inst=0:1,data=1:",
                                         "--monitor-log", os.path.join(tmp, "monitor.jsonl")])]
# And replays of the TorchScript capture (exact, bit for bit) and of the
# Qwen3 one (forced, deeper selection).
runs += [(None, ["--replay", os.path.join(tmp, "llama.pt.h5"), "--verify"]),
         (None, ["--replay", os.path.join(tmp, "qwen3-qknorm-bf16-misaligned.h5"), "--replay-mode", "forced",
                 "--hooks", "full,kv", "--verify"])]
# Shards (dmi-run --shard) and their merges, virtual and copied.
for k in range(2):
    runs.append(("llama-gqa-f32", ["--hooks", "resid_post,logits", "--logits", "topk:3", "--shard", f"{k}/2"]))
merge_runs = {"merged-virtual.h5": [], "merged-copy.h5": ["--copy"]}
for i, (model, extra) in enumerate(runs):
    if model is None:
        out = os.path.join(tmp, f"replay-{i}.h5")
        args = [dmi_run, "-q", "-o", out] + extra
    else:
        out = os.path.join(tmp, os.path.basename(model) + ("-" + extra[-1].replace("/", "-") if "--shard" in extra
                                                          else "") + ".h5")
        args = [dmi_run, "-q", "--model", os.path.join(models, model), "--prompt", "LOVE, n.", "--prompt", "WAR",
                "-b", "2", "-n", "4", "-o", out] + extra
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"FAIL: dmi-run {extra}: {r.stdout} {r.stderr}")
    with h5py.File(out, "r") as f:
        doc = describe(f)
        jsonschema.validate(doc, schema)
        for name, g in f["sites"].items():
            n = g["data"].shape[0]
            if g["seq"].shape[0] != n or g["pos"].shape[0] != n:
                sys.exit(f"FAIL: {name}: data/seq/pos row counts differ")
        if len(f.attrs["records_dropped_per_site"]) != len(f["sites"]):
            sys.exit("FAIL: records_dropped_per_site length")
        off = f["sequences/offsets"][:]
        if off[0] != 0 or off[-1] != f["sequences/tokens"].shape[0]:
            sys.exit("FAIL: offsets")
        # The JSON-valued attributes parse and hold what the format promises.
        fp = json.loads(f.attrs["model_fingerprint"])
        if not fp or not all(v.startswith(("sha256:", "xxh3-128:")) for v in fp.values()) or \
                "tokenizer.json" not in fp:
            sys.exit(f"FAIL: model_fingerprint {fp}")
        env = json.loads(f.attrs["environment"])
        for k in ["dmi_version", "libtorch_version", "cpu_model", "cpu_flags", "aten_cpu_capability", "onednn_isa",
                  "openblas_core", "threads", "dmi_kernels", "dmi_attention"]:
            if k not in env:
                sys.exit(f"FAIL: environment lacks {k}")
        if "--monitor" in extra and f["monitors/attn-tracker/score"].shape != (2,):
            sys.exit("FAIL: /monitors/attn-tracker/score")
        if model is None and json.loads(f.attrs["replay_of"])["mode"] not in ("exact", "forced"):
            sys.exit("FAIL: replay_of")
    print(f"{os.path.basename(model or 'replay')} {' '.join(extra)}: valid ({len(doc['sites'])} sites)")
inspect = os.path.join(os.path.dirname(dmi_run), "dmi-inspect")
for name, flags in merge_runs.items():
    out = os.path.join(tmp, name)
    r = subprocess.run([inspect, "merge", out, os.path.join(tmp, "llama-gqa-f32-0-2.h5"),
                        os.path.join(tmp, "llama-gqa-f32-1-2.h5"), *flags], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"FAIL: dmi-inspect merge {flags}: {r.stderr}")
    with h5py.File(out, "r") as f:
        jsonschema.validate(describe(f), schema)
        if json.loads(f.attrs["merged"])["count"] != 2 or "shard" in f.attrs:
            sys.exit("FAIL: merged attribute")
    print(f"{name}: valid")
print("ok")
