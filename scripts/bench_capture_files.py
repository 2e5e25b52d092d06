#!/usr/bin/python3
"""Capture files: size on disk against the rows' own bytes, and write speed,
for one or more dmi-run builds, in alternating rounds (docs/benchmarks.md).

  scripts/bench_capture_files.py [--rounds N] NAME=PATH/TO/dmi-run [NAME=...]

Two workloads on the embedded default model:
  small: 2 prompts, -n 4, resid_post,pattern,logits, bfloat16 rows (issue 17's example)
  large: 8 prompts at batch 8, -n 400 --ignore-eos, --hooks full, float32 rows
Prints, per build and workload: file bytes, row bytes (the datasets' own
bytes, read with h5py), their ratio, and the median decode tokens/s and
sink CPU seconds of the rounds.
"""
import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import tempfile

import h5py

WORKLOADS = {
    "small": ["--prompt", "The cat sat on the", "--prompt", "LOVE, n.", "-n", "4",
              "--hooks", "resid_post,pattern,logits", "--capture-dtype", "bfloat16"],
    "large": [*sum((["--prompt", f"Prompt number {i} says"] for i in range(8)), []), "--batch-size", "8",
              "-n", "400", "--ignore-eos", "--hooks", "full"],
}


def row_bytes(path):
    total = 0

    def visit(_, obj):
        nonlocal total
        if isinstance(obj, h5py.Dataset):
            total += obj.size * obj.id.get_type().get_size()  # stored type: bfloat16 is 2 bytes
    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("builds", nargs="+", help="NAME=path/to/dmi-run")
    a = ap.parse_args()
    builds = [b.split("=", 1) for b in a.builds]
    tmp = tempfile.mkdtemp(prefix="dmi-files-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # its captures, when it exits
    results = {}
    for r in range(a.rounds):
        order = builds if r % 2 == 0 else builds[::-1]
        for name, exe in order:
            for w, args in WORKLOADS.items():
                out = os.path.join(tmp, f"{name}-{w}.h5")
                p = subprocess.run([exe, "-q", "--json", "--overwrite", "-o", out, *args], capture_output=True,
                                   text=True, check=True)
                j = json.loads(p.stdout)
                rec = results.setdefault((name, w), {"tok_s": [], "sink_s": []})
                rec["tok_s"].append(j["timings"]["decode_tokens_per_second"])
                rec["sink_s"].append(j["capture"]["sink_cpu_seconds"])
                rec["file"] = os.path.getsize(out)
                rec["rows"] = row_bytes(out)
    print(f"{'build':<10} {'workload':<8} {'file bytes':>12} {'row bytes':>12} {'ratio':>6} "
          f"{'decode tok/s':>13} {'sink CPU s':>10}")
    for (name, w), rec in results.items():
        print(f"{name:<10} {w:<8} {rec['file']:>12,} {rec['rows']:>12,} {rec['file'] / rec['rows']:>6.2f} "
              f"{statistics.median(rec['tok_s']):>13.1f} {statistics.median(rec['sink_s']):>10.3f}")


if __name__ == "__main__":
    main()
