// Portable fallback: plain loops with fmaf, in the order the vector kernels
// use, so every machine computes the same bits as AVX2/AVX-512 would.
#include <math.h>

#include "kernels/gemm_impl.h"

namespace dmi::kernels::detail {

void gemm_bf16w_scalar(const GemmArgs& a) {
  drive<1>(a, a.K / 2, [&](auto, auto, int64_t m, int64_t p, int64_t k0, int64_t k1, float* acc, bool first, Prefetch) {
    const uint16_t* w = static_cast<const uint16_t*>(a.w) + p * a.K * kPanel;
    const float* x = static_cast<const float*>(a.x) + m * a.x_stride;
    if (first) memset(acc, 0, sizeof(float) * kPanel);
    for (int64_t kp = k0; kp < k1; ++kp)
      for (int64_t n = 0; n < kPanel; ++n) {
        const uint16_t* pair = w + (kp * kPanel + n) * 2;
        acc[n] = fmaf(bf16_value(pair[0]), x[2 * kp], acc[n]);
        acc[n] = fmaf(bf16_value(pair[1]), x[2 * kp + 1], acc[n]);
      }
  });
}

void gemm_f32w_scalar(const GemmArgs& a) {
  drive<1>(a, a.K, [&](auto, auto, int64_t m, int64_t p, int64_t k0, int64_t k1, float* acc, bool first, Prefetch) {
    const float* w = static_cast<const float*>(a.w) + p * a.K * kPanel;
    const float* x = static_cast<const float*>(a.x) + m * a.x_stride;
    if (first) memset(acc, 0, sizeof(float) * kPanel);
    for (int64_t k = k0; k < k1; ++k)
      for (int64_t n = 0; n < kPanel; ++n) acc[n] = fmaf(w[k * kPanel + n], x[k], acc[n]);
  });
}

}  // namespace dmi::kernels::detail
