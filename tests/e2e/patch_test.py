#!/usr/bin/python3
"""dmi-patch against an independent reference: scripts/dmi_reference.py runs
every patched cell by itself (float32, no KV cache), and single
`dmi-run --patch` runs give the same numbers bit for bit.

  patch_test.py BIN_DIR TEST_MODELS CASE

Cases: reference, exact, onehot, head, outputs, bad-input.
"""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import torch

from scratch import scratch_dir

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import dmi_reference as ref  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from capture_util import check_heatmap  # noqa: E402
import make_test_models as mtm  # noqa: E402
from capture_util import rows_by_key  # noqa: E402

bindir, models, case = sys.argv[1], sys.argv[2], sys.argv[3]
DMI_RUN = os.path.join(bindir, "dmi-run")
DMI_PATCH = os.path.join(bindir, "dmi-patch")
MODEL = os.path.join(models, "qwen3-untied-f32")
tmp = scratch_dir("dmi-patch-")
SITES = {"resid_pre": "hook_resid_pre", "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out", "z": "attn.hook_z",
         "pattern": "attn.hook_pattern"}
PER_HEAD = ("z", "pattern")


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def run(tool, *args, expect_rc=0):
    r = subprocess.run([tool, *args], capture_output=True, text=True, timeout=900)
    if expect_rc is not None and r.returncode != expect_rc:
        fail(f"{os.path.basename(tool)} {' '.join(args)}: exit {r.returncode}, want {expect_rc}\n{r.stdout[-1500:]}\n"
             f"{r.stderr[-1500:]}")
    return r


def prompt_file(name, lines):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def patch(clean, corrupt, out, *extra, model=MODEL):
    args = ["--model", model, "--clean", prompt_file(out + ".clean", clean),
            "--corrupt", prompt_file(out + ".corrupt", corrupt), "-o", os.path.join(tmp, out), "-q", *extra]
    return run(DMI_PATCH, *args)


def grids(path):
    with h5py.File(path, "r") as f:
        return ({k: (f["patch"][k]["raw"][:], f["patch"][k]["norm"][:]) for k in f["patch"]},
                float(f.attrs["m_clean"]), float(f.attrs["m_corrupt"]))


def metric(name, logits, answer, wrong, clean_logits=None):
    """The metric in float64, written from the issue's definitions."""
    l = np.asarray(logits, np.float64)
    if name == "logit-diff":
        return l[answer] - l[wrong]
    logp = l - l.max() - np.log(np.exp(l - l.max()).sum())
    if name == "logprob":
        return logp[answer]
    if name == "prob":
        return np.exp(logp[answer])
    c = np.asarray(clean_logits, np.float64)
    clogp = c - c.max() - np.log(np.exp(c - c.max()).sum())
    return float((np.exp(clogp) * (clogp - logp)).sum())


def ids(text):
    return list(text.encode())  # the test models' byte-level tokenizer: one token per byte


class Reference:
    """Patched runs of scripts/dmi_reference.py, one full forward each."""

    def __init__(self, model):
        cfg_d, self.w = ref.load_model_dir(model)
        self.cfg = ref.Config(cfg_d)

    def run(self, toks, record=None, patch=None):
        def iv(name, t):
            if patch is None or name != patch[0]:
                return t
            t = t.clone()
            src, pos, head = patch[1], patch[2], patch[3]
            if head is None:
                t[pos] = src[pos]
            else:
                t[:, head] = src[:, head]
            return t
        return ref.forward(self.cfg, self.w, toks, torch.float32, record=record, intervene=iv)[-1].numpy()

    def sweep(self, pairs, sites, metric_name, answer, wrong, direction="denoise"):
        """{site: raw [layers, cols]}, m_clean, m_corrupt; means over pairs."""
        L, H = self.cfg.n_layers, self.cfg.n_heads
        raw, mc, mx = {}, 0.0, 0.0
        for clean, corrupt in pairs:
            src_toks, base_toks = (clean, corrupt) if direction == "denoise" else (corrupt, clean)
            rows = {}
            src_logits = self.run(src_toks, record=lambda n, t: rows.__setitem__(n, t.clone()))
            base_logits = self.run(base_toks)
            clean_logits = src_logits if direction == "denoise" else base_logits
            corrupt_logits = base_logits if direction == "denoise" else src_logits
            mc += metric(metric_name, clean_logits, answer, wrong, clean_logits) / len(pairs)
            mx += metric(metric_name, corrupt_logits, answer, wrong, clean_logits) / len(pairs)
            for s in sites:
                cols = H if s in PER_HEAD else len(clean)
                g = raw.setdefault(s, np.zeros((L, cols)))
                for layer in range(L):
                    name = f"blocks.{layer}.{SITES[s]}"
                    for c in range(cols):
                        p = (name, rows[name], None, c) if s in PER_HEAD else (name, rows[name], c, None)
                        g[layer, c] += metric(metric_name, self.run(base_toks, patch=p), answer, wrong,
                                              clean_logits) / len(pairs)
        return raw, mc, mx


def case_reference():
    """Every cell of every site, both directions, every metric, two pairs,
    against the reference (float32 forward passes: 1e-4)."""
    pairs = [("The cat sat", "The dog sat"), ("One red hat", "One big hat")]
    r = Reference(MODEL)
    answer, wrong = ids("c")[0], ids("d")[0]
    sites = ["resid_pre", "attn_out", "mlp_out", "z", "pattern"]
    for direction, metric_name in (("denoise", "logit-diff"), ("noise", "logprob"), ("denoise", "prob"),
                                   ("denoise", "kl")):
        out = f"ref-{direction}-{metric_name}.h5"
        patch([p[0] for p in pairs], [p[1] for p in pairs], out, "--sites", ",".join(sites), "--direction", direction,
              "--metric", metric_name, "--answer-id", str(answer), "--wrong-id", str(wrong), "--batch-size", "5")
        got, mc, mx = grids(os.path.join(tmp, out))
        want, wc, wx = r.sweep([(ids(a), ids(b)) for a, b in pairs], sites, metric_name, answer, wrong, direction)
        scale = max(1.0, abs(wc), abs(wx))
        if abs(mc - wc) > 1e-4 * scale or abs(mx - wx) > 1e-4 * scale:
            fail(f"{direction} {metric_name}: m_clean {mc} m_corrupt {mx}, reference {wc} {wx}")
        for s in sites:
            raw, norm = got[s]
            if raw.shape != want[s].shape:
                fail(f"{s}: shape {raw.shape}, want {want[s].shape}")
            err = np.abs(raw - want[s]).max()
            if err > 1e-4 * scale:
                bad = np.unravel_index(np.abs(raw - want[s]).argmax(), raw.shape)
                fail(f"{direction} {metric_name} {s}: cell {bad} = {raw[bad]}, reference {want[s][bad]} (max err {err})")
            if not np.allclose(norm, (raw - mx) / (mc - mx), rtol=0, atol=1e-12):
                fail(f"{s}: norm is not (raw - m_corrupt) / (m_clean - m_corrupt)")
        print(f"{direction} {metric_name}: m_clean {mc:.6g} m_corrupt {mx:.6g}; every cell within 1e-4 of the reference")


def case_exact():
    """Cells equal single dmi-run --patch runs bit for bit (float32), and the
    KV-prefix reuse changes no bit of the result."""
    clean, corrupt = "The cat sat", "The dog sat"
    answer, wrong = ids("c")[0], ids("d")[0]
    common = ["--sites", "resid_pre,attn_out,mlp_out,z,pattern", "--answer-id", str(answer), "--wrong-id", str(wrong)]
    patch([clean], [corrupt], "reuse.h5", *common, "--batch-size", "3")
    patch([clean], [corrupt], "naive.h5", *common, "--no-prefix-reuse", "--batch-size", "7")
    got, mc, mx = grids(os.path.join(tmp, "reuse.h5"))
    naive, nc, nx = grids(os.path.join(tmp, "naive.h5"))
    for s in got:
        if not np.array_equal(got[s][0], naive[s][0]):
            fail(f"{s}: prefix reuse changed the result: max diff {np.abs(got[s][0] - naive[s][0]).max()}")
    src = os.path.join(tmp, "src.h5")
    run(DMI_RUN, "--model", MODEL, "--prompt-ids", ",".join(map(str, ids(clean))), "-n", "1",
        "--hooks", "resid_pre,attn_out,mlp_out,z,pattern,logits", "-o", src, "-q")
    base = ",".join(map(str, ids(corrupt)))
    T = len(ids(clean))

    def single(*flags):
        out = os.path.join(tmp, "single.h5")
        run(DMI_RUN, "--model", MODEL, "--prompt-ids", base, "-n", "1", "--hooks", "logits", "-o", out,
            "--overwrite", "-q", *flags)
        with h5py.File(out, "r") as f:
            return metric("logit-diff", rows_by_key(f, "unembed.hook_out")[(0, T - 1)], answer, wrong)

    with h5py.File(src, "r") as f:
        clean_m = metric("logit-diff", rows_by_key(f, "unembed.hook_out")[(0, T - 1)], answer, wrong)
    if single() != mx or clean_m != mc:
        fail(f"unpatched runs: dmi-patch m_clean {mc} m_corrupt {mx}, dmi-run {clean_m} {single()}")
    # Every head cell; the first, a middle and the last position of each
    # position site (every cell equals the full reruns above, bit for bit).
    checked = 0
    for s in ("resid_pre", "attn_out", "mlp_out"):
        for layer in range(2):
            for p in (0, T // 2, T - 1):
                want = single("--patch", f"{src},site=blocks.{layer}.{SITES[s]},pos={p}")
                if got[s][0][layer, p] != want:
                    fail(f"{s} layer {layer} pos {p}: dmi-patch {got[s][0][layer, p]!r}, dmi-run --patch {want!r}")
                checked += 1
    for s in PER_HEAD:
        for layer in range(2):
            for h in range(4):
                want = single("--patch", f"{src},site=blocks.{layer}.{SITES[s]},heads={h}")
                if got[s][0][layer, h] != want:
                    fail(f"{s} layer {layer} head {h}: dmi-patch {got[s][0][layer, h]!r}, dmi-run --patch {want!r}")
                checked += 1
    # The base prompt left-padded in a batch: pattern rows are matched by key
    # position, so the cell is unchanged.
    longer = ",".join(map(str, ids("A longer prompt here")))
    want = single("--patch", f"{src},site=blocks.1.attn.hook_pattern,heads=2,src-seq=0,pos=0:{T}")
    got_padded = single("--patch", f"{src},site=blocks.1.attn.hook_pattern,heads=2,src-seq=0,pos=0:{T}",
                        "--prompt-ids", longer, "-b", "2")
    if got_padded != want or want != got["pattern"][0][1, 2]:
        fail(f"pattern patch with left padding: {got_padded!r}, unpadded {want!r}, dmi-patch {got['pattern'][0][1, 2]!r}")
    print(f"{checked} cells equal single dmi-run --patch runs exactly (a pattern patch also when left-padded); "
          "prefix reuse bit-identical to full reruns")


def case_onehot():
    """Clean and corrupt differ at one position p: resid_pre at layer 0 has
    norm 1 at p and 0 elsewhere (denoise), the reverse with noise."""
    clean, corrupt, p = "The cat sat", "The bat sat", 4
    for direction in ("denoise", "noise"):
        for metric_name in ("logit-diff", "kl"):
            out = f"onehot-{direction}-{metric_name}.h5"
            patch([clean], [corrupt], out, "--sites", "resid_pre", "--direction", direction, "--metric", metric_name,
                  "--answer-id", str(ids("c")[0]), "--wrong-id", str(ids("b")[0]))
            g, mc, mx = grids(os.path.join(tmp, out))
            norm = g["resid_pre"][1][0]
            want = np.zeros(len(clean))
            want[p] = 1.0
            if direction == "noise":
                want = 1.0 - want
            if not np.array_equal(norm, want):
                fail(f"{direction} {metric_name}: layer-0 resid_pre norm {norm.tolist()}, want {want.tolist()}")
    print("layer-0 resid_pre: norm exactly 1 at the differing position and 0 elsewhere (and reversed for noise)")


def carrier_model():
    """Random weights except that attention output is tiny for every head but
    layer 1 head 2, which is amplified: the only route from the name token to
    the last position goes through that head."""
    def post(w, cfg):
        D = cfg["hidden_size"] // cfg["num_attention_heads"]
        for layer in range(cfg["num_hidden_layers"]):
            o = w[f"model.layers.{layer}.self_attn.o_proj.weight"]
            for h in range(cfg["num_attention_heads"]):
                o[:, h * D:(h + 1) * D] *= 4.0 if (layer, h) == (1, 2) else 0.005
        return w
    spec = dict(arch="LlamaForCausalLM", file_dtype=torch.float32, tie=False, kv=4, shards=1, post=post)
    return mtm.write_model(tmp, "carrier", spec, torch.Generator().manual_seed(7))


def case_head():
    """On a model built so that layer 1 head 2 carries the answer, that head is
    the top z cell, far ahead of the others."""
    model = carrier_model()
    patch(["Ann saw it"], ["Bob saw it"], "head.h5", "--sites", "z", "--answer-id", str(ids("A")[0]),
          "--wrong-id", str(ids("B")[0]), model=model)
    g, mc, mx = grids(os.path.join(tmp, "head.h5"))
    norm = np.abs(g["z"][1])
    top = np.unravel_index(norm.argmax(), norm.shape)
    rest = norm.copy()
    rest[top] = 0
    print(f"z norm:\n{np.array2string(g['z'][1], precision=4)}")
    if tuple(int(i) for i in top) != (1, 2):
        fail(f"top z cell is layer {top[0]} head {top[1]}, want layer 1 head 2")
    if not (norm[top] > 0.5 and rest.max() < 0.2 * norm[top]):
        fail(f"layer 1 head 2 does not stand out: {norm[top]} against {rest.max()}")
    print(f"layer 1 head 2 is the top cell: |norm| {norm[top]:.4f}, next {rest.max():.4f}")


def case_outputs():
    """The file's attributes, --json, --png and the text summary."""
    pngdir = os.path.join(tmp, "png")
    r = patch(["The cat sat"], ["The dog sat"], "out.h5", "--sites", "resid_pre,z", "--answer", "c", "--wrong", "d",
              "--png", pngdir, "--svg", pngdir, "--json", "--top", "3")
    j = json.loads(r.stdout)
    g, mc, mx = grids(os.path.join(tmp, "out.h5"))
    with h5py.File(os.path.join(tmp, "out.h5"), "r") as f:
        a = f.attrs
        for k, want in (("metric", "logit-diff"), ("direction", "denoise"), ("format", "dmi-patch"), ("answer", "c"),
                        ("wrong", "d")):
            if a[k] != want:
                fail(f"attribute {k} = {a[k]!r}, want {want!r}")
        if json.loads(a["prompts"]) != [{"clean": "The cat sat", "corrupt": "The dog sat"}]:
            fail(f"prompts attribute {a['prompts']}")
        if json.loads(a["tokens"]) != list("The dog sat") or [t.decode() for t in f["tokens"][:]] != list("The dog sat"):
            fail(f"tokens {a['tokens']}")
        if "model.safetensors" not in json.loads(a["model_fingerprint"]):
            fail(f"model_fingerprint {a['model_fingerprint']}")
        if f["patch"]["z"].attrs["axes"] != "layer,head" or f["patch"]["resid_pre"].attrs["axes"] != "layer,position":
            fail("axes attributes")
    if j["m_clean"] != mc or j["m_corrupt"] != mx or j["answer"]["id"] != ids("c")[0]:
        fail(f"--json {j}")
    cells = [(c["site"], c["layer"], c.get("position", c.get("head"))) for c in j["top"]]
    flat = sorted(((abs(v), s, l, c) for s in g for (l, c), v in np.ndenumerate(g[s][1])), reverse=True)[:3]
    if sorted(cells) != sorted((s, l, c) for _, s, l, c in flat):
        fail(f"--json top cells {cells}, file's largest |norm| {flat}")
    # Labelled heatmaps: every cell is the file's norm on the diverging map,
    # layers down, positions (with tokens) or heads across.
    maps = {(m["site"], os.path.splitext(m["file"])[1]): m for m in j["heatmaps"]}
    for s, (rows, cols), label in (("resid_pre", (2, 11), "4 d"), ("z", (2, 4), "head")):
        for ext in (".png", ".svg"):
            m = maps[(s, ext)]
            if (m["rows"], m["cols"]) != (rows, cols) or m["file"] != os.path.join(pngdir, s + ext):
                fail(f"--json heatmaps entry {m}")
            err = check_heatmap(m["file"], m, g[s][1], "diverging",
                                ["out.h5: patching blocks.*.", "normalised effect", "layer", label])
            if err:
                fail(err)
    text = patch(["The cat sat"], ["The dog sat"], "out.h5", "--answer", "c", "--wrong", "d", "--overwrite").stdout
    if "top cells" not in text or "resid_pre" not in text:
        fail(f"text summary:\n{text}")
    print("attributes, --json top cells, labelled PNG/SVG heatmaps and the text summary as documented")


def case_bad_input():
    """Bad input: exit 2, one line on stderr naming the problem, nothing written."""
    out = os.path.join(tmp, "bad.h5")
    c, x = prompt_file("c.txt", ["The cat sat", "A cat"]), prompt_file("x.txt", ["The dog sat", "A bird"])
    one_c, one_x = prompt_file("c1.txt", ["The cat sat"]), prompt_file("x1.txt", ["The dog sat"])
    base = ["--model", MODEL, "--answer-id", "1", "--wrong-id", "2", "-o", out]
    cases = [
        (["--clean", c, "--corrupt", x], "pair 2"),
        (["--clean", c, "--corrupt", one_x], "paired by line"),
        (["--clean", one_c, "--corrupt", one_x, "--sites", "resid_pre,resid_post"], "resid_post"),
        (["--clean", one_c, "--corrupt", os.path.join(tmp, "missing.txt")], "missing.txt"),
        (["--clean", one_c, "--corrupt", one_x, "--batch-size", "0"], "at least 1"),
        (["--clean", one_c, "--corrupt", one_x, "--metric", "accuracy"], "accuracy"),
        (["--clean", one_c, "--corrupt", one_x, "--answer-id", "999"], "--answer"),
    ]
    for args, needle in cases:
        r = run(DMI_PATCH, *base, *args, expect_rc=2)
        lines = r.stderr.strip().splitlines()
        if len(lines) != 1 or needle not in lines[0]:
            fail(f"{args}: stderr {r.stderr!r}, want one line naming {needle!r}")
        if os.path.exists(out):
            fail(f"{args}: {out} was written")
    r = run(DMI_PATCH, "--model", MODEL, "--clean", one_c, "--corrupt", one_x, "--answer", "ca", "--wrong-id", "2",
            "-o", out, expect_rc=2)
    if "2 tokens" not in r.stderr:
        fail(f"--answer of two tokens: {r.stderr!r}")
    r = run(DMI_PATCH, "--model", MODEL, "--clean", one_c, "--corrupt", one_x, "--answer-id", "1", "-o", out,
            expect_rc=2)
    if "--wrong" not in r.stderr:
        fail(f"logit-diff without --wrong: {r.stderr!r}")
    with open(out, "w") as f:
        f.write("keep me")
    r = run(DMI_PATCH, *base, "--clean", one_c, "--corrupt", one_x, expect_rc=2)
    if "--overwrite" not in r.stderr or open(out).read() != "keep me":
        fail(f"existing output: {r.stderr!r}")
    print("bad input: exit 2 with one line naming the problem; nothing written")


{"reference": case_reference, "exact": case_exact, "onehot": case_onehot, "head": case_head,
 "outputs": case_outputs, "bad-input": case_bad_input}[case]()
print("ok")
