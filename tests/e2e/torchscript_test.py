#!/usr/bin/python3
"""TorchScript models in dmi-run: the same weights exported with
scripts/dmi_torchscript.py and loaded natively generate the same tokens and
capture the same tensors; a module exported without hooks and instrumented
from a hook map captures the same residual streams; bad modules exit 2.

  torchscript_test.py DMI_RUN TEST_MODELS CASE
    parity-MODEL   hooked export vs native, --hooks full, fp32 (forward_step: KV cache)
    full-recompute-MODEL  the same through forward only (whole sequence each step)
    auto           --no-hooks export + data/hook-maps/hf-llama.json vs native
    bfloat16       --dtype bfloat16 on a TorchScript model (module.to(bf16))
    bad-NAME       one-line errors with exit status 2
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
import dmi_torchscript as dts  # noqa: E402
from capture_util import rel_err, rows_by_key as rows  # noqa: E402

dmi_run, models, case = sys.argv[1], sys.argv[2], sys.argv[3]
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11, 64, 128, 1, 33], [9, 8, 7], [200], [60, 61, 62, 63, 64, 65, 66]]
N_NEW = 5
HOOK_MAP = os.path.join(ROOT, "data", "hook-maps", "hf-llama.json")
tmp = scratch_dir("dmi-ts-")


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def run(model, out=None, *extra, expect_rc=0):
    args = [dmi_run, "-q", "--model", model, "-n", str(N_NEW), "-b", "4", "--json"]
    for p in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, p))]
    if out:
        args += ["-o", out]
    r = subprocess.run(args + list(extra), capture_output=True, text=True, timeout=600)
    if r.returncode != expect_rc:
        fail(f"{' '.join(args + list(extra))}: exit {r.returncode}, want {expect_rc}: {r.stderr}")
    return r




def compare(native_h5, ts_h5, sites, bound=1e-5):
    worst = (-1.0, "")
    with h5py.File(native_h5, "r") as fa, h5py.File(ts_h5, "r") as fb:
        if not np.array_equal(fa["sequences"]["tokens"][:], fb["sequences"]["tokens"][:]):
            fail("generated tokens differ between the native and the TorchScript model")
        for site in sites:
            ra, rb = rows(fa, site), rows(fb, site)
            if ra.keys() != rb.keys():
                fail(f"{site}: captured (seq, pos) rows differ: {sorted(ra)[:5]} vs {sorted(rb)[:5]}")
            e = max(rel_err(rb[k], ra[k]) for k in ra)
            if e > bound:
                fail(f"{site}: relative difference {e:.3g} > {bound}")
            worst = max(worst, (e, site))
    return worst


def native_ids(r):
    return [s["output_ids"] for s in json.loads(r.stdout)["sequences"]]


def expect_bad(model, expect, *extra):
    args = [dmi_run, "--model", model, "-n", "2", "--prompt-ids", "1,2,3"] + list(extra)
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    if r.returncode != 2 or len(lines) != 1 or expect not in lines[0] or r.stdout:
        fail(f"{' '.join(args)}: exit {r.returncode}, stderr {r.stderr!r}, stdout {r.stdout!r}; want exit 2 and "
             f"one line containing {expect!r}")
    print(f"ok: {lines[0]}")


def script_save(module, path, config=True):
    extra = {"config.json": json.dumps({"max_position_embeddings": 64, "eos_token_id": 2})} if config else {}
    torch.jit.save(torch.jit.script(module), path, _extra_files=extra)
    return path


class FullOnly(torch.nn.Module):
    """A module with forward only (no forward_step): dmi recomputes the whole sequence each step."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids, attention_mask)


def case_parity(name, full_recompute=False):
    src = os.path.join(models, name)
    pt = os.path.join(tmp, name + ".pt")
    dts.export(src, pt)
    if full_recompute:
        config, m = dts.build(src)
        torch.jit.save(torch.jit.script(FullOnly(m)), pt, _extra_files={"config.json": json.dumps(config)})
    a, b = os.path.join(tmp, "native.h5"), os.path.join(tmp, "ts.h5")
    ra = run(src, a, "--hooks", "full")
    rb = run(pt, b, "--hooks", "full")
    if native_ids(ra) != native_ids(rb):
        fail(f"tokens differ: {native_ids(ra)} vs {native_ids(rb)}")
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        sa, sb = sorted(fa["sites"]), sorted(fb["sites"])
    if sa != sb:
        fail(f"sites differ: native only {set(sa) - set(sb)}, TorchScript only {set(sb) - set(sa)}")
    e, site = compare(a, b, sa)
    how = "full recomputation" if full_recompute else "forward_step"
    print(f"{name} ({how}): {len(sa)} sites, tokens equal, worst relative difference {e:.3g} ({site})")


def case_auto():
    import jsonschema
    schema = json.load(open(os.path.join(ROOT, "schemas", "dmi-hook-map.schema.json")))
    jsonschema.validate(json.load(open(HOOK_MAP)), schema)
    src = os.path.join(models, "llama-gqa-f32")
    pt = os.path.join(tmp, "plain.pt")
    dts.export(src, pt, hooks=False)
    a, b = os.path.join(tmp, "native.h5"), os.path.join(tmp, "auto.h5")
    run(src, a, "--hooks", "full")
    run(pt, b, "--hooks", "full", "--hook-map", HOOK_MAP)
    with h5py.File(b, "r") as fb:
        sb = sorted(fb["sites"])
    want = sorted(["hook_embed", "ln_final.hook_normalized", "unembed.hook_out"] +
                  [f"blocks.{l}.{s}" for l in range(2) for s in
                   ["hook_resid_pre", "ln1.hook_normalized", "hook_attn_out", "ln2.hook_normalized", "hook_mlp_out",
                    "hook_resid_post"]])
    if sb != want:
        fail(f"auto-instrumented sites {sb}, want {want}")
    e, site = compare(a, b, sb)
    print(f"auto: {len(sb)} sites from the hook map, tokens equal, worst relative difference {e:.3g} ({site})")
    # Selecting a site the module does not produce is an error naming what it has.
    expect_bad(pt, "is not produced by this model", "--hook-map", HOOK_MAP, "--hooks", "pattern", "-o",
               os.path.join(tmp, "x.h5"))
    if os.path.exists(os.path.join(tmp, "x.h5")):
        fail("a capture file was left behind by a rejected --hooks")
    expect_bad(pt, "is not produced by this model", "--hooks", "resid_post", "-o", os.path.join(tmp, "y.h5"))


def case_bfloat16():
    src = os.path.join(models, "qwen3-untied-f32")
    pt = os.path.join(tmp, "q.pt")
    dts.export(src, pt)
    out = os.path.join(tmp, "bf16.h5")
    r = run(pt, out, "--hooks", "resid_post", "--dtype", "bfloat16")
    ids = native_ids(r)
    if any(len(s) != N_NEW for s in ids):
        fail(f"bf16 TorchScript run generated {ids}")
    with h5py.File(out, "r") as f:
        d = f["sites"]["blocks.1.hook_resid_post"]["data"]
        size = d.id.get_type().get_size()  # h5py reads dmi's bfloat16 type as float32; the file holds 2 bytes
        if size != 2 or f.attrs["compute_dtype"] != "bfloat16":
            fail(f"bf16 capture stores {size}-byte values, compute_dtype {f.attrs['compute_dtype']}")
    print(f"bfloat16: tokens {ids}")


def case_bad(what):
    good = os.path.join(models, "llama-gqa-f32")
    if what == "signature":
        class OneArg(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x.float()
        expect_bad(script_save(OneArg(), os.path.join(tmp, "one.pt")),
                   "forward must be forward(input_ids: Tensor, attention_mask: Tensor) -> Tensor")

        class BadStep(torch.nn.Module):
            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
                return input_ids.float()[:, :, None].repeat(1, 1, 256)

            @torch.jit.export
            def forward_step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
                return self.forward(input_ids, attention_mask)
        expect_bad(script_save(BadStep(), os.path.join(tmp, "badstep.pt")),
                   "forward_step must be forward_step(input_ids: Tensor, attention_mask: Tensor, cache: List[Tensor])")
    elif what == "corrupt":
        p = os.path.join(tmp, "corrupt.pt")
        open(p, "wb").write(b"PK\x03\x04" + os.urandom(4000))
        expect_bad(p, "not a loadable TorchScript archive")
    elif what == "truncated":
        src = os.path.join(tmp, "good.pt")
        dts.export(good, src)
        raw = open(src, "rb").read()
        p = os.path.join(tmp, "truncated.pt")
        open(p, "wb").write(raw[:len(raw) // 2])
        expect_bad(p, "not a loadable TorchScript archive")
    elif what == "output-shape":
        class Flat(torch.nn.Module):
            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
                return torch.zeros(input_ids.shape[0], 256)
        expect_bad(script_save(Flat(), os.path.join(tmp, "flat.pt")), "forward returned Float logits of shape [1, 256]")
    elif what == "unknown-site":
        class Odd(torch.nn.Module):
            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
                x = torch.ops.dmi.hook(input_ids.float()[:, :, None].repeat(1, 1, 4), "blocks.0.hook_resid_pots")
                return x.repeat(1, 1, 64)
        expect_bad(script_save(Odd(), os.path.join(tmp, "odd.pt")),
                   "dmi::hook site 'blocks.0.hook_resid_pots' is not a TransformerLens site name")
    elif what == "twice":
        class Twice(torch.nn.Module):
            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
                x = input_ids.float()[:, :, None].repeat(1, 1, 256)
                x = torch.ops.dmi.hook(x, "hook_embed")
                return torch.ops.dmi.hook(x + 1, "hook_embed")
        expect_bad(script_save(Twice(), os.path.join(tmp, "twice.pt")), "is called 2 times per forward")
    elif what == "no-config":
        class Plain(torch.nn.Module):
            def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
                return input_ids.float()[:, :, None].repeat(1, 1, 256)
        d = os.path.join(tmp, "noconf")
        os.makedirs(d)
        expect_bad(script_save(Plain(), os.path.join(d, "plain.pt"), config=False), "no config.json inside the archive",
                   "--tokenizer", os.path.join(good, "tokenizer.json"))
    elif what == "hook-map":
        pt = os.path.join(tmp, "plain.pt")
        dts.export(good, pt, hooks=False)
        bad = os.path.join(tmp, "map.json")
        json.dump({"format": "dmi-hook-map", "version": 1,
                   "hooks": [{"module": "model.layerz.{i}", "site": "blocks.{i}.hook_resid_post"}]}, open(bad, "w"))
        expect_bad(pt, "module 'model.layerz.{i}' (hooks[0]) is not called by", "--hook-map", bad)
        json.dump({"format": "dmi-hook-map", "version": 1,
                   "hooks": [{"module": "model.layers.{i}", "site": "blocks.0.hook_resid_post"}]}, open(bad, "w"))
        expect_bad(pt, "'{i}' must appear once in both 'module' and 'site'", "--hook-map", bad)
        open(bad, "w").write('{"format": "dmi-hook-map", ')
        expect_bad(pt, "map.json: not valid JSON", "--hook-map", bad)
        expect_bad(good, "--hook-map applies to TorchScript models only", "--hook-map", HOOK_MAP)
    else:
        fail("unknown case " + case)


if case.startswith("parity-"):
    case_parity(case[len("parity-"):])
elif case.startswith("full-recompute-"):
    case_parity(case[len("full-recompute-"):], full_recompute=True)
elif case == "auto":
    case_auto()
elif case == "bfloat16":
    case_bfloat16()
elif case.startswith("bad-"):
    case_bad(case[len("bad-"):])
else:
    fail("unknown case " + case)
