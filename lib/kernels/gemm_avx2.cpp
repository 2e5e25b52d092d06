// AVX2 + FMA: 16 registers of 8 floats. The tiles are gemm_avx_tiles.inc's
// (one row takes a whole 64-column panel per pass; 2 to 6 rows walk it in
// four 16-column strips), here with one fused multiply-add per step: the same
// FMAs in the same order as the AVX-512 and scalar kernels. Compiled with
// -mavx2 -mfma.
#include <immintrin.h>

#include "kernels/gemm_impl.h"

namespace dmi::kernels::detail {

namespace {

inline __m256 mul_add(__m256 w, __m256 b, __m256 c) { return _mm256_fmadd_ps(w, b, c); }
inline __m256 bf16_even(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 bf16_odd(__m256i v, __m256 mask) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_castps_si256(mask)));
}

#include "kernels/gemm_avx_tiles.inc"

}  // namespace

void gemm_bf16w_avx2(const GemmArgs& a) { gemm_bf16w_tiles(a); }
void gemm_f32w_avx2(const GemmArgs& a) { gemm_f32w_tiles(a); }

// kernels/linear.h, measure_peak_macs_per_second: the 256-bit fp32 FMA
// alone, 8 multiply-adds each (12 chains and 2 operands: 14 of the 16
// registers).
int64_t peak_macs_avx2(int64_t iterations) {
  const __m256 x = _mm256_set1_ps(1.0f), y = _mm256_set1_ps(0.0078125f);
  return peak_chains<__m256>(iterations, 8, [&](__m256 a) { return _mm256_fmadd_ps(x, y, a); });
}

}  // namespace dmi::kernels::detail
