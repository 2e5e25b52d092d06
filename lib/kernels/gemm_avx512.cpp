// AVX-512F without BF16: bf16 weights widened to fp32 in registers (a shift
// for the even element of each pair, a mask for the odd one), then fp32 FMAs.
// Compiled with -mavx512f -mfma; called only when the CPU has AVX-512F.
#include <immintrin.h>

#include "kernels/gemm_impl.h"

namespace dmi::kernels::detail {

namespace {

// Per k pair: the even weights of the four vectors, widened, meet every row,
// then the odd ones (reloaded from L1, a mask instead of a shift): each
// accumulator still takes k then k + 1, and 6 rows fit the 32 registers (24
// accumulators, 4 weights, a broadcast). Widening both halves first held 8
// registers and allowed 4 rows: 6-row tiles take 0.90-0.97x the time of
// prefill's projections (docs/benchmarks.md, 2026-12-02 fourth session).
template <int MR, int NP = 1>
void tile_bf16w(const GemmArgs& a, int64_t m0, int64_t p, int64_t k0, int64_t k1, float* out, bool first,
                Prefetch pf) {
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + p * a.K * kPanel;
  const float* x = static_cast<const float*>(a.x) + m0 * a.x_stride;
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 acc[NP][MR][4];
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j)
        acc[q][r][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(out + (q * MR + r) * kPanel + 16 * j);
  for (int64_t kp = k0; kp < k1; ++kp) {
    __m512 wv[NP][4];
    for (int q = 0; q < NP; ++q) {
      const uint16_t* wk = w + (q * a.K / 2 + kp) * 2 * kPanel;
      pf.at(wk);
      for (int j = 0; j < 4; ++j)
        wv[q][j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(wk + 32 * j), 16));
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 b0 = _mm512_set1_ps(x[r * a.x_stride + 2 * kp]);
      for (int q = 0; q < NP; ++q)
        for (int j = 0; j < 4; ++j) acc[q][r][j] = _mm512_fmadd_ps(wv[q][j], b0, acc[q][r][j]);
    }
    for (int q = 0; q < NP; ++q) {
      const uint16_t* wk = w + (q * a.K / 2 + kp) * 2 * kPanel;
      for (int j = 0; j < 4; ++j)
        wv[q][j] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(wk + 32 * j), odd_mask));
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 b1 = _mm512_set1_ps(x[r * a.x_stride + 2 * kp + 1]);
      for (int q = 0; q < NP; ++q)
        for (int j = 0; j < 4; ++j) acc[q][r][j] = _mm512_fmadd_ps(wv[q][j], b1, acc[q][r][j]);
    }
  }
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) _mm512_store_ps(out + (q * MR + r) * kPanel + 16 * j, acc[q][r][j]);
}

template <int MR, int NP = 1>
void tile_f32w(const GemmArgs& a, int64_t m0, int64_t p, int64_t k0, int64_t k1, float* out, bool first,
               Prefetch pf) {
  const float* w = static_cast<const float*>(a.w) + p * a.K * kPanel;
  const float* x = static_cast<const float*>(a.x) + m0 * a.x_stride;
  __m512 acc[NP][MR][4];
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j)
        acc[q][r][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(out + (q * MR + r) * kPanel + 16 * j);
  for (int64_t k = k0; k < k1; ++k) {
    __m512 wv[NP][4];
    for (int q = 0; q < NP; ++q) {
      const float* wk = w + (q * a.K + k) * kPanel;
      pf.at(wk);
      for (int j = 0; j < 4; ++j) wv[q][j] = _mm512_loadu_ps(wk + 16 * j);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * a.x_stride + k]);
      for (int q = 0; q < NP; ++q)
        for (int j = 0; j < 4; ++j) acc[q][r][j] = _mm512_fmadd_ps(wv[q][j], b, acc[q][r][j]);
    }
  }
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) _mm512_store_ps(out + (q * MR + r) * kPanel + 16 * j, acc[q][r][j]);
}

}  // namespace

void gemm_bf16w_avx512(const GemmArgs& a) {
  drive<6, 4, 8, kWideMR>(
      a, a.K / 2,
      [&](auto mr, auto np, int64_t m, int64_t p, int64_t k0, int64_t k1, float* acc, bool first, Prefetch pf) {
        tile_bf16w<decltype(mr)::value, decltype(np)::value>(a, m, p, k0, k1, acc, first, pf);
      });
}

void gemm_f32w_avx512(const GemmArgs& a) {
  drive<6, 6, 10, kWideMR>(
      a, a.K,
      [&](auto mr, auto np, int64_t m, int64_t p, int64_t k0, int64_t k1, float* acc, bool first, Prefetch pf) {
        tile_f32w<decltype(mr)::value, decltype(np)::value>(a, m, p, k0, k1, acc, first, pf);
      });
}

// kernels/linear.h, measure_peak_macs_per_second: the 512-bit fp32 FMA
// alone, 16 multiply-adds each.
int64_t peak_macs_avx512(int64_t iterations) {
  const __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(0.0078125f);
  return peak_chains<__m512>(iterations, 16, [&](__m512 a) { return _mm512_fmadd_ps(x, y, a); });
}

}  // namespace dmi::kernels::detail
