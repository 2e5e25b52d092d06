#!/usr/bin/python3
"""Plots dmi-bench's JSON: capture overhead vs batch size, one line per mode
(and hooks selection), with the 95 % confidence interval of the median as
error bars (the min-max spread when there were fewer than 6 repeats).
off2, when measured, is the noise floor: "off" against itself.

  /usr/bin/python3 scripts/plot_bench.py RESULTS.json OUT.png
Uses Debian's python3-matplotlib.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    src, out = sys.argv[1], sys.argv[2]
    j = json.load(open(src))
    series = {}
    for s in j["summary"]:
        if s["mode"] == "off":
            continue
        series.setdefault((s["hooks"], s["mode"]), []).append(s)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for n, ((hooks, mode), pts) in enumerate(sorted(series.items())):
        pts.sort(key=lambda s: s["batch"])
        x = [p["batch"] * 2 ** (0.04 * (n - len(series) / 2)) for p in pts]  # side by side
        y = [100 * (p["overhead"] - 1) for p in pts]
        bounds = [p.get("overhead_ci95") or [p["overhead_min"], p["overhead_max"]] for p in pts]
        lo = [100 * (p["overhead"] - b[0]) for p, b in zip(pts, bounds)]
        hi = [100 * (b[1] - p["overhead"]) for p, b in zip(pts, bounds)]
        label = "off2 = off again (noise floor)" if mode == "off2" else f"{mode} ({hooks})"
        ax.errorbar(x, y, yerr=[lo, hi], marker="o", capsize=3, label=label, ls="--" if mode == "off2" else "-")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("overhead vs off (%)")
    ax.set_title(f"{j['architecture']} {j['dtype']}, prompt {j['prompt_len']} + {j['new_tokens']} tokens, "
                 f"median of {j['repeats']} (bars: 95% CI or min-max)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
