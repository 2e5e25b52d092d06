// AVX-512F attention score rows: one query row against L cached keys. The
// same lane assignment and reduction tree as the portable dot() in ops.cpp
// (16 fp32 lanes, then +8, +4, +2, +1), multiplies and adds unfused, so the
// bits equal the portable code's. Compiled with -mavx512f; called only on
// CPUs that have it.
#include <immintrin.h>

#include "kernels/gemm_impl.h"

namespace dmi::kernels::detail {

namespace {

inline float reduce16(__m512 acc) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(acc),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

inline __m512 widen(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

constexpr int kMaxChunks = 32;  // head_dim up to 512

}  // namespace

bool scores_row_avx512(const uint16_t* q, const uint16_t* kb, const bool* m, uint16_t* o, int64_t L, int64_t D,
                       float scale) {
  if (D % 16 != 0 || D / 16 > kMaxChunks) return false;
  const int64_t chunks = D / 16;
  __m512 qv[kMaxChunks];
  for (int64_t i = 0; i < chunks; ++i) qv[i] = widen(q + 16 * i);
  const uint16_t neg_inf = 0xff80;
  for (int64_t c = 0; c < L; ++c) {
    if (m[c]) {
      o[c] = neg_inf;
      continue;
    }
    const uint16_t* k = kb + c * D;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < chunks; ++i) acc = _mm512_add_ps(acc, _mm512_mul_ps(qv[i], widen(k + 16 * i)));
    o[c] = to_bf16(bf16_value(to_bf16(reduce16(acc))) * scale);
  }
  return true;
}

bool scores_row_avx512(const float* q, const float* kb, const bool* m, float* o, int64_t L, int64_t D, float scale) {
  if (D % 16 != 0 || D / 16 > kMaxChunks) return false;
  const int64_t chunks = D / 16;
  __m512 qv[kMaxChunks];
  for (int64_t i = 0; i < chunks; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
  const uint32_t neg_inf_bits = 0xff800000u;
  float neg_inf;
  memcpy(&neg_inf, &neg_inf_bits, 4);
  for (int64_t c = 0; c < L; ++c) {
    if (m[c]) {
      o[c] = neg_inf;
      continue;
    }
    const float* k = kb + c * D;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < chunks; ++i) acc = _mm512_add_ps(acc, _mm512_mul_ps(qv[i], _mm512_loadu_ps(k + 16 * i)));
    o[c] = reduce16(acc) * scale;
  }
  return true;
}

}  // namespace dmi::kernels::detail
