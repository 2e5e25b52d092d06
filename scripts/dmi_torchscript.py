#!/usr/bin/python3
"""TorchScript export of dmi's Llama-family models, with HookPoints.

  /usr/bin/python3 scripts/dmi_torchscript.py MODEL_DIR OUT.pt [--no-hooks]

Reads an HF directory (config.json + safetensors; Llama, Mistral, Qwen2,
Qwen3), builds the same network as an nn.Module whose submodule names are
Hugging Face's (model.embed_tokens, model.layers.3.self_attn.q_proj, ...),
scripts it with torch.jit.script and saves it with config.json inside the
archive. tokenizer.json (and tokenizer_config.json) are copied next to OUT.pt;
an existing different file there is left alone, with a warning.

The module follows dmi's TorchScript calling convention (docs/torchscript.md):

    forward(input_ids: Tensor[B, L] int64, attention_mask: Tensor[B, L] int64)
        -> logits Tensor[B, L, vocab]

recomputing the whole sequence each call; attention_mask is 0 at left padding.
It also has dmi's KV-cache method

    forward_step(input_ids: Tensor[B, T], attention_mask: Tensor[B, S + T], cache: List[Tensor])
        -> (logits Tensor[B, T, vocab], List[Tensor])

which dmi-run uses when present: one new token per decode step.
With hooks (the default) every TransformerLens site calls
torch.ops.dmi.hook(x, "blocks.3.hook_resid_post"), an identity that dmi-run
captures from. --no-hooks exports the same network with no hook calls at all
(for dmi-run --hook-map, which inserts hooks into the loaded graph).

To add hooks to your own model: `import dmi_torchscript` (which defines the
dmi::hook operator for Python, see register_hook_op), then call
`x = torch.ops.dmi.hook(x, "blocks.{i}.hook_resid_post")` where the tensor is
made, and script and save as usual. Python is needed only to export.
"""
import argparse
import json
import os
import shutil
import sys
from typing import List, Tuple

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dmi_reference as ref  # noqa: E402

_LIB = None


def register_hook_op():
    """Defines dmi::hook(Tensor x, str site) -> Tensor in this Python process
    (identity), so that torch.jit.script accepts torch.ops.dmi.hook calls.
    libdmi registers the capturing implementation under the same schema."""
    global _LIB
    if _LIB is not None:
        return
    _LIB = torch.library.Library("dmi", "DEF")
    # CONSERVATIVE: the JIT must keep every call (it has a side effect: capture).
    _LIB.define("hook(Tensor x, str site) -> Tensor", alias_analysis="CONSERVATIVE")
    _LIB.impl("hook", lambda x, site: x, "CompositeExplicitAutograd")


register_hook_op()


class HookPoint(nn.Module):
    """A TransformerLens-style hook site: identity, captured by dmi-run."""

    site: str

    def __init__(self, site):
        super().__init__()
        self.site = site

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.dmi.hook(x, self.site)


class NoHook(nn.Module):
    def __init__(self, site):
        super().__init__()

    def forward(self, x: Tensor) -> Tensor:
        return x


class RMSNorm(nn.Module):
    eps: float

    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dt = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dt)


def rotate_half(x: Tensor) -> Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    n_heads: int
    n_kv: int
    head_dim: int
    qk_norm: bool

    def __init__(self, c, prefix, Hook):
        super().__init__()
        d, H, KV, D = c.hidden_size, c.n_heads, c.n_kv, c.head_dim
        self.n_heads, self.n_kv, self.head_dim, self.qk_norm = H, KV, D, c.qk_norm
        self.q_proj = nn.Linear(d, H * D, bias=c.qkv_bias)
        self.k_proj = nn.Linear(d, KV * D, bias=c.qkv_bias)
        self.v_proj = nn.Linear(d, KV * D, bias=c.qkv_bias)
        self.o_proj = nn.Linear(H * D, d, bias=c.o_bias)
        self.q_norm = RMSNorm(D, c.eps) if c.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(D, c.eps) if c.qk_norm else nn.Identity()
        a = prefix + "attn."
        self.hook_q, self.hook_k, self.hook_v = Hook(a + "hook_q"), Hook(a + "hook_k"), Hook(a + "hook_v")
        self.hook_q_norm = Hook(a + "q_norm.hook_normalized")
        self.hook_k_norm = Hook(a + "k_norm.hook_normalized")
        self.hook_rot_q, self.hook_rot_k = Hook(a + "hook_rot_q"), Hook(a + "hook_rot_k")
        self.hook_attn_scores, self.hook_pattern = Hook(a + "hook_attn_scores"), Hook(a + "hook_pattern")
        self.hook_z = Hook(a + "hook_z")

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, allowed: Tensor, past_k: Tensor,
                past_v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """x: the T new tokens [B, T, d]; past_k/past_v: [B, S, kv, D] (rotated keys, values) of the
        tokens before them; allowed: [B, T, S + T]. Returns the output and the keys/values of all S + T."""
        B, T = x.shape[0], x.shape[1]
        H, KV, D = self.n_heads, self.n_kv, self.head_dim
        q = self.hook_q(self.q_proj(x).view(B, T, H, D))
        k = self.hook_k(self.k_proj(x).view(B, T, KV, D))
        v = self.hook_v(self.v_proj(x).view(B, T, KV, D))
        if self.qk_norm:
            q = self.hook_q_norm(self.q_norm(q))
            k = self.hook_k_norm(self.k_norm(k))
        c, s = cos[:, :, None, :], sin[:, :, None, :]
        q = self.hook_rot_q(q * c + rotate_half(q) * s)
        k = self.hook_rot_k(k * c + rotate_half(k) * s)
        k_all = torch.cat((past_k, k), dim=1)
        v_all = torch.cat((past_v, v), dim=1)
        rep = H // KV
        kk = k_all.repeat_interleave(rep, dim=2).transpose(1, 2)  # [B, H, S + T, D]
        vv = v_all.repeat_interleave(rep, dim=2).transpose(1, 2)
        scores = torch.matmul(q.transpose(1, 2), kk.transpose(2, 3)) * (D ** -0.5)  # [B, H, T, S + T]
        scores = self.hook_attn_scores(scores.masked_fill(~allowed[:, None, :, :], float("-inf")))
        pattern = self.hook_pattern(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype))
        z = self.hook_z(torch.matmul(pattern, vv).transpose(1, 2))  # [B, T, H, D]
        return self.o_proj(z.reshape(B, T, H * D)), k_all, v_all


class MLP(nn.Module):
    def __init__(self, c, prefix, Hook):
        super().__init__()
        d, f = c.hidden_size, c.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        m = prefix + "mlp."
        self.hook_pre, self.hook_pre_linear, self.hook_post = Hook(m + "hook_pre"), Hook(m + "hook_pre_linear"), Hook(m + "hook_post")

    def forward(self, x: Tensor) -> Tensor:
        gate = self.hook_pre(self.gate_proj(x))
        up = self.hook_pre_linear(self.up_proj(x))
        return self.down_proj(self.hook_post(nn.functional.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, c, i, Hook):
        super().__init__()
        p = f"blocks.{i}."
        self.input_layernorm = RMSNorm(c.hidden_size, c.eps)
        self.self_attn = Attention(c, p, Hook)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.eps)
        self.mlp = MLP(c, p, Hook)
        self.hook_resid_pre, self.hook_ln1 = Hook(p + "hook_resid_pre"), Hook(p + "ln1.hook_normalized")
        self.hook_attn_out, self.hook_resid_mid = Hook(p + "hook_attn_out"), Hook(p + "hook_resid_mid")
        self.hook_ln2, self.hook_mlp_out = Hook(p + "ln2.hook_normalized"), Hook(p + "hook_mlp_out")
        self.hook_resid_post = Hook(p + "hook_resid_post")

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, allowed: Tensor, past_k: Tensor,
                past_v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        x = self.hook_resid_pre(x)
        a, k, v = self.self_attn(self.hook_ln1(self.input_layernorm(x)), cos, sin, allowed, past_k, past_v)
        x = self.hook_resid_mid(x + self.hook_attn_out(a))
        m = self.hook_mlp_out(self.mlp(self.hook_ln2(self.post_attention_layernorm(x))))
        return self.hook_resid_post(x + m), k, v


class Body(nn.Module):
    def __init__(self, c, Hook):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(c, i, Hook) for i in range(c.n_layers)])
        self.norm = RMSNorm(c.hidden_size, c.eps)


class CausalLM(nn.Module):
    window: int
    n_kv: int
    head_dim: int

    def __init__(self, c, Hook):
        super().__init__()
        self.model = Body(c, Hook)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        # A plain tensor attribute (not a buffer): Module.to(dtype) leaves it float32.
        self.inv_freq = ref.inv_freq(c).float()
        self.window = c.sliding_window if c.sliding_window is not None else 0
        self.n_kv, self.head_dim = c.n_kv, c.head_dim
        self.hook_embed, self.hook_ln_final = Hook("hook_embed"), Hook("ln_final.hook_normalized")

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The whole (left-padded) sequence: logits [B, L, vocab]."""
        no_cache: List[Tensor] = []
        return self.forward_step(input_ids, attention_mask, no_cache)[0]

    @torch.jit.export
    def forward_step(self, input_ids: Tensor, attention_mask: Tensor,
                     cache: List[Tensor]) -> Tuple[Tensor, List[Tensor]]:
        """dmi's KV-cache convention: input_ids [B, T] are the tokens after the S that `cache` holds
        (empty list: none), attention_mask [B, S + T] covers all of them. Returns the logits of the T new
        tokens and the cache to pass with the next tokens."""
        dtype = self.lm_head.weight.dtype
        B, T = input_ids.shape[0], input_ids.shape[1]
        S = attention_mask.shape[1] - T
        valid = attention_mask != 0
        # Position within each (left-padded) sequence, as Hugging Face's generate computes it.
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, S:]
        freqs = pos[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        qcol = torch.arange(S, S + T, device=input_ids.device)[:, None]
        kcol = torch.arange(S + T, device=input_ids.device)[None, :]
        allowed = (kcol <= qcol)[None, :, :] & valid[:, None, :]
        if self.window > 0:
            allowed = allowed & (kcol > qcol - self.window)[None, :, :]
        # Padding queries attend to themselves so that no row is all -inf.
        allowed = allowed | (kcol == qcol)[None, :, :]
        x = self.hook_embed(self.model.embed_tokens(input_ids))
        empty = x.new_zeros([B, 0, self.n_kv, self.head_dim])
        out: List[Tensor] = []
        i = 0
        for layer in self.model.layers:
            past_k = cache[2 * i] if len(cache) > 0 else empty
            past_v = cache[2 * i + 1] if len(cache) > 0 else empty
            x, k, v = layer(x, cos, sin, allowed, past_k, past_v)
            out.append(k)
            out.append(v)
            i += 1
        x = self.hook_ln_final(self.model.norm(x))
        return self.lm_head(x).float(), out


def build(model_dir, hooks=True):
    config, tensors = ref.load_model_dir(model_dir)
    c = ref.Config(config)
    m = CausalLM(c, HookPoint if hooks else NoHook)
    state = {k: v.float() for k, v in tensors.items()}
    if c.tie:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = m.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (c.tie and k == "lm_head.weight")]
    if missing or unexpected:
        raise SystemExit(f"{model_dir}: weights do not match the module: missing {missing}, unexpected {unexpected}")
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return config, m


def export(model_dir, out, hooks=True):
    config, m = build(model_dir, hooks)
    sm = torch.jit.script(m)
    torch.jit.save(sm, out, _extra_files={"config.json": json.dumps(config, indent=2)})
    dst = os.path.dirname(os.path.abspath(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src, to = os.path.join(model_dir, name), os.path.join(dst, name)
        if not os.path.exists(src):
            continue
        if not os.path.exists(to):
            shutil.copyfile(src, to)
        elif open(src, "rb").read() != open(to, "rb").read():
            print(f"warning: {to} exists and differs from {src}; not overwritten (give dmi-run --tokenizer {src})",
                  file=sys.stderr)


def main(argv: List[str]):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--no-hooks", action="store_true", help="export without any dmi::hook call")
    a = ap.parse_args(argv)
    export(a.model_dir, a.out, hooks=not a.no_hooks)
    print(a.out)


if __name__ == "__main__":
    main(sys.argv[1:])
