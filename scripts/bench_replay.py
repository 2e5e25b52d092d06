#!/usr/bin/python3
"""What replay costs and saves, measured with dmi-run itself.

  /usr/bin/python3 scripts/bench_replay.py [--model DIR] [--dtype bfloat16] [--prompts 8] [--new 64]
                                           [--batch 8] [--rounds 3] [--hooks residual] [--deep full]

Per round, alternating so that machine noise hits every mode alike:
  original   dmi-run --hooks HOOKS (generation + capture)
  exact      dmi-run --replay --verify (generation again, bit-for-bit check)
  forced     dmi-run --replay --replay-mode forced --hooks HOOKS (teacher forcing, same selection)
  deep       dmi-run --replay --replay-mode forced --hooks DEEP (teacher forcing, more sites)
and the model fingerprint's cost at load (seconds per GB of weight files).
Prints a table of medians and the forced / original speed ratio.
"""
import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
RUN = os.path.join(ROOT, "build", "bin", "dmi-run")
PROMPTS = ["LOVE, n.", "WAR, n.", "LAWYER, n.", "ABSURDITY, n.", "PEACE, n.", "BORE, n.", "CYNIC, n.", "DIPLOMACY, n."]


def run(args):
    r = subprocess.run([RUN, "-q", "--json"] + args, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"dmi-run {' '.join(args)}: exit {r.returncode}: {r.stderr}")
    return json.loads(r.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "data", "default-model"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hooks", default="residual")
    ap.add_argument("--deep", default="full")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="dmi-bench-replay-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # its captures, when it exits
    src = os.path.join(tmp, "src.h5")
    prompts = sum([["--prompt", (PROMPTS * 100)[i]] for i in range(a.prompts)], [])
    base = ["--model", a.model, "--dtype", a.dtype, "-n", str(a.new), "-b", str(a.batch), "--ignore-eos"]
    rates = {k: [] for k in ["original", "exact", "forced", "deep"]}
    fp = []
    for _ in range(a.rounds):
        j = run(base + prompts + ["--hooks", a.hooks, "-o", src])
        t = j["timings"]
        tokens = t["prefill_tokens"] + t["decode_tokens"]
        rates["original"].append(tokens / (t["prefill_seconds"] + t["decode_seconds"]))
        fp.append(j["fingerprint"]["seconds"] / (j["fingerprint"]["bytes"] / 1e9))
        j = run(["--replay", src, "--verify"])
        if not j["replay"]["verify"]["equal"] or not j["replay"]["verify"]["bitwise"]:
            sys.exit("exact replay did not verify bit for bit")
        t = j["timings"]
        rates["exact"].append((t["prefill_tokens"] + t["decode_tokens"]) / (t["prefill_seconds"] + t["decode_seconds"]))
        for mode, hooks in [("forced", a.hooks), ("deep", a.deep)]:
            out = os.path.join(tmp, mode + ".h5")
            j = run(["--replay", src, "--replay-mode", "forced", "--hooks", hooks, "-o", out])
            t = j["timings"]
            rates[mode].append(t["prefill_tokens"] / t["prefill_seconds"])
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    flags = [f for f in ["avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"] if f" {f} " in cpu + " "]
    print(f"model {a.model}, {a.dtype}, {a.prompts} prompts x {a.new} new tokens, batch {a.batch}, "
          f"{a.rounds} rounds; CPU {model_name} [{' '.join(flags)}], {os.cpu_count()} cores")
    print(f"{'mode':<10} {'tokens/s (median)':>18}  runs")
    for k, v in rates.items():
        print(f"{k:<10} {statistics.median(v):>18.0f}  {' '.join(f'{x:.0f}' for x in v)}")
    print(f"forced / original: {statistics.median(rates['forced']) / statistics.median(rates['original']):.1f}x "
          f"(--hooks {a.hooks}); deep forced (--hooks {a.deep}) / original: "
          f"{statistics.median(rates['deep']) / statistics.median(rates['original']):.1f}x")
    print(f"fingerprint at load: {statistics.median(fp):.3f} s per GB of weight files (page cache warm)")


if __name__ == "__main__":
    main()
