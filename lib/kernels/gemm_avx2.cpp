// AVX2 + FMA: 16 registers, so each 64-column panel is computed as four
// 16-column strips. Same FMAs in the same order as the AVX-512 and scalar
// kernels. Compiled with -mavx2 -mfma.
#include <immintrin.h>

#include "kernels/gemm_impl.h"

namespace dmi::kernels::detail {

namespace {

template <int MR>
void tile_bf16w(const GemmArgs& a, int64_t m0, int64_t p) {
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + p * a.K * kPanel;
  const float* x = static_cast<const float*>(a.x) + m0 * a.x_stride;
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  alignas(32) float out[MR * kPanel];
  const int64_t pairs = a.K / 2;
  for (int s = 0; s < 4; ++s) {  // columns [16 s, 16 s + 16)
    __m256 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t kp = 0; kp < pairs; ++kp) {
      const uint16_t* wk = w + kp * 2 * kPanel + 32 * s;
      __m256 even[2], odd[2];
      for (int j = 0; j < 2; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16 * j));
        even[j] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        odd[j] = _mm256_castsi256_ps(_mm256_and_si256(v, odd_mask));
      }
      for (int r = 0; r < MR; ++r) {
        const __m256 b0 = _mm256_broadcast_ss(x + r * a.x_stride + 2 * kp);
        const __m256 b1 = _mm256_broadcast_ss(x + r * a.x_stride + 2 * kp + 1);
        for (int j = 0; j < 2; ++j) {
          acc[r][j] = _mm256_fmadd_ps(even[j], b0, acc[r][j]);
          acc[r][j] = _mm256_fmadd_ps(odd[j], b1, acc[r][j]);
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 2; ++j) _mm256_store_ps(out + r * kPanel + 16 * s + 8 * j, acc[r][j]);
  }
  store_tile(a, m0, MR, p, out);
}

template <int MR>
void tile_f32w(const GemmArgs& a, int64_t m0, int64_t p) {
  const float* w = static_cast<const float*>(a.w) + p * a.K * kPanel;
  const float* x = static_cast<const float*>(a.x) + m0 * a.x_stride;
  alignas(32) float out[MR * kPanel];
  for (int s = 0; s < 4; ++s) {
    __m256 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < a.K; ++k) {
      const float* wk = w + k * kPanel + 16 * s;
      const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
      for (int r = 0; r < MR; ++r) {
        const __m256 b = _mm256_broadcast_ss(x + r * a.x_stride + k);
        acc[r][0] = _mm256_fmadd_ps(w0, b, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, b, acc[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 2; ++j) _mm256_store_ps(out + r * kPanel + 16 * s + 8 * j, acc[r][j]);
  }
  store_tile(a, m0, MR, p, out);
}

}  // namespace

void gemm_bf16w_avx2(const GemmArgs& a) {
  drive<4>(a, [&](auto mr, int64_t m, int64_t p) { tile_bf16w<decltype(mr)::value>(a, m, p); });
}

void gemm_f32w_avx2(const GemmArgs& a) {
  drive<6>(a, [&](auto mr, int64_t m, int64_t p) { tile_f32w<decltype(mr)::value>(a, m, p); });
}

}  // namespace dmi::kernels::detail
