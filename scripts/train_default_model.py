#!/usr/bin/python3
"""Trains dmi's embedded default model (data/default-model/) from scratch.

Source text: Ambrose Bierce, "The Devil's Dictionary" (1911), public domain,
from Debian's `dict-devil` package (/usr/share/dictd/devil.dict.dz).

Steps:
  1. a byte-level BPE tokenizer (GPT-2 byte map, Llama-3 split regex) with
     VOCAB tokens, written as a Hugging Face tokenizer.json;
  2. a LlamaForCausalLM (grouped-query attention, tied embeddings) trained with
     AdamW on next-token prediction, saved as bf16 safetensors + config.json.

Run:  apt-get install dict-devil && /usr/bin/python3 scripts/train_default_model.py
Deterministic for a given torch version and thread count (seeded).
"""
import argparse
import collections
import gzip
import json
import math
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dmi_reference as ref  # noqa: E402

SOURCE = "/usr/share/dictd/devil.dict.dz"
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# The same split in Python's re (no \p classes): used only while training merges.
PY_SPLIT = re.compile(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\w]?[^\W\d_]+|\d{1,3}| ?[^\s\w]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def load_text():
    raw = gzip.open(SOURCE).read().decode("utf-8", "replace")
    start = raw.find("ABASEMENT, n.")
    body = raw[start:]
    paras = []
    for block in re.split(r"\n\s*\n", body):
        lines = [ln.strip() for ln in block.splitlines() if ln.strip()]
        if lines:
            paras.append(" ".join(lines))
    return "\n".join(paras) + "\n"


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def train_bpe(text, vocab_size):
    b2u = bytes_to_unicode()
    words = collections.Counter("".join(b2u[b] for b in w.encode()) for w in PY_SPLIT.findall(text))
    vocab = sorted(b2u.values(), key=lambda ch: [k for k, v in b2u.items() if v == ch][0])
    seqs = {w: list(w) for w in words}
    merges = []
    while len(vocab) < vocab_size:
        pairs = collections.Counter()
        for w, f in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += f
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        new = best[0] + best[1]
        vocab.append(new)
        for w in words:
            s = seqs[w]
            if len(s) < 2:
                continue
            i, out = 0, []
            while i < len(s):
                if i + 1 < len(s) and s[i] == best[0] and s[i + 1] == best[1]:
                    out.append(new)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return vocab, merges


def tokenizer_json(vocab, merges):
    specials = ["<|endoftext|>"]
    v = {tok: i for i, tok in enumerate(vocab)}
    for s in specials:
        v[s] = len(v)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": v[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for s in specials],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT_REGEX}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": v, "merges": [[a, b] for a, b in merges]},
    }


def encode_with_merges(text, merges):
    """Training-time encoder (same merges, Python split): good enough to make
    training data; the shipped tokenizer.json is what dmi uses at run time."""
    b2u = bytes_to_unicode()
    rank = {m: i for i, m in enumerate(merges)}
    cache = {}
    out = []
    for w in PY_SPLIT.findall(text):
        u = "".join(b2u[b] for b in w.encode())
        if u not in cache:
            s = list(u)
            while len(s) > 1:
                cand = [(rank.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(s, s[1:]))]
                r, i = min(cand)
                if r == 1 << 30:
                    break
                s[i:i + 2] = [s[i] + s[i + 1]]
            cache[u] = s
        out.extend(cache[u])
    return out


class Model(torch.nn.Module):
    """Batched training twin of dmi_reference.forward (same math, fp32)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d, f, H, KV, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], \
            cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
        self.p = {}  # HF name -> parameter (ParameterDict rejects dotted names)
        P = lambda *s: torch.nn.Parameter(torch.randn(*s) * 0.02)  # noqa: E731
        self.p["model.embed_tokens.weight"] = P(cfg["vocab_size"], d)
        self.p["model.norm.weight"] = torch.nn.Parameter(torch.ones(d))
        for l in range(cfg["num_hidden_layers"]):
            q = f"model.layers.{l}."
            self.p[q + "input_layernorm.weight"] = torch.nn.Parameter(torch.ones(d))
            self.p[q + "post_attention_layernorm.weight"] = torch.nn.Parameter(torch.ones(d))
            self.p[q + "self_attn.q_proj.weight"] = P(H * D, d)
            self.p[q + "self_attn.k_proj.weight"] = P(KV * D, d)
            self.p[q + "self_attn.v_proj.weight"] = P(KV * D, d)
            self.p[q + "self_attn.o_proj.weight"] = P(d, H * D)
            self.p[q + "mlp.gate_proj.weight"] = P(f, d)
            self.p[q + "mlp.up_proj.weight"] = P(f, d)
            self.p[q + "mlp.down_proj.weight"] = P(d, f)
        self.H, self.KV, self.D = H, KV, D
        self.params = torch.nn.ParameterList(list(self.p.values()))
        c = ref.Config(cfg)
        self.register_buffer("inv_freq", ref.inv_freq(c), persistent=False)

    def forward(self, ids):
        B, T = ids.shape
        W, c = self.p, self.cfg
        x = W["model.embed_tokens.weight"][ids]
        pos = torch.arange(T, dtype=torch.float32)
        fr = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((fr, fr), -1)
        cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        rep = self.H // self.KV
        for l in range(c["num_hidden_layers"]):
            q_ = f"model.layers.{l}."
            h = ref.rms_norm(x, W[q_ + "input_layernorm.weight"], c["rms_norm_eps"])
            q = (h @ W[q_ + "self_attn.q_proj.weight"].t()).view(B, T, self.H, self.D)
            k = (h @ W[q_ + "self_attn.k_proj.weight"].t()).view(B, T, self.KV, self.D)
            v = (h @ W[q_ + "self_attn.v_proj.weight"].t()).view(B, T, self.KV, self.D)
            q = q * cos + ref.rotate_half(q) * sin
            k = k * cos + ref.rotate_half(k) * sin
            k = k.repeat_interleave(rep, 2)
            v = v.repeat_interleave(rep, 2)
            s = (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)) * self.D ** -0.5
            s = s.masked_fill(~causal, float("-inf"))
            z = (torch.softmax(s, -1) @ v.transpose(1, 2)).transpose(1, 2).reshape(B, T, -1)
            x = x + z @ W[q_ + "self_attn.o_proj.weight"].t()
            h = ref.rms_norm(x, W[q_ + "post_attention_layernorm.weight"], c["rms_norm_eps"])
            a = torch.nn.functional.silu(h @ W[q_ + "mlp.gate_proj.weight"].t()) * (h @ W[q_ + "mlp.up_proj.weight"].t())
            x = x + a @ W[q_ + "mlp.down_proj.weight"].t()
        x = ref.rms_norm(x, W["model.norm.weight"], c["rms_norm_eps"])
        return x @ W["model.embed_tokens.weight"].t()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "data", "default-model"))
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1911)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    text = load_text()
    vocab, merges = train_bpe(text, a.vocab)
    tj = tokenizer_json(vocab, merges)
    ids_of = tj["model"]["vocab"]
    data = torch.tensor([ids_of[t] for t in encode_with_merges(text, merges)], dtype=torch.long)
    print(f"text {len(text)} chars -> {len(data)} tokens, vocab {len(ids_of)}, bpe {time.time() - t0:.0f}s", flush=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": len(ids_of), "hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu",
        "attention_bias": False, "bos_token_id": None, "eos_token_id": ids_of["<|endoftext|>"],
        "torch_dtype": "bfloat16",
    }
    m = Model(cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    n_val = len(data) // 20
    train, val = data[:-n_val], data[-n_val:]
    g = torch.Generator().manual_seed(a.seed)

    def batch(src):
        ix = torch.randint(0, len(src) - a.ctx - 1, (a.batch,), generator=g)
        return torch.stack([src[i:i + a.ctx] for i in ix]), torch.stack([src[i + 1:i + a.ctx + 1] for i in ix])

    for step in range(a.steps + 1):
        lr = 3e-3 * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / a.steps)))
        for pg in opt.param_groups:
            pg["lr"] = lr
        if step % 100 == 0:
            with torch.no_grad():
                xv, yv = batch(val)
                vl = torch.nn.functional.cross_entropy(m(xv).flatten(0, 1), yv.flatten())
            print(f"step {step} val loss {vl.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
        if step == a.steps:
            break
        x, y = batch(train)
        loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
    os.makedirs(a.out, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16) for k, v in m.p.items()}
    ref.save_safetensors(os.path.join(a.out, "model.safetensors"), tensors,
                         {"format": "pt", "source": "The Devil's Dictionary (Bierce, 1911), public domain; dict-devil"})
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(a.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False)
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                   "eos_token": "<|endoftext|>", "model_max_length": cfg["max_position_embeddings"]}, f)
    print(f"done in {time.time() - t0:.0f}s, final val loss {vl.item():.3f}", flush=True)


if __name__ == "__main__":
    main()
