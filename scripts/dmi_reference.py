"""Reference decoder for dmi's tests, written from Hugging Face's modeling code.

This is an independent re-statement of transformers' eager forward pass for
LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM in
plain torch (Debian's python3-torch 1.13, /usr/bin/python3). It shares no code
with the C++ engine. It also reads and writes safetensors files (the format is
small enough to do by hand, and Debian has no safetensors package).

Numerics follow HF's eager attention:
  * RMSNorm in float32, cast back, then multiplied by the weight;
  * rotary cos/sin computed in float32 and cast to the compute dtype;
  * scores = (q @ k^T) * head_dim**-0.5, masked, softmax in float32, cast back.
  * (masked scores are -inf rather than HF's finfo.min: the same probabilities.)
"""
import json
import math
import os
import struct

import torch

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_ELEM = {"F32": 4, "F16": 2, "BF16": 2}


# ----------------------------------------------------------------------------
# safetensors


def save_safetensors(path, tensors, metadata=None, misalign=False):
    """Writes a dict name -> tensor. misalign=True pads the header so that the
    data area starts at an odd offset (real HF files can do this)."""
    header = {}
    offset = 0
    blobs = []
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    hj = json.dumps(header, separators=(",", ":")).encode()
    pad = (8 - (8 + len(hj)) % 8) % 8
    hj += b" " * pad
    if misalign:
        hj += b" "  # data area now starts at an odd byte
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        dt = info["dtype"]
        buf = bytearray(data[b:e])
        if dt == "BF16":
            t = torch.frombuffer(buf, dtype=torch.int16).view(torch.bfloat16)
        else:
            t = torch.frombuffer(buf, dtype=_ST_DTYPES[dt])
        out[name] = t.reshape(info["shape"]).clone()
    return out


def load_model_dir(path):
    """config dict and name -> tensor for an HF directory (single or sharded)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    idx = os.path.join(path, "model.safetensors.index.json")
    tensors = {}
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        for fn in files:
            tensors.update(load_safetensors(os.path.join(path, fn)))
    else:
        tensors = load_safetensors(os.path.join(path, "model.safetensors"))
    return config, tensors


# ----------------------------------------------------------------------------
# config with HF's per-architecture defaults

_DEFAULTS = {
    "LlamaForCausalLM": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
                             rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False),
    "MistralForCausalLM": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                               rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                               sliding_window=4096, attention_bias=False),
    "Qwen2ForCausalLM": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768,
                             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False),
    "Qwen3ForCausalLM": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                             max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0,
                             tie_word_embeddings=False, attention_bias=False),
}


class Config:
    def __init__(self, d):
        arch = d["architectures"][0]
        assert arch in SUPPORTED, arch
        c = dict(_DEFAULTS[arch])
        c.update(d)
        self.arch = arch
        self.vocab_size = c["vocab_size"]
        self.hidden_size = c["hidden_size"]
        self.intermediate_size = c["intermediate_size"]
        self.n_layers = c["num_hidden_layers"]
        self.n_heads = c["num_attention_heads"]
        self.n_kv = c.get("num_key_value_heads") or self.n_heads
        self.head_dim = c.get("head_dim") or self.hidden_size // self.n_heads
        self.eps = c["rms_norm_eps"]
        self.tie = c["tie_word_embeddings"]
        rp = c.get("rope_parameters")
        if rp is not None:
            self.rope_theta = rp.get("rope_theta", c.get("rope_theta", 10000.0))
            self.rope_scaling = rp if rp.get("rope_type", "default") != "default" else None
        else:
            self.rope_theta = c["rope_theta"]
            self.rope_scaling = c.get("rope_scaling")
        self.qkv_bias = arch == "Qwen2ForCausalLM" or c.get("attention_bias", False)
        self.o_bias = arch != "Qwen2ForCausalLM" and c.get("attention_bias", False)
        self.qk_norm = arch == "Qwen3ForCausalLM"
        sw = c.get("sliding_window")
        if arch == "Qwen2ForCausalLM" or arch == "Qwen3ForCausalLM":
            sw = sw if c.get("use_sliding_window", False) else None
        self.sliding_window = sw


def inv_freq(cfg):
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return inv / rs["factor"]
    if kind == "llama3":
        factor = rs["factor"]
        lo, hi = rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > lo_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < hi_wl) * ~(wavelen > lo_wl)
        return torch.where(medium, smoothed, out)
    raise ValueError("unsupported rope type " + str(kind))


def rms_norm(x, w, eps):
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dt)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def forward(cfg, w, ids, dtype=torch.float32, record=None, intervene=None):
    """Full (no-cache) forward of one sequence. ids: list of ints.
    Returns logits [T, vocab] in float32. record(name, tensor) receives every
    intermediate under its TransformerLens name (tensors shaped [T, ...]);
    intervene(name, tensor) may return a replacement, which the forward pass
    continues with (and record sees)."""
    rec_ = record or (lambda n, t: None)

    def rec(name, t):
        if intervene is not None:
            t = intervene(name, t)
        rec_(name, t)
        return t

    W = {k: v.to(dtype) for k, v in w.items()}
    T = len(ids)
    ids_t = torch.tensor(ids, dtype=torch.long)
    x = W["model.embed_tokens.weight"][ids_t]
    x = rec("hook_embed", x)
    pos = torch.arange(T, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq(cfg)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    H, KV, D = cfg.n_heads, cfg.n_kv, cfg.head_dim
    i = torch.arange(T)
    allowed = i[None, :] <= i[:, None]
    if cfg.sliding_window is not None:
        allowed = allowed & (i[None, :] > i[:, None] - cfg.sliding_window)
    for l in range(cfg.n_layers):
        p = f"model.layers.{l}."
        b = f"blocks.{l}."
        x = rec(b + "hook_resid_pre", x)
        h = rms_norm(x, W[p + "input_layernorm.weight"], cfg.eps)
        h = rec(b + "ln1.hook_normalized", h)

        def lin(name, inp, bias):
            return torch.nn.functional.linear(inp, W[p + name + ".weight"], W[p + name + ".bias"] if bias else None)

        q = lin("self_attn.q_proj", h, cfg.qkv_bias).view(T, H, D)
        k = lin("self_attn.k_proj", h, cfg.qkv_bias).view(T, KV, D)
        v = lin("self_attn.v_proj", h, cfg.qkv_bias).view(T, KV, D)
        q = rec(b + "attn.hook_q", q)
        k = rec(b + "attn.hook_k", k)
        v = rec(b + "attn.hook_v", v)
        if cfg.qk_norm:
            q = rms_norm(q, W[p + "self_attn.q_norm.weight"], cfg.eps)
            k = rms_norm(k, W[p + "self_attn.k_norm.weight"], cfg.eps)
            q = rec(b + "attn.q_norm.hook_normalized", q)
            k = rec(b + "attn.k_norm.hook_normalized", k)
        q = q * cos[:, None, :] + rotate_half(q) * sin[:, None, :]
        k = k * cos[:, None, :] + rotate_half(k) * sin[:, None, :]
        q = rec(b + "attn.hook_rot_q", q)
        k = rec(b + "attn.hook_rot_k", k)
        rep = H // KV
        kk = k.repeat_interleave(rep, dim=1)  # HF repeat_kv: head h uses kv head h // rep
        vv = v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q.transpose(0, 1), kk.permute(1, 2, 0)) * (D ** -0.5)  # [H, T, T]
        # HF adds finfo.min; -inf gives the same softmax and is what
        # TransformerLens's hook_attn_scores shows for masked entries.
        scores = scores.masked_fill(~allowed, float("-inf"))
        scores = rec(b + "attn.hook_attn_scores", scores.transpose(0, 1)).transpose(0, 1)
        pattern = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
        pattern = rec(b + "attn.hook_pattern", pattern.transpose(0, 1)).transpose(0, 1)
        z = torch.matmul(pattern, vv.transpose(0, 1)).transpose(0, 1)  # [T, H, D]
        z = rec(b + "attn.hook_z", z)
        attn_out = lin("self_attn.o_proj", z.reshape(T, H * D), cfg.o_bias)
        attn_out = rec(b + "hook_attn_out", attn_out)
        x = x + attn_out
        x = rec(b + "hook_resid_mid", x)
        h = rms_norm(x, W[p + "post_attention_layernorm.weight"], cfg.eps)
        h = rec(b + "ln2.hook_normalized", h)
        gate = lin("mlp.gate_proj", h, False)
        up = lin("mlp.up_proj", h, False)
        gate = rec(b + "mlp.hook_pre", gate)
        up = rec(b + "mlp.hook_pre_linear", up)
        act = torch.nn.functional.silu(gate) * up
        act = rec(b + "mlp.hook_post", act)
        mlp_out = lin("mlp.down_proj", act, False)
        mlp_out = rec(b + "hook_mlp_out", mlp_out)
        x = x + mlp_out
        x = rec(b + "hook_resid_post", x)
    x = rms_norm(x, W["model.norm.weight"], cfg.eps)
    x = rec("ln_final.hook_normalized", x)
    head = W["model.embed_tokens.weight"] if cfg.tie else W["lm_head.weight"]
    logits = torch.nn.functional.linear(x, head)
    logits = rec("unembed.hook_out", logits)
    return logits.float()


def greedy(cfg, w, ids, n_new, dtype=torch.float32, eos=(), intervene=None):
    """Greedy decode by full recomputation (no KV cache): independent of the
    engine's cache logic. Returns (new ids, logits of every step [T+n-1, V])."""
    seq = list(ids)
    out = []
    logits = None
    for _ in range(n_new):
        logits = forward(cfg, w, seq, dtype, intervene=intervene)
        nxt = int(torch.argmax(logits[-1]))
        out.append(nxt)
        seq.append(nxt)
        if nxt in eos:
            break
    return out, forward(cfg, w, seq[:-1], dtype, intervene=intervene) if out else logits
