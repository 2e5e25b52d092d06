#include "kernels/ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "common/error.h"
#include "kernels/gemm_impl.h"
#include "kernels/linear.h"
#include "kernels/pool.h"

namespace dmi::kernels {

namespace {

#define DMI_INLINE inline __attribute__((always_inline))
// The row loops below are compiled three times (x86-64-v4, i.e. AVX-512
// F/BW/DQ/VL; AVX2; baseline x86-64) and picked at load time (GCC
// target_clones, an ifunc). With FMA contraction off (lib/CMakeLists.txt)
// and fixed summation orders, all three compute the same bits; only the
// vector width differs. An "avx512f" clone alone could not widen bf16 in
// 512-bit registers (vpmovzxwd zmm needs AVX512BW) and ran 256 bits wide.
#define DMI_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))

DMI_INLINE float load(const float* p, std::int64_t i) { return p[i]; }
DMI_INLINE float load(const std::uint16_t* p, std::int64_t i) {
  const std::uint32_t u = static_cast<std::uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
DMI_INLINE float round_to(float v, const float*) { return v; }
DMI_INLINE float round_to(float v, const std::uint16_t*) {
  const std::uint32_t u = static_cast<std::uint32_t>(detail::to_bf16(v)) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
DMI_INLINE void store(float* p, std::int64_t i, float v) { p[i] = v; }
DMI_INLINE void store(std::uint16_t* p, std::int64_t i, float v) { p[i] = detail::to_bf16(v); }

// 16 fp32 lanes summed pairwise (lane j with j + 8, then + 4, + 2, + 1).
DMI_INLINE float tree_sum16(float* acc) {
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

// Dot product in 16 fp32 lanes, summed pairwise at the end: a fixed order
// the compiler can vectorize without reassociating.
template <class Ta, class Tb>
DMI_INLINE float dot(const Ta* a, const Tb* b, std::int64_t n) {
  float acc[16] = {};
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += load(a, i + j) * load(b, i + j);
  for (int j = 0; i < n; ++i, ++j) acc[j] += load(a, i) * load(b, i);
  return tree_sum16(acc);
}

// exp(x) for float, Cephes' polynomial after rounding x / ln 2 to an integer
// n (relative error ~2e-7; tests/unit/kernels_test.cpp). Plain arithmetic,
// so it vectorizes, and gives the same bits on every CPU.
DMI_INLINE float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.44269504088896341f + 12582912.0f;  // 1.5 * 2^23: round to nearest
  const float n = t - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  std::int32_t ni;
  std::memcpy(&ni, &t, 4);
  const std::int32_t bits = (ni - 0x4B400000 + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

template <class E>
DMI_INLINE void rms_norm_row(const E* x, const E* w, E* o, std::int64_t n, float eps) {
  const float mean = dot(x, x, n) / static_cast<float>(n);
  const float inv = 1.0f / std::sqrt(mean + eps);
  for (std::int64_t i = 0; i < n; ++i) {
    const float h = round_to(load(x, i) * inv, x);  // h.to(x.dtype)
    store(o, i, load(w, i) * h);                    // w * h in the dtype
  }
}

template <class E>
DMI_INLINE void rope_row(const E* x, const E* c, const E* s, E* o, std::int64_t D) {
  const std::int64_t half = D / 2;
  for (std::int64_t i = 0; i < half; ++i) {  // rotate_half: [-x2, x1]
    const float a = round_to(load(x, i) * load(c, i), x), b = round_to(-load(x, i + half) * load(s, i), x);
    store(o, i, a + b);
  }
  for (std::int64_t i = half; i < D; ++i) {
    const float a = round_to(load(x, i) * load(c, i), x), b = round_to(load(x, i - half) * load(s, i), x);
    store(o, i, a + b);
  }
}

template <class E>
DMI_INLINE void silu_mul_row(const E* g, const E* u, E* o, std::int64_t n) {
  // In chunks through float buffers: each loop stays simple enough to vectorize.
  constexpr std::int64_t kChunk = 256;
  float gf[kChunk], act[kChunk];
  for (std::int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const std::int64_t m = std::min(kChunk, n - c0);
    for (std::int64_t i = 0; i < m; ++i) gf[i] = load(g, c0 + i);
    // The exp and the division in separate loops: in one, GCC had divided
    // every lane by exp's largest value as well (the clamped input's
    // constant), blending the result away, and those divisions' denormal
    // results took microcode assists (3.3-3.6 ns an element on a Zen 3).
    for (std::int64_t i = 0; i < m; ++i) act[i] = fast_exp(-gf[i]);
    for (std::int64_t i = 0; i < m; ++i) act[i] = gf[i] / (1.0f + act[i]);
    for (std::int64_t i = 0; i < m; ++i) act[i] = round_to(act[i], g);  // silu, in the dtype
    for (std::int64_t i = 0; i < m; ++i) store(o, c0 + i, act[i] * load(u, c0 + i));
  }
}

// One query row against L keys; masked keys cost nothing.
template <class E>
DMI_INLINE void scores_row(const E* q, const E* kb, const bool* m, E* o, std::int64_t L, std::int64_t D,
                           float scale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (std::int64_t c = 0; c < L; ++c) store(o, c, m[c] ? neg_inf : round_to(dot(q, kb + c * D, D), q) * scale);
}

template <class E>
DMI_INLINE void values_row(const E* p, const E* vb, E* o, std::int64_t L, std::int64_t D, float* acc) {
  for (std::int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
  float* vf = acc + D;  // the value row, widened (two simple loops vectorize)
  for (std::int64_t c = 0; c < L; ++c) {
    const float pc = load(p, c);
    if (pc == 0.0f) continue;  // masked (or underflowed): adds nothing
    const E* v = vb + c * D;
    for (std::int64_t d = 0; d < D; ++d) vf[d] = load(v, d);
    for (std::int64_t d = 0; d < D; ++d) acc[d] += pc * vf[d];
  }
  for (std::int64_t d = 0; d < D; ++d) store(o, d, acc[d]);
}

// True when the 16 values at p are all -inf, compared as bit patterns
// (-inf has exactly one in each dtype), 8 bytes at a time.
template <int Bytes>
DMI_INLINE bool all_words(const void* p, std::uint64_t pattern) {
  std::uint64_t w[Bytes / 8];
  std::memcpy(w, p, Bytes);
  std::uint64_t diff = 0;
  for (int k = 0; k < Bytes / 8; ++k) diff |= w[k] ^ pattern;
  return diff == 0;
}
DMI_INLINE bool all_neg_inf16(const float* p) { return all_words<64>(p, 0xff800000ff800000ull); }
DMI_INLINE bool all_neg_inf16(const std::uint16_t* p) { return all_words<32>(p, 0xff80ff80ff80ff80ull); }
DMI_INLINE void set_neg_inf(float* p) { *p = -std::numeric_limits<float>::infinity(); }
DMI_INLINE void set_neg_inf(std::uint16_t* p) { *p = 0xff80; }

template <class E>
DMI_INLINE void softmax_row(const E* x, E* o, std::int64_t n, float* e) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // Masked columns at the end (causal prefill rows, cache columns not yet
  // attended) and at the start (left padding, keys before a sliding window)
  // are 0 and add nothing: the loops below run over [first, end) only.
  // 16 columns at a time, then one by one. (A float comparison per column
  // had compiled to scalar code; with it and the padded exp tail below, one
  // layer's causal softmax at 8 x 256 tokens, bf16, one thread, went from
  // 24-31 to 20-27 ms: docs/benchmarks.md, "Where to look next".)
  std::int64_t end = n;
  while (end >= 16 && all_neg_inf16(x + end - 16)) end -= 16;
  while (end > 0 && load(x, end - 1) == neg_inf) --end;
  std::int64_t first = 0;
  while (first + 16 <= end && all_neg_inf16(x + first)) first += 16;
  while (first < end && load(x, first) == neg_inf) ++first;
  // The maximum in 16 lanes (std::max's rule in each: a NaN never enters, as
  // it never did the single running maximum); max is exact, so the order of
  // comparisons changes no bit.
  float lanes_max[16];
  for (int j = 0; j < 16; ++j) lanes_max[j] = neg_inf;
  std::int64_t c = first;
  for (; c + 16 <= end; c += 16)
    for (int j = 0; j < 16; ++j) lanes_max[j] = std::max(lanes_max[j], load(x, c + j));
  for (int j = 0; c < end; ++c, ++j) lanes_max[j] = std::max(lanes_max[j], load(x, c));
  float mx = neg_inf;
  for (int j = 0; j < 16; ++j) mx = std::max(mx, lanes_max[j]);
  if (mx == neg_inf) mx = 0.0f;  // a fully masked row: all zeros, not NaN
  // 16 exps at a time; the last partial block goes through a buffer padded
  // with -inf (exp 0), so no exp runs in a scalar epilogue: each is the same
  // expression either way, the same bits.
  auto exp16 = [&](const E* src, float* dst) {
    for (int j = 0; j < 16; ++j) {
      const float v = load(src, j);
      dst[j] = v == neg_inf ? 0.0f : fast_exp(v - mx);
    }
  };
  std::int64_t b = first;
  for (; b + 16 <= end; b += 16) exp16(x + b, e + b);
  if (b < end) {
    E pad[16];
    float out[16];
    for (int j = 0; j < 16; ++j) set_neg_inf(pad + j);
    std::memcpy(pad, x + b, static_cast<std::size_t>(end - b) * sizeof(E));
    exp16(pad, out);
    std::memcpy(e + b, out, static_cast<std::size_t>(end - b) * sizeof(float));
  }
  // The sum in 16 lanes counted from the first unmasked column, then dot()'s
  // fixed tree: the same bits wherever the row's keys sit in the cache (left
  // padding differs with the batch), and masked columns inside add +0 to a
  // lane, which changes nothing. (The running maximum and the in-order sum
  // were scalar loops: the softmax fell from 5.3 to 4.2 % of a 256-token
  // prefill's samples.)
  float lanes[16] = {};
  std::int64_t i = first;
  for (; i + 16 <= end; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += e[i + j];
  for (int j = 0; i < end; ++i, ++j) lanes[j] += e[i];
  const float sum = tree_sum16(lanes);
  const float denom = sum > 0.0f ? sum : 1.0f;
  for (c = 0; c < first; ++c) store(o, c, 0.0f);
  for (c = first; c < end; ++c) store(o, c, e[c] / denom);
  for (c = end; c < n; ++c) store(o, c, 0.0f);
}

// The entry points the row loops below call, one per dtype, each cloned
// (DMI_CLONES); score rows try the AVX-512 intrinsics first.
using bf16 = std::uint16_t;
DMI_CLONES void rms_norm_row_any(const float* x, const float* w, float* o, std::int64_t n, float eps) { rms_norm_row(x, w, o, n, eps); }
DMI_CLONES void rms_norm_row_any(const bf16* x, const bf16* w, bf16* o, std::int64_t n, float eps) { rms_norm_row(x, w, o, n, eps); }
DMI_CLONES void rope_row_any(const float* x, const float* c, const float* s, float* o, std::int64_t D) { rope_row(x, c, s, o, D); }
DMI_CLONES void rope_row_any(const bf16* x, const bf16* c, const bf16* s, bf16* o, std::int64_t D) { rope_row(x, c, s, o, D); }
DMI_CLONES void silu_mul_row_any(const float* g, const float* u, float* o, std::int64_t n) { silu_mul_row(g, u, o, n); }
DMI_CLONES void silu_mul_row_any(const bf16* g, const bf16* u, bf16* o, std::int64_t n) { silu_mul_row(g, u, o, n); }
DMI_CLONES void softmax_row_any(const float* x, float* o, std::int64_t n, float* e) { softmax_row(x, o, n, e); }
DMI_CLONES void softmax_row_any(const bf16* x, bf16* o, std::int64_t n, float* e) { softmax_row(x, o, n, e); }
DMI_CLONES void values_row_any(const float* p, const float* v, float* o, std::int64_t L, std::int64_t D, float* acc) { values_row(p, v, o, L, D, acc); }
DMI_CLONES void values_row_any(const bf16* p, const bf16* v, bf16* o, std::int64_t L, std::int64_t D, float* acc) { values_row(p, v, o, L, D, acc); }
DMI_CLONES void scores_row_cloned(const float* q, const float* k, const bool* m, float* o, std::int64_t L, std::int64_t D, float s) { scores_row(q, k, m, o, L, D, s); }
DMI_CLONES void scores_row_cloned(const bf16* q, const bf16* k, const bool* m, bf16* o, std::int64_t L, std::int64_t D, float s) { scores_row(q, k, m, o, L, D, s); }

// $DMI_ATTENTION: "portable" keeps bf16 attention off vdpbf16ps (true);
// unset or empty: the default (false); anything else throws.
bool portable_attention_requested() {
  const char* env = std::getenv("DMI_ATTENTION");
  if (!env || !*env) return false;
  DMI_CHECK(std::string(env) == "portable", "DMI_ATTENTION={}: the one value is 'portable' (unset: the default)", env);
  return true;
}

// The instruction set whose attention kernels run (attention_avx512bf16.cpp,
// attention_avx512.cpp, attention_avx2.cpp): the CPU's, or less where
// $DMI_KERNELS, read once per process, asks for less (avx512, avx2, avx, sse2
// or scalar, e.g. to measure what an older CPU runs; aten keeps the CPU's).
// The same bits either way, except bf16 attention on avx512_bf16
// (dp_attention below). An invalid value is
// reported where the projections are built, never from here (this may run
// in a parallel region).
Isa attention_isa() {
  static const Isa isa = [] {
    Isa chosen = detect_isa();
    try {
      chosen = selected_isa();
    } catch (const Error&) {
    }
    return chosen == Isa::aten ? detect_isa() : chosen;
  }();
  return isa;
}
bool has_avx512() { return static_cast<int>(attention_isa()) >= static_cast<int>(Isa::avx512); }
// bf16 attention on vdpbf16ps (attention_avx512bf16.cpp), where the blocked
// kernels run: with AVX512-BF16 and head_dim a multiple of 32, unless
// $DMI_ATTENTION=portable (read once per process; an invalid value is
// reported by attention_arithmetic(), at the model's load, never from here).
// Its bits are its own (as the projections' on that instruction set); every
// bf16 attention op of a model takes the same choice, so decode and prefill,
// fused and separate, keep agreeing.
bool vdpbf16ps_attention() {
  static const bool on = [] {
    bool portable = false;
    try {
      portable = portable_attention_requested();
    } catch (const Error&) {
    }
    return !portable && attention_isa() == Isa::avx512_bf16;
  }();
  return on;
}
template <class E>
bool dp_attention(std::int64_t D) {
  return std::is_same_v<E, bf16> && vdpbf16ps_attention() && D % 32 == 0;
}
bool has_avx2() { return static_cast<int>(attention_isa()) >= static_cast<int>(Isa::avx2); }

template <class E>
void scores_row_any(const E* q, const E* k, const bool* m, E* o, std::int64_t L, std::int64_t D, float s) {
  if (!has_avx512() || !detail::scores_row_avx512(q, k, m, o, L, D, s)) scores_row_cloned(q, k, m, o, L, D, s);
}

// Items per thread of an at::parallel_for loop whose items each cost
// `work` element operations: at least 32768 operations per thread, the grain
// ATen's own elementwise loops use (at::internal::GRAIN_SIZE). Handing a
// few rows of a small model to the OpenMP pool cost more than computing
// them, and threads that wait at the join slow every other process on the
// same cores (docs/benchmarks.md, "small models on shared cores").
std::int64_t grain(std::int64_t work) {
  constexpr std::int64_t kGrain = 32768;
  return std::max<std::int64_t>(1, kGrain / std::max<std::int64_t>(1, work));
}

// What one element of a row loop below costs in such operations: ATen's
// add takes ~0.1 ns per element of a large tensor, these loops 0.6-1.1 ns
// (RMSNorm, RoPE, SwiGLU on bf16 rows; AVX512-BF16 EPYC, one thread), so
// each element counts as 8. At batch-8 decode of the Qwen3-0.6B shape they
// then split over 2 threads (SwiGLU 8 x 3072: 23-28 us on one thread); one
// row of batch 1 and a small model's rows stay on the calling thread.
constexpr std::int64_t kRowElementCost = 8;

// x's rows are [outer, inner]: row (o, i) starts at x + o * outer_stride +
// i * n (a contiguous x is one outer block); out is contiguous.
template <class E>
void rms_norm_rows(const E* x, const E* w, E* out, std::int64_t rows, std::int64_t n, std::int64_t inner,
                   std::int64_t outer_stride, float eps) {
  parallel_for(0, rows, grain(kRowElementCost * n), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r)
      rms_norm_row_any(x + r / inner * outer_stride + r % inner * n, w, out + r * n, n, eps);
  });
}

// Position bt of x starts at x + bt * x_stride (heads of D contiguous after it).
template <class E>
void rope_rows(const E* x, std::int64_t x_stride, const E* cos, const E* sin, E* out, std::int64_t B, std::int64_t T,
               std::int64_t H, std::int64_t D) {
  parallel_for(0, B * T, grain(kRowElementCost * H * D), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t bt = begin; bt < end; ++bt)
      for (std::int64_t h = 0; h < H; ++h)
        rope_row_any(x + bt * x_stride + h * D, cos + bt * D, sin + bt * D, out + (bt * H + h) * D, D);
  });
}

// attention_inputs' loop. Position bt of q, k and v starts at q + bt *
// q_stride (heads of D contiguous after it), and so on; q_norm and k_norm are
// null without per-head norms.
template <class E>
struct AttentionInputs {
  const E *q, *k, *v, *q_norm, *k_norm, *cos, *sin;
  std::int64_t q_stride, k_stride, v_stride;
  E *q_out, *k_cache, *v_cache;
  std::int64_t B, T, H, KV, D, capacity, start;
  float eps;
};

// One position's heads: norm (into a row buffer, rounded as rms_norm's
// output), then rotary from that buffer, so the bits are those of rms_norm
// then rope.
template <class E>
void attention_inputs_rows(const AttentionInputs<E>& a) {
  const std::int64_t D = a.D, per_position = 2 * kRowElementCost * (a.H + a.KV) * D;  // a norm and a rotation
  parallel_for(0, a.B * a.T, grain(per_position), [&](std::int64_t begin, std::int64_t end) {
    std::vector<E> normed(static_cast<std::size_t>(D));
    auto row = [&](const E* x, const E* norm, const E* cos, const E* sin, E* out) {
      if (has_avx512() && detail::norm_rope_row_avx512(x, norm, cos, sin, out, D, a.eps)) return;
      if (norm) {
        rms_norm_row_any(x, norm, normed.data(), D, a.eps);
        x = normed.data();
      }
      rope_row_any(x, cos, sin, out, D);
    };
    for (std::int64_t bt = begin; bt < end; ++bt) {
      const std::int64_t b = bt / a.T, t = bt % a.T;
      const E *cos = a.cos + bt * D, *sin = a.sin + bt * D;
      for (std::int64_t h = 0; h < a.H; ++h)
        row(a.q + bt * a.q_stride + h * D, a.q_norm, cos, sin, a.q_out + (bt * a.H + h) * D);
      for (std::int64_t h = 0; h < a.KV; ++h) {
        const std::int64_t column = ((b * a.KV + h) * a.capacity + a.start + t) * D;
        row(a.k + bt * a.k_stride + h * D, a.k_norm, cos, sin, a.k_cache + column);
        std::memcpy(a.v_cache + column, a.v + bt * a.v_stride + h * D, static_cast<std::size_t>(D) * sizeof(E));
      }
    }
  });
}

// The stride of t's dims [0, dims) taken as one dim (size-1 dims skipped), or
// -1 when they are not evenly spaced. q, k and v are views into the fused
// q/k/v projection's output, [B, T, heads, D]: their (b, t) positions are
// evenly spaced and each position's heads are contiguous, so the row loops
// read them in place (ATen's copy to contiguous took longer than a decode
// step's norm of them).
std::int64_t collapsed_stride(const at::Tensor& t, std::int64_t dims) {
  std::int64_t stride = -1, next = 0;
  for (std::int64_t d = dims - 1; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (stride < 0) stride = t.stride(d), next = stride * t.size(d);
    else if (t.stride(d) != next) return -1;
    else next *= t.size(d);
  }
  return stride < 0 ? 0 : stride;
}

template <class E>
void silu_mul_rows(const E* g, const E* u, E* out, std::int64_t rows, std::int64_t n, std::int64_t g_stride,
                   std::int64_t u_stride) {
  parallel_for(0, rows, grain(kRowElementCost * n), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) silu_mul_row_any(g + r * g_stride, u + r * u_stride, out + r * n, n);
  });
}

template <class E>
void softmax_rows(const E* x, E* out, std::int64_t rows, std::int64_t n) {
  parallel_for(0, rows, grain(n), [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> e(static_cast<std::size_t>(n));
    for (std::int64_t r = begin; r < end; ++r) softmax_row_any(x + r * n, out + r * n, n, e.data());
  });
}

// Rows of one KV head in blocks (detail::scores_block_avx512 and
// values_block_avx512, or attention_many_avx512; without AVX-512 the _avx2
// blocks): the G query heads of consecutive positions, at most max_rows rows. Calls fn(b, kv, rows, row_h,
// row_t, scratch) per block, with scratch_floats floats of scratch per
// thread; blocks split over threads (each row costs L * D multiply-adds);
// false when the blocked kernels cannot run (no AVX2, or a head_dim they
// do not take).
std::int64_t block_scratch_floats(std::int64_t D) { return (detail::kBlockRows + detail::kBlockKeys) * D; }

template <class Fn>
bool for_head_blocks(std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t KV, std::int64_t D, std::int64_t L,
                     int max_rows, std::int64_t scratch_floats, Fn fn) {
  const std::int64_t G = H / KV;
  if (!has_avx2() || D % 16 != 0 || D > detail::kBlockMaxD || G > detail::kBlockRows) return false;
  const std::int64_t per = std::max<std::int64_t>(1, max_rows / G);  // positions per block
  const std::int64_t tblocks = (T + per - 1) / per, units = B * KV * tblocks;
  // As many threads as at::parallel_for would start; they take blocks from a
  // shared counter, so a thread slowed by a busy core does not leave the
  // other waiting at the end (causal prefill blocks also differ in length).
  // A block is computed by one thread whichever it is: the same bits.
  const std::int64_t g = grain(std::min(T, per) * G * L * D);
  const std::int64_t threads = std::min<std::int64_t>(pool_threads(), (units + g - 1) / g);
  std::atomic<std::int64_t> next{0};
  parallel(static_cast<int>(threads), [&](int) {
    std::vector<float> scratch(static_cast<std::size_t>(scratch_floats));
    std::int64_t row_h[detail::kManyRows], row_t[detail::kManyRows];
    for (std::int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < units;
         u = next.fetch_add(1, std::memory_order_relaxed)) {
      const std::int64_t b = u / (KV * tblocks), kv = u / tblocks % KV, t0 = u % tblocks * per;
      int rows = 0;
      for (std::int64_t t = t0; t < std::min(T, t0 + per); ++t)
        for (std::int64_t g = 0; g < G; ++g, ++rows) {
          row_h[rows] = kv * G + g;
          row_t[rows] = t;
        }
      fn(b, kv, rows, row_h, row_t, scratch.data());
    }
  });
  return true;
}

template <class E>
void scores_impl(const at::Tensor& q, const at::Tensor& keys, std::int64_t L, const at::Tensor& masked, float scale,
                 at::Tensor& out) {
  const std::int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const std::int64_t KV = keys.size(1), cap = keys.size(2), G = H / KV;
  const E* qp = reinterpret_cast<const E*>(q.data_ptr());
  const E* kp = reinterpret_cast<const E*>(keys.data_ptr());
  const bool* mp = masked.data_ptr<bool>();
  E* op = reinterpret_cast<E*>(out.data_ptr());
  const bool dp = dp_attention<E>(D);
  const bool blocked = for_head_blocks(
      B, T, H, KV, D, L, detail::kBlockRows, block_scratch_floats(D),
      [&](std::int64_t b, std::int64_t kv, int rows, const std::int64_t* rh, const std::int64_t* rt, float* scratch) {
        const E* qr[detail::kBlockRows];
        const bool* mr[detail::kBlockRows];
        E* orow[detail::kBlockRows];
        for (int r = 0; r < rows; ++r) {
          qr[r] = qp + ((b * T + rt[r]) * H + rh[r]) * D;
          mr[r] = mp + (b * T + rt[r]) * L;
          orow[r] = op + ((b * H + rh[r]) * T + rt[r]) * L;
        }
        const E* kb = kp + (b * KV + kv) * cap * D;
        if constexpr (std::is_same_v<E, bf16>)
          if (dp) return detail::scores_block_avx512bf16(qr, mr, orow, rows, kb, L, D, scale);
        if (has_avx512()) detail::scores_block_avx512(qr, mr, orow, rows, kb, L, D, scale, scratch);
        else detail::scores_block_avx2(qr, mr, orow, rows, kb, L, D, scale, scratch);
      });
  if (blocked) return;
  parallel_for(0, B * H, grain(T * L * D), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t bh = begin; bh < end; ++bh) {
      const std::int64_t b = bh / H, h = bh % H, kv = h / G;
      for (std::int64_t t = 0; t < T; ++t)
        scores_row_any(qp + ((b * T + t) * H + h) * D, kp + (b * KV + kv) * cap * D, mp + (b * T + t) * L,
                       op + ((b * H + h) * T + t) * L, L, D, scale);
    }
  });
}

template <class E>
void values_impl(const at::Tensor& probs, const at::Tensor& values, std::int64_t L, at::Tensor& out) {
  const std::int64_t B = probs.size(0), H = probs.size(1), T = probs.size(2);
  const std::int64_t KV = values.size(1), cap = values.size(2), D = values.size(3), G = H / KV;
  const E* pp = reinterpret_cast<const E*>(probs.data_ptr());
  const E* vp = reinterpret_cast<const E*>(values.data_ptr());
  E* op = reinterpret_cast<E*>(out.data_ptr());
  const bool dp = dp_attention<E>(D);
  const bool blocked = for_head_blocks(
      B, T, H, KV, D, L, detail::kBlockRows, block_scratch_floats(D),
      [&](std::int64_t b, std::int64_t kv, int rows, const std::int64_t* rh, const std::int64_t* rt, float* scratch) {
        const E* pr[detail::kBlockRows];
        E* orow[detail::kBlockRows];
        for (int r = 0; r < rows; ++r) {
          pr[r] = pp + ((b * H + rh[r]) * T + rt[r]) * L;
          orow[r] = op + ((b * T + rt[r]) * H + rh[r]) * D;
        }
        const E* vb = vp + (b * KV + kv) * cap * D;
        if constexpr (std::is_same_v<E, bf16>)
          if (dp) return detail::values_block_avx512bf16(pr, orow, rows, vb, L, D, scratch);
        if (has_avx512()) detail::values_block_avx512(pr, orow, rows, vb, L, D, scratch);
        else detail::values_block_avx2(pr, orow, rows, vb, L, D, scratch);
      });
  if (blocked) return;
  parallel_for(0, B * H, grain(T * L * D), [&](std::int64_t begin, std::int64_t end) {
    std::vector<float> acc(static_cast<std::size_t>(2 * D));
    for (std::int64_t bh = begin; bh < end; ++bh) {
      const std::int64_t b = bh / H, h = bh % H, kv = h / G;
      for (std::int64_t t = 0; t < T; ++t)
        values_row_any(pp + ((b * H + h) * T + t) * L, vp + (b * KV + kv) * cap * D, op + ((b * T + t) * H + h) * D,
                       L, D, acc.data());
    }
  });
}

// Scores, softmax and values of each block of rows in one pass: the row
// functions of the three separate ops on the same inputs, so the same bits,
// with the block's scores and probabilities in a per-thread buffer instead of
// [B, H, T, L] tensors, and one parallel region instead of three. With
// AVX-512, prefill (more rows per KV head than one block of kBlockRows) runs
// blocks of up to kManyRows rows through attention_many_avx512, which widens
// and transposes each key chunk once for all of them; the AVX2 blocks stay
// at kBlockRows rows.
template <class E>
bool fused_impl(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, std::int64_t L,
                const at::Tensor& masked, float scale, at::Tensor& out) {
  const std::int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const std::int64_t KV = keys.size(1), cap = keys.size(2), G = H / KV;
  const E* qp = reinterpret_cast<const E*>(q.data_ptr());
  const E* kp = reinterpret_cast<const E*>(keys.data_ptr());
  const E* vp = reinterpret_cast<const E*>(values.data_ptr());
  const bool* mp = masked.data_ptr<bool>();
  E* op = reinterpret_cast<E*>(out.data_ptr());
  const bool many = has_avx512() && T * G > detail::kBlockRows;
  const bool dp = dp_attention<E>(D);
  const int max_rows = many ? detail::kManyRows : detail::kBlockRows;
  const std::int64_t scratch = many ? detail::many_scratch_floats(D, L) : block_scratch_floats(D);
  return for_head_blocks(
      B, T, H, KV, D, L, max_rows, scratch,
      [&](std::int64_t b, std::int64_t kv, int rows, const std::int64_t* rh, const std::int64_t* rt, float* buf) {
        thread_local std::vector<E> sp;  // scores, then probabilities: [2][kBlockRows][L], or [kManyRows][L]
        thread_local std::vector<float> e;
        sp.resize(static_cast<std::size_t>((many ? detail::kManyRows : 2 * detail::kBlockRows) * L));
        const E* qr[detail::kManyRows];
        const bool* mr[detail::kManyRows];
        E* orow[detail::kManyRows];
        for (int r = 0; r < rows; ++r) {
          qr[r] = qp + ((b * T + rt[r]) * H + rh[r]) * D;
          mr[r] = mp + (b * T + rt[r]) * L;
          orow[r] = op + ((b * T + rt[r]) * H + rh[r]) * D;
        }
        const E* kb = kp + (b * KV + kv) * cap * D;
        const E* vb = vp + (b * KV + kv) * cap * D;
        if (many) {
          if constexpr (std::is_same_v<E, bf16>)
            if (dp) return detail::attention_many_avx512bf16(qr, mr, orow, rows, kb, vb, L, D, scale, buf, sp.data());
          detail::attention_many_avx512(qr, mr, orow, rows, kb, vb, L, D, scale, buf, sp.data());
          return;
        }
        e.resize(static_cast<std::size_t>(L));
        E* sr[detail::kBlockRows];
        E* pr[detail::kBlockRows];
        for (int r = 0; r < rows; ++r) {
          sr[r] = sp.data() + r * L;
          pr[r] = sp.data() + (detail::kBlockRows + r) * L;
        }
        if constexpr (std::is_same_v<E, bf16>) {
          if (dp) {
            detail::scores_block_avx512bf16(qr, mr, sr, rows, kb, L, D, scale);
            for (int r = 0; r < rows; ++r) detail::softmax_row_avx512(sr[r], pr[r], L, e.data());
            detail::values_block_avx512bf16(pr, orow, rows, vb, L, D, buf);
            return;
          }
        }
        if (has_avx512()) {
          detail::scores_block_avx512(qr, mr, sr, rows, kb, L, D, scale, buf);
          for (int r = 0; r < rows; ++r) detail::softmax_row_avx512(sr[r], pr[r], L, e.data());
          detail::values_block_avx512(pr, orow, rows, vb, L, D, buf);
        } else {
          detail::scores_block_avx2(qr, mr, sr, rows, kb, L, D, scale, buf);
          for (int r = 0; r < rows; ++r) softmax_row_any(sr[r], pr[r], L, e.data());
          detail::values_block_avx2(pr, orow, rows, vb, L, D, buf);
        }
      });
}

void check_dtype(const at::Tensor& t, const char* what) {
  DMI_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "{}: dtype must be float32 or bfloat16",
            what);
}

// x [B, T, heads, D] as rows: a view with each position's heads contiguous
// (q, k, v of the fused projection) is read in place, positions the returned
// stride apart; any other layout is copied to contiguous into xc first.
std::int64_t position_stride(const at::Tensor& x, at::Tensor& xc) {
  const std::int64_t H = x.size(2), D = x.size(3);
  xc = x;
  if (x.is_contiguous()) return H * D;
  const std::int64_t positions = collapsed_stride(x, 2);
  if (positions >= 0 && x.stride(3) == 1 && (x.stride(2) == D || H == 1)) return positions;
  xc = x.contiguous();
  return H * D;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_dtype(x, "rms_norm");
  const std::int64_t n = x.size(-1);
  DMI_CHECK(w.numel() == n && w.scalar_type() == x.scalar_type(), "rms_norm: weight must be [{}] of the input's dtype",
            n);
  at::Tensor xc = x, wc = w.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const std::int64_t rows = n ? x.numel() / n : 0;
  // Rows [outer, inner]: the whole tensor, or a view whose last two dims are
  // contiguous rows (collapsed_stride), read in place.
  std::int64_t inner = std::max<std::int64_t>(rows, 1), outer_stride = 0;
  if (!x.is_contiguous()) {
    const std::int64_t outer = x.dim() >= 2 ? collapsed_stride(x, x.dim() - 2) : -1;
    if (outer >= 0 && x.stride(-1) == 1 && (x.stride(-2) == n || x.size(-2) == 1)) {
      inner = std::max<std::int64_t>(x.size(-2), 1), outer_stride = outer;
    } else {
      xc = x.contiguous();
    }
  }
  if (x.scalar_type() == at::kFloat)
    rms_norm_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), rows, n, inner, outer_stride,
                  static_cast<float>(eps));
  else
    rms_norm_rows(reinterpret_cast<const std::uint16_t*>(xc.data_ptr()),
                  reinterpret_cast<const std::uint16_t*>(wc.data_ptr()),
                  reinterpret_cast<std::uint16_t*>(out.data_ptr()), rows, n, inner, outer_stride,
                  static_cast<float>(eps));
  return out;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_dtype(x, "rope");
  DMI_CHECK(x.dim() == 4, "rope: x [B, T, H, D] with cos, sin [B, T, 1, D] of its dtype");
  const std::int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  DMI_CHECK(D % 2 == 0 && cos.numel() == B * T * D && sin.numel() == B * T * D &&
                cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
            "rope: x [B, T, H, D] with cos, sin [B, T, 1, D] of its dtype");
  at::Tensor xc, cc = cos.contiguous(), sc = sin.contiguous();
  const std::int64_t x_stride = position_stride(x, xc);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat)
    rope_rows(xc.data_ptr<float>(), x_stride, cc.data_ptr<float>(), sc.data_ptr<float>(), out.data_ptr<float>(), B, T,
              H, D);
  else
    rope_rows(reinterpret_cast<const std::uint16_t*>(xc.data_ptr()), x_stride,
              reinterpret_cast<const std::uint16_t*>(cc.data_ptr()), reinterpret_cast<const std::uint16_t*>(sc.data_ptr()),
              reinterpret_cast<std::uint16_t*>(out.data_ptr()), B, T, H, D);
  return out;
}

void write_cache(at::Tensor& cache, const at::Tensor& x, std::int64_t start) {
  DMI_CHECK(x.dim() == 4 && cache.dim() == 4 && cache.is_contiguous() && x.scalar_type() == cache.scalar_type() &&
                x.size(0) == cache.size(0) && x.size(2) == cache.size(1) && x.size(3) == cache.size(3),
            "write_cache: x [B, T, heads, D] and cache [B, heads, capacity, D] (contiguous, one dtype) do not fit");
  const std::int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3), cap = cache.size(2);
  DMI_CHECK(start >= 0 && start + T <= cap, "write_cache: columns [{}, {}) outside the cache's {}", start, start + T, cap);
  at::Tensor xc = x.stride(3) == 1 ? x : x.contiguous();
  const std::size_t es = xc.element_size(), row = static_cast<std::size_t>(D) * es;
  const char* src = static_cast<const char*>(xc.data_ptr());
  char* dst = static_cast<char*>(cache.data_ptr());
  const std::int64_t s0 = xc.stride(0), s1 = xc.stride(1), s2 = xc.stride(2);
  parallel_for(0, B * T, grain(H * D), [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t bt = begin; bt < end; ++bt) {
      const std::int64_t b = bt / T, t = bt % T;
      for (std::int64_t h = 0; h < H; ++h)
        std::memcpy(dst + static_cast<std::size_t>(((b * H + h) * cap + start + t) * D) * es,
                    src + static_cast<std::size_t>(b * s0 + t * s1 + h * s2) * es, row);
    }
  });
}

at::Tensor attention_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_norm,
                            const at::Tensor& k_norm, double eps, const at::Tensor& cos, const at::Tensor& sin,
                            at::Tensor& k_cache, at::Tensor& v_cache, std::int64_t start) {
  check_dtype(q, "attention_inputs");
  const auto dtype = q.scalar_type();
  DMI_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && k.size(0) == q.size(0) &&
                k.size(1) == q.size(1) && k.size(3) == q.size(3) && q.size(3) % 2 == 0 &&
                k.scalar_type() == dtype && v.scalar_type() == dtype,
            "attention_inputs: q [B, T, H, D], k and v [B, T, KV, D] of one dtype, D even");
  const std::int64_t B = q.size(0), T = q.size(1), H = q.size(2), KV = k.size(2), D = q.size(3);
  DMI_CHECK(cos.numel() == B * T * D && sin.numel() == B * T * D && cos.scalar_type() == dtype &&
                sin.scalar_type() == dtype,
            "attention_inputs: cos, sin must be [B, T, 1, D] of q's dtype");
  DMI_CHECK(q_norm.defined() == k_norm.defined(), "attention_inputs: q and k are normalized both or neither");
  DMI_CHECK(!q_norm.defined() || (q_norm.numel() == D && k_norm.numel() == D && q_norm.scalar_type() == dtype &&
                                  k_norm.scalar_type() == dtype),
            "attention_inputs: q and k norm weights must be [{}] of q's dtype", D);
  for (const at::Tensor* cache : {&k_cache, &v_cache})
    DMI_CHECK(cache->dim() == 4 && cache->is_contiguous() && cache->scalar_type() == dtype && cache->size(0) == B &&
                  cache->size(1) == KV && cache->size(3) == D,
              "attention_inputs: caches must be [B, KV, capacity, D] (contiguous, q's dtype)");
  const std::int64_t capacity = k_cache.size(2);
  DMI_CHECK(v_cache.size(2) == capacity && start >= 0 && start + T <= capacity,
            "attention_inputs: columns [{}, {}) outside the cache's {}", start, start + T, capacity);
  at::Tensor qc, kc, vc, cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor qn = q_norm.defined() ? q_norm.contiguous() : q_norm, kn = k_norm.defined() ? k_norm.contiguous() : k_norm;
  const std::int64_t q_stride = position_stride(q, qc), k_stride = position_stride(k, kc),
                     v_stride = position_stride(v, vc);
  at::Tensor out = at::empty(q.sizes(), q.options());
  auto run = [&](auto tag) {
    using E = decltype(tag);
    auto ptr = [](const at::Tensor& t) { return t.defined() ? static_cast<E*>(t.data_ptr()) : nullptr; };
    AttentionInputs<E> a{ptr(qc), ptr(kc), ptr(vc), ptr(qn), ptr(kn), ptr(cc), ptr(sc), q_stride, k_stride, v_stride,
                         ptr(out), ptr(k_cache), ptr(v_cache), B, T, H, KV, D, capacity, start,
                         static_cast<float>(eps)};
    attention_inputs_rows(a);
  };
  if (dtype == at::kFloat) run(float{});
  else run(std::uint16_t{});
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_dtype(gate, "silu_mul");
  DMI_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(),
            "silu_mul: gate and up must have one shape and dtype");
  const std::int64_t n = gate.size(-1), rows = n ? gate.numel() / n : 0;
  // Rows may be strided views (gate and up are halves of one projection).
  at::Tensor g = gate.reshape({rows, n}), u = up.reshape({rows, n});
  if (g.stride(1) != 1) g = g.contiguous();
  if (u.stride(1) != 1) u = u.contiguous();
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  if (gate.scalar_type() == at::kFloat)
    silu_mul_rows(g.data_ptr<float>(), u.data_ptr<float>(), out.data_ptr<float>(), rows, n, g.stride(0), u.stride(0));
  else
    silu_mul_rows(reinterpret_cast<const std::uint16_t*>(g.data_ptr()), reinterpret_cast<const std::uint16_t*>(u.data_ptr()),
                  reinterpret_cast<std::uint16_t*>(out.data_ptr()), rows, n, g.stride(0), u.stride(0));
  return out;
}

at::Tensor softmax(const at::Tensor& scores) {
  check_dtype(scores, "softmax");
  const std::int64_t n = scores.size(-1), rows = n ? scores.numel() / n : 0;
  at::Tensor xc = scores.contiguous();
  at::Tensor out = at::empty(scores.sizes(), scores.options());
  if (scores.scalar_type() == at::kFloat)
    softmax_rows(xc.data_ptr<float>(), out.data_ptr<float>(), rows, n);
  else
    softmax_rows(reinterpret_cast<const std::uint16_t*>(xc.data_ptr()), reinterpret_cast<std::uint16_t*>(out.data_ptr()),
                 rows, n);
  return out;
}

std::string attention_arithmetic() {
  portable_attention_requested();  // throws on an invalid value
  return vdpbf16ps_attention() ? "vdpbf16ps" : "portable";
}

bool vdpbf16ps_attention_shape(std::int64_t head_dim, std::int64_t heads_per_kv) {
  return head_dim > 0 && head_dim % 32 == 0 && head_dim <= detail::kBlockMaxD && heads_per_kv >= 1 &&
         heads_per_kv <= detail::kBlockRows;
}

bool bf16_attention_on_vdpbf16ps(std::int64_t head_dim) {
  return vdpbf16ps_attention() && vdpbf16ps_attention_shape(head_dim, 1);
}

at::Tensor attention_scores(const at::Tensor& q, const at::Tensor& keys, std::int64_t L, const at::Tensor& masked,
                            double scale) {
  check_dtype(q, "attention_scores");
  DMI_CHECK(q.dim() == 4 && keys.dim() == 4 && keys.scalar_type() == q.scalar_type() && keys.size(3) == q.size(3) &&
                q.size(2) % keys.size(1) == 0 && L <= keys.size(2),
            "attention_scores: q [B, T, H, D] and keys [B, KV, capacity >= L, D] do not fit");
  at::Tensor qc = q.contiguous(), kc = keys.contiguous();
  at::Tensor mc = masked.expand({q.size(0), 1, q.size(1), L}).contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1), L}, q.options());
  if (q.scalar_type() == at::kFloat) scores_impl<float>(qc, kc, L, mc, static_cast<float>(scale), out);
  else scores_impl<std::uint16_t>(qc, kc, L, mc, static_cast<float>(scale), out);
  return out;
}

at::Tensor attention_values(const at::Tensor& probs, const at::Tensor& values, std::int64_t L) {
  check_dtype(probs, "attention_values");
  DMI_CHECK(probs.dim() == 4 && values.dim() == 4 && probs.size(3) == L && L <= values.size(2) &&
                values.scalar_type() == probs.scalar_type() && probs.size(1) % values.size(1) == 0,
            "attention_values: probs [B, H, T, L] and values [B, KV, capacity >= L, D] do not fit");
  at::Tensor pc = probs.contiguous(), vc = values.contiguous();
  at::Tensor out = at::empty({probs.size(0), probs.size(2), probs.size(1), values.size(3)}, probs.options());
  if (probs.scalar_type() == at::kFloat) values_impl<float>(pc, vc, L, out);
  else values_impl<std::uint16_t>(pc, vc, L, out);
  return out;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, std::int64_t L,
                     const at::Tensor& masked, double scale) {
  check_dtype(q, "attention");
  DMI_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && keys.scalar_type() == q.scalar_type() &&
                values.scalar_type() == q.scalar_type() && keys.sizes() == values.sizes() &&
                keys.size(3) == q.size(3) && q.size(2) % keys.size(1) == 0 && L <= keys.size(2),
            "attention: q [B, T, H, D], keys and values [B, KV, capacity >= L, D] do not fit");
  at::Tensor qc = q.contiguous(), kc = keys.contiguous(), vc = values.contiguous();
  at::Tensor mc = masked.expand({q.size(0), 1, q.size(1), L}).contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options());
  const bool fused = q.scalar_type() == at::kFloat
                         ? fused_impl<float>(qc, kc, vc, L, mc, static_cast<float>(scale), out)
                         : fused_impl<std::uint16_t>(qc, kc, vc, L, mc, static_cast<float>(scale), out);
  if (fused) return out;
  return attention_values(softmax(attention_scores(q, keys, L, masked, scale)), values, L);
}

}  // namespace dmi::kernels
