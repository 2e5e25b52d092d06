#!/usr/bin/python3
"""The storage plan of docs/scale-out.md: bytes per token of each --hooks
preset for a few model shapes, from dmi-run --plan (config.json only: no
weights are made or loaded).

  /usr/bin/python3 scripts/storage_plan.py [DMI_RUN] [--prompt-len 128] [--new 128] [--capture-dtype bfloat16]

Prints a Markdown table. Attention rows (attention, full) are as wide as the
longest sequence, so their bytes per token grow with prompt + generated length.
"""
import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_test_models as mtm  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
COMMON = {"model_type": "qwen3", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "hidden_act": "silu", "eos_token_id": 2, "bos_token_id": 1, "torch_dtype": "bfloat16"}
SHAPES = {
    "Qwen3-0.6B": dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=True),
    "Qwen3-8B": dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, tie_word_embeddings=False),
    "Llama-3.1-8B": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
                         hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rope_theta=500000.0,
                         max_position_embeddings=131072),
}
SELECTIONS = [["resid_post"], ["residual"], ["hf-hidden-states"], ["attention"], ["mlp"], ["kv"], ["full"],
              ["logits"], ["logits", "--logits", "topk:20"]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dmi_run", nargs="?", default=os.path.join(ROOT, "build", "bin", "dmi-run"))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--capture-dtype", default="bfloat16")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="dmi-plan-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # its captures, when it exits
    rows = {}
    for shape, cfg in SHAPES.items():
        d = os.path.join(tmp, shape)
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**COMMON, **cfg}, f)
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(mtm.byte_tokenizer(), f, ensure_ascii=False)
        ids = ",".join(str(3 + i % 200) for i in range(a.prompt_len))
        for sel in SELECTIONS:
            r = subprocess.run([a.dmi_run, "--model", d, "--prompt-ids", ids, "-n", str(a.new), "--ignore-eos",
                                "--capture-dtype", a.capture_dtype, "--plan", "--json", "--hooks", *sel],
                               capture_output=True, text=True, check=True)
            p = json.loads(r.stdout)
            rows.setdefault(" ".join(sel), {})[shape] = (p["data_bytes"] / p["max_tokens"], len(p["sites"]))
    print(f"Bytes per token ({a.capture_dtype}, prompt {a.prompt_len} + {a.new} generated tokens; attention rows "
          f"{a.prompt_len + a.new} wide):\n")
    print("| --hooks | " + " | ".join(SHAPES) + " |")
    print("| --- |" + " ---: |" * len(SHAPES))
    for sel, per in rows.items():
        cells = []
        for shape in SHAPES:
            b, n = per[shape]
            cells.append(f"{b / 1e3:,.1f} KB ({n} sites)" if b < 1e6 else f"{b / 1e6:,.2f} MB ({n} sites)")
        print(f"| `{sel}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
