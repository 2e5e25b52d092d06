#!/usr/bin/python3
"""dmi-run on bad input: exit status 2, one line on stderr naming the
problem, nothing on stdout, no crash.

  bad_input.py DMI_RUN TEST_MODELS CASE
"""
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile

dmi_run, models, case = sys.argv[1], sys.argv[2], sys.argv[3]
good = os.path.join(models, "llama-gqa-f32")
tmp = tempfile.mkdtemp(prefix="dmi-bad-")


def copy_model():
    d = os.path.join(tmp, "model")
    shutil.copytree(good, d)
    return d


def edit_header(d, fn):
    """Rewrites model.safetensors' header through fn(header) keeping the data."""
    p = os.path.join(d, "model.safetensors")
    raw = open(p, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    h = json.loads(raw[8:8 + n])
    fn(h)
    hj = json.dumps(h).encode()
    hj += b" " * ((8 - (8 + len(hj)) % 8) % 8)
    open(p, "wb").write(struct.pack("<Q", len(hj)) + hj + raw[8 + n:])


def edit_config(d, fn):
    p = os.path.join(d, "config.json")
    c = json.load(open(p))
    fn(c)
    json.dump(c, open(p, "w"))


args = ["--max-new-tokens", "2"]
if case == "missing-model-dir":
    args += ["--model", os.path.join(tmp, "nope")]
    expect = "model directory does not exist"
elif case == "model-dir-is-file":
    d = copy_model()
    args += ["--model", os.path.join(d, "config.json")]
    expect = "neither an HF model directory nor a TorchScript archive"
elif case == "malformed-config":
    d = copy_model()
    open(os.path.join(d, "config.json"), "w").write('{"architectures": ["LlamaForCausalLM"], ')
    args += ["--model", d]
    expect = "config.json: malformed JSON"
elif case == "unsupported-architecture":
    d = copy_model()
    edit_config(d, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    args += ["--model", d]
    expect = "architecture 'GPT2LMHeadModel' is not supported (supported: LlamaForCausalLM"
elif case == "truncated-safetensors":
    d = copy_model()
    p = os.path.join(d, "model.safetensors")
    raw = open(p, "rb").read()
    open(p, "wb").write(raw[: len(raw) // 2])
    args += ["--model", d]
    expect = "lie outside the data area"
elif case == "lying-header":
    d = copy_model()
    p = os.path.join(d, "model.safetensors")
    raw = bytearray(open(p, "rb").read())
    raw[:8] = struct.pack("<Q", 1 << 33)
    open(p, "wb").write(raw)
    args += ["--model", d]
    expect = "safetensors header claims"
elif case == "missing-tensor":
    d = copy_model()
    edit_header(d, lambda h: h.pop("model.layers.1.mlp.up_proj.weight"))
    args += ["--model", d]
    expect = "missing tensor 'model.layers.1.mlp.up_proj.weight'"
elif case == "shape-mismatch":
    d = copy_model()
    edit_config(d, lambda c: c.update(intermediate_size=96))
    args += ["--model", d]
    expect = "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [80, 48], config.json implies [96, 48]"
elif case == "unknown-dtype":
    d = copy_model()
    edit_header(d, lambda h: h["model.norm.weight"].update(dtype="F8_E4M3"))
    args += ["--model", d]
    expect = "tensor 'model.norm.weight' has dtype 'F8_E4M3'"
elif case == "tokenizer-missing":
    d = copy_model()
    os.remove(os.path.join(d, "tokenizer.json"))
    args += ["--model", d]
    expect = "tokenizer.json: cannot read tokenizer"
elif case == "tokenizer-malformed":
    d = copy_model()
    open(os.path.join(d, "tokenizer.json"), "w").write('{"model": {"type": "BPE", "vocab": ')
    args += ["--model", d]
    expect = "malformed tokenizer JSON"
elif case == "prompt-too-long":
    args += ["--model", good, "--prompt-ids", ",".join(["5"] * 70)]
    expect = "prompt 0 has 70 tokens; the model's context is 64"
elif case == "invalid-utf8-prompts-file":
    p = os.path.join(tmp, "prompts.txt")
    open(p, "wb").write(b"fine line\nbad \xff\xfe line\n")
    args += ["--model", good, "--prompts", p]
    expect = "prompts.txt:2: not valid UTF-8"
elif case == "token-id-out-of-range":
    args += ["--model", good, "--prompt-ids", "1,2,256"]
    expect = "token id 256 is out of range (vocab_size 256)"
elif case == "bad-id-list":
    args += ["--model", good, "--prompt-ids", "1,x,3"]
    expect = "'x' is not a non-negative integer"
elif case == "bad-flag":
    args += ["--model", good, "--dtype", "float8"]
    expect = "--dtype"
elif case == "bad-jsonl":
    p = os.path.join(tmp, "prompts.jsonl")
    open(p, "w").write('{"text": "ok"}\n{"texts": "typo"}\n')
    args += ["--model", good, "--prompts", p]
    expect = "prompts.jsonl:2: each JSON line needs exactly one of \"text\", \"ids\" or \"messages\""
elif case == "unknown-hook":
    out = os.path.join(tmp, "never.h5")
    args += ["--model", good, "--hooks", "resid_pots", "-o", out]
    expect = "--hooks: unknown site 'resid_pots'; did you mean resid_post"
elif case == "hooks-without-output":
    args += ["--model", good, "--hooks", "residual"]
    expect = "--hooks with --sink hdf5 needs --output FILE.h5"
elif case == "tokenizer-huge-id":
    d = copy_model()
    t = json.load(open(os.path.join(d, "tokenizer.json")))
    t["model"]["vocab"][next(iter(t["model"]["vocab"]))] = 10 ** 9
    json.dump(t, open(os.path.join(d, "tokenizer.json"), "w"))
    args += ["--model", d]
    expect = "has id 1000000000: implausibly large"
elif case == "tokenizer-beyond-vocab":
    d = copy_model()
    t = json.load(open(os.path.join(d, "tokenizer.json")))
    t["model"]["vocab"][next(iter(t["model"]["vocab"]))] = 300
    json.dump(t, open(os.path.join(d, "tokenizer.json"), "w"))
    args += ["--model", d, "--hooks", "resid_post", "-o", os.path.join(tmp, "never.h5")]
    expect = "has token id 300, but the model's vocab_size is 256"
elif case == "output-exists":
    out = os.path.join(tmp, "exists.h5")
    open(out, "w").write("precious")
    args += ["--model", good, "--hooks", "resid_post", "-o", out]
    expect = "exists; pass --overwrite to replace it"
elif case == "output-dir-missing":
    args += ["--model", good, "--hooks", "resid_post", "-o", os.path.join(tmp, "no", "such", "dir", "x.h5")]
    expect = "does not exist"
elif case == "output-read-only":
    ro = os.path.join(tmp, "ro")
    os.mkdir(ro)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", ro], capture_output=True).returncode != 0:
        print("skipped: cannot mount a read-only tmpfs here (needs root)")
        sys.exit(77)
    args += ["--model", good, "--hooks", "resid_post", "-o", os.path.join(ro, "x.h5")]
    expect = "is on a read-only file system"
elif case == "output-not-a-file":
    # A pipe (or /dev/null) is never replaced, not even with --overwrite: the
    # writer unlinks the regular file it replaces.
    fifo = os.path.join(tmp, "pipe")
    os.mkfifo(fifo)
    args += ["--model", good, "--hooks", "resid_post", "-o", fifo, "--overwrite"]
    expect = "is not a regular file"
elif case == "range-in-words":
    args += ["--model", good, "--batch-size", "0"]
    expect = "--batch-size: must be at least 1 (got 0)"
else:
    sys.exit(f"unknown case {case}")

r = subprocess.run([dmi_run] + args, capture_output=True, text=True, errors="replace", timeout=120)
if case == "output-read-only":
    subprocess.run(["umount", os.path.join(tmp, "ro")], capture_output=True)
left_behind = [f for f in os.listdir(tmp) if f.endswith(".h5") and f != "exists.h5"]
if case == "output-not-a-file" and not stat.S_ISFIFO(os.stat(os.path.join(tmp, "pipe")).st_mode):
    print("FAIL: the pipe was replaced")
    sys.exit(1)
if case == "output-exists" and open(os.path.join(tmp, "exists.h5")).read() != "precious":
    print("FAIL: the existing file was touched")
    sys.exit(1)
shutil.rmtree(tmp)
err_lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
problems = []
if r.returncode != 2:
    problems.append(f"exit status {r.returncode}, want 2")
if len(err_lines) != 1:
    problems.append(f"{len(err_lines)} stderr lines, want 1")
if expect not in r.stderr:
    problems.append(f"stderr lacks {expect!r}")
if r.stdout:
    problems.append("stdout is not empty")
if left_behind:
    problems.append(f"left a capture file behind: {left_behind}")
print(f"stderr: {r.stderr.strip()}")
if problems:
    print("FAIL: " + "; ".join(problems))
    sys.exit(1)
print("ok")
