// SSE2, which every x86-64 CPU has: the kernels of CPUs without AVX2 and FMA
// (x86-64 cores before Haswell and Piledriver, Atom-class cores, virtual
// CPUs that hide AVX). Without FMA each multiply-add is a multiply and an
// add, each rounded to fp32, so these kernels' bits are their own. (The
// portable kernels keep the FMA kernels' bits with libm's fmaf, a call per
// multiply-add: a Qwen3-0.6B fp32 decode step took 976 ms on them, about
// four times eager PyTorch's on such a CPU; docs/benchmarks.md, 2026-12-07.)
// Each output is still one fp32 accumulator summed over k in order (bf16:
// k, then k + 1), so a row's result does not depend on the batch, and any
// x86-64 CPU computes these bits under DMI_KERNELS=sse2.
//
// 16 registers of 4 floats. One row walks the panel a few k units at a
// time in two 32-column halves (row(), below); 2 to 5 rows walk it in
// 8-column strips (two accumulators per row, beside two weight vectors, a
// broadcast, a product and the bf16 mask), kKBlock units at a time, so that
// the block the first strips bring in from memory stays in L1 for the rest.
// Compiled with -msse2 (the x86-64 baseline).
#include <emmintrin.h>

#include "kernels/gemm_impl.h"

namespace dmi::kernels::detail {

namespace {

// How far ahead (bytes) the strips prefetch: one k block, as the AVX2 strips
// (gemm_avx2.cpp). Not measured on a CPU without AVX2.
constexpr int64_t kStripPrefetch = 8192;

#define DMI_FIVE_ROWS(X) X(0) X(1) X(2) X(3) X(4)

// Columns [c0, c0 + 8) of panel p for MR rows over k units [k0, k1). xb
// holds each row's x over those units broadcast to 4 lanes (n vectors per
// row: a unit's k, or its pair k, k + 1). When pf.parts > 0 the strip
// prefetches line pf.lo of the units k with k % pf.parts == pf.part
// (gemm_impl.h, Prefetch).
template <int MR, bool Bf16>
void strip(const GemmArgs& a, const __m128* xb, int64_t n, int64_t p, int c0, int64_t k0, int64_t k1, float* out,
           bool first, Prefetch pf) {
  static_assert(MR >= 2 && MR <= 5, "10 accumulators beside the weights, broadcast, product and mask");
  const __m128 *x0 = xb, *x1 = x0 + n, *x2 = x1 + n, *x3 = x2 + n, *x4 = x3 + n;
  const int64_t first_k = (Bf16 ? 2 : 1) * k0;  // x0[k - first_k] is row 0's x[k]
  const __m128 zero = _mm_setzero_ps();
  __m128 c00 = zero, c01 = zero, c10 = zero, c11 = zero, c20 = zero, c21 = zero;
  __m128 c30 = zero, c31 = zero, c40 = zero, c41 = zero;
#define DMI_LOAD(r)                                    \
  if constexpr (MR > r) {                              \
    if (!first) {                                      \
      c##r##0 = _mm_load_ps(out + r * kPanel + c0);    \
      c##r##1 = _mm_load_ps(out + r * kPanel + c0 + 4); \
    }                                                  \
  }
  DMI_FIVE_ROWS(DMI_LOAD)
#undef DMI_LOAD
  // Row r's two accumulators += w0, w1 x[r][k]: the product rounded, then the sum.
#define DMI_MUL_ADD(r)                                      \
  if constexpr (MR > r) {                                   \
    const __m128 b = x##r[k - first_k];                     \
    c##r##0 = _mm_add_ps(c##r##0, _mm_mul_ps(w0, b));       \
    c##r##1 = _mm_add_ps(c##r##1, _mm_mul_ps(w1, b));       \
  }
  int64_t next_pf = pf.first_unit(k0, k1);  // the next unit whose line pf.lo it prefetches
  // One line, known as such here: with pf's own bounds, batch-8 fp32 decode
  // steps took 1.05x as long and prefill 1.10x (Zen 3, 2 alternating rounds).
  const Prefetch line{pf.lo, pf.lo + 1, 0, 1};
  if constexpr (Bf16) {
    const uint16_t* w = static_cast<const uint16_t*>(a.w) + p * a.K * kPanel + 2 * c0;
    const __m128i odd_mask = _mm_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t kp = k0; kp < k1; ++kp) {
      const uint16_t* wk = w + kp * 2 * kPanel;
      if (kp == next_pf) {
        line.at(wk - 2 * c0, kStripPrefetch);  // relative to the unit's first line
        next_pf += pf.parts;
      }
      // Columns c0 .. c0 + 3 and c0 + 4 .. c0 + 7, each a (k, k + 1) pair.
      const __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wk));
      const __m128i v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + 8));
      {
        const int64_t k = 2 * kp;
        const __m128 w0 = _mm_castsi128_ps(_mm_slli_epi32(v0, 16));
        const __m128 w1 = _mm_castsi128_ps(_mm_slli_epi32(v1, 16));
        DMI_FIVE_ROWS(DMI_MUL_ADD)
      }
      {
        const int64_t k = 2 * kp + 1;
        const __m128 w0 = _mm_castsi128_ps(_mm_and_si128(v0, odd_mask));
        const __m128 w1 = _mm_castsi128_ps(_mm_and_si128(v1, odd_mask));
        DMI_FIVE_ROWS(DMI_MUL_ADD)
      }
    }
  } else {
    const float* w = static_cast<const float*>(a.w) + p * a.K * kPanel + c0;
    for (int64_t k = k0; k < k1; ++k) {
      const float* wk = w + k * kPanel;
      if (k == next_pf) {
        line.at(wk - c0, kStripPrefetch);
        next_pf += pf.parts;
      }
      const __m128 w0 = _mm_loadu_ps(wk), w1 = _mm_loadu_ps(wk + 4);
      DMI_FIVE_ROWS(DMI_MUL_ADD)
    }
  }
#undef DMI_MUL_ADD
#define DMI_STORE(r)                                 \
  if constexpr (MR > r) {                            \
    _mm_store_ps(out + r * kPanel + c0, c##r##0);    \
    _mm_store_ps(out + r * kPanel + c0 + 4, c##r##1); \
  }
  DMI_FIVE_ROWS(DMI_STORE)
#undef DMI_STORE
}
#undef DMI_FIVE_ROWS

// One row (batch-1 decode): 64 columns take 16 registers, so the row walks
// the panel kRowUnits units at a time, columns [0, 32) then [32, 64) with 8
// accumulators each (kept in `out` between blocks), prefetching the whole
// unit kRowPrefetch ahead in the first half when the tile prefetches (a
// short last tile of a decode-sized batch does not: gemm_impl.h, drive()).
// Short blocks keep the reads close to sequential: on a Zen 3 EPYC
// (DMI_KERNELS=sse2, Qwen3-0.6B shape, 2 alternating dmi-bench rounds)
// batch-1 fp32 steps took 71-84 ms at 4 units (72-76 at 2, 83-89 at 8,
// 97-100 at 32) against 119-134 ms for the 8-column strips below, and 80-83
// ms on the AVX2 kernel; bf16 40-42 ms at 4 units, AVX2 39-41
// (docs/benchmarks.md, 2026-12-07).
constexpr int64_t kRowUnits = 4;
constexpr int64_t kRowPrefetch = 4096;

template <bool Bf16>
void row(const GemmArgs& a, int64_t m0, int64_t p, int64_t k0, int64_t k1, float* out, bool first, Prefetch pf) {
  const bool fetch = pf.parts > 0;
  const float* x = static_cast<const float*>(a.x) + m0 * a.x_stride;
  const __m128i odd_mask = _mm_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t kb = k0; kb < k1; kb += kRowUnits) {
    const int64_t ke = k1 < kb + kRowUnits ? k1 : kb + kRowUnits;
    for (int c0 = 0; c0 < kPanel; c0 += 32) {
      __m128 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = first && kb == k0 ? _mm_setzero_ps() : _mm_load_ps(out + c0 + 4 * j);
      if constexpr (Bf16) {
        const uint16_t* w = static_cast<const uint16_t*>(a.w) + p * a.K * kPanel;
        for (int64_t kp = kb; kp < ke; ++kp) {
          const uint16_t* wk = w + kp * 2 * kPanel;
          if (fetch && c0 == 0) kWholeUnits.at(wk, kRowPrefetch);
          const __m128 b0 = _mm_set1_ps(x[2 * kp]), b1 = _mm_set1_ps(x[2 * kp + 1]);
          for (int j = 0; j < 8; ++j) {
            const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + 2 * c0 + 8 * j));
            acc[j] = _mm_add_ps(acc[j], _mm_mul_ps(_mm_castsi128_ps(_mm_slli_epi32(v, 16)), b0));
            acc[j] = _mm_add_ps(acc[j], _mm_mul_ps(_mm_castsi128_ps(_mm_and_si128(v, odd_mask)), b1));
          }
        }
      } else {
        const float* w = static_cast<const float*>(a.w) + p * a.K * kPanel;
        for (int64_t k = kb; k < ke; ++k) {
          const float* wk = w + k * kPanel;
          if (fetch && c0 == 0) kWholeUnits.at(wk, kRowPrefetch);
          const __m128 b = _mm_set1_ps(x[k]);
          for (int j = 0; j < 8; ++j) acc[j] = _mm_add_ps(acc[j], _mm_mul_ps(_mm_loadu_ps(wk + c0 + 4 * j), b));
        }
      }
      for (int j = 0; j < 8; ++j) _mm_store_ps(out + c0 + 4 * j, acc[j]);
    }
  }
}

// MR rows of panel p over [k0, k1): per k block, the rows' x broadcast
// once (four values per load), then the eight strips one after the other.
// The first strip of each cache line (16 columns) prefetches that line when
// the tile prefetches (pf.parts > 0, as the AVX2 strips). Batch-8 fp32
// decode steps on a Zen 3 EPYC (DMI_KERNELS=sse2, 3 alternating rounds):
// 203-205 ms with a load and a shuffle per row and k in every strip,
// 181-186 broadcast once per block, 175-178 four per load
// (docs/benchmarks.md, 2026-12-07).
template <int MR, bool Bf16>
void tile(const GemmArgs& a, int64_t m, int64_t p, int64_t k0, int64_t k1, float* acc, bool first, Prefetch pf) {
  if constexpr (MR == 1) {
    row<Bf16>(a, m, p, k0, k1, acc, first, pf);
    return;
  } else {
    constexpr int64_t per_unit = Bf16 ? 2 : 1;  // x values per k unit
    __m128 xb[MR * kKBlock * per_unit];
    const float* x = static_cast<const float*>(a.x) + m * a.x_stride;
    for (int64_t kb = k0; kb < k1; kb += kKBlock) {
      const int64_t ke = k1 < kb + kKBlock ? k1 : kb + kKBlock;
      const int64_t n = (ke - kb) * per_unit;
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * a.x_stride + kb * per_unit;
        __m128* dst = xb + r * n;
        int64_t i = 0;
        for (; i + 4 <= n; i += 4) {  // four at a time: a load and four shuffles
          const __m128 v = _mm_loadu_ps(xr + i);
          dst[i] = _mm_shuffle_ps(v, v, 0x00);
          dst[i + 1] = _mm_shuffle_ps(v, v, 0x55);
          dst[i + 2] = _mm_shuffle_ps(v, v, 0xaa);
          dst[i + 3] = _mm_shuffle_ps(v, v, 0xff);
        }
        for (; i < n; ++i) dst[i] = _mm_set1_ps(xr[i]);
      }
      for (int c0 = 0; c0 < kPanel; c0 += 8) {
        const int line = c0 / 16;
        const Prefetch lp = c0 % 16 == 0 ? Prefetch{line, line + 1, pf.part, pf.parts} : Prefetch{};
        strip<MR, Bf16>(a, xb, n, p, c0, kb, ke, acc, first && kb == k0, lp);
      }
    }
  }
}

}  // namespace

// One row (batch-1 decode): whole-depth tiles, k-blocked inside. 2 to 32
// rows: 4-row tiles in k blocks (drive()'s decode-sized path; batch 8 runs
// 4 + 4). More rows (prefill): 5-row tiles in row blocks.
void gemm_bf16w_sse2(const GemmArgs& a) {
  drive<5, 4, 1>(a, a.K / 2, [&](auto mr, auto, int64_t m, int64_t p, int64_t k0, int64_t k1, float* acc, bool first,
                                Prefetch pf) {
    tile<decltype(mr)::value, true>(a, m, p, k0, k1, acc, first, pf);
  });
}

void gemm_f32w_sse2(const GemmArgs& a) {
  drive<5, 4, 1>(a, a.K, [&](auto mr, auto, int64_t m, int64_t p, int64_t k0, int64_t k1, float* acc, bool first,
                            Prefetch pf) {
    tile<decltype(mr)::value, false>(a, m, p, k0, k1, acc, first, pf);
  });
}

// kernels/linear.h, measure_peak_macs_per_second: a 128-bit multiply and an
// add, 4 multiply-adds per pair. The chain goes through both (a = a y + x),
// or the compiler would hoist the multiply out of the loop.
int64_t peak_macs_sse2(int64_t iterations) {
  const __m128 x = _mm_set1_ps(1.0f), y = _mm_set1_ps(0.5f);
  return peak_chains<__m128>(iterations, 4, [&](__m128 a) { return _mm_add_ps(_mm_mul_ps(a, y), x); });
}

}  // namespace dmi::kernels::detail
