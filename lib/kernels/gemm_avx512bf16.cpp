// AVX512-BF16: vdpbf16ps multiplies bf16 pairs of x and W and adds both
// products to fp32 accumulators; weights and x stay bf16 all the way.
// Compiled with -mavx512f -mavx512bf16 (lib/CMakeLists.txt); called only when
// the CPU has both (kernels/isa.cpp).
#include <immintrin.h>

#include "kernels/gemm_impl.h"

namespace dmi::kernels::detail {

namespace {

template <int MR, int NP = 1>
void tile(const GemmArgs& a, int64_t m0, int64_t p, int64_t k0, int64_t k1, float* out, bool first,
          Prefetch pf) {
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + p * a.K * kPanel;
  const uint16_t* x = static_cast<const uint16_t*>(a.x) + m0 * a.x_stride;
  __m512 acc[NP][MR][4];
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j)
        acc[q][r][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(out + (q * MR + r) * kPanel + 16 * j);
  for (int64_t kp = k0; kp < k1; ++kp) {
    __m512bh wv[NP][4];
    for (int q = 0; q < NP; ++q) {
      const uint16_t* wk = w + (q * a.K / 2 + kp) * 2 * kPanel;
      pf.at(wk);
      for (int j = 0; j < 4; ++j) wv[q][j] = (__m512bh)_mm512_loadu_si512(wk + 32 * j);
    }
    for (int r = 0; r < MR; ++r) {
      int32_t xv;
      memcpy(&xv, x + r * a.x_stride + 2 * kp, 4);
      const __m512bh b = (__m512bh)_mm512_set1_epi32(xv);
      for (int q = 0; q < NP; ++q)
        for (int j = 0; j < 4; ++j) acc[q][r][j] = _mm512_dpbf16_ps(acc[q][r][j], wv[q][j], b);
    }
  }
  for (int q = 0; q < NP; ++q)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) _mm512_store_ps(out + (q * MR + r) * kPanel + 16 * j, acc[q][r][j]);
}

}  // namespace

void gemm_bf16w_avx512bf16(const GemmArgs& a) {
  drive<6, 6, 10, kWideMR>(
      a, a.K / 2,
      [&](auto mr, auto np, int64_t m, int64_t p, int64_t k0, int64_t k1, float* acc, bool first, Prefetch pf) {
        tile<decltype(mr)::value, decltype(np)::value>(a, m, p, k0, k1, acc, first, pf);
      });
}

// kernels/linear.h, measure_peak_macs_per_second: vdpbf16ps alone, 32
// multiply-adds each.
int64_t peak_macs_avx512bf16(int64_t iterations) {
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3c003c00);
  return peak_chains<__m512>(iterations, 32, [&](__m512 a) { return _mm512_dpbf16_ps(a, x, y); });
}

}  // namespace dmi::kernels::detail
