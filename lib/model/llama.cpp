#include "model/llama.h"

#include <ATen/ATen.h>

#include <limits>

#include "common/error.h"
#include "kernels/memory.h"
#include "kernels/ops.h"
#include "kernels/pool.h"
#include "model/rope.h"

namespace dmi::model {

using hooks::Site;

LlamaFamily::LlamaFamily(io::ModelConfig cfg, const io::WeightStore& w, at::ScalarType dtype)
    : cfg_(std::move(cfg)), dtype_(dtype) {
  DMI_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "compute dtype must be float32 or bfloat16");
  const std::int64_t d = cfg_.hidden_size, H = cfg_.num_heads, KV = cfg_.num_kv_heads, D = cfg_.head_dim,
                     F = cfg_.intermediate_size, V = cfg_.vocab_size;
  auto get = [&](const std::string& name, std::vector<std::int64_t> shape) {
    at::Tensor t = w.get(name, dtype, shape);
    weight_bytes_ += t.numel() * t.element_size();
    return t;
  };
  // The projections are packed once for the selected kernels
  // (kernels/linear.h); q/k/v and gate/up become one matrix each.
  const kernels::Isa isa = kernels::selected_isa();
  kernels::attention_arithmetic();  // an invalid $DMI_ATTENTION is reported here, at the load
  auto linear = [&](std::vector<at::Tensor> ws, std::vector<at::Tensor> bs) {
    return kernels::PackedLinear(ws, bs, dtype, isa);
  };
  embed_ = get("model.embed_tokens.weight", {V, d});
  final_norm_ = get("model.norm.weight", {d});
  if (cfg_.tie_word_embeddings) {
    lm_head_ = linear({embed_}, {at::Tensor()});
  } else {
    DMI_CHECK(w.has("lm_head.weight"),
              "missing tensor 'lm_head.weight' (config.json has tie_word_embeddings=false)");
    lm_head_ = linear({get("lm_head.weight", {V, d})}, {at::Tensor()});
  }
  for (std::int64_t i = 0; i < cfg_.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer l;
    l.ln1 = get(p + "input_layernorm.weight", {d});
    at::Tensor bq, bk, bv, bo;
    if (cfg_.qkv_bias) {
      bq = get(p + "self_attn.q_proj.bias", {H * D});
      bk = get(p + "self_attn.k_proj.bias", {KV * D});
      bv = get(p + "self_attn.v_proj.bias", {KV * D});
    }
    l.qkv = linear({get(p + "self_attn.q_proj.weight", {H * D, d}), get(p + "self_attn.k_proj.weight", {KV * D, d}),
                    get(p + "self_attn.v_proj.weight", {KV * D, d})},
                   {bq, bk, bv});
    if (cfg_.o_bias) bo = get(p + "self_attn.o_proj.bias", {d});
    l.o = linear({get(p + "self_attn.o_proj.weight", {d, H * D})}, {bo});
    if (cfg_.qk_norm) {
      l.q_norm = get(p + "self_attn.q_norm.weight", {D});
      l.k_norm = get(p + "self_attn.k_norm.weight", {D});
    }
    l.ln2 = get(p + "post_attention_layernorm.weight", {d});
    l.gate_up = linear({get(p + "mlp.gate_proj.weight", {F, d}), get(p + "mlp.up_proj.weight", {F, d})},
                       {at::Tensor(), at::Tensor()});
    l.down = linear({get(p + "mlp.down_proj.weight", {d, F})}, {at::Tensor()});
    layers_.push_back(std::move(l));
  }
  inv_freq_ = rope_inv_freq(cfg_.rope, D);
}

bool LlamaFamily::attention_arithmetic_applies() const {
  return dtype_ == at::kBFloat16 && cfg_.num_kv_heads > 0 &&
         kernels::vdpbf16ps_attention_shape(cfg_.head_dim, cfg_.num_heads / cfg_.num_kv_heads);
}

ForwardWork LlamaFamily::forward_work() const {
  auto macs = [](const kernels::PackedLinear& l) { return l.in_features() * l.out_features(); };
  ForwardWork w;
  for (const Layer& l : layers_) w.per_token += macs(l.qkv) + macs(l.o) + macs(l.gate_up) + macs(l.down);
  w.per_logits_row = macs(lm_head_);
  const std::int64_t layers = cfg_.num_layers, D = cfg_.head_dim;
  w.attention_per_position = layers * cfg_.num_heads * D * 2;  // q·k and p·v
  w.kv_bytes_per_position = layers * cfg_.num_kv_heads * D * 2 * static_cast<std::int64_t>(c10::elementSize(dtype_));
  return w;
}

KVCache LlamaFamily::new_cache(std::int64_t batch, std::int64_t capacity) const {
  KVCache c;
  c.capacity = capacity;
  // One block on huge pages for all layers (kernels/memory.h): each decode
  // step reads all of it. On 4 KiB pages the attention of a batch-8 decode
  // step took 1.01-1.18x as long (3 alternating runs on a Zen 5 EPYC;
  // docs/benchmarks.md, 2026-12-05 second session). The block of the
  // previous cache is reused when it fits, its pages already faulted in
  // (a batch-8, 256-token prefill had spent 3-4 % of its time in the OS's
  // page zeroing: 2026-12-05 fourth session).
  const at::Tensor all =
      kernels::recycled_huge_page_zeros({2, cfg_.num_layers, batch, cfg_.num_kv_heads, capacity, cfg_.head_dim}, dtype_);
  for (std::int64_t i = 0; i < cfg_.num_layers; ++i) {
    c.k.push_back(all[0][i]);
    c.v.push_back(all[1][i]);
  }
  return c;
}

// Hugging Face's LlamaRMSNorm: float32 statistics, cast back, then weight.
at::Tensor LlamaFamily::rms_norm(const at::Tensor& x, const at::Tensor& w) const {
  return kernels::rms_norm(x, w, cfg_.rms_norm_eps);
}

// A forward pass of up to this many rows (batch x new positions: decode
// steps) runs with the threads held (kernels/pool.h): its ~140 parallel
// operations are then handed to a waiting thread instead of each forking
// one, and the held thread reads the next projection's first weights while
// the calling thread computes the small operations between two projections.
// Larger passes (prefill) fork per operation, so that ATen's own operations
// in them (the mask, the embedding) keep their threads. Bits do not depend on it.
constexpr std::int64_t kHeldRows = 32;

at::Tensor LlamaFamily::forward(const ForwardInput& in, KVCache& cache, hooks::Observer* obs) {
  if (in.ids.numel() > kHeldRows) return forward_pass(in, cache, obs);
  at::Tensor logits;
  kernels::hold_threads([&] { logits = forward_pass(in, cache, obs); });
  return logits;
}

at::Tensor LlamaFamily::forward_pass(const ForwardInput& in, KVCache& cache, hooks::Observer* obs) {
  const std::int64_t B = in.ids.size(0), T = in.ids.size(1), L = in.start + T;
  const std::int64_t H = cfg_.num_heads, KV = cfg_.num_kv_heads, D = cfg_.head_dim;
  DMI_CHECK(L <= cache.capacity, "sequence needs {} cache columns, cache holds {}", L, cache.capacity);
  DMI_CHECK(in.key_valid.size(0) == B && in.key_valid.size(1) == L, "key_valid must be [B, start + T]");

#ifdef DMI_NO_HOOKS
  // Hooks compiled out (-DDMI_HOOKS=OFF): the baseline dmi-bench compares
  // "off" with, to show that an unused HookPoint costs nothing.
  DMI_CHECK(!obs, "this build has hooks compiled out (DMI_HOOKS=OFF)");
  auto hook = [](Site, int, at::Tensor&) {};
  auto listens = [](Site, int) { return false; };
#else
  DMI_CHECK(!obs || in.info, "forward: an observer needs ForwardInput::info");
  if (obs) obs->begin_forward(*in.info);
  // The HookPoint: one branch when nobody listens. An intervention replaces
  // the tensor the forward pass continues with; a capture sees the result.
  auto hook = [&](Site s, int layer, at::Tensor& t) {
    if (!obs) return;
    if (obs->writes(s, layer)) t = obs->intervene(s, layer, t, *in.info);
    if (obs->wants(s, layer)) obs->observe(s, layer, t, *in.info);
  };
  auto listens = [&](Site s, int layer) { return obs && (obs->wants(s, layer) || obs->writes(s, layer)); };
#endif

  // allowed[b, t, c]: query t (cache column start + t) may attend to column
  // c. Every query sees its own column, so padding rows stay finite.
  at::Tensor qcol = at::arange(in.start, L, at::kLong).view({T, 1});
  at::Tensor kcol = at::arange(0, L, at::kLong).view({1, L});
  at::Tensor causal = kcol <= qcol;
  if (cfg_.sliding_window) causal = causal.logical_and(kcol > qcol - *cfg_.sliding_window);
  at::Tensor allowed = causal.unsqueeze(0).logical_and(in.key_valid.unsqueeze(1)).logical_or((kcol == qcol).unsqueeze(0));
  at::Tensor masked = allowed.logical_not().unsqueeze(1);  // [B, 1, T, L]
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  auto [cos, sin] = rope_cos_sin(inv_freq_, in.positions, dtype_);
  at::Tensor x = at::embedding(embed_, in.ids);
  hook(Site::embed, -1, x);

  for (std::int64_t li = 0; li < cfg_.num_layers; ++li) {
    const Layer& l = layers_[li];
    const int i = static_cast<int>(li);
    hook(Site::resid_pre, i, x);
    at::Tensor h = rms_norm(x, l.ln1);
    hook(Site::ln1_normalized, i, h);
    at::Tensor qkv = l.qkv(h);  // [B, T, (H + 2 KV) D]
    l.o.prefetch();  // each projection's start, while the operations before it run (kernels/pool.h)
    at::Tensor q = qkv.narrow(2, 0, H * D).view({B, T, H, D});
    at::Tensor k = qkv.narrow(2, H * D, KV * D).view({B, T, KV, D});
    at::Tensor v = qkv.narrow(2, (H + KV) * D, KV * D).view({B, T, KV, D});
    hook(Site::q, i, q);
    hook(Site::k, i, k);
    hook(Site::v, i, v);
    // The normalized and rotated q and k exist as tensors only for a
    // HookPoint that reads or writes them; otherwise one pass per position
    // computes the same bits and writes k and v into the cache.
    const bool qk_sites = listens(Site::q_normalized, i) || listens(Site::k_normalized, i) ||
                          listens(Site::rot_q, i) || listens(Site::rot_k, i);
    if (!qk_sites) {
      // l.q_norm and l.k_norm are undefined without per-head norms.
      q = kernels::attention_inputs(q, k, v, l.q_norm, l.k_norm, cfg_.rms_norm_eps, cos, sin, cache.k[li], cache.v[li],
                                    in.start);
    } else {
      if (cfg_.qk_norm) {
        q = rms_norm(q, l.q_norm);
        k = rms_norm(k, l.k_norm);
        hook(Site::q_normalized, i, q);
        hook(Site::k_normalized, i, k);
      }
      q = kernels::rope(q, cos, sin);
      k = kernels::rope(k, cos, sin);
      hook(Site::rot_q, i, q);
      hook(Site::rot_k, i, k);
      kernels::write_cache(cache.k[li], k, in.start);
      kernels::write_cache(cache.v[li], v, in.start);
    }

    // Grouped-query attention without repeating K/V: query head h reads KV
    // head h / G (HF's repeat_kv), straight from the cache (kernels/ops.h).
    // Scores and probabilities exist as tensors only for a HookPoint that
    // reads or writes them; otherwise one fused pass computes the same bits.
    at::Tensor z;  // [B, T, H, D]
    if (listens(Site::attn_scores, i) || listens(Site::pattern, i)) {
      at::Tensor scores = kernels::attention_scores(q, cache.k[li], L, masked, scale);  // [B, H, T, L]
      hook(Site::attn_scores, i, scores);
      at::Tensor probs = kernels::softmax(scores);  // float32 softmax, cast to the dtype
      hook(Site::pattern, i, probs);
      z = kernels::attention_values(probs, cache.v[li], L);
    } else {
      z = kernels::attention(q, cache.k[li], cache.v[li], L, masked, scale);
    }
    hook(Site::z, i, z);
    at::Tensor attn_out = l.o(z.reshape({B, T, H * D}));
    l.gate_up.prefetch();
    hook(Site::attn_out, i, attn_out);
    x = x + attn_out;
    hook(Site::resid_mid, i, x);

    h = rms_norm(x, l.ln2);
    hook(Site::ln2_normalized, i, h);
    const std::int64_t F = cfg_.intermediate_size;
    at::Tensor gate_up = l.gate_up(h);  // [B, T, 2 F]
    l.down.prefetch();
    at::Tensor gate = gate_up.narrow(2, 0, F);
    hook(Site::mlp_pre, i, gate);
    at::Tensor up = gate_up.narrow(2, F, F);
    hook(Site::mlp_pre_linear, i, up);
    at::Tensor act = kernels::silu_mul(gate, up);
    hook(Site::mlp_post, i, act);
    at::Tensor mlp_out = l.down(act);
    (li + 1 < cfg_.num_layers ? layers_[li + 1].qkv : lm_head_).prefetch();
    hook(Site::mlp_out, i, mlp_out);
    x = x + mlp_out;
    hook(Site::resid_post, i, x);
  }
  x = rms_norm(x, final_norm_);
  hook(Site::ln_final, -1, x);
#ifdef DMI_NO_HOOKS
  const bool all = in.all_logits;
#else
  const bool all = in.all_logits || (obs && obs->wants(Site::logits, -1));
#endif
  at::Tensor logits = lm_head_(all ? x : x.narrow(1, T - 1, 1));
  hook(Site::logits, -1, logits);
  logits = logits.to(at::kFloat);
  return all && !in.all_logits ? logits.narrow(1, T - 1, 1) : logits;
}

}  // namespace dmi::model
