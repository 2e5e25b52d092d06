#!/usr/bin/python3
"""dmi-bench smoke run on a tiny model: the JSON is well-formed, every mode
ran for every configuration, and the plotter turns it into a PNG. No timing
assertions.

  bench_smoke.py DMI_BENCH TEST_MODELS
"""
import json
import os
import subprocess
import sys

from scratch import scratch_dir

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
bench, models = sys.argv[1], sys.argv[2]
tmp = scratch_dir("dmi-bench-")
out = os.path.join(tmp, "r.json")
modes = ["off", "null", "async", "sync", "materialize"]
r = subprocess.run([bench, "-q", "--model", os.path.join(models, "qwen3-untied-f32"), "--dtype", "float32",
                    "--batch-sizes", "1,2", "--prompt-len", "8", "--new-tokens", "4", "--hooks", "residual",
                    "--hooks", "blocks.{0-1}.attn.hook_pattern,logits", "--repeats", "2", "--warmup", "0",
                    "--tmp-dir", tmp, "--json", out], capture_output=True, text=True, timeout=300)
if r.returncode != 0:
    sys.exit(f"FAIL: dmi-bench exited {r.returncode}: {r.stderr}")
j = json.load(open(out))
for k in ("model", "dtype", "weight_bytes", "read_bandwidth_gbs", "decode_floor_ms", "summary", "runs",
          "peak_macs_per_second", "peak_instruction", "projection_macs_per_token", "lm_head_macs_per_row",
          "compute_floor_ms_per_token", "attention_macs_per_position", "kv_bytes_per_position", "decode_context"):
    if k not in j:
        sys.exit(f"FAIL: JSON lacks {k}")
# The machine floor: the model's projections counted from its config.json,
# the peak rate measured with the instruction of the kernels that ran.
cfg = json.load(open(os.path.join(models, "qwen3-untied-f32", "config.json")))
d, F, V, H, KV = (cfg[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
                                   "num_key_value_heads"))
D, layers = cfg["head_dim"], cfg["num_hidden_layers"]
if j["projection_macs_per_token"] != layers * (d * (H + 2 * KV) * D + H * D * d + 3 * d * F) or \
        j["lm_head_macs_per_row"] != d * V:
    sys.exit(f"FAIL: projection work {j['projection_macs_per_token']}, {j['lm_head_macs_per_row']}")
if j["attention_macs_per_position"] != layers * H * D * 2 or j["kv_bytes_per_position"] != layers * KV * D * 2 * 4:
    sys.exit(f"FAIL: attention work {j['attention_macs_per_position']}, {j['kv_bytes_per_position']}")
if j["decode_context"] != 8 + 4 / 2:  # --prompt-len 8 --new-tokens 4: the mean decode step's context
    sys.exit(f"FAIL: decode context {j['decode_context']}")
isa = j["kernels"].split()[0]
want = {"avx512_bf16": "FMA zmm", "avx512": "FMA zmm", "avx2": "FMA ymm"}.get(isa, "")  # float32 weights
if j["peak_instruction"] != want or (j["peak_macs_per_second"] > 0) != bool(want):
    sys.exit(f"FAIL: kernels {isa}: peak {j['peak_macs_per_second']} with '{j['peak_instruction']}'")
if want and abs(j["compute_floor_ms_per_token"] - 1e3 * (j["projection_macs_per_token"] + j["lm_head_macs_per_row"])
                / j["peak_macs_per_second"]) > 1e-9 * j["compute_floor_ms_per_token"]:
    sys.exit(f"FAIL: compute floor {j['compute_floor_ms_per_token']}")
for s in j["summary"]:
    kv = s["batch"] * j["decode_context"] * j["kv_bytes_per_position"]
    attention = s["batch"] * j["decode_context"] * j["attention_macs_per_position"]
    floor = max(j["decode_floor_ms"] + 1e3 * kv / (j["read_bandwidth_gbs"] * 1e9),
                s["batch"] * j["compute_floor_ms_per_token"] + (1e3 * attention / j["peak_macs_per_second"] if want else 0))
    if abs(s["step_floor_ms"] - floor) > 1e-9 * floor or \
            abs(s["tpot_over_floor"] - s["time_per_output_token_ms"] / floor) > 1e-9 * s["tpot_over_floor"]:
        sys.exit(f"FAIL: batch {s['batch']}: step floor {s['step_floor_ms']}, want {floor}")
    if not 0 < s["prefill_share_of_ceiling"] or not s["prefill_ceiling_tokens_per_second"] > 0:
        sys.exit(f"FAIL: prefill ceiling {s['prefill_ceiling_tokens_per_second']}")
want = {(b, h, m) for b in (1, 2) for h in j["hooks"] for m in modes}
got = {(s["batch"], s["hooks"], s["mode"]) for s in j["summary"]}
if got != want:
    sys.exit(f"FAIL: configurations {sorted(want - got)} missing")
if len(j["runs"]) != 2 * len(want):
    sys.exit(f"FAIL: {len(j['runs'])} runs, want {2 * len(want)}")
for s in j["summary"]:
    for k in ("prefill_tokens_per_second", "decode_tokens_per_second", "time_per_output_token_ms",
              "end_to_end_tokens_per_second", "overhead", "peak_rss_mb"):
        if not s[k] > 0:
            sys.exit(f"FAIL: {s['mode']} {k} = {s[k]}")
    captured = s["bytes_captured"] > 0
    if captured != (s["mode"] != "off"):
        sys.exit(f"FAIL: {s['mode']} captured {s['bytes_captured']} bytes")
# Every capturing mode captured the same bytes for the same configuration.
for b in (1, 2):
    for h in j["hooks"]:
        sizes = {s["bytes_captured"] for s in j["summary"] if s["batch"] == b and s["hooks"] == h and s["mode"] != "off"}
        if len(sizes) != 1:
            sys.exit(f"FAIL: modes captured different amounts: {sizes}")
if "overhead" not in r.stdout or "materialize" not in r.stdout:
    sys.exit("FAIL: no table on stdout")
# Modes start at a different one each repeat (a rotation).
firsts = {}
for run in j["runs"]:
    firsts.setdefault((run["batch"], run["hooks"], run["repeat"]), run["mode"])
if len({m for (b, h, rep), m in firsts.items() if b == 1 and h == "residual"}) != 2:
    sys.exit(f"FAIL: repeats did not rotate the mode order: {firsts}")
# off2 (the noise floor) and the confidence interval of the median from 6 repeats on.
out2 = os.path.join(tmp, "r2.json")
r = subprocess.run([bench, "-q", "--model", os.path.join(models, "qwen3-untied-f32"), "--dtype", "float32",
                    "--batch-sizes", "1", "--prompt-len", "4", "--new-tokens", "2", "--modes", "off,off2,null",
                    "--repeats", "6", "--warmup", "0", "--tmp-dir", tmp, "--json", out2],
                   capture_output=True, text=True, timeout=300)
if r.returncode != 0:
    sys.exit(f"FAIL: dmi-bench --modes off,off2,null exited {r.returncode}: {r.stderr}")
for s in json.load(open(out2))["summary"]:
    ci = s["overhead_ci95"]
    if not (isinstance(ci, list) and ci[0] <= s["overhead"] <= ci[1]):
        sys.exit(f"FAIL: {s['mode']}: overhead {s['overhead']} outside its CI {ci}")
    if s["mode"] == "off2" and s["bytes_captured"] != 0:
        sys.exit("FAIL: off2 captured data")
png = os.path.join(tmp, "r.png")
p = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "scripts", "plot_bench.py"), out, png],
                   capture_output=True, text=True)
if p.returncode != 0 or open(png, "rb").read(8) != b"\x89PNG\r\n\x1a\n":
    sys.exit(f"FAIL: plot: {p.stderr}")
# steer mode: runs, captures nothing.
r = subprocess.run([bench, "-q", "--model", os.path.join(models, "qwen3-untied-f32"), "--dtype", "float32",
                    "--batch-sizes", "2", "--prompt-len", "4", "--new-tokens", "2", "--modes", "off,steer",
                    "--repeats", "2", "--tmp-dir", tmp, "--json", os.path.join(tmp, "steer.json")],
                   capture_output=True, text=True, timeout=300)
if r.returncode != 0:
    sys.exit(f"FAIL: dmi-bench --modes off,steer exited {r.returncode}: {r.stderr}")
js = json.load(open(os.path.join(tmp, "steer.json")))
steer = [s for s in js["summary"] if s["mode"] == "steer"]
if len(steer) != 1 or steer[0]["bytes_captured"] != 0:
    sys.exit(f"FAIL: steer mode summary {steer}")
print("ok")
