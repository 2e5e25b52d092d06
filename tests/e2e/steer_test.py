#!/usr/bin/python3
"""dmi-run --steer / --ablate / --patch against scripts/dmi_reference.py run
with the same interventions (float32), and the properties the issue names.

  steer_test.py BIN_DIR TEST_MODELS CASE [MODEL]
"""
import json
import os
import struct
import subprocess
import sys

import h5py
import numpy as np
import torch

from scratch import scratch_dir

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import dmi_reference as ref  # noqa: E402
from capture_util import reference_row, rel_err, rows_by_key  # noqa: E402
from gguf_writer import gguf_control_vector  # noqa: E402

bindir, models, case = sys.argv[1], sys.argv[2], sys.argv[3]
DMI_RUN = os.path.join(bindir, "dmi-run")
DMI_INSPECT = os.path.join(bindir, "dmi-inspect")
model_name = sys.argv[4] if len(sys.argv) > 4 else "qwen3-untied-f32"
MODEL = os.path.join(models, model_name)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11, 64, 128, 1, 33], [9, 8, 7], [200, 4], [60, 61, 62, 63, 64, 65, 66]]
N_NEW = 5
tmp = scratch_dir("dmi-steer-")


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def run(*args, expect_rc=0, tool=DMI_RUN):
    r = subprocess.run([tool, *args], capture_output=True, text=True, timeout=600)
    if expect_rc is not None and r.returncode != expect_rc:
        fail(f"{os.path.basename(tool)} {' '.join(args)}: exit {r.returncode}, want {expect_rc}\n{r.stdout[-1500:]}\n"
             f"{r.stderr[-1500:]}")
    return r


def prompt_args(prompts):
    return sum([["--prompt-ids", ",".join(map(str, p))] for p in prompts], [])


def save_vectors(path, vectors, targets=None, meta=None):
    """dmi's vector format (safetensors), written here from its description."""
    header, data = {}, b""
    if meta:
        header["__metadata__"] = meta
    items = [(f"direction.{k}", np.asarray(v, np.float32)) for k, v in vectors.items()]
    items += [(f"target.{k}", np.asarray(v, np.float32).reshape(())) for k, v in (targets or {}).items()]
    for name, v in items:
        header[name] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [len(data), len(data) + v.nbytes]}
        data += v.tobytes()
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def write_gguf(path, vectors, alignment=32):
    """A GGUF control vector from the independent writer (scripts/gguf_writer.py)."""
    with open(path, "wb") as f:
        f.write(gguf_control_vector(vectors, alignment))


def cfg_of(model):
    cfg_d, w = ref.load_model_dir(model)
    return ref.Config(cfg_d), w


# Python twins of dmi's interventions (hooks/intervene.cpp), float32 math.
def pos_pred(spec):
    if spec == "all":
        return lambda p, plen: True
    if spec == "prompt":
        return lambda p, plen: p < plen
    if spec == "generated":
        return lambda p, plen: p >= plen
    if spec == "last-prompt":
        return lambda p, plen: p == plen - 1
    ranges = []
    for item in spec.split(","):
        if ":" in item:
            a, b = item.split(":")
            ranges.append((int(a), int(b)))
        else:
            ranges.append((int(item), int(item) + 1))
    return lambda p, plen: any(a <= p < b for a, b in ranges)


def steer_fn(steers, plen):
    """steers: list of dicts (site suffix, mode, scale, vectors {L: np}, targets {L: c}, pos predicate)."""
    def f(name, t):
        for st in steers:
            for layer, v in st["vectors"].items():
                if name != f"blocks.{layer}.{st['site']}":
                    continue
                x = t.float()
                v = torch.tensor(v, dtype=torch.float32)
                u = v / v.norm()
                if st["mode"] == "add":
                    y = x + st["scale"] * v
                elif st["mode"] == "normadd":
                    y = x + (st["scale"] * torch.linalg.vector_norm(x, dim=-1, keepdim=True)) * u
                elif st["mode"] == "set":
                    y = x + (st["targets"][layer] - (x * u).sum(-1, keepdim=True)) * u
                else:
                    y = x - (x * u).sum(-1, keepdim=True) * u
                y = y.to(t.dtype)
                m = torch.tensor([st["pos"](p, plen) for p in range(t.shape[0])])
                t = torch.where(m[:, None], y, t)
        return t
    return f


def check_against_reference(h5, summary, steers, model=MODEL, prompts=PROMPTS):
    """Tokens and every captured site of every sequence equal the reference
    run with the same interventions (fp32, 1e-5 relative)."""
    cfg, w = cfg_of(model)
    f = h5py.File(h5, "r")
    width = int(f.attrs["attention_width"])
    worst = {}
    for s, p in enumerate(prompts):
        plen = len(p)
        fn = steer_fn(steers, plen)
        want_new, _ = ref.greedy(cfg, w, p, N_NEW, torch.float32, intervene=fn)
        got_new = summary["sequences"][s]["output_ids"]
        if got_new != want_new:
            fail(f"sequence {s}: tokens {got_new}, reference {want_new}")
        toks = p + got_new
        n_fed = len(toks) - 1
        rec = {}
        ref.forward(cfg, w, toks[:n_fed], torch.float32, intervene=fn,
                    record=lambda n, t: rec.__setitem__(n, t.detach().numpy()))
        for name in f["sites"]:
            rows = rows_by_key(f, name)
            for q in range(n_fed):
                e = reference_row(name, rec[name], q, width)
                worst[name] = max(worst.get(name, 0.0), rel_err(rows[(s, q)], e))
    bad = {k: v for k, v in worst.items() if not v <= 1e-5}
    if bad:
        fail(f"sites beyond 1e-5 relative of the reference: {bad}")
    return max(worst.values())


rng = np.random.default_rng(7)

if case == "reference":
    cfg, _ = cfg_of(MODEL)
    d, L = cfg.hidden_size, cfg.n_layers
    vec_path = os.path.join(tmp, "v.safetensors")
    vecs = {l: rng.standard_normal(d).astype(np.float32) * 0.5 for l in range(L)}
    targets = {l: float(rng.standard_normal()) for l in range(L)}
    save_vectors(vec_path, vecs, targets)
    # Every mode, every residual-shaped site, every position selector.
    cases = [("add", "resid_post", "all", "all", 2.0), ("normadd", "resid_pre", "generated", "1", 0.3),
             ("set", "attn_out", "2:5", "0-1", 1.0), ("ablate", "mlp_out", "last-prompt", "all", 1.0),
             ("add", "resid_mid", "prompt", "0", -1.5), ("add", "resid_post", "1,3", "0,1", 3.0)]
    report = []
    plain = json.loads(run("-q", "--model", MODEL, "--dtype", "float32", "-n", str(N_NEW), "-b", "4", "--ignore-eos",
                           "--json", *prompt_args(PROMPTS)).stdout)
    for k, (mode, site, pos, layers, scale) in enumerate(cases):
        out = os.path.join(tmp, f"{k}-{mode}-{site}.h5")
        spec = f"{vec_path},scale={scale},layers={layers},pos={pos},mode={mode},site={site}"
        r = run("-q", "--model", MODEL, "--dtype", "float32", "-n", str(N_NEW), "-b", "4", "--ignore-eos",
                "--hooks", "full", "--capture-dtype", "float32", "-o", out, "--json", "--steer", spec,
                *prompt_args(PROMPTS))
        summary = json.loads(r.stdout)
        layer_set = range(L) if layers == "all" else sorted({int(x) for part in layers.split(",")
                                                              for x in (range(int(part.split("-")[0]),
                                                                              int(part.split("-")[-1]) + 1))})
        steer = {"site": "hook_" + site, "mode": mode, "scale": scale, "vectors": {l: vecs[l] for l in layer_set},
                 "targets": targets, "pos": pos_pred(pos)}
        worst = check_against_reference(out, summary, [steer])
        if mode == "add" and pos == "all" and all(a["output_ids"] == b["output_ids"] for a, b in
                                                   zip(summary["sequences"], plain["sequences"])):
            fail("steering at every layer and position left every token unchanged: the test would prove nothing")
        report.append(f"{mode}@{site} pos={pos}: {worst:.1e}")
    print(f"{model_name}: " + "; ".join(report))
elif case == "after":
    # pos=after:TEXT on text prompts (CAA): positions after TEXT's last
    # occurrence; positions found here from the token ids dmi reports.
    cfg, _ = cfg_of(MODEL)
    vec_path = os.path.join(tmp, "v.safetensors")
    vecs = {l: rng.standard_normal(cfg.hidden_size).astype(np.float32) for l in range(cfg.n_layers)}
    save_vectors(vec_path, vecs)
    texts = ["Question: is it? Answer: yes", "Answer: no. Question: why? Answer:", "x Answer: y Answer: z"]
    out = os.path.join(tmp, "after.h5")
    r = run("-q", "--model", MODEL, "-n", str(N_NEW), "-b", "3", "--ignore-eos", "--hooks", "full", "-o", out,
            "--json", "--steer", f"{vec_path},pos=after:Answer:", *sum([["--prompt", t] for t in texts], []))
    summary = json.loads(r.stdout)
    needle = json.loads(run("-q", "--model", MODEL, "--prompt", "Answer:", "--no-special-tokens", "-n", "0",
                            "--json").stdout)["sequences"][0]["prompt_ids"]
    prompts = [sq["prompt_ids"] for sq in summary["sequences"]]
    steers = []
    for s, p in enumerate(prompts):
        starts = [i for i in range(len(p) - len(needle) + 1) if p[i:i + len(needle)] == needle]
        if not starts:
            fail(f"prompt {s} lacks the needle {needle}")
        first = starts[-1] + len(needle)
        steers.append({"site": "hook_resid_post", "mode": "add", "scale": 1.0, "vectors": vecs, "targets": {},
                       "pos": (lambda first: lambda p, plen: p >= first)(first)})
    cfg_, w = cfg_of(MODEL)
    # One sequence at a time, each with its own start.
    f = h5py.File(out, "r")
    for s, p in enumerate(prompts):
        fn = steer_fn([steers[s]], len(p))
        want, _ = ref.greedy(cfg_, w, p, N_NEW, torch.float32, intervene=fn)
        if summary["sequences"][s]["output_ids"] != want:
            fail(f"after: sequence {s}: tokens {summary['sequences'][s]['output_ids']}, reference {want}")
        toks = p + want
        rec = {}
        ref.forward(cfg_, w, toks[:-1], torch.float32, intervene=fn,
                    record=lambda n, t: rec.__setitem__(n, t.detach().numpy()))
        rows = rows_by_key(f, "unembed.hook_out")
        for q in range(len(toks) - 1):
            if rel_err(rows[(s, q)], rec["unembed.hook_out"][q]) > 1e-5:
                fail(f"after: logits of sequence {s} position {q}")
    print(f"pos=after:Answer: matches the reference on {len(prompts)} prompts (needle {needle})")
    # A prompt without the text is an error naming it.
    r = run("-q", "--model", MODEL, "--prompt", "no needle here", "--steer", f"{vec_path},pos=after:Answer:",
            expect_rc=2)
    if "prompt 0 does not contain" not in r.stderr:
        fail(f"after: missing text: {r.stderr!r}")
elif case == "properties":
    cfg, _ = cfg_of(MODEL)
    d = cfg.hidden_size
    vec_path = os.path.join(tmp, "v.safetensors")
    vecs = {l: rng.standard_normal(d).astype(np.float32) for l in range(cfg.n_layers)}
    save_vectors(vec_path, vecs)
    base = ["-q", "--model", MODEL, "-n", str(N_NEW), "-b", "4", "--ignore-eos", "--hooks", "full", "--json"]
    plain, zero = os.path.join(tmp, "plain.h5"), os.path.join(tmp, "zero.h5")
    run(*base, "-o", plain, *prompt_args(PROMPTS))
    run(*base, "-o", zero, "--steer", f"{vec_path},scale=0", "--steer", f"{vec_path},scale=0,mode=normadd",
        *prompt_args(PROMPTS))
    fp, fz = h5py.File(plain, "r"), h5py.File(zero, "r")
    for name in fp["sites"]:
        a, b = fp["sites"][name]["data"][:], fz["sites"][name]["data"][:]
        if a.tobytes() != b.tobytes():
            fail(f"scale=0: {name} is not bit-identical to no steering")
    print("scale=0 (add, normadd): every site bit-identical to no steering")
    # Directional ablation: h.u = 0 at that site afterwards.
    abl = os.path.join(tmp, "abl.h5")
    run(*base, "-o", abl, "--dtype", "float32", "--capture-dtype", "float32", "--steer",
        f"{vec_path},mode=ablate,layers=1,site=resid_mid", *prompt_args(PROMPTS))
    x = h5py.File(abl, "r")["sites/blocks.1.hook_resid_mid/data"][:].astype(np.float64)
    u = vecs[1] / np.linalg.norm(vecs[1])
    proj = np.abs(x @ u).max()
    if not proj <= 1e-5 * np.abs(x).max():
        fail(f"ablated direction still has projection {proj}")
    before = os.path.join(tmp, "before.h5")
    run(*base, "-o", before, "--dtype", "float32", "--capture-dtype", "float32", "--capture-before-interventions",
        "--steer", f"{vec_path},mode=ablate,layers=1,site=resid_mid", *prompt_args(PROMPTS))
    xb = h5py.File(before, "r")["sites/blocks.1.hook_resid_mid/data"][:].astype(np.float64)
    if np.abs(xb @ u).max() < 1e-3:
        fail("--capture-before-interventions recorded the ablated values")
    print(f"ablate: max |h.u| after = {proj:.1e}; --capture-before-interventions keeps the value before "
          f"(max |h.u| {np.abs(xb @ u).max():.2f})")
    # Zero-ablating head 1 of z: its rows are zero, the other heads unchanged.
    za = os.path.join(tmp, "zhead.h5")
    run(*base, "-o", za, "--ablate", "blocks.1.attn.hook_z,heads=1=zero", *prompt_args(PROMPTS))
    # (Prompt positions: later tokens may differ once the ablation changed the output.)
    z0 = rows_by_key(h5py.File(plain, "r"), "blocks.1.attn.hook_z")
    z1 = rows_by_key(h5py.File(za, "r"), "blocks.1.attn.hook_z")
    if max(np.abs(r[1]).max() for r in z1.values()) != 0:
        fail("zero-ablated head 1 of blocks.1.attn.hook_z is not zero")
    for s, p in enumerate(PROMPTS):
        for q in range(len(p)):
            if not np.array_equal(np.delete(z1[(s, q)], 1, axis=0), np.delete(z0[(s, q)], 1, axis=0)):
                fail(f"zero-ablating head 1 changed another head at ({s}, {q})")
    # KV heads under GQA: k has num_kv_heads heads.
    r = run(*base, "-o", os.path.join(tmp, "k.h5"), "--ablate", f"blocks.0.attn.hook_k,heads={cfg.n_kv}=zero",
            *prompt_args(PROMPTS), expect_rc=2)
    if "key/value heads" not in r.stderr and "out of range" not in r.stderr:
        fail(f"KV head out of range: {r.stderr!r}")
    run(*base, "-o", os.path.join(tmp, "k.h5"), "--ablate", f"blocks.0.attn.hook_k,heads={cfg.n_kv - 1}=zero",
        *prompt_args(PROMPTS))
    k = h5py.File(os.path.join(tmp, "k.h5"), "r")["sites/blocks.0.attn.hook_k/data"][:]
    if np.abs(k[:, cfg.n_kv - 1]).max() != 0:
        fail("k head ablation")
    print("zero-ablation of z head 1: zero rows, other heads bit-identical; k heads are KV heads")
    # Per-row steering in a mixed-length batch equals each row alone.
    jl = os.path.join(tmp, "rows.jsonl")
    v2 = os.path.join(tmp, "v2.safetensors")
    save_vectors(v2, {l: rng.standard_normal(d).astype(np.float32) for l in range(cfg.n_layers)})
    row_specs = [[f"{vec_path},scale=2"], [], [f"{v2},mode=normadd,scale=0.5", f"{vec_path},pos=generated"],
                 [f"{v2},scale=-1,layers=0"]]
    with open(jl, "w") as fh:
        for p, st in zip(PROMPTS, row_specs):
            fh.write(json.dumps({"ids": p, "steer": st}) + "\n")
    batched = os.path.join(tmp, "batched.h5")
    sb = json.loads(run(*base, "-o", batched, "--dtype", "float32", "--prompts", jl).stdout)
    fbat = h5py.File(batched, "r")
    worst = 0.0
    for i, (p, st) in enumerate(zip(PROMPTS, row_specs)):
        alone = os.path.join(tmp, f"alone{i}.h5")
        sa = json.loads(run(*[x for x in base if x not in ("-b", "4")], "-o", alone, "--dtype", "float32", *sum([["--steer", x] for x in st], []),
                            "--prompt-ids", ",".join(map(str, p))).stdout)
        if sa["sequences"][0]["output_ids"] != sb["sequences"][i]["output_ids"]:
            fail(f"per-row steering: row {i} tokens differ from the row alone")
        fal = h5py.File(alone, "r")
        for name in fal["sites"]:
            a, b = rows_by_key(fal, name), rows_by_key(fbat, name)
            for (s, q), row in a.items():
                other = b[(i, q)]
                if row.ndim == 2 and (name.endswith("scores") or name.endswith("pattern")):
                    w = min(row.shape[1], other.shape[1])  # attention rows are as wide as each file's longest sequence
                    row, other = row[:, :w], other[:, :w]
                worst = max(worst, rel_err(other, row))
    if not worst <= 1e-5:
        fail(f"per-row steering: batched rows differ from alone by {worst:.1e}")
    print(f"per-row steering (JSONL \"steer\") in a mixed-length batch = each row alone (worst {worst:.1e})")
    # A replay of an intervened capture reproduces it bit for bit.
    r = run("--replay", batched, "--verify", "-o", os.path.join(tmp, "replayed.h5"))
    if "bit for bit" not in r.stdout:
        fail(f"replay of a steered capture: {r.stdout}")
    r = run("--replay", za, "--replay-mode", "forced", "--verify")
    print("replays of steered and ablated captures verify (exact bit for bit, forced within tolerance)")
elif case == "patch":
    # Patching every position of blocks.0.hook_resid_pre from B into A makes
    # A equal B downstream, generated tokens included.
    A = [[5, 17, 42, 99, 3], [9, 8, 7, 6, 5, 4, 3]]
    Bp = [[60, 61, 62, 63, 64], [100, 101, 102, 103, 104, 105, 106]]
    base = ["-q", "--model", MODEL, "-n", str(N_NEW), "-b", "2", "--ignore-eos", "--hooks", "full", "--json",
            "--dtype", "float32"]
    b_h5, a_h5 = os.path.join(tmp, "B.h5"), os.path.join(tmp, "A-patched.h5")
    sb = json.loads(run(*base, "-o", b_h5, *prompt_args(Bp)).stdout)
    sa = json.loads(run(*base, "-o", a_h5, "--patch", f"{b_h5},site=blocks.0.hook_resid_pre", *prompt_args(A)).stdout)
    for i in range(2):
        if sa["sequences"][i]["output_ids"] != sb["sequences"][i]["output_ids"]:
            fail(f"patched sequence {i}: tokens {sa['sequences'][i]['output_ids']}, B's "
                 f"{sb['sequences'][i]['output_ids']}")
    fa, fb = h5py.File(a_h5, "r"), h5py.File(b_h5, "r")
    worst = 0.0
    for name in fb["sites"]:
        if name == "hook_embed":
            continue  # A's own tokens' embeddings, before the patch
        a, b = rows_by_key(fa, name), rows_by_key(fb, name)
        if set(a) != set(b):
            fail(f"{name}: rows differ")
        worst = max(worst, max(rel_err(a[k], b[k]) for k in b))
    if worst != 0.0:
        fail(f"patched A differs from B by {worst:.1e}")
    print("patching blocks.0.hook_resid_pre from B: every downstream site and token of A equals B's (bit for bit)")
    # A patch from another model's capture is refused.
    other = os.path.join(models, "llama-gqa-f32" if model_name != "llama-gqa-f32" else "qwen3-untied-f32")
    o_h5 = os.path.join(tmp, "other.h5")
    run("-q", "--model", other, "-n", "2", "--hooks", "resid_pre", "-o", o_h5, *prompt_args(Bp))
    r = run(*base, "-o", os.path.join(tmp, "never.h5"), "--patch", f"{o_h5},site=blocks.0.hook_resid_pre",
            *prompt_args(A), expect_rc=2)
    if "another model" not in r.stderr or os.path.exists(os.path.join(tmp, "never.h5")):
        fail(f"patch from another model: {r.stderr!r}")
    # A missing row is an error naming it.
    r = run(*base, "-o", os.path.join(tmp, "never.h5"), "--patch", f"{b_h5},site=blocks.0.hook_resid_pre,src-seq=0",
            "--prompt-ids", ",".join(map(str, A[1])), expect_rc=2)
    if "sequence 0 position 9" not in r.stderr:  # B's sequence 0 has rows for positions 0..8
        fail(f"patch missing row: {r.stderr!r}")
    # mean / resample ablation from a reference capture.
    mean_h5 = os.path.join(tmp, "mean.h5")
    run(*base, "-o", mean_h5, "--ablate", f"blocks.1.hook_mlp_out=mean:{b_h5}", *prompt_args(A))
    x = h5py.File(mean_h5, "r")["sites/blocks.1.hook_mlp_out/data"][:]
    want = h5py.File(b_h5, "r")["sites/blocks.1.hook_mlp_out/data"][:].astype(np.float64).mean(0)
    if np.abs(x - want).max() > 1e-6 * np.abs(want).max():
        fail("mean ablation does not hold REF's mean")
    res_h5 = os.path.join(tmp, "resample.h5")
    run(*base, "-o", res_h5, "--ablate", f"blocks.1.hook_mlp_out,pos=0:5=resample:{b_h5}", *prompt_args(A))
    ra, rb = rows_by_key(h5py.File(res_h5, "r"), "blocks.1.hook_mlp_out"), rows_by_key(fb, "blocks.1.hook_mlp_out")
    for s in range(2):
        for q in range(5):
            if not np.array_equal(ra[(s, q)], rb[((s + 1) % 2, q)]):
                fail(f"resample ablation row ({s}, {q})")
    print("mean and resample ablation hold REF's values; patches from another model and missing rows are refused")
elif case == "vectors":
    cfg, _ = cfg_of(MODEL)
    d, L = cfg.hidden_size, cfg.n_layers
    vecs = {l: rng.standard_normal(d).astype(np.float32) for l in range(1, L)}
    st, gg = os.path.join(tmp, "v.safetensors"), os.path.join(tmp, "v.gguf")
    save_vectors(st, vecs)
    write_gguf(gg, vecs)
    base = ["-q", "--model", MODEL, "-n", str(N_NEW), "-b", "4", "--ignore-eos", "--hooks", "resid_post,logits",
            "--json"]
    a, b = os.path.join(tmp, "st.h5"), os.path.join(tmp, "gg.h5")
    run(*base, "-o", a, "--steer", f"{st},scale=1.5", *prompt_args(PROMPTS))
    run(*base, "-o", b, "--steer", f"{gg},scale=1.5", *prompt_args(PROMPTS))
    for name in h5py.File(a, "r")["sites"]:
        if h5py.File(a, "r")["sites"][name]["data"][:].tobytes() != h5py.File(b, "r")["sites"][name]["data"][:].tobytes():
            fail(f"GGUF from the independent writer steers differently from the same safetensors vectors ({name})")
    # dmi's GGUF export reads back identically and is what the spec says.
    out = os.path.join(tmp, "export.gguf")
    run("steer-vector", "export", st, "--gguf", out, "--model-hint", "qwen3", tool=DMI_INSPECT)
    raw = open(out, "rb").read()
    if raw[:4] != b"GGUF" or struct.unpack("<I", raw[4:8])[0] != 3:
        fail("exported GGUF header")
    c = os.path.join(tmp, "export.h5")
    run(*base, "-o", c, "--steer", f"{out},scale=1.5", *prompt_args(PROMPTS))
    for name in h5py.File(a, "r")["sites"]:
        if h5py.File(a, "r")["sites"][name]["data"][:].tobytes() != h5py.File(c, "r")["sites"][name]["data"][:].tobytes():
            fail(f"dmi's GGUF export does not read back identically ({name})")
    # HDF5 datasets of the same names.
    h5v = os.path.join(tmp, "v.h5")
    with h5py.File(h5v, "w") as f:
        for l, v in vecs.items():
            f[f"direction.{l}"] = v
    e = os.path.join(tmp, "h5v.h5")
    run(*base, "-o", e, "--steer", f"{h5v},scale=1.5", *prompt_args(PROMPTS))
    if h5py.File(a, "r")["sites/unembed.hook_out/data"][:].tobytes() != \
            h5py.File(e, "r")["sites/unembed.hook_out/data"][:].tobytes():
        fail("HDF5 vectors steer differently")
    print("GGUF (independent writer, and dmi's export) and HDF5 vectors steer exactly like the safetensors file")
    # Bad vector files: exit 2, one line naming the file and the tensor.
    bad = {}
    bad["wrong d_model"] = (os.path.join(tmp, "d.safetensors"), {1: np.zeros(d + 1, np.float32) + 1}, "direction.1")
    bad["layer out of range"] = (os.path.join(tmp, "l.safetensors"), {L + 3: np.ones(d, np.float32)}, f"direction.{L + 3}")
    bad["NaN"] = (os.path.join(tmp, "n.safetensors"), {1: np.full(d, np.nan, np.float32)}, "direction.1")
    for what, (path, v, tensor) in bad.items():
        save_vectors(path, v)
        r = run("-q", "--model", MODEL, "--prompt-ids", "1,2", "--steer", path, expect_rc=2)
        if path not in r.stderr or tensor not in r.stderr or len(r.stderr.strip().splitlines()) != 1:
            fail(f"{what}: {r.stderr!r}")
    g0 = os.path.join(tmp, "zero.gguf")
    write_gguf(g0, {0: np.ones(d, np.float32)})
    r = run("-q", "--model", MODEL, "--prompt-ids", "1,2", "--steer", g0, expect_rc=2)
    if "direction.0" not in r.stderr:
        fail(f"GGUF direction.0: {r.stderr!r}")
    junk = os.path.join(tmp, "junk.bin")
    with open(junk, "wb") as fh:
        fh.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    r = run("-q", "--model", MODEL, "--prompt-ids", "1,2", "--steer", junk, expect_rc=2)
    if junk not in r.stderr:
        fail(f"unknown format: {r.stderr!r}")
    for spec, want in [(f"{st},mode=sideways", "mode=sideways"), (f"{st},site=pattern", "not residual-shaped"),
                       (f"{st},bogus=1", "unknown key"), (f"{st},layers=0", "no direction.0"),
                       (f"{st},pos=3:1", "is empty")]:
        r = run("-q", "--model", MODEL, "--prompt-ids", "1,2", "--steer", spec, expect_rc=2)
        if want not in r.stderr:
            fail(f"--steer {spec}: {r.stderr!r}")
    print("bad vector files and specs: exit 2, one line naming the file and tensor")
elif case == "make":
    # steer-vector make: mean-diff equals numpy's paired mean difference of
    # the captured rows; pca-diff is signed so that positives project higher.
    Pp = [[5, 17, 42], [9, 8, 7, 6], [200, 4], [60, 61]]
    Np = [[5, 17, 43], [9, 8, 7, 1], [201, 4], [60, 62]]
    base = ["-q", "--model", MODEL, "-n", "3", "-b", "4", "--hooks", "resid_post"]
    ph, nh = os.path.join(tmp, "pos.h5"), os.path.join(tmp, "neg.h5")
    run(*base, "-o", ph, *prompt_args(Pp))
    run(*base, "-o", nh, *prompt_args(Np))
    fp, fn = h5py.File(ph, "r"), h5py.File(nh, "r")
    cfg, _ = cfg_of(MODEL)
    for method, select in [("mean-diff", "last-prompt"), ("pca-diff", "last-prompt"), ("pca-center", "all"),
                           ("mean-diff", "pos:1")]:
        out = os.path.join(tmp, f"{method}-{select.replace(':', '')}.safetensors")
        r = run("steer-vector", "make", "--pos", ph, "--neg", nh, "--site", "resid_post", "--select", select,
                "--method", method, "-o", out, "--json", tool=DMI_INSPECT)
        j = json.loads(r.stdout)
        for layer in range(cfg.n_layers):
            name = f"blocks.{layer}.hook_resid_post"
            a, b = rows_by_key(fp, name), rows_by_key(fn, name)
            if select == "last-prompt":
                keys = [(s, len(p) - 1) for s, p in enumerate(Pp)]
            elif select == "pos:1":
                keys = [(s, 1) for s in range(len(Pp))]
            else:
                keys = sorted(k for k in a if k in b)
            P = np.stack([a[k] for k in keys]).astype(np.float64)
            N = np.stack([b[k] for k in keys]).astype(np.float64)
            D = P - N
            # Read dmi's vector back (our own safetensors reader: header + F32 data).
            raw = open(out, "rb").read()
            hl = struct.unpack("<Q", raw[:8])[0]
            hdr = json.loads(raw[8:8 + hl])
            o0, o1 = hdr[f"direction.{layer}"]["data_offsets"]
            got = np.frombuffer(raw[8 + hl + o0:8 + hl + o1], np.float32).astype(np.float64)
            if method == "mean-diff":
                want = D.mean(0)
                if np.abs(got - want).max() > 1e-6 * max(np.abs(want).max(), 1e-12):
                    fail(f"{method} {select} layer {layer}: differs from numpy's paired mean difference")
            else:
                M = D - D.mean(0) if method == "pca-diff" else D
                want = np.linalg.svd(M, full_matrices=False)[2][0]
                if (P @ want > N @ want).mean() < 0.5:
                    want = -want
                if abs(abs(got @ want) / np.linalg.norm(got) - 1) > 1e-5 or got @ want < 0:
                    fail(f"{method} layer {layer}: not numpy's first component with the positive sign")
        if j["pairs"] != len(keys):
            fail(f"{method}: pairs {j['pairs']}, want {len(keys)}")
    r = run("steer-vector", "show", out, "--capture", ph, "--scale", "4", "--json", tool=DMI_INSPECT)
    j = json.loads(r.stdout)
    x = h5py.File(ph, "r")["sites/blocks.1.hook_resid_post/data"][:].astype(np.float64)
    hn = np.linalg.norm(x, axis=1).mean()
    l1 = [e for e in j["layers"] if e["layer"] == 1][0]
    if abs(l1["mean_h_norm"] - hn) > 1e-6 * hn or abs(l1["scale_v_over_h"] - 4 * l1["norm"] / hn) > 1e-9:
        fail(f"show: {l1} vs mean |h| {hn}")
    print("steer-vector make (mean-diff, pca-diff, pca-center; last-prompt, pos:K, all) matches numpy; show's "
          "|v|/|h| matches")
    # Unequal pair counts are an error.
    r = run("steer-vector", "make", "--pos", ph, "--neg", os.path.join(tmp, "never.h5"), "-o", out, tool=DMI_INSPECT,
            expect_rc=2)
    short = os.path.join(tmp, "short.h5")
    run(*base, "-o", short, *prompt_args(Np[:3]))
    r = run("steer-vector", "make", "--pos", ph, "--neg", short, "-o", out, tool=DMI_INSPECT, expect_rc=2)
    if "equal counts" not in r.stderr:
        fail(f"unequal counts: {r.stderr!r}")
else:
    fail(f"unknown case {case}")
print("ok")
