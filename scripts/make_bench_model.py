#!/usr/bin/python3
"""Writes a random-weight model with Qwen3-0.6B's shapes (bf16 safetensors,
~1.2 GB) for benchmarks; not committed, made on demand.

  /usr/bin/python3 scripts/make_bench_model.py [OUT_DIR]   (default build/bench-models/qwen3-0.6b-shape)
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dmi_reference as ref  # noqa: E402
import make_test_models as mtm  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "hidden_act": "silu", "eos_token_id": 151645, "bos_token_id": 151643,
    "torch_dtype": "bfloat16",
}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "bench-models", "qwen3-0.6b-shape")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        print(f"{out}: exists")
        return
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(6)
    w = {k: v.to(torch.bfloat16) for k, v in mtm.make_weights(CONFIG, gen).items()}
    ref.save_safetensors(os.path.join(out, "model.safetensors"), w)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(mtm.byte_tokenizer(), f, ensure_ascii=False)
    print(f"{out}: written")


if __name__ == "__main__":
    main()
