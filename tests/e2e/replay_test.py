#!/usr/bin/python3
"""dmi-run --replay, checked against the source capture (read with h5py) and
against scripts/dmi_reference.py; never against the replay's own report alone.

  replay_test.py DMI_RUN TEST_MODELS CASE [MODEL]
"""
import json
import os
import shutil
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
model_name = sys.argv[4] if len(sys.argv) > 4 else "qwen3-untied-f32"
MODEL = os.path.join(models, model_name)
# Mixed lengths, batch 3: a full batch with padding and a partial one.
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11, 64, 128, 1, 33], [9, 8, 7], [200], [60, 61, 62, 63, 64, 65, 66]]
N_NEW = 6
tmp = scratch_dir("dmi-replay-")


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def dmi(*args, expect_rc=0, timeout=600, env=None):
    r = subprocess.run([dmi_run, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if expect_rc is not None and r.returncode != expect_rc:
        fail(f"dmi-run {' '.join(args)}: exit {r.returncode}, want {expect_rc}\nstdout: {r.stdout[-2000:]}\n"
             f"stderr: {r.stderr[-2000:]}")
    return r


def capture(out, *extra, model=MODEL, prompts=PROMPTS, batch=3, env=None):
    args = ["-q", "--model", model, "-n", str(N_NEW), "--batch-size", str(batch), "-o", out]
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    dmi(*args, *extra, env=env)


def as_str(x):
    return x.decode() if isinstance(x, bytes) else str(x)


def identical(a_path, b_path, seqs=None):
    """Every site both files have: the same (seq, pos) rows with bit-identical
    stored bytes; tokens identical. Returns the number of rows compared."""
    fa, fb = h5py.File(a_path, "r"), h5py.File(b_path, "r")
    ta, oa = fa["sequences/tokens"][:], fa["sequences/offsets"][:]
    tb, ob = fb["sequences/tokens"][:], fb["sequences/offsets"][:]
    n = len(oa) - 1
    for s in (range(n) if seqs is None else seqs):
        if not np.array_equal(ta[oa[s]:oa[s + 1]], tb[ob[s]:ob[s + 1]]):
            fail(f"sequence {s}: tokens differ: {ta[oa[s]:oa[s + 1]]} vs {tb[ob[s]:ob[s + 1]]}")
    common = sorted(set(fa["sites"]) & set(fb["sites"]))
    if not common:
        fail("no site in common")
    rows = 0
    for name in common:
        ga, gb = fa["sites"][name], fb["sites"][name]
        ka = {(int(s), int(p)): i for i, (s, p) in enumerate(zip(ga["seq"][:], ga["pos"][:]))
              if seqs is None or s in seqs}
        kb = {(int(s), int(p)): i for i, (s, p) in enumerate(zip(gb["seq"][:], gb["pos"][:]))
              if seqs is None or s in seqs}
        if set(ka) != set(kb):
            fail(f"{name}: row keys differ ({len(ka)} vs {len(kb)})")
        da, db = ga["data"][:], gb["data"][:]
        if da.dtype != db.dtype:
            fail(f"{name}: stored dtypes differ")
        va = da.view(np.uint8).reshape(da.shape[0], -1)
        vb = db.view(np.uint8).reshape(db.shape[0], -1)
        for k, i in ka.items():
            if not np.array_equal(va[i], vb[kb[k]]):
                fail(f"{name}: row {k} differs in its bytes")
        rows += len(ka)
    return rows


def replay(*args, expect_rc=0):
    return dmi("--replay", *args, expect_rc=expect_rc)


if case.startswith("exact"):
    # Capture, then replay exactly and verify: bit-identical sites and tokens,
    # greedy in float32 and sampled in bfloat16, mixed-length batches.
    for dtype, sampling in [("float32", []), ("bfloat16", ["--temperature", "0.9", "--top-p", "0.9", "--seed", "7"])]:
        src, out = os.path.join(tmp, f"src-{dtype}.h5"), os.path.join(tmp, f"replay-{dtype}.h5")
        capture(src, "--hooks", "full", "--dtype", dtype, *sampling)
        r = replay(src, "--verify", "-o", out, "--json")
        j = json.loads(r.stdout)["replay"]
        if not (j["verify"]["equal"] and j["verify"]["bitwise"] and j["fingerprint_matched"]):
            fail(f"{dtype}: replay report {j['verify']['equal']=} {j['verify']['bitwise']=}")
        rows = identical(src, out)
        fr = h5py.File(out, "r")
        ro = json.loads(fr.attrs["replay_of"])
        if ro["mode"] != "exact" or not ro["record_hash"].startswith("xxh3-128:") or ro["sequences"] != [0, 1, 2, 3]:
            fail(f"replay_of {ro}")
        fs = h5py.File(src, "r")
        for a in ["batch", "row", "left_pad"]:
            if not np.array_equal(fs["sequences"][a][:], fr["sequences"][a][:]):
                fail(f"/sequences/{a} differs")
        if fs["sequences/batch"][:].tolist() != [0, 0, 0, 1] or fs["sequences/left_pad"][:].tolist() != [0, 9, 11, 0]:
            fail(f"batch composition {fs['sequences/batch'][:]} {fs['sequences/left_pad'][:]}")
        print(f"{model_name} {dtype}{' sampled' if sampling else ''}: {len(fs['sites'])} sites, {rows} rows "
              f"bit-identical; tokens equal")
elif case == "subset":
    # --seq 2 in exact mode replays the batch holding sequence 2 (0, 1, 2);
    # sequence 3 is skipped.
    src, out = os.path.join(tmp, "src.h5"), os.path.join(tmp, "sub.h5")
    capture(src, "--hooks", "resid_post,pattern,logits", "--temperature", "1.0", "--seed", "3")
    replay(src, "--seq", "2", "--verify", "-o", out)
    f = h5py.File(out, "r")
    reasons = [as_str(x) for x in f["sequences/finish_reason"][:]]
    if reasons[3] != "skipped" or "skipped" in reasons[:3]:
        fail(f"finish reasons {reasons}")
    if set(f["sites/blocks.0.hook_resid_post/seq"][:].tolist()) != {0, 1, 2}:
        fail("rows of sequences outside the replayed batch")
    identical(src, out, seqs={0, 1, 2})
    # dmi-diff leaves the skipped sequence out instead of calling it different.
    d = subprocess.run([os.path.join(os.path.dirname(dmi_run), "dmi-diff"), out, src, "--json"], capture_output=True,
                       text=True)
    if d.returncode != 0 or json.loads(d.stdout)["skipped_sequences"] != [3]:
        fail(f"dmi-diff of a subset replay: exit {d.returncode}: {d.stdout[-500:]} {d.stderr}")
    # Forced mode takes any subset; keys stay the source's.
    outf = os.path.join(tmp, "subf.h5")
    replay(src, "--replay-mode", "forced", "--seq", "1,3:4", "-o", outf, "--verify")
    ff = h5py.File(outf, "r")
    if set(ff["sites/blocks.0.hook_resid_post/seq"][:].tolist()) != {1, 3}:
        fail("forced --seq 1,3:4 rows")
    print("subset replays ok")
elif case == "forced":
    # A cheap residual capture, deepened by a forced replay selecting every
    # site: residual sites equal the source's, every other site equals the
    # reference's intermediates for the same tokens (fp32, 1e-5 relative).
    src, out = os.path.join(tmp, "res.h5"), os.path.join(tmp, "deep.h5")
    capture(src, "--hooks", "residual", "--dtype", "float32")
    r = replay(src, "--replay-mode", "forced", "--hooks", "full", "-o", out, "--verify", "--json")
    j = json.loads(r.stdout)["replay"]
    if not j["verify"]["equal"] or j["verify"]["bitwise"]:
        fail(f"forced --verify: {j['verify']}")
    fs, fo = h5py.File(src, "r"), h5py.File(out, "r")
    worst_src = 0.0
    for name in fs["sites"]:
        a, b = rows_by_key(fs, name), rows_by_key(fo, name)
        if set(a) != set(b):
            fail(f"{name}: keys differ between the source and the forced replay")
        worst_src = max(worst_src, max(rel_err(b[k], a[k]) for k in a))
    if not worst_src <= 1e-5:
        fail(f"residual sites differ from the source by {worst_src:.2e} relative")
    width = int(fo.attrs["attention_width"])
    tokens, offsets = fo["sequences/tokens"][:], fo["sequences/offsets"][:]
    cfg_d, w = ref.load_model_dir(MODEL)
    cfg = ref.Config(cfg_d)
    worst = {}
    for s in range(len(PROMPTS)):
        toks = tokens[offsets[s]:offsets[s + 1]].tolist()
        n_fed = len(toks) - 1
        rec = {}
        ref.forward(cfg, w, toks[:n_fed], torch.float32, record=lambda n, t: rec.__setitem__(n, t.detach().numpy()))
        for name in fo["sites"]:
            rows = rows_by_key(fo, name)
            for p in range(n_fed):
                e = reference_row(name, rec[name], p, width)
                if (s, p) not in rows:
                    fail(f"{name}: no row ({s}, {p})")
                worst[name] = max(worst.get(name, 0.0), rel_err(rows[(s, p)], e))
    bad = {k: v for k, v in worst.items() if not v <= 1e-5}
    if bad:
        fail(f"forced sites beyond 1e-5 of the reference: {bad}")
    st = json.loads(fs.attrs["timings"])
    ft = json.loads(fo.attrs["timings"])
    orig_tps = (st["prefill_tokens"] + st["decode_tokens"]) / (st["prefill_seconds"] + st["decode_seconds"])
    forced_tps = ft["prefill_tokens"] / ft["prefill_seconds"]
    print(f"forced replay: {len(fo['sites'])} sites; residual vs source {worst_src:.2e}, worst vs reference "
          f"{max(worst.values()):.2e}; {forced_tps:.0f} tok/s forced vs {orig_tps:.0f} tok/s original (with full "
          f"capture vs residual)")
    # Token policies carry over: a --tokens generated --every 2 capture replays
    # to the same keys.
    src2, out2 = os.path.join(tmp, "gen.h5"), os.path.join(tmp, "gen-forced.h5")
    capture(src2, "--hooks", "resid_post", "--tokens", "generated", "--every", "2")
    replay(src2, "--replay-mode", "forced", "-o", out2, "--verify")
    for policy in ["prompt", "last-prompt"]:
        src3, out3 = os.path.join(tmp, f"{policy}.h5"), os.path.join(tmp, f"{policy}-f.h5")
        capture(src3, "--hooks", "resid_post", "--tokens", policy)
        replay(src3, "--replay-mode", "forced", "-o", out3, "--verify")
        a, b = rows_by_key(h5py.File(src3, "r"), "blocks.0.hook_resid_post"), rows_by_key(
            h5py.File(out3, "r"), "blocks.0.hook_resid_post")
        if set(a) != set(b):
            fail(f"--tokens {policy}: forced keys differ")
    print("forced keys follow the token policy (generated/every, prompt, last-prompt)")
elif case == "changed-model":
    # One byte of one tensor's data edited after the capture: refused, naming
    # the file; --allow-mismatch --verify reports the divergence (exit 1).
    mdir = os.path.join(tmp, "model")
    shutil.copytree(MODEL, mdir)
    src = os.path.join(tmp, "src.h5")
    capture(src, "--hooks", "full", model=mdir)
    path = os.path.join(mdir, "model.safetensors")
    with open(path, "rb") as fh:
        hlen = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(hlen))
    begin = header["model.norm.weight"]["data_offsets"][0]
    with open(path, "r+b") as fh:  # the exponent byte of model.norm.weight[0] (F32, little-endian)
        fh.seek(8 + hlen + begin + 3)
        b = fh.read(1)
        fh.seek(8 + hlen + begin + 3)
        fh.write(bytes([b[0] ^ 0x01]))
    out = os.path.join(tmp, "never.h5")
    r = replay(src, "-o", out, expect_rc=2)
    if "model.safetensors" not in r.stderr or len(r.stderr.strip().splitlines()) != 1 or os.path.exists(out):
        fail(f"changed weights: stderr {r.stderr!r}, output left: {os.path.exists(out)}")
    r = replay(src, "--allow-mismatch", "--verify", "-o", os.path.join(tmp, "mismatch.h5"), expect_rc=1)
    if "DIFF" not in r.stdout or "ln_final.hook_normalized" not in r.stdout:
        fail(f"--allow-mismatch --verify output: {r.stdout}")
    print("changed weights: exit 1 with --allow-mismatch --verify;",
          [ln for ln in r.stdout.splitlines() if "ln_final" in ln][0])
    # A changed tokenizer is refused the same way.
    with open(os.path.join(mdir, "tokenizer.json"), "a") as fh:
        fh.write("\n")
    shutil.copy(os.path.join(MODEL, "model.safetensors"), path)
    r = replay(src, "-o", out, expect_rc=2)
    if "tokenizer.json" not in r.stderr or os.path.exists(out):
        fail(f"changed tokenizer: {r.stderr!r}")
    # Moved model: --model finds it, fingerprint matches again.
    shutil.copy(os.path.join(MODEL, "tokenizer.json"), os.path.join(mdir, "tokenizer.json"))
    moved = os.path.join(tmp, "moved")
    os.rename(mdir, moved)
    r = replay(src, "-o", out, expect_rc=2)
    if "pass --model" not in r.stderr:
        fail(f"missing model: {r.stderr!r}")
    replay(src, "--model", moved, "--verify", "-o", os.path.join(tmp, "moved.h5"))
    print("changed tokenizer refused; moved model replays with --model")
elif case == "interrupted":
    # A capture stopped by SIGINT replays the part it contains, bit for bit.
    src = os.path.join(tmp, "int.h5")
    dm = os.path.join(ROOT, "data", "default-model")
    args = [dmi_run, "-q", "--model", dm, "-n", "300", "--ignore-eos", "--batch-size", "3", "--hooks",
            "resid_post,logits", "--logits", "topk:5", "-o", src] + sum(
                [["--prompt", p] for p in ["LOVE, n.", "WAR, n.", "A", "THE"] * 8], [])
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        if os.path.exists(src) or p.poll() is not None:
            break
        time.sleep(0.05)
    time.sleep(0.4)
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=120)
    if p.returncode != 130:
        fail(f"source run exit {p.returncode}, want 130")
    fs = h5py.File(src, "r")
    reasons = [as_str(x) for x in fs["sequences/finish_reason"][:]]
    batch = fs["sequences/batch"][:].tolist()
    if fs.attrs["status"] != "interrupted" or "interrupted" not in reasons:
        fail(f"source status {fs.attrs['status']}, reasons {reasons}")
    out = os.path.join(tmp, "int-replay.h5")
    r = replay(src, "--verify", "-o", out)
    if "interrupted" not in r.stderr:
        fail(f"no warning about the interrupted source: {r.stderr!r}")
    ran = [i for i, b in enumerate(batch) if b >= 0]
    identical(src, out, seqs=set(ran))
    fo = h5py.File(out, "r")
    if fo.attrs["status"] != "complete":
        fail(f"replay status {fo.attrs['status']}")
    print(f"interrupted source ({len(ran)} of {len(batch)} sequences ran, reasons "
          f"{ {x: reasons.count(x) for x in set(reasons)} }): replay bit-identical")
elif case == "failed":
    # A run that fails mid-generation (a patch source without the rows a
    # generated position needs) leaves a readable file with status failed and
    # the tokens made so far; its replay stops where it stopped.
    bsrc = os.path.join(tmp, "short.h5")
    capture(bsrc, "--hooks", "resid_pre", prompts=[[60, 61, 62]], batch=1)
    src = os.path.join(tmp, "failed.h5")
    args = ["-q", "--model", MODEL, "-n", str(N_NEW), "--batch-size", "2", "-o", src, "--hooks", "resid_post",
            "--patch", f"{bsrc},site=blocks.0.hook_resid_pre,src-seq=0", "--prompt-ids", "5,17,42,99,3",
            "--prompt-ids", "9,8"]
    r = dmi(*args, expect_rc=2)
    # short.h5's sequence has rows for positions 0..7; the 5-token prompt needs 8 at its 4th token.
    if "no row of blocks.0.hook_resid_pre for sequence 0 position 8" not in r.stderr:
        fail(f"expected the patch to fail at position 8: {r.stderr!r}")
    fs = h5py.File(src, "r")
    reasons = [as_str(x) for x in fs["sequences/finish_reason"][:]]
    if fs.attrs["status"] != "failed" or "failed" not in reasons:
        fail(f"failed run: status {fs.attrs['status']}, reasons {reasons}")
    out = os.path.join(tmp, "failed-replay.h5")
    r = replay(src, "--verify", "-o", out)
    if "failed" not in r.stderr:
        fail(f"no warning about the failed source: {r.stderr!r}")
    identical(src, out)
    print(f"failed source (reasons {reasons}, {len(fs['sites/blocks.0.hook_resid_post/seq'])} rows): replay verified")
elif case == "version1":
    # A version-1 file (no fingerprint, no batch composition) still replays:
    # a warning, batches rebuilt from batch_size, verified within tolerance.
    src = os.path.join(tmp, "v1.h5")
    capture(src, "--hooks", "resid_post", "--ignore-eos")
    with h5py.File(src, "r+") as f:
        f.attrs["format_version"] = 1
        for a in ["model_fingerprint", "environment", "threads", "ignore_eos", "add_special_tokens", "eos_token_ids",
                  "hook_map", "transport", "timings"]:
            if a in f.attrs:
                del f.attrs[a]
        for d in ["batch", "row", "left_pad"]:
            del f["sequences"][d]
    out = os.path.join(tmp, "v1-replay.h5")
    r = replay(src, "--verify", "-o", out)
    if "without a model fingerprint" not in r.stderr:
        fail(f"no version-1 warning: {r.stderr!r}")
    identical(src, out)
    print("version-1 capture replays")
elif case == "kernels":
    # A capture made on other linear kernels (DMI_KERNELS=scalar, never the
    # default on x86-64: sse2 at least): the replay warns, naming the
    # recorded kernels and how to select them; with DMI_KERNELS as recorded
    # there is no such warning and the replay is bit-identical. The same for
    # the sse2 kernels (a multiply, then an add: their own bits), which any
    # x86-64 CPU runs, and the avx kernels have their bits.
    default = {k: v for k, v in os.environ.items() if k != "DMI_KERNELS"}
    cpu_flags = set(next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "").split())
    hints = []
    for kernels, dtype in (("scalar", "bfloat16"), ("sse2", "float32")):
        chosen = dict(os.environ, DMI_KERNELS=kernels)
        src = os.path.join(tmp, f"src-{kernels}.h5")
        capture(src, "--hooks", "residual", "--dtype", dtype, env=chosen)
        r = dmi("--replay", src, "-o", os.path.join(tmp, f"default-{kernels}.h5"), "--json", env=default)
        warnings = json.loads(r.stdout)["replay"]["warnings"]
        hint = [w for w in warnings if w.startswith(f'environment differs (dmi_kernels: recorded "{kernels}"')]
        # Without AVX, sse2 is the default: nothing to warn about.
        if kernels == "sse2" and "avx" not in cpu_flags:
            if hint:
                fail(f"sse2 is the default here, yet the replay warned: {hint}")
            hint = ["sse2: the default here, no warning"]
        elif len(hint) != 1 or f"DMI_KERNELS={kernels} selects the recorded ones" not in hint[0]:
            fail(f"default kernels against {kernels}: warnings {warnings}")
        r = dmi("--replay", src, "--verify", "-o", os.path.join(tmp, f"{kernels}.h5"), "--json", env=chosen)
        j = json.loads(r.stdout)["replay"]
        if any("dmi_kernels" in w for w in j["warnings"]) or not (j["verify"]["equal"] and j["verify"]["bitwise"]):
            fail(f"DMI_KERNELS={kernels}: warnings {j['warnings']}, verify {j['verify']['equal']} {j['verify']['bitwise']}")
        hints.append(hint[0])
    # The avx kernels do sse2's operations in the same order, twice as wide:
    # a capture made on them replays bit for bit on sse2.
    if "avx" in cpu_flags:
        src = os.path.join(tmp, "src-avx.h5")
        capture(src, "--hooks", "residual", "--dtype", "float32", env=dict(os.environ, DMI_KERNELS="avx"))
        r = dmi("--replay", src, "--verify", "-o", os.path.join(tmp, "avx-on-sse2.h5"), "--json",
                env=dict(os.environ, DMI_KERNELS="sse2"))
        j = json.loads(r.stdout)["replay"]
        if not (j["verify"]["equal"] and j["verify"]["bitwise"]):
            fail(f"an avx capture replayed on sse2: verify {j['verify']['equal']} {j['verify']['bitwise']}")
        hints.append("avx capture replayed on sse2 bit for bit")
    # bf16 attention on vdpbf16ps (AVX512-BF16 kernels) has bits of its own:
    # a capture made with the portable attention (DMI_ATTENTION=portable, as
    # every capture before dmi recorded dmi_attention) warns where the
    # default differs, naming the variable, and replays bit for bit with it.
    # The Qwen3 test model: head_dim 32, where vdpbf16ps attention runs.
    qwen3 = os.path.join(models, "qwen3-qknorm-bf16-misaligned")
    src = os.path.join(tmp, "src-portable-attention.h5")
    portable = dict(default, DMI_ATTENTION="portable")
    capture(src, "--hooks", "residual", "--dtype", "bfloat16", model=qwen3, env=portable)
    with h5py.File(src, "r") as f:
        if json.loads(f.attrs["environment"])["dmi_attention"] != "portable":
            fail("DMI_ATTENTION=portable: the capture records another attention")
    now = os.path.join(tmp, "default-attention.h5")
    capture(now, "--hooks", "resid_post", "--dtype", "bfloat16", model=qwen3, env=default)
    with h5py.File(now, "r") as f:
        here = json.loads(f.attrs["environment"])["dmi_attention"]
    r = dmi("--replay", src, "-o", os.path.join(tmp, "portable-on-default.h5"), "--json", env=default)
    hint = [w for w in json.loads(r.stdout)["replay"]["warnings"] if "dmi_attention" in w]
    if here == "vdpbf16ps" and (len(hint) != 1 or "DMI_ATTENTION=portable selects the recorded one" not in hint[0]):
        fail(f"portable attention replayed on vdpbf16ps: warnings {hint}")
    if here == "portable" and hint:
        fail(f"portable attention is the default here, yet the replay warned: {hint}")
    r = dmi("--replay", src, "--verify", "-o", os.path.join(tmp, "portable-again.h5"), "--json", env=portable)
    j = json.loads(r.stdout)["replay"]
    if any("dmi_attention" in w for w in j["warnings"]) or not (j["verify"]["equal"] and j["verify"]["bitwise"]):
        fail(f"DMI_ATTENTION=portable: warnings {j['warnings']}, verify {j['verify']['equal']} {j['verify']['bitwise']}")
    hints.append(f"portable attention ({here} here): " + (hint[0] if hint else "no warning"))
    # dmi_attention decides bf16 attention with vdpbf16ps-shaped heads only:
    # the same model in float32, or a bf16 model with head_dim 16, computes
    # the same attention either way, and its replay across the switch warns
    # about nothing (it had, before the model's shape was considered).
    for label, model, dtype in (("float32 Qwen3", qwen3, "float32"), ("head_dim 16, bf16", MODEL, "bfloat16")):
        other = os.path.join(tmp, f"src-portable-{dtype}.h5")
        capture(other, "--hooks", "resid_post", "--dtype", dtype, model=model, env=portable)
        r = dmi("--replay", other, "--verify", "-o", os.path.join(tmp, f"portable-{dtype}-on-default.h5"), "--json",
                env=default)
        j = json.loads(r.stdout)["replay"]
        if any("dmi_attention" in w for w in j["warnings"]) or not (j["verify"]["equal"] and j["verify"]["bitwise"]):
            fail(f"{label} across DMI_ATTENTION: warnings {j['warnings']}, "
                 f"verify {j['verify']['equal']} {j['verify']['bitwise']}")
    hints.append("float32 and head_dim 16 across the attention switch: no warning, bit for bit")
    r = dmi("--replay", src, "-o", os.path.join(tmp, "bad-attention.h5"), env=dict(default, DMI_ATTENTION="fast"),
            expect_rc=2)
    if "DMI_ATTENTION=fast" not in r.stderr:
        fail(f"DMI_ATTENTION=fast: exit {r.returncode}, {r.stderr!r}")
    print("other kernels: warned with", " | ".join(hints))
elif case == "bad-input":
    src = os.path.join(tmp, "src.h5")
    capture(src, "--hooks", "resid_post")
    notdmi = os.path.join(tmp, "plain.h5")
    with h5py.File(notdmi, "w") as f:
        f["x"] = np.zeros(3)
    text = os.path.join(tmp, "text.h5")
    with open(text, "w") as fh:
        fh.write("not hdf5\n")
    v99 = os.path.join(tmp, "v99.h5")
    shutil.copy(src, v99)
    with h5py.File(v99, "r+") as f:
        f.attrs["format_version"] = 99
    nomodel = os.path.join(tmp, "nomodel.h5")
    shutil.copy(src, nomodel)
    with h5py.File(nomodel, "r+") as f:
        f.attrs["model_path"] = os.path.join(tmp, "no-such-model")
    out = os.path.join(tmp, "out.h5")
    cases = {
        "not a dmi capture": [notdmi, "-o", out],
        "not an HDF5 file": [text, "-o", out],
        "version 99": [v99, "-o", out],
        "does not exist": [nomodel, "-o", out],
        "sequence 4 does not exist": [src, "--seq", "4", "-o", out],
        "not a sequence number": [src, "--seq", "x", "-o", out],
        "cannot be combined with --replay": [src, "--temperature", "0.5", "-o", out],
        "needs --output": [src],
        "is the capture being replayed": [src, "-o", src],
        "--replay-mode forced only": [src, "--batch-size", "2", "-o", out],
        "no such file": [os.path.join(tmp, "missing.h5"), "-o", out],
    }
    for want, args in cases.items():
        r = replay(*args, expect_rc=2)
        lines = r.stderr.strip().splitlines()
        if len(lines) != 1 or want not in lines[0]:
            fail(f"{want!r}: stderr {r.stderr!r}")
        if os.path.exists(out):
            fail(f"{want!r}: output file left behind")
    r = dmi("--verify", expect_rc=2)
    if "need --replay" not in r.stderr:
        fail(f"--verify without --replay: {r.stderr!r}")
    if h5py.File(src, "r").attrs["status"] != "complete":
        fail("the source was modified")
    print(f"{len(cases) + 1} bad inputs: one line, exit 2, no output file")
else:
    fail(f"unknown case {case}")
print("ok")
