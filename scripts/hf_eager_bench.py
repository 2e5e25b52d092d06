#!/usr/bin/python3
"""PyTorch eager with Hugging Face generate() semantics: the baseline dmi's
engine is measured against (docs/benchmarks.md, scripts/bench_vs_eager.py).

Written from transformers' published Llama/Qwen3 modeling code and its
generation loop, in plain torch (Debian's python3-torch; no transformers on
this machine):
  * nn.Linear projections (F.linear), q/k/v and gate/up separate;
  * DynamicCache: each layer's keys/values grow by torch.cat every step;
  * a 4-D additive float mask [B, 1, q, kv] (finfo.min where masked), rebuilt
    from the 2-D attention mask and cache_position every step;
  * rotary cos/sin recomputed every step from position_ids (float32, cast);
  * eager attention: repeat_kv, q @ k^T * scaling + mask, softmax in float32;
  * position_ids = attention_mask.cumsum(-1) - 1 (left padding), as generate();
  * logits_to_keep=1: the LM head runs on the last position only;
  * greedy decoding, ignore EOS: exactly --new-tokens tokens per sequence.

Usage:
  /usr/bin/python3 scripts/hf_eager_bench.py MODEL_DIR --dtype bfloat16 --batch-sizes 1,8 \
      --prompt-len 32 --new-tokens 24 [--threads 2] [--json out.jsonl]
Prints one JSON line per batch size: prefill and decode tokens/s (decode:
tokens made by the new_tokens - 1 decode steps over their time, as dmi-bench),
time per output token, the median step, and the machine.
"""
import argparse
import json
import os
import sys
import time

# OpenBLAS 0.3.21 misdetects recent CPUs; the same choice dmi-run makes
# (engine/runtime.cpp). Must be set before torch loads OpenBLAS.
if "OPENBLAS_CORETYPE" not in os.environ:
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    if {"avx512f", "avx512bw", "avx512vl"} <= set(flags):
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"
    elif "avx2" in flags:
        os.environ["OPENBLAS_CORETYPE"] = "Haswell"

# fp32 matmuls run on OpenBLAS's own threads: torch's OpenMP workers must not
# spin against them on few cores (what dmi-run does too, engine/runtime.cpp).
if "float32" in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dmi_reference as ref  # noqa: E402


class DynamicCache:
    def __init__(self):
        self.k, self.v = [], []

    def update(self, k, v, layer):
        if len(self.k) <= layer:
            self.k.append(k)
            self.v.append(v)
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=-2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=-2)
        return self.k[layer], self.v[layer]

    def seq_len(self):
        return self.k[0].shape[-2] if self.k else 0


class EagerModel:
    def __init__(self, path, dtype):
        config, tensors = ref.load_model_dir(path)
        self.cfg = ref.Config(config)
        self.w = {k: v.to(dtype) for k, v in tensors.items()}
        self.dtype = dtype
        self.inv_freq = ref.inv_freq(self.cfg)

    def rms(self, x, w):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.cfg.eps)
        return w * h.to(x.dtype)

    def causal_mask(self, attention_mask, cache_position, kv_len):
        # create_causal_mask, eager: [B, 1, q, kv] with 0 where allowed, finfo.min elsewhere.
        min_value = torch.finfo(self.dtype).min
        kv_idx = torch.arange(kv_len)
        allowed = kv_idx[None, :] <= cache_position[:, None]
        if self.cfg.sliding_window is not None:
            allowed = allowed & (kv_idx[None, :] > cache_position[:, None] - self.cfg.sliding_window)
        allowed = allowed[None, None, :, :] & attention_mask[:, None, None, :kv_len].bool()
        mask = torch.full(allowed.shape, min_value, dtype=self.dtype)
        return mask.masked_fill(allowed, 0.0)

    def forward(self, ids, position_ids, attention_mask, cache, cache_position):
        c, W = self.cfg, self.w
        B, T = ids.shape
        H, KV, D = c.n_heads, c.n_kv, c.head_dim
        x = F.embedding(ids, W["model.embed_tokens.weight"])
        freqs = (self.inv_freq[None, :, None] @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype)[:, None], emb.sin().to(self.dtype)[:, None]
        kv_len = cache.seq_len() + T
        mask = self.causal_mask(attention_mask, cache_position, kv_len)
        for li in range(c.n_layers):
            p = f"model.layers.{li}."
            h = self.rms(x, W[p + "input_layernorm.weight"])
            bias = (lambda n: W[p + n + ".bias"]) if c.qkv_bias else (lambda n: None)
            q = F.linear(h, W[p + "self_attn.q_proj.weight"], bias("self_attn.q_proj")).view(B, T, H, D)
            k = F.linear(h, W[p + "self_attn.k_proj.weight"], bias("self_attn.k_proj")).view(B, T, KV, D)
            v = F.linear(h, W[p + "self_attn.v_proj.weight"], bias("self_attn.v_proj")).view(B, T, KV, D)
            if c.qk_norm:
                q = self.rms(q, W[p + "self_attn.q_norm.weight"])
                k = self.rms(k, W[p + "self_attn.k_norm.weight"])
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + ref.rotate_half(q) * sin
            k = k * cos + ref.rotate_half(k) * sin
            k, v = cache.update(k, v, li)
            rep = H // KV
            if rep > 1:  # repeat_kv
                k = k[:, :, None].expand(B, KV, rep, kv_len, D).reshape(B, H, kv_len, D)
                v = v[:, :, None].expand(B, KV, rep, kv_len, D).reshape(B, H, kv_len, D)
            scores = torch.matmul(q, k.transpose(2, 3)) * (D ** -0.5) + mask
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            z = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, H * D)
            x = x + F.linear(z, W[p + "self_attn.o_proj.weight"])
            h = self.rms(x, W[p + "post_attention_layernorm.weight"])
            act = F.silu(F.linear(h, W[p + "mlp.gate_proj.weight"])) * F.linear(h, W[p + "mlp.up_proj.weight"])
            x = x + F.linear(act, W[p + "mlp.down_proj.weight"])
        x = self.rms(x[:, -1:], W["model.norm.weight"])  # logits_to_keep=1
        head = W["model.embed_tokens.weight"] if c.tie else W["lm_head.weight"]
        return F.linear(x, head).float()


def generate(model, prompts, new_tokens):
    """generate(do_sample=False) over left-padded prompts; returns timings."""
    B = len(prompts)
    L = max(len(p) for p in prompts)
    ids = torch.zeros(B, L, dtype=torch.long)
    attention_mask = torch.zeros(B, L, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        attention_mask[b, L - len(p):] = 1
    cache = DynamicCache()
    cache_position = torch.arange(L)
    out = []
    steps = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        for step in range(new_tokens):
            position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
            position_ids = position_ids[:, -ids.shape[1]:]
            logits = model.forward(ids, position_ids, attention_mask, cache, cache_position)
            nxt = logits[:, -1].argmax(-1)
            out.append(nxt)
            ids = nxt[:, None]
            attention_mask = torch.cat([attention_mask, torch.ones(B, 1, dtype=torch.long)], dim=-1)
            cache_position = cache_position[-1:] + 1
            t1 = time.perf_counter()
            steps.append(t1 - t0)
            t0 = t1
    return steps


def cpu_flags():
    flags = open("/proc/cpuinfo").read().split("flags", 1)[1].split("\n", 1)[0].split()
    keep = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16")
    return [f for f in keep if f in flags]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    try:
        batches = [int(b) for b in a.batch_sizes.split(",")]
    except ValueError:
        sys.exit(f"hf_eager_bench: --batch-sizes: '{a.batch_sizes}' is not a comma-separated list of integers")
    if min(batches) < 1 or a.prompt_len < 1 or a.new_tokens < 2:
        sys.exit("hf_eager_bench: batch sizes and --prompt-len must be >= 1, --new-tokens >= 2")
    torch.set_num_threads(a.threads or os.cpu_count())
    dtype = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    model = EagerModel(a.model, dtype)
    lines = []
    for batch in batches:
        g = torch.Generator().manual_seed(a.seed + batch)
        prompts = torch.randint(0, model.cfg.vocab_size, (batch, a.prompt_len), generator=g).tolist()
        runs = []
        for r in range(a.warmup + a.repeats):
            steps = generate(model, prompts, a.new_tokens)
            if r >= a.warmup:
                runs.append(steps)
        best = min(runs, key=lambda s: sum(s))
        decode = sorted(best[1:])
        res = {
            "tool": "hf_eager_bench", "dtype": a.dtype, "batch": batch, "prompt_len": a.prompt_len,
            "new_tokens": a.new_tokens, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_flags": cpu_flags(),
            "prefill_tps": batch * a.prompt_len / best[0],
            "decode_tps": batch * (a.new_tokens - 1) / sum(best[1:]),
            "tpot_ms": 1000 * sum(best[1:]) / (a.new_tokens - 1),
            "step_ms_median": 1000 * decode[len(decode) // 2],
        }
        lines.append(json.dumps(res))
        print(lines[-1], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            f.write("\n".join(lines) + "\n")

if __name__ == "__main__":
    main()
