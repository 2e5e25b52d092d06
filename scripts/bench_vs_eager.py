#!/usr/bin/python3
"""dmi's engine against PyTorch eager with Hugging Face semantics, interleaved.

Each round runs, in an order rotated from round to round, (1) the eager
baseline scripts/hf_eager_bench.py, (2) dmi-bench's `off` mode (no capture)
with the kernels dmi picks for this CPU, and, with --before KERNELS, (3)
dmi-bench again with DMI_KERNELS=KERNELS (e.g. `aten`: ATen's at::linear,
the engine before lib/kernels), and with --before-bench PATH (4) another
dmi-bench binary, e.g. one built from an earlier commit. Every engine gets one warm-up per run.
Ratios are taken within a round and reported as the median and range over
rounds, so that a noisy neighbour hits all engines alike.

  /usr/bin/python3 scripts/bench_vs_eager.py --model build/bench-models/qwen3-0.6b-shape \\
      --dtype bfloat16 --batch-sizes 1,8 --prompt-len 32 --new-tokens 24 --rounds 3 --before aten
  /usr/bin/python3 scripts/bench_vs_eager.py --model build/bench-models/qwen3-0.6b-shape \\
      --dtype bfloat16 --batch-sizes 8 --prompt-len 256 --new-tokens 2 --rounds 3    # prefill

--emulate-no-bf16 runs both engines as on an AVX-512 CPU without AVX512-BF16:
oneDNN is capped with ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI (so eager's bf16
matmuls take the path such CPUs get) and dmi with DMI_KERNELS=avx512.
--emulate-sse2 runs them as on an x86-64 CPU without AVX (nor AVX2, FMA):
ATen on ATEN_CPU_CAPABILITY=default, OpenBLAS on its Nehalem (SSE) kernels,
oneDNN capped at SSE41, and dmi with DMI_KERNELS=sse2. dmi's row loops
(kernels/ops.cpp: norms, rotary, softmax, SwiGLU) are target_clones chosen by
the CPU itself, so they still take their AVX2 clones on an AVX2 machine.
--emulate-avx runs them as on an x86-64 CPU with AVX but without AVX2 and FMA
(Sandy Bridge, Ivy Bridge): ATen on its default kernels (it has no AVX
level), OpenBLAS on its Sandybridge (AVX) kernels, oneDNN capped at AVX, and
dmi with DMI_KERNELS=avx (the kernels dmi picks there; --emulate-kernels
KERNELS names others, e.g. sse2, what it picked before 2026-12-07). The row
loops' caveat holds for both: to run them as such a CPU does, pass
--dmi-bench a build whose ops.cpp DMI_CLONES is empty (docs/benchmarks.md,
2026-12-07 second session).

Reported per batch size: decode tokens/s of each engine and dmi/eager
(target: >= 3x at batch 8), TPOT / the weight-read floor that dmi-bench
measures (target: <= 1.3x at batch 1), prefill tokens/s and dmi/eager.
Then the machine's line: the batch's step floor that dmi-bench measures
(weights and KV cache read once, or the batch's projections and attention
at the kernels' measured peak multiply-add rate, whichever is longer), dmi's TPOT against it, and
what 3x eager's decode and 2x eager's prefill would need of it: a target
that needs less than 1x the floor is beyond this machine.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def engine_env(a, kernels=None):
    env = dict(os.environ)
    if a.emulate_no_bf16:
        env["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_VNNI"
        env["DNNL_MAX_CPU_ISA"] = "AVX512_CORE_VNNI"  # oneDNN 2.x before the rename
        env["DMI_KERNELS"] = "avx512"
    if a.emulate_sse2:
        env["ATEN_CPU_CAPABILITY"] = "default"
        env["OPENBLAS_CORETYPE"] = "Nehalem"
        env["ONEDNN_MAX_CPU_ISA"] = env["DNNL_MAX_CPU_ISA"] = "SSE41"
        env["DMI_KERNELS"] = "sse2"
    if a.emulate_avx:
        env["ATEN_CPU_CAPABILITY"] = "default"
        env["OPENBLAS_CORETYPE"] = "Sandybridge"
        env["ONEDNN_MAX_CPU_ISA"] = env["DNNL_MAX_CPU_ISA"] = "AVX"
        env["DMI_KERNELS"] = a.emulate_kernels
    if kernels:
        env["DMI_KERNELS"] = kernels
    return env


def run_eager(a, out):
    cmd = ["/usr/bin/python3", os.path.join(HERE, "hf_eager_bench.py"), a.model, "--dtype", a.dtype,
           "--batch-sizes", a.batch_sizes, "--prompt-len", str(a.prompt_len), "--new-tokens", str(a.new_tokens),
           "--repeats", "1", "--warmup", "1", "--json", out]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=engine_env(a))
    res = {}
    with open(out) as f:
        for line in f:
            r = json.loads(line)
            res[r["batch"]] = {"decode_tps": r["decode_tps"], "prefill_tps": r["prefill_tps"], "tpot_ms": r["tpot_ms"]}
    return res, {}


def run_dmi(a, out, kernels=None, binary=None):
    cmd = [binary or a.dmi_bench, "--model", a.model, "--dtype", a.dtype, "--batch-sizes", a.batch_sizes, "--prompt-len",
           str(a.prompt_len), "--new-tokens", str(a.new_tokens), "--modes", "off", "--repeats", "1", "--warmup", "1",
           "--json", out, "-q"]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=engine_env(a, kernels))
    with open(out) as f:
        j = json.load(f)
    # The machine's floor for each batch (dmi-bench's MachineFloor); a binary
    # from before it existed has only the weight-read floor.
    res = {s["batch"]: {"decode_tps": s["decode_tokens_per_second"], "prefill_tps": s["prefill_tokens_per_second"],
                        "tpot_ms": s["time_per_output_token_ms"],
                        "step_floor_ms": s.get("step_floor_ms", j["decode_floor_ms"]),
                        "prefill_ceiling_tps": s.get("prefill_ceiling_tokens_per_second")} for s in j["summary"]}
    return res, {"floor_ms": j["decode_floor_ms"], "bandwidth_gbs": j["read_bandwidth_gbs"], "kernels": j["kernels"],
                 "peak_gmacs": j.get("peak_macs_per_second", 0) / 1e9, "peak_instruction": j.get("peak_instruction", ""),
                 "cpu_flags": j["environment"]["cpu_flags"], "cpu_model": j["environment"]["cpu_model"]}


def spread(v):
    return f"{statistics.median(v):.2f}x [{min(v):.2f}-{max(v):.2f}]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--before", help="also run dmi-bench with DMI_KERNELS=BEFORE (e.g. aten)")
    ap.add_argument("--emulate-no-bf16", action="store_true",
                    help="cap oneDNN and dmi's kernels below AVX512-BF16 (see above)")
    ap.add_argument("--emulate-sse2", action="store_true",
                    help="run ATen, OpenBLAS, oneDNN and dmi's kernels as on a CPU without AVX (see above)")
    ap.add_argument("--emulate-avx", action="store_true",
                    help="run them as on a CPU with AVX but without AVX2 and FMA (see above)")
    ap.add_argument("--emulate-kernels", default="avx", metavar="KERNELS",
                    help="dmi's kernels under --emulate-avx (default: avx)")
    ap.add_argument("--dmi-bench", default=os.path.join(ROOT, "build", "bin", "dmi-bench"))
    ap.add_argument("--before-bench", metavar="PATH",
                    help="also run this dmi-bench binary (e.g. one built from an earlier commit) as 'dmi[before]'")
    ap.add_argument("--json", help="write every round's numbers here")
    a = ap.parse_args()
    if a.rounds < 1 or a.new_tokens < 2:
        sys.exit("bench_vs_eager: --rounds must be >= 1 and --new-tokens >= 2")
    if a.emulate_no_bf16 + a.emulate_sse2 + a.emulate_avx > 1:
        sys.exit("bench_vs_eager: --emulate-no-bf16, --emulate-sse2 and --emulate-avx exclude each other")
    engines = [("eager", lambda out: run_eager(a, out)), ("dmi", lambda out: run_dmi(a, out))]
    if a.before:
        engines.append((f"dmi[{a.before}]", lambda out: run_dmi(a, out, a.before)))
    if a.before_bench:
        if not os.access(a.before_bench, os.X_OK):
            sys.exit(f"bench_vs_eager: --before-bench {a.before_bench}: not an executable file")
        engines.append(("dmi[before]", lambda out: run_dmi(a, out, binary=a.before_bench)))
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            got, meta = {}, {}
            for k in range(len(engines)):
                name, fn = engines[(k + r) % len(engines)]
                got[name], m = fn(os.path.join(tmp, "out.json"))
                meta.setdefault(name, m)
                print(f"round {r + 1}/{a.rounds}: {name} " +
                      ", ".join(f"b{b}: decode {v['decode_tps']:.1f} tok/s, prefill {v['prefill_tps']:.1f} tok/s"
                                for b, v in sorted(got[name].items())), file=sys.stderr, flush=True)
            rounds.append({"results": got, "meta": meta})
    m = rounds[0]["meta"]["dmi"]
    print(f"{a.dtype}, prompt {a.prompt_len} + {a.new_tokens} new tokens, {a.rounds} rounds; kernels {m['kernels']}"
          + ("; emulating a CPU without AVX512-BF16 (oneDNN capped at avx512_core_vnni)" if a.emulate_no_bf16 else "")
          + ("; emulating a CPU without AVX (ATen default, OpenBLAS Nehalem, oneDNN SSE41, dmi sse2)"
             if a.emulate_sse2 else "")
          + (f"; emulating a CPU with AVX, without AVX2 and FMA (ATen default, OpenBLAS Sandybridge, oneDNN AVX,"
             f" dmi {a.emulate_kernels})" if a.emulate_avx else ""))
    print(f"CPU {m['cpu_model']} [{' '.join(m['cpu_flags'])}]")
    floors = [rd["meta"]["dmi"]["floor_ms"] for rd in rounds]
    print(f"weight-read floor {statistics.median(floors):.1f} ms/step (read bandwidth "
          f"{statistics.median(rd['meta']['dmi']['bandwidth_gbs'] for rd in rounds):.1f} GB/s)")
    peaks = [rd["meta"]["dmi"]["peak_gmacs"] for rd in rounds]
    if all(peaks):
        print(f"compute peak {statistics.median(peaks):.1f} G multiply-adds/s ({m['peak_instruction']}): "
              "a batch's step floor is the longer of reading the weights and its KV cache and computing its "
              "projections and attention at that peak")
    print()
    names = [n for n, _ in engines]
    for b in sorted(rounds[0]["results"]["dmi"]):
        print(f"batch {b}")
        for n in names:
            dec = [rd["results"][n][b]["decode_tps"] for rd in rounds]
            pre = [rd["results"][n][b]["prefill_tps"] for rd in rounds]
            tpot = [rd["results"][n][b]["tpot_ms"] for rd in rounds]
            line = (f"  {n:<12} decode {statistics.median(dec):8.1f} tok/s  TPOT {statistics.median(tpot):7.1f} ms"
                    f"  prefill {statistics.median(pre):8.1f} tok/s")
            if n != "eager":
                line += (f"  | vs eager: decode {spread([d / rd['results']['eager'][b]['decode_tps'] for d, rd in zip(dec, rounds)])}"
                         f"  prefill {spread([p / rd['results']['eager'][b]['prefill_tps'] for p, rd in zip(pre, rounds)])}"
                         f"  | TPOT/floor {spread([t / rd['meta']['dmi']['floor_ms'] for t, rd in zip(tpot, rounds)])}")
            print(line)
        # What the targets ask of this machine, round by round: 3x eager's
        # decode tokens/s and 2x its prefill tokens/s against the floor.
        fl = [rd["results"]["dmi"][b]["step_floor_ms"] for rd in rounds]
        need = [rd["results"]["eager"][b]["tpot_ms"] / 3 for rd in rounds]
        line = (f"  machine      step floor {statistics.median(fl):.1f} ms; dmi at {spread([rd['results']['dmi'][b]['tpot_ms'] / f for rd, f in zip(rounds, fl)])} of it;"
                f" 3x eager's decode needs a {statistics.median(need):.1f} ms step, {spread([n / f for n, f in zip(need, fl)])} of it")
        ceil = [rd["results"]["dmi"][b]["prefill_ceiling_tps"] for rd in rounds]
        if all(ceil):
            want = [2 * rd["results"]["eager"][b]["prefill_tps"] for rd in rounds]
            line += (f"; prefill ceiling {statistics.median(ceil):.1f} tok/s, dmi at "
                     f"{spread([rd['results']['dmi'][b]['prefill_tps'] / c for rd, c in zip(rounds, ceil)])} of it,"
                     f" 2x eager needs {spread([w / c for w, c in zip(want, ceil)])} of it")
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
