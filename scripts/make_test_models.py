#!/usr/bin/python3
"""Makes dmi's small random-weight test models and their reference outputs.

  /usr/bin/python3 scripts/make_test_models.py OUT_DIR

Writes one HF-style directory per case (config.json, safetensors, a byte-level
tokenizer.json with one token per byte) covering all four architectures, grouped-
query attention, tied and untied embeddings, F32/F16/BF16 files, sharded and
single files, misaligned tensor data, rope_scaling (linear, llama3) and the
newer rope_parameters form, Qwen2 biases, Qwen3 q/k norms and Mistral's
sliding window. Each directory also gets reference.json: greedy decodes and
logits from scripts/dmi_reference.py (Hugging Face semantics, fp32 and bf16),
which the C++ tests compare against.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dmi_reference as ref  # noqa: E402
import train_default_model as tdm  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VOCAB = 256

# Prompts of different lengths (token ids); the longest exceeds Mistral's
# test sliding window so that the window matters.
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 11, 64, 128, 1, 33], [9, 8, 7], [200], [60, 61, 62, 63, 64, 65, 66]]
N_NEW = 6

CASES = {
    "llama-gqa-f32": dict(
        arch="LlamaForCausalLM", file_dtype=torch.float32, tie=False, kv=2, shards=1,
        extra={"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
               "rope_theta": 500000.0}),
    "llama-mha-tied-bf16-sharded": dict(
        arch="LlamaForCausalLM", file_dtype=torch.bfloat16, tie=True, kv=4, shards=3,
        extra={"rope_scaling": {"type": "linear", "factor": 2.0}}),
    "mistral-window-bf16-sharded": dict(
        arch="MistralForCausalLM", file_dtype=torch.bfloat16, tie=False, kv=2, shards=2,
        extra={"sliding_window": 5}),
    "qwen2-bias-tied-f16": dict(
        arch="Qwen2ForCausalLM", file_dtype=torch.float16, tie=True, kv=2, shards=1,
        extra={"rope_theta": 1000000.0}),
    "qwen3-qknorm-bf16-misaligned": dict(
        arch="Qwen3ForCausalLM", file_dtype=torch.bfloat16, tie=True, kv=1, shards=1, misalign=True,
        head_dim=32, extra={"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "qwen3-untied-f32": dict(
        arch="Qwen3ForCausalLM", file_dtype=torch.float32, tie=False, kv=2, shards=1, head_dim=16,
        extra={"rope_theta": 10000.0}),
}


def make_weights(cfg, gen):
    c = ref.Config(cfg)
    d, f = c.hidden_size, c.intermediate_size
    H, KV, D = c.n_heads, c.n_kv, c.head_dim

    def r(*shape, std=0.15):
        return torch.randn(*shape, generator=gen) * std

    def norm(n):
        return 1.0 + r(n, std=0.1)

    w = {"model.embed_tokens.weight": r(c.vocab_size, d, std=0.5), "model.norm.weight": norm(d)}
    if not c.tie:
        w["lm_head.weight"] = r(c.vocab_size, d, std=0.2)
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = r(H * D, d)
        w[p + "self_attn.k_proj.weight"] = r(KV * D, d)
        w[p + "self_attn.v_proj.weight"] = r(KV * D, d)
        w[p + "self_attn.o_proj.weight"] = r(d, H * D)
        if c.qkv_bias:
            w[p + "self_attn.q_proj.bias"] = r(H * D, std=0.1)
            w[p + "self_attn.k_proj.bias"] = r(KV * D, std=0.1)
            w[p + "self_attn.v_proj.bias"] = r(KV * D, std=0.1)
        if c.qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm(D)
            w[p + "self_attn.k_norm.weight"] = norm(D)
        w[p + "mlp.gate_proj.weight"] = r(f, d)
        w[p + "mlp.up_proj.weight"] = r(f, d)
        w[p + "mlp.down_proj.weight"] = r(d, f)
    return w


def write_model(out, name, spec, gen):
    cfg = {"architectures": [spec["arch"]], "vocab_size": VOCAB, "hidden_size": 48, "intermediate_size": 80,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": spec["kv"],
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": spec["tie"],
           "hidden_act": "silu", "eos_token_id": 255, "bos_token_id": None}
    if "head_dim" in spec:
        cfg["head_dim"] = spec["head_dim"]
    cfg.update(spec.get("extra", {}))
    w = make_weights(cfg, gen)
    if "post" in spec:  # a case's own edits (tests/e2e/patch_test.py builds a model with a known circuit)
        w = spec["post"](w, cfg)
    # What the file holds is what the model is: round through the file dtype.
    w = {k: v.to(spec["file_dtype"]) for k, v in w.items()}
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    names = list(w)
    if spec["shards"] == 1:
        ref.save_safetensors(os.path.join(d, "model.safetensors"), w, misalign=spec.get("misalign", False))
    else:
        k = spec["shards"]
        weight_map = {}
        for s in range(k):
            fn = f"model-{s + 1:05d}-of-{k:05d}.safetensors"
            part = {n: w[n] for n in names[s::k]}
            ref.save_safetensors(os.path.join(d, fn), part)
            weight_map.update({n: fn for n in part})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(byte_tokenizer(), f, ensure_ascii=False)
    return d


def byte_tokenizer():
    """A byte-level BPE tokenizer with exactly the 256 byte tokens (ids 0-255
    in GPT-2's byte order) and no merges: any text fits the test vocabulary."""
    b2u = tdm.bytes_to_unicode()
    tj = tdm.tokenizer_json([b2u[b] for b in range(256)], [])
    tj["added_tokens"] = []
    tj["model"]["vocab"] = {b2u[b]: b for b in range(256)}
    return tj


def reference_outputs(d):
    cfg_d, w = ref.load_model_dir(d)
    cfg = ref.Config(cfg_d)
    out = {"prompts": PROMPTS, "n_new": N_NEW, "float32": [], "bfloat16": []}
    for dtype, key in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        for p in PROMPTS:
            ids, logits = ref.greedy(cfg, w, p, N_NEW, dtype, eos=(255,))
            out[key].append({"greedy": ids, "logits": logits.tolist()})
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(out, f)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "test-models")
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(20261130)
    for name, spec in CASES.items():
        d = write_model(out, name, spec, gen)
        reference_outputs(d)
        print(f"{name}: {d}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
