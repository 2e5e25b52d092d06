// The sites a forward pass exposes, by their TransformerLens names. The model
// calls each HookPoint once, where the tensor is made; with no observer (or
// one that does not want the site) that costs one branch.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace dmi::hooks {

enum class Site : std::uint8_t {
  embed,           // hook_embed                      [B, T, d_model]
  resid_pre,       // blocks.{i}.hook_resid_pre        [B, T, d_model]
  ln1_normalized,  // blocks.{i}.ln1.hook_normalized   [B, T, d_model]
  q,               // blocks.{i}.attn.hook_q           [B, T, heads, head_dim]
  k,               // blocks.{i}.attn.hook_k           [B, T, kv_heads, head_dim]
  v,               // blocks.{i}.attn.hook_v           [B, T, kv_heads, head_dim]
  q_normalized,    // blocks.{i}.attn.q_norm.hook_normalized (Qwen3)
  k_normalized,    // blocks.{i}.attn.k_norm.hook_normalized (Qwen3)
  rot_q,           // blocks.{i}.attn.hook_rot_q       [B, T, heads, head_dim]
  rot_k,           // blocks.{i}.attn.hook_rot_k       [B, T, kv_heads, head_dim]
  attn_scores,     // blocks.{i}.attn.hook_attn_scores [B, heads, T, L] (masked: -inf)
  pattern,         // blocks.{i}.attn.hook_pattern     [B, heads, T, L]
  z,               // blocks.{i}.attn.hook_z           [B, T, heads, head_dim]
  attn_out,        // blocks.{i}.hook_attn_out         [B, T, d_model]
  resid_mid,       // blocks.{i}.hook_resid_mid        [B, T, d_model]
  ln2_normalized,  // blocks.{i}.ln2.hook_normalized   [B, T, d_model]
  mlp_pre,         // blocks.{i}.mlp.hook_pre          [B, T, d_ff] (gate projection)
  mlp_pre_linear,  // blocks.{i}.mlp.hook_pre_linear   [B, T, d_ff] (up projection)
  mlp_post,        // blocks.{i}.mlp.hook_post         [B, T, d_ff] (act(gate) * up)
  mlp_out,         // blocks.{i}.hook_mlp_out          [B, T, d_model]
  resid_post,      // blocks.{i}.hook_resid_post       [B, T, d_model]
  ln_final,        // ln_final.hook_normalized         [B, T, d_model]
  logits,          // unembed.hook_out                 [B, T, vocab]
  kCount
};

// True for sites that exist once per layer (named blocks.{i}.<suffix>).
bool is_layer_site(Site s);
// The name without the blocks.{i}. prefix, e.g. "attn.hook_rot_k".
const char* site_suffix(Site s);
// The full TransformerLens name; layer is ignored for global sites.
std::string site_name(Site s, int layer);
// The inverse of site_name: "blocks.3.hook_resid_post" -> (resid_post, 3),
// "hook_embed" -> (embed, -1); false for names that are not sites.
bool parse_site_name(const std::string& name, Site& site, int& layer);

// The residual-shaped sites a steering vector may target, by short name
// ("resid_post") or suffix ("hook_resid_post"): resid_pre, resid_mid,
// resid_post, attn_out, mlp_out. Throws dmi::Error for anything else.
Site residual_site(const std::string& name);

// What the generator knows about the tokens a forward pass processes, for
// observers that must map batch rows back to sequences and positions.
struct ForwardInfo {
  at::Tensor positions;           // [B, T] int64, position within each sequence
  at::Tensor valid;               // [B, T] bool, false for padding and finished sequences
  std::int64_t start = 0;         // cache column of the first token
  std::vector<std::int32_t> seq;  // [B] index of each row's sequence among all prompts
  std::int32_t step = -1;         // -1: prefill; else the decode step
  // Teacher forcing (replay): [B] prompt length of each row's sequence. The
  // pass then holds prompt and generated tokens, and position p >= prompt_len
  // stands for decode step p - prompt_len (token policies apply per token).
  std::vector<std::int64_t> prompt_len;
};

// Receives tensors at HookPoints (and may replace them). wants() is asked
// first so that tensors an observer does not want (full logits) are never
// made.
class Observer {
 public:
  virtual ~Observer() = default;
  // Called once per forward pass, before any HookPoint.
  virtual void begin_forward(const ForwardInfo& info) {}
  virtual bool wants(Site site, int layer) const = 0;
  virtual void observe(Site site, int layer, const at::Tensor& t, const ForwardInfo& info) = 0;
  // Write-capable HookPoints (hooks/intervene.h): asked before wants(); when
  // true, the forward pass continues with intervene()'s result, and
  // observe() then sees that result.
  virtual bool writes(Site site, int layer) const { return false; }
  virtual at::Tensor intervene(Site site, int layer, const at::Tensor& t, const ForwardInfo& info) { return t; }
};

}  // namespace dmi::hooks
