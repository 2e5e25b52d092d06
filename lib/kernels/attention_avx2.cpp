// AVX2 attention blocks: rows that share a KV head (scores, and
// probabilities·values), for CPUs without AVX-512. The arithmetic of the
// portable row loops in ops.cpp: a score's dot product in 16 fp32 lanes
// (here two 8-lane registers: lanes 0-7 and 8-15), the lanes summed pairwise
// (+8, +4, +2, +1), rounded, scaled, rounded; a value output sums p * v over
// the keys in order, skipping p == 0. Multiplies and adds unfused: the bits
// equal the portable code's. Compiled with -mavx2; called only on CPUs that
// have it.
#include <immintrin.h>

#include "kernels/gemm_impl.h"

namespace dmi::kernels::detail {

namespace {

inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return widen8(p); }
inline float value(const float* p, int64_t i) { return p[i]; }
inline float value(const uint16_t* p, int64_t i) { return bf16_value(p[i]); }

// 8 floats rounded to bfloat16 as to_bf16 does (NaN stays NaN): the bits
// in the low half of each 32-bit lane.
inline __m256i to_bf16_lanes(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, quiet_nan, nan);
}
inline void store8(uint16_t* o, __m256 v) {
  const __m256i r = to_bf16_lanes(v);  // each lane <= 0xffff: the unsigned pack is exact
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(o), packed);
}
inline void store8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }

// Scores from 8 dot products: rounded to the dtype, times scale, rounded.
inline void scores8(uint16_t* o, __m256 dots, float scale) {
  const __m256 rounded = _mm256_castsi256_ps(_mm256_slli_epi32(to_bf16_lanes(dots), 16));
  store8(o, _mm256_mul_ps(rounded, _mm256_set1_ps(scale)));
}
inline void scores8(float* o, __m256 dots, float scale) { store8(o, _mm256_mul_ps(dots, _mm256_set1_ps(scale))); }
inline void set_neg_inf(uint16_t* o) { *o = 0xff80; }
inline void set_neg_inf(float* o) { *o = -__builtin_inff(); }

// The rows [c0, c0 + n) of a block's keys or values (D apart) in fp32:
// bf16 widened into w, fp32 read where they lie.
inline const float* rows_f32(const float* b, int64_t c0, int64_t, int64_t D, float*) { return b + c0 * D; }
inline const float* rows_f32(const uint16_t* b, int64_t c0, int64_t n, int64_t D, float* w) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(w + j * D + d, widen8(b + (c0 + j) * D + d));
  return w;
}

// A block's rows in pairs, then an odd last one: fn(Int<ROWS>{}, r0).
template <class Fn>
inline void for_pairs(int rows, Fn fn) {
  int r0 = 0;
  for (; r0 + 2 <= rows; r0 += 2) fn(Int<2>{}, r0);
  if (r0 < rows) fn(Int<1>{}, r0);
}

// Four dot products of R rows (fp32, q[r]) with 4 / R keys (k[j]: fp32 or
// bf16, widened here), each in 16 lanes (lo: lanes 0-7, hi: 8-15) and summed
// in the tree's order, four at once: dot d = r * (4 / R) + j in lane
// dot_lane(d), [d0, d2, d0, d2, d1, d3, d1, d3].
constexpr int dot_lane(int d) { return (d & 1) * 4 + (d >> 1); }
template <int R, class K>
inline __m256 dots4(const float* const* q, const K* const* k, int64_t D) {
  constexpr int KEYS = 4 / R;
  __m256 lo0 = _mm256_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0, lo2 = lo0, hi2 = lo0, lo3 = lo0, hi3 = lo0;
  // Named accumulators, in the order d = r * KEYS + j (an array of them can
  // end up in memory: gemm_avx2.cpp).
  auto acc = [&](int d, __m256 l, __m256 h) {
    switch (d) {
      case 0: lo0 = _mm256_add_ps(lo0, l), hi0 = _mm256_add_ps(hi0, h); break;
      case 1: lo1 = _mm256_add_ps(lo1, l), hi1 = _mm256_add_ps(hi1, h); break;
      case 2: lo2 = _mm256_add_ps(lo2, l), hi2 = _mm256_add_ps(hi2, h); break;
      default: lo3 = _mm256_add_ps(lo3, l), hi3 = _mm256_add_ps(hi3, h); break;
    }
  };
  for (int64_t i = 0; i < D; i += 16) {
    __m256 ql[R], qh[R];
    for (int r = 0; r < R; ++r) ql[r] = _mm256_loadu_ps(q[r] + i), qh[r] = _mm256_loadu_ps(q[r] + i + 8);
    for (int j = 0; j < KEYS; ++j) {
      const __m256 kl = load8(k[j] + i), kh = load8(k[j] + i + 8);
      for (int r = 0; r < R; ++r) acc(r * KEYS + j, _mm256_mul_ps(ql[r], kl), _mm256_mul_ps(qh[r], kh));
    }
  }
  // Lanes l and l + 8 added (s8), then per dot [s8 0-3] + [s8 4-7] (s4), then
  // elements 0, 1 + 2, 3 (s2), then 0 + 1: reduce16's pairs.
  const __m256 v0 = _mm256_add_ps(lo0, hi0), v1 = _mm256_add_ps(lo1, hi1);
  const __m256 v2 = _mm256_add_ps(lo2, hi2), v3 = _mm256_add_ps(lo3, hi3);
  const __m256 x01 = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20), _mm256_permute2f128_ps(v0, v1, 0x31));
  const __m256 x23 = _mm256_add_ps(_mm256_permute2f128_ps(v2, v3, 0x20), _mm256_permute2f128_ps(v2, v3, 0x31));
  const __m256 y = _mm256_add_ps(_mm256_shuffle_ps(x01, x23, 0x44), _mm256_shuffle_ps(x01, x23, 0xee));
  return _mm256_add_ps(_mm256_shuffle_ps(y, y, 0x88), _mm256_shuffle_ps(y, y, 0xdd));
}

// Scores of rows [r0, r0 + R) against the n keys of a chunk (keys: fp32 or
// bf16 rows D apart), in tiles of R rows x 4 / R keys; a short last tile
// repeats its last key. masked[r] bit j: key j is masked for row r; a tile
// whose every score is masked computes nothing.
template <int R, class K, class E>
inline void scores_rows(const float* qw, int r0, const uint32_t* masked, const K* keys, int n, int64_t D, float scale,
                        E* const* o, int64_t c0) {
  constexpr int KEYS = 4 / R;
  const float* q[R];
  for (int r = 0; r < R; ++r) q[r] = qw + (r0 + r) * D;
  for (int j0 = 0; j0 < n; j0 += KEYS) {
    int key[KEYS];
    const K* k[KEYS];
    uint32_t in_tile = 0;
    for (int j = 0; j < KEYS; ++j) {
      key[j] = j0 + j < n ? j0 + j : n - 1;
      k[j] = keys + key[j] * D;
      in_tile |= 1u << key[j];
    }
    bool any = false;
    for (int r = 0; r < R; ++r) any = any || (~masked[r0 + r] & in_tile) != 0;
    alignas(32) E scores[8] = {};
    if (any) scores8(scores, dots4<R>(q, k, D), scale);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < KEYS; ++j) {
        E* out = o[r0 + r] + c0 + key[j];
        if ((masked[r0 + r] >> key[j]) & 1u) set_neg_inf(out);
        else *out = scores[dot_lane(r * KEYS + j)];
      }
  }
}

template <class E>
void scores_block_t(const E* const* q, const bool* const* m, E* const* o, int rows, const E* kb, int64_t L, int64_t D,
                    float scale, float* scratch) {
  float* qw = scratch;                   // [rows][D]
  float* kw = scratch + kBlockRows * D;  // [16][D]
  for (int r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(qw + r * D + d, load8(q[r] + d));
  const bool decode = rows <= 4;  // keys widened in registers, asked for two chunks ahead
  if (decode) prefetch_rows(kb, 0, 32, L, D);
  for (int64_t c0 = 0; c0 < L; c0 += 16) {
    const int n = L - c0 < 16 ? static_cast<int>(L - c0) : 16;
    if (decode) prefetch_rows(kb, c0 + 32, c0 + 48, L, D);
    uint32_t masked[kBlockRows];
    const uint32_t all = (1u << n) - 1;
    bool any = false;
    for (int r = 0; r < rows; ++r) {
      masked[r] = 0;
      for (int j = 0; j < n; ++j) masked[r] |= static_cast<uint32_t>(m[r][c0 + j]) << j;
      any = any || masked[r] != all;
    }
    if (!any) {
      for (int r = 0; r < rows; ++r)
        for (int j = 0; j < n; ++j) set_neg_inf(o[r] + c0 + j);
      continue;
    }
    auto groups = [&](const auto* keys) {
      for_pairs(rows, [&](auto g, int r0) {
        scores_rows<decltype(g)::value>(qw, r0, masked, keys, n, D, scale, o, c0);
      });
    };
    if (decode) groups(kb + c0 * D);
    else groups(rows_f32(kb, c0, n, D, kw));
  }
}

// Rows [r0, r0 + R) of a block, columns [d0, d0 + 8 PIECES), over the n keys
// of a chunk: acc ([rows][D], the sums so far) += p * v per key in order;
// pf: the rows' weights [rows][kBlockKeys]; live[r] bit j: row r weighs key
// j (p != 0). A key no row weighs is skipped, a row that does not weigh it
// is left unchanged: values_row's bits.
template <int R, int PIECES, class V>
inline void values_rows(float* acc, const float* pf, const uint32_t* live, int r0, const V* v, int64_t n, int64_t D,
                        int64_t d0) {
  __m256 a[R][PIECES];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < PIECES; ++k) a[r][k] = _mm256_loadu_ps(acc + (r0 + r) * D + d0 + 8 * k);
  for (int64_t j = 0; j < n; ++j) {
    uint32_t on = 0;  // bit r: row r0 + r weighs key j
    for (int r = 0; r < R; ++r) on |= ((live[r0 + r] >> j) & 1u) << r;
    if (on == 0) continue;
    const V* vj = v + j * D + d0;
    for (int k = 0; k < PIECES; ++k) {
      const __m256 vk = load8(vj + 8 * k);
      for (int r = 0; r < R; ++r)
        if ((on >> r) & 1u)
          a[r][k] = _mm256_add_ps(a[r][k], _mm256_mul_ps(_mm256_set1_ps(pf[(r0 + r) * kBlockKeys + j]), vk));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < PIECES; ++k) _mm256_storeu_ps(acc + (r0 + r) * D + d0 + 8 * k, a[r][k]);
}

// All D columns of rows [r0, r0 + R): passes of 32 columns (2 rows x 4
// registers), 16 for the rest (D is a multiple of 16).
template <int R, class V>
inline void values_group(float* acc, const float* pf, const uint32_t* live, int r0, const V* v, int64_t n, int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) values_rows<R, 4>(acc, pf, live, r0, v, n, D, d0);
  if (d0 < D) values_rows<R, 2>(acc, pf, live, r0, v, n, D, d0);
}

template <class E>
void values_block_t(const E* const* p, E* const* o, int rows, const E* vb, int64_t L, int64_t D, float* scratch) {
  float* acc = scratch;                  // [rows][D]
  float* vw = scratch + kBlockRows * D;  // [kBlockKeys][D]
  for (int64_t i = 0; i < rows * D; ++i) acc[i] = 0.0f;
  alignas(32) float pf[kBlockRows * kBlockKeys];
  uint32_t live[kBlockRows];
  const bool decode = rows <= 4;  // values widened in registers, asked for a chunk ahead
  if (decode) prefetch_rows(vb, 0, kBlockKeys, L, D);
  for (int64_t c0 = 0; c0 < L; c0 += kBlockKeys) {
    const int64_t n = L - c0 < kBlockKeys ? L - c0 : kBlockKeys;
    if (decode) prefetch_rows(vb, c0 + kBlockKeys, c0 + 2 * kBlockKeys, L, D);
    uint32_t any = 0;
    for (int r = 0; r < rows; ++r) {
      live[r] = 0;
      for (int64_t j = 0; j < n; ++j) {
        const float w = value(p[r] + c0, j);
        pf[r * kBlockKeys + j] = w;
        live[r] |= static_cast<uint32_t>(w != 0.0f) << j;  // a NaN weighs
      }
      any |= live[r];
    }
    if (any == 0) continue;
    auto groups = [&](const auto* v) {
      for_pairs(rows, [&](auto g, int r0) { values_group<decltype(g)::value>(acc, pf, live, r0, v, n, D); });
    };
    if (decode) groups(vb + c0 * D);
    else groups(rows_f32(vb, c0, n, D, vw));
  }
  for (int r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; d += 8) store8(o[r] + d, _mm256_loadu_ps(acc + r * D + d));
}

}  // namespace

void scores_block_avx2(const uint16_t* const* q, const bool* const* masked, uint16_t* const* out, int rows,
                       const uint16_t* keys, int64_t L, int64_t D, float scale, float* scratch) {
  scores_block_t(q, masked, out, rows, keys, L, D, scale, scratch);
}
void scores_block_avx2(const float* const* q, const bool* const* masked, float* const* out, int rows,
                       const float* keys, int64_t L, int64_t D, float scale, float* scratch) {
  scores_block_t(q, masked, out, rows, keys, L, D, scale, scratch);
}
void values_block_avx2(const uint16_t* const* probs, uint16_t* const* out, int rows, const uint16_t* values,
                       int64_t L, int64_t D, float* scratch) {
  values_block_t(probs, out, rows, values, L, D, scratch);
}
void values_block_avx2(const float* const* probs, float* const* out, int rows, const float* values, int64_t L,
                       int64_t D, float* scratch) {
  values_block_t(probs, out, rows, values, L, D, scratch);
}

}  // namespace dmi::kernels::detail
