// AVX2 + FMA: 16 registers. One row (batch-1 decode) takes a whole 64-column
// panel per pass (8 accumulators), so the weights stream once, in order.
// Tiles of 2 to 6 rows compute the panel as four 16-column strips, one after
// the other: two accumulators per row, two weight vectors and a broadcast
// (bf16: up to 5 rows, since the odd halves' mask takes a register).
// Same FMAs in the same order as the AVX-512 and scalar kernels. Compiled
// with -mavx2 -mfma.
#include <immintrin.h>

#include "kernels/gemm_impl.h"

namespace dmi::kernels::detail {

namespace {

// How far ahead (bytes) the bf16 one-row tile prefetches: 1 KiB, four k
// units. At the AVX-512 kernels' 16 KiB (gemm_impl.h, kPrefetch) a Zen 3
// EPYC's batch-1 bf16 steps took 1.16x as long (dmi-bench TPOT, median of 6
// rounds each, 1, 4 and 16 KiB interleaved: 37.2, 44.8 and 43.1 ms); a
// decode step's 113 projections alone, interleaved in one process, 34.5-36.3
// ms at 1-1.25 KiB against 39.2-41.6 at 16 KiB and 38.6 with no prefetch
// (docs/benchmarks.md, 2026-12-06 fourth session). The fp32 one-row tile
// keeps 16 KiB: end to end its steps took 1.15x as long at 1 KiB (median
// 84.8 against 73.8 ms, the same rounds), though the projections alone had
// run faster (73.4 against 77.3 ms).
constexpr int64_t kRowPrefetchBf16 = 1024;
// The multi-row strips prefetch one k block (8 KiB, gemm_impl.h) ahead:
// there, fp32 batch-4 and batch-8 projections took 0.91-0.94x the time of
// 16 KiB, bf16 batch 8 0.96-0.98x, prefill tied; below 8 KiB they slowed
// down (1 KiB: 1.42x the time at bf16 batch 8).
constexpr int64_t kStripPrefetch = 8192;

// One row: columns [0, 64) of panel p, 8 accumulators; each weight vector
// is widened just before its two FMAs.
void row_bf16w(const GemmArgs& a, int64_t m0, int64_t p, int64_t k0, int64_t k1, float* out, bool first,
               Prefetch pf) {
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + p * a.K * kPanel;
  const float* x = static_cast<const float*>(a.x) + m0 * a.x_stride;
  const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = first ? _mm256_setzero_ps() : _mm256_load_ps(out + 8 * j);
  for (int64_t kp = k0; kp < k1; ++kp) {
    const uint16_t* wk = w + kp * 2 * kPanel;
    pf.at(wk, kRowPrefetchBf16);
    const __m256 b0 = _mm256_broadcast_ss(x + 2 * kp);
    const __m256 b1 = _mm256_broadcast_ss(x + 2 * kp + 1);
    for (int j = 0; j < 8; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16 * j));
      acc[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), b0, acc[j]);
      acc[j] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, odd_mask)), b1, acc[j]);
    }
  }
  for (int j = 0; j < 8; ++j) _mm256_store_ps(out + 8 * j, acc[j]);
}

void row_f32w(const GemmArgs& a, int64_t m0, int64_t p, int64_t k0, int64_t k1, float* out, bool first,
              Prefetch pf) {
  const float* w = static_cast<const float*>(a.w) + p * a.K * kPanel;
  const float* x = static_cast<const float*>(a.x) + m0 * a.x_stride;
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = first ? _mm256_setzero_ps() : _mm256_load_ps(out + 8 * j);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * kPanel;
    pf.at(wk);
    const __m256 b = _mm256_broadcast_ss(x + k);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(wk + 8 * j), b, acc[j]);
  }
  for (int j = 0; j < 8; ++j) _mm256_store_ps(out + 8 * j, acc[j]);
}

// The accumulators of up to 6 rows x 16 columns are named variables, one
// macro expansion per row: an array of them (`__m256 acc[6][2]`) was kept in
// memory by GCC 12 at 16 registers, a store per accumulator per k unit,
// and the 6-row tile ran the projections at ~65 % of the FMA peak instead of
// ~90 %.
#define DMI_SIX_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

// Columns [c0, c0 + 16) of panel p for MR rows. bf16: per k pair the even
// halves, widened, go through every row, then the odd halves (as the
// AVX-512 widening tile): each accumulator still takes k, then k + 1.
template <int MR, bool Bf16>
void strip(const GemmArgs& a, int64_t m0, int64_t p, int c0, int64_t k0, int64_t k1, float* out, bool first,
           Prefetch pf) {
  static_assert(MR >= 2 && MR <= (Bf16 ? 5 : 6), "12 accumulators, or 10 beside the bf16 mask");
  const int64_t xs = a.x_stride;
  const float* x0 = static_cast<const float*>(a.x) + m0 * xs;
  const float *x1 = x0 + xs, *x2 = x1 + xs, *x3 = x2 + xs, *x4 = x3 + xs, *x5 = x4 + xs;
  const __m256 zero = _mm256_setzero_ps();
  __m256 c00 = zero, c01 = zero, c10 = zero, c11 = zero, c20 = zero, c21 = zero;
  __m256 c30 = zero, c31 = zero, c40 = zero, c41 = zero, c50 = zero, c51 = zero;
#define DMI_LOAD(r)                                      \
  if constexpr (MR > r) {                                \
    if (!first) {                                        \
      c##r##0 = _mm256_load_ps(out + r * kPanel + c0);   \
      c##r##1 = _mm256_load_ps(out + r * kPanel + c0 + 8); \
    }                                                    \
  }
  DMI_SIX_ROWS(DMI_LOAD)
#undef DMI_LOAD
  // Row r's two accumulators += w0, w1 x[r][k].
#define DMI_FMA(r)                                 \
  if constexpr (MR > r) {                          \
    const __m256 b = _mm256_broadcast_ss(x##r + k); \
    c##r##0 = _mm256_fmadd_ps(w0, b, c##r##0);     \
    c##r##1 = _mm256_fmadd_ps(w1, b, c##r##1);     \
  }
  int64_t next_pf = pf.first_unit(k0, k1);  // the next unit whose line [pf.lo, pf.hi) it prefetches
  if constexpr (Bf16) {
    const uint16_t* w = static_cast<const uint16_t*>(a.w) + p * a.K * kPanel + 2 * c0;
    const __m256i odd_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    for (int64_t kp = k0; kp < k1; ++kp) {
      const uint16_t* wk = w + kp * 2 * kPanel;
      if (kp == next_pf) {
        pf.at(wk - 2 * c0, kStripPrefetch);  // relative to the unit's first line
        next_pf += pf.parts;
      }
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + 16));
      {
        const int64_t k = 2 * kp;
        const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
        const __m256 w1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
        DMI_SIX_ROWS(DMI_FMA)
      }
      {
        const int64_t k = 2 * kp + 1;
        const __m256 w0 = _mm256_castsi256_ps(_mm256_and_si256(v0, odd_mask));
        const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(v1, odd_mask));
        DMI_SIX_ROWS(DMI_FMA)
      }
    }
  } else {
    const float* w = static_cast<const float*>(a.w) + p * a.K * kPanel + c0;
    for (int64_t k = k0; k < k1; ++k) {
      const float* wk = w + k * kPanel;
      if (k == next_pf) {
        pf.at(wk - c0, kStripPrefetch);
        next_pf += pf.parts;
      }
      const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
      DMI_SIX_ROWS(DMI_FMA)
    }
  }
#undef DMI_FMA
#define DMI_STORE(r)                                     \
  if constexpr (MR > r) {                                \
    _mm256_store_ps(out + r * kPanel + c0, c##r##0);     \
    _mm256_store_ps(out + r * kPanel + c0 + 8, c##r##1); \
  }
  DMI_SIX_ROWS(DMI_STORE)
#undef DMI_STORE
}
#undef DMI_SIX_ROWS

// One row: a single pass. More rows: four strips one after the other over
// [k0, k1), each reading one of every unit's four lines; when the tile
// prefetches, each strip prefetches its own line (gemm_impl.h, Prefetch).
template <int MR, bool Bf16>
void tile(const GemmArgs& a, int64_t m, int64_t p, int64_t k0, int64_t k1, float* acc, bool first, Prefetch pf) {
  if constexpr (MR == 1) {
    (Bf16 ? row_bf16w : row_f32w)(a, m, p, k0, k1, acc, first, pf);
  } else {
    for (int c0 = 0; c0 < kPanel; c0 += 16) {
      const int line = c0 / 16;
      strip<MR, Bf16>(a, m, p, c0, k0, k1, acc, first,
                      Prefetch{line, line + 1, pf.part, pf.parts});
    }
  }
}

}  // namespace

// One row (batch-1 decode): a whole-depth pass per panel. 2 to 32 rows
// (decode batches): 4-row tiles in k blocks (drive()'s decode-sized path),
// so the strips read an 8 KiB block from L1 while memory streams the next
// (a whole-depth multi-strip tile would re-read the panel from L2 with
// memory idle), and batch 8 runs two even tiles of 8 accumulators. More
// rows (prefill): whole-depth 5-row (bf16) or 6-row (fp32) tiles in row
// blocks.
void gemm_bf16w_avx2(const GemmArgs& a) {
  drive<5, 4, 1>(a, a.K / 2, [&](auto mr, auto, int64_t m, int64_t p, int64_t k0, int64_t k1, float* acc, bool first,
                                Prefetch pf) {
    tile<decltype(mr)::value, true>(a, m, p, k0, k1, acc, first, pf);
  });
}

void gemm_f32w_avx2(const GemmArgs& a) {
  drive<6, 4, 1>(a, a.K, [&](auto mr, auto, int64_t m, int64_t p, int64_t k0, int64_t k1, float* acc, bool first,
                            Prefetch pf) {
    tile<decltype(mr)::value, false>(a, m, p, k0, k1, acc, first, pf);
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
