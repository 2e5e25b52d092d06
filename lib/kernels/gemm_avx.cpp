// AVX without AVX2 and FMA (Sandy Bridge, Ivy Bridge; Jaguar-class cores):
// 16 registers of 8 floats, a 256-bit multiply and a 256-bit add. The
// tiles are gemm_avx_tiles.inc's, as the AVX2 kernels', with each
// multiply-add a multiply, then an add, each rounded to fp32, in the same
// order as the SSE2 kernels (gemm_sse2.cpp): the same bits as theirs, twice
// as wide. There, without these, dmi ran the SSE2 kernels while OpenBLAS
// runs its AVX kernels: eager PyTorch's fp32 batch-8 decode came within
// 2.5x of dmi's (emulated, docs/benchmarks.md, 2026-12-07 second session).
// AVX has no 256-bit integer shift: the even bf16 halves are shifted as
// two 128-bit halves; the odd ones are masked with a float AND. Compiled
// with -mavx.
#include <immintrin.h>

#include "kernels/gemm_impl.h"

namespace dmi::kernels::detail {

namespace {

inline __m256 mul_add(__m256 w, __m256 b, __m256 c) { return _mm256_add_ps(c, _mm256_mul_ps(w, b)); }
inline __m256 bf16_even(__m256i v) {
  const __m128i lo = _mm_slli_epi32(_mm256_castsi256_si128(v), 16);
  const __m128i hi = _mm_slli_epi32(_mm256_extractf128_si256(v, 1), 16);
  return _mm256_castsi256_ps(_mm256_insertf128_si256(_mm256_castsi128_si256(lo), hi, 1));
}
inline __m256 bf16_odd(__m256i v, __m256 mask) { return _mm256_and_ps(_mm256_castsi256_ps(v), mask); }

#include "kernels/gemm_avx_tiles.inc"

}  // namespace

void gemm_bf16w_avx(const GemmArgs& a) { gemm_bf16w_tiles(a); }
void gemm_f32w_avx(const GemmArgs& a) { gemm_f32w_tiles(a); }

// kernels/linear.h, measure_peak_macs_per_second: a 256-bit multiply and an
// add, 8 multiply-adds per pair (the chain through both, as the SSE2 loop).
int64_t peak_macs_avx(int64_t iterations) {
  const __m256 x = _mm256_set1_ps(1.0f), y = _mm256_set1_ps(0.5f);
  return peak_chains<__m256>(iterations, 8, [&](__m256 a) { return _mm256_add_ps(_mm256_mul_ps(a, y), x); });
}

}  // namespace dmi::kernels::detail
