// AVX2 + FMA: 16 registers. One row (decode) takes a whole 64-column panel
// per pass (8 accumulators), so the weights stream once, in order; tiles of
// more rows compute the panel as 32-column strips (8 accumulators for two
// rows). Same FMAs in the same order as the AVX-512 and scalar kernels.
// Compiled with -mavx2 -mfma.
#include <immintrin.h>

#include "kernels/gemm_impl.h"

namespace dmi::kernels::detail {

namespace {

// Columns [c0, c0 + 8 S) of panel p for MR rows: S accumulators per row.
template <int MR, int S>
void strip_bf16w(const GemmArgs& a, int64_t m0, int64_t p, int c0, int64_t k0, int64_t k1, float* out, bool first,
                 Prefetch pf) {
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + p * a.K * kPanel + 2 * c0;
  const float* x = static_cast<const float*>(a.x) + m0 * a.x_stride;
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[MR][S];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < S; ++j) acc[r][j] = first ? _mm256_setzero_ps() : _mm256_load_ps(out + r * kPanel + c0 + 8 * j);
  for (int64_t kp = k0; kp < k1; ++kp) {
    const uint16_t* wk = w + kp * 2 * kPanel;
    pf.at(wk - 2 * c0);  // the unit's first line
    for (int r = 0; r < MR; ++r) {
      const __m256 b0 = _mm256_broadcast_ss(x + r * a.x_stride + 2 * kp);
      const __m256 b1 = _mm256_broadcast_ss(x + r * a.x_stride + 2 * kp + 1);
      for (int j = 0; j < S; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16 * j));
        acc[r][j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), b0, acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, odd_mask)), b1, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < S; ++j) _mm256_store_ps(out + r * kPanel + c0 + 8 * j, acc[r][j]);
}

template <int MR, int S>
void strip_f32w(const GemmArgs& a, int64_t m0, int64_t p, int c0, int64_t k0, int64_t k1, float* out, bool first,
                Prefetch pf) {
  const float* w = static_cast<const float*>(a.w) + p * a.K * kPanel + c0;
  const float* x = static_cast<const float*>(a.x) + m0 * a.x_stride;
  __m256 acc[MR][S];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < S; ++j) acc[r][j] = first ? _mm256_setzero_ps() : _mm256_load_ps(out + r * kPanel + c0 + 8 * j);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * kPanel;
    pf.at(wk - c0);
    for (int r = 0; r < MR; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * a.x_stride + k);
      for (int j = 0; j < S; ++j) acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(wk + 8 * j), b, acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < S; ++j) _mm256_store_ps(out + r * kPanel + c0 + 8 * j, acc[r][j]);
}

}  // namespace

void gemm_bf16w_avx2(const GemmArgs& a) {
  drive<2>(a, a.K / 2, [&](auto mr, auto, int64_t m, int64_t p, int64_t k0, int64_t k1, float* acc, bool first,
                      Prefetch pf) {
    constexpr int MR = decltype(mr)::value;
    if constexpr (MR == 1) {
      strip_bf16w<1, 8>(a, m, p, 0, k0, k1, acc, first, pf);
    } else {  // each strip prefetches half the tile's lines
      const int mid = (pf.lo + pf.hi) / 2;
      strip_bf16w<MR, 4>(a, m, p, 0, k0, k1, acc, first, Prefetch{pf.lo, mid});
      strip_bf16w<MR, 4>(a, m, p, 32, k0, k1, acc, first, Prefetch{mid, pf.hi});
    }
  });
}

void gemm_f32w_avx2(const GemmArgs& a) {
  drive<2>(a, a.K, [&](auto mr, auto, int64_t m, int64_t p, int64_t k0, int64_t k1, float* acc, bool first,
                      Prefetch pf) {
    constexpr int MR = decltype(mr)::value;
    if constexpr (MR == 1) {
      strip_f32w<1, 8>(a, m, p, 0, k0, k1, acc, first, pf);
    } else {  // each strip prefetches half the tile's lines
      const int mid = (pf.lo + pf.hi) / 2;
      strip_f32w<MR, 4>(a, m, p, 0, k0, k1, acc, first, Prefetch{pf.lo, mid});
      strip_f32w<MR, 4>(a, m, p, 32, k0, k1, acc, first, Prefetch{mid, pf.hi});
    }
  });
}

// kernels/linear.h, measure_peak_macs_per_second: the 256-bit fp32 FMA
// alone, 8 multiply-adds each (12 chains and 2 operands: 14 of the 16
// registers).
int64_t peak_macs_avx2(int64_t iterations) {
  const __m256 x = _mm256_set1_ps(1.0f), y = _mm256_set1_ps(0.0078125f);
  return peak_chains<__m256>(iterations, 8, [&](__m256 a) { return _mm256_fmadd_ps(x, y, a); });
}

}  // namespace dmi::kernels::detail
