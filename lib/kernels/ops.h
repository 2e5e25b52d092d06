// The per-layer operations besides the projections, one loop per row each:
// ATen spends more time dispatching and allocating for a handful of rows
// than computing them, and its bf16 batched matmul is slow on CPU. Numerics follow Hugging Face's eager code step by
// step (the same roundings to bf16 at the same points); only the order of
// fp32 summations differs from ATen's. Each row is computed alone, in a fixed
// order, so results do not depend on the batch.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace dmi::kernels {

// Hugging Face's RMSNorm over the last dim: float32 statistics, normalized
// value cast to x's dtype, then multiplied by w (in x's dtype). Returns a
// contiguous tensor; a view whose rows are evenly spaced (q, k of the fused
// projection) is read in place.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

// Rotary embedding as HF's apply_rotary_pos_emb: x * cos + rotate_half(x) *
// sin, each product and the sum rounded to the dtype. x [B, T, H, D];
// cos, sin [B, T, 1, D] of x's dtype. Returns a contiguous tensor; a view
// with each position's heads contiguous is read in place.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// The KV cache's append: cache[b, h, start + t, :] = x[b, t, h, :] for x
// [B, T, heads, D] (any strides) and cache [B, heads, capacity, D]
// (contiguous, x's dtype). Row copies, the bits of ATen's copy_ (whose
// strided copy took ~15 us a call at decode, more than the copying).
void write_cache(at::Tensor& cache, const at::Tensor& x, std::int64_t start);

// What attention reads, in one pass per position: q's and k's heads
// normalized when q_norm and k_norm are given (per-head RMSNorm, Qwen3; both
// or neither), then rotated; k's rows written into k_cache and v's into
// v_cache at columns [start, start + T). Returns the rotated q, contiguous.
// The bits of rms_norm, rope and write_cache in turn, without their
// tensors in between: for a forward pass in which no HookPoint reads or
// writes the normalized or rotated q and k. q [B, T, H, D], k and v
// [B, T, KV, D], read in place as views of the fused projection; cos, sin
// and the caches as for rope and write_cache.
at::Tensor attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_norm,
                            const at::Tensor& k_norm, double eps, const at::Tensor& cos, const at::Tensor& sin,
                            at::Tensor& k_cache, at::Tensor& v_cache, std::int64_t start);

// SwiGLU: silu(gate) rounded to the dtype, times up, rounded (HF's
// act_fn(gate_proj(x)) * up_proj(x)).
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

// Grouped-query attention scores: q [B, T, H, D]; keys [B, KV, capacity, D]
// (columns [0, L) used; query head h reads KV head h / (H / KV));
// masked [B, 1, T, L] bool. Returns [B, H, T, L] in q's dtype:
// (q·k rounded to the dtype) * scale, rounded; -inf where masked (HF: matmul,
// then * scaling).
at::Tensor attention_scores(const at::Tensor& q, const at::Tensor& keys, std::int64_t L, const at::Tensor& masked,
                            double scale);

// Softmax over the last dim in float32, rounded to the input's dtype (HF:
// softmax(scores, dtype=float32).to(dtype)); -inf entries become 0 and cost
// nothing. The sum runs in 16 lanes counted from the row's first unmasked
// column, then a fixed tree, so masked (padding) columns leave every bit
// unchanged.
at::Tensor softmax(const at::Tensor& scores);

// z [B, T, H, D] = probs [B, H, T, L] · values [B, KV, capacity, D] (columns
// [0, L)), accumulated in fp32 over columns in order, rounded to the dtype.
at::Tensor attention_values(const at::Tensor& probs, const at::Tensor& values, std::int64_t L);

// Whether bf16 attention with this head_dim runs on vdpbf16ps here (the
// AVX512-BF16 kernels selected, head_dim a multiple of 32, where the blocked
// kernels run: head_dim at most 512, at most 16 query heads per KV head).
// Then attention_scores and attention_values sum their bf16 products in
// vdpbf16ps's order (pairs of elements or of keys; attention_avx512bf16.cpp),
// not in the order above: bits of their own, shared by decode and prefill.
// $DMI_ATTENTION=portable keeps the order above (dmi's attention before
// 2026-12-07), e.g. to replay a capture made with it.
bool bf16_attention_on_vdpbf16ps(std::int64_t head_dim);
// Whether bf16 attention with these heads is of a shape that runs on
// vdpbf16ps where the CPU and $DMI_ATTENTION allow it (head_dim a multiple
// of 32, at most 512; at most 16 query heads per KV head), whatever this CPU
// has: the attention whose bits dmi_attention decides. Other shapes (and
// fp32, fp16) compute the portable attention everywhere.
bool vdpbf16ps_attention_shape(std::int64_t head_dim, std::int64_t heads_per_kv);
// "vdpbf16ps" where bf16 attention runs on it (head_dim permitting), else
// "portable": recorded in each capture's environment (dmi_attention).
// Throws dmi::Error when $DMI_ATTENTION is set to anything but "portable".
std::string attention_arithmetic();

// attention_values(softmax(attention_scores(q, keys, L, masked, scale)),
// values, L), the same bits, without materializing scores and probabilities
// where the blocked kernels run (AVX-512): for a forward pass in which no
// HookPoint reads or writes them.
at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, std::int64_t L,
                     const at::Tensor& masked, double scale);

}  // namespace dmi::kernels
