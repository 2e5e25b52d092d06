// AVX512-BF16 attention for bf16 models: vdpbf16ps multiplies q and k, and
// the probabilities and v, as bf16 pairs where they lie (no widening) and adds
// both products to fp32 accumulators, 32 multiply-adds an instruction where
// the AVX-512F kernels (attention_avx512.cpp) do 16 in a multiply and an
// add. Its bits are its own, as the projections' vdpbf16ps kernel's are
// (gemm_avx512bf16.cpp); decode, prefill, blocks and rows agree with each
// other:
// - a score: lane l of 16 sums, over the 32-element chunks i of D in order,
//   vdpbf16ps(acc, q pair, k pair) on the elements (32 i + 2 l, 32 i + 2 l + 1)
//   (vdpbf16ps adds the odd product, then the even one, each rounded; inputs
//   and results below FLT_MIN are zero); then reduce16's tree (l + 8, + 4,
//   + 2, + 1), rounded to bf16, times scale, rounded, as the other kernels;
// - a value output d: over the key pairs (c, c + 1), c even from 0, in
//   order, vdpbf16ps(acc, (p_c, p_c+1), (v_c[d], v_c+1[d])). A key whose
//   weight is +-0 (masked, or past L) enters as +0 * +0; a pair with both
//   weights 0 is skipped. Rounded to bf16 at the end.
// Compiled with -mavx512f -mavx512bw -mavx512bf16 (lib/CMakeLists.txt);
// called only when the CPU has them and $DMI_KERNELS allows avx512_bf16
// (kernels/ops.cpp), for head_dim a multiple of 32.
#include <immintrin.h>

#include "kernels/gemm_impl.h"

namespace dmi::kernels::detail {

namespace {

#include "kernels/attention_avx512_common.inc"

inline __m512 dp(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
inline __m512i load_pairs(const uint16_t* p) { return _mm512_loadu_si512(p); }
// Pair word i of a bf16 row: elements 2 i (low half) and 2 i + 1.
inline __m512i pair_word(const uint16_t* p, int64_t i) {
  int32_t w;
  memcpy(&w, p + 2 * i, 4);
  return _mm512_set1_epi32(w);
}

// ---------------------------------------------------------------------------
// Scores.

// One row's scores against keys [0, n) (D apart): lane by lane, reduce16.
void scores_row(const uint16_t* q, const uint16_t* kb, const bool* m, uint16_t* o, int64_t n, int64_t D,
                float scale) {
  for (int64_t c = 0; c < n; ++c) {
    if (m[c]) {
      o[c] = 0xff80;
      continue;
    }
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 32) acc = dp(acc, load_pairs(q + i), load_pairs(kb + c * D + i));
    o[c] = to_bf16(bf16_value(to_bf16(reduce16(acc))) * scale);
  }
}

// Scores of rows [r0, r0 + ROWS) against the first n (<= 16) of 16 keys (D
// apart) in scores_tiles' tiles (attention_avx512.cpp's scores_group, with
// vdpbf16ps on the bf16 rows as they lie), asking for each line read the one
// `ahead` elements on (prefetch_ahead; 0: none).
template <int ROWS>
inline int scores_group(const uint16_t* const* q, int r0, const __mmask16* masked, const uint16_t* keys, int n,
                        int64_t D, float scale, uint16_t* const* o, int64_t c0, int64_t ahead, const uint16_t* end) {
  constexpr int KEYS = 16 / ROWS;
  return scores_tiles<ROWS>(r0, masked, n, scale, o, c0, [&](int k0, __m512* acc) {
    for (int64_t i = 0; i < D; i += 32) {
      __m512i qv[ROWS];
      for (int r = 0; r < ROWS; ++r) qv[r] = load_pairs(q[r0 + r] + i);
      for (int j = 0; j < KEYS; ++j) {
        prefetch_ahead(keys + (k0 + j) * D + i, ahead, end);
        const __m512i kv = load_pairs(keys + (k0 + j) * D + i);
        for (int r = 0; r < ROWS; ++r) acc[r * KEYS + j] = dp(acc[r * KEYS + j], qv[r], kv);
      }
    }
  });
}

void scores_block(const uint16_t* const* q, const bool* const* m, uint16_t* const* o, int rows, const uint16_t* kb,
                  int64_t L, int64_t D, float scale) {
  for_score_chunks(m, o, rows, kb, L, D, [&](int64_t c0, int n, const __mmask16* masked) {
    for_groups(rows, [&](auto g, int r0) {
      constexpr int ROWS = decltype(g)::value;
      const int done = scores_group<ROWS>(q, r0, masked, kb + c0 * D, n, D, scale, o, c0,
                                          rows <= 4 ? kKvAheadRows * D : 0, kb + L * D);
      if (done < n)
        for (int r = r0; r < r0 + ROWS; ++r)
          scores_row(q[r], kb + (c0 + done) * D, m[r] + c0 + done, o[r] + c0 + done, n - done, D, scale);
    });
  });
}

// kt[w][j] = pair word w of key c0 + j (j < 16; zero past n): 16 keys
// transposed in 16 x 16 blocks of pair words.
inline void transpose_pairs(const uint16_t* kb, int64_t c0, int n, int64_t D, float* kt) {
  for (int64_t w0 = 0; w0 < D / 2; w0 += 16) {
    __m512 r[16];
    for (int j = 0; j < 16; ++j)
      r[j] = j < n ? _mm512_castsi512_ps(load_pairs(kb + (c0 + j) * D + 2 * w0)) : _mm512_setzero_ps();
    transpose16(r, kt + w0 * 16);
  }
}

// Lanes P, P + 8, P + 4 and P + 12 of the dot products of ROWS q rows with
// 16 transposed keys (a key in each element), each lane summed over the
// chunks in order with the same vdpbf16ps operands as scores_group's; per row
// (lane P + lane P + 8) + (lane P + 4 + lane P + 12): the tree's s4[P].
template <int ROWS, int P>
inline void dot_lanes(const uint16_t* const* q, const float* kt, int64_t D, __m512* s4) {
  __m512 a0[ROWS], a1[ROWS], a2[ROWS], a3[ROWS];
  for (int r = 0; r < ROWS; ++r) a0[r] = a1[r] = a2[r] = a3[r] = _mm512_setzero_ps();
  for (int64_t w = 0; w < D / 2; w += 16) {
    const __m512i k0 = _mm512_castps_si512(_mm512_loadu_ps(kt + (w + P) * 16));
    const __m512i k1 = _mm512_castps_si512(_mm512_loadu_ps(kt + (w + P + 8) * 16));
    const __m512i k2 = _mm512_castps_si512(_mm512_loadu_ps(kt + (w + P + 4) * 16));
    const __m512i k3 = _mm512_castps_si512(_mm512_loadu_ps(kt + (w + P + 12) * 16));
    for (int r = 0; r < ROWS; ++r) {
      a0[r] = dp(a0[r], pair_word(q[r], w + P), k0);
      a1[r] = dp(a1[r], pair_word(q[r], w + P + 8), k1);
      a2[r] = dp(a2[r], pair_word(q[r], w + P + 4), k2);
      a3[r] = dp(a3[r], pair_word(q[r], w + P + 12), k3);
    }
  }
  for (int r = 0; r < ROWS; ++r) s4[r] = _mm512_add_ps(_mm512_add_ps(a0[r], a1[r]), _mm512_add_ps(a2[r], a3[r]));
}

// Scores of `rows` rows against keys [0, ends[r]) (attention_avx512.cpp's
// scores_many_t): 16 keys at a time, transposed once, then tiles of 4 rows
// (2 and 1 for the rest).
void scores_many(const uint16_t* const* q, const bool* const* m, uint16_t* const* o, int rows, const int64_t* ends,
                 const uint16_t* kb, int64_t L, int64_t D, float scale, float* kt) {
  for_score_chunks_many(m, o, rows, ends, L, [&](auto g, int r0, int64_t c0, int n, const __mmask16* masked, bool first) {
    if (first) transpose_pairs(kb, c0, n, D, kt);
    constexpr int ROWS = decltype(g)::value;
    scores_tile<ROWS>([&](auto p, __m512* s4) { dot_lanes<ROWS, decltype(p)::value>(q + r0, kt, D, s4); }, masked,
                      scale, o + r0, c0, n);
  });
}

// ---------------------------------------------------------------------------
// Values. A chunk of kBlockKeys keys is interleaved once into pair rows:
// pair j's row holds, for each 32 columns d0, unpacklo_epi16 of keys
// (c0 + 2 j, c0 + 2 j + 1) (columns d0 + 8 l + t, l < 4, t < 4, in dword
// 4 l + t) and then unpackhi (columns d0 + 8 l + 4 + t). The accumulators
// keep that order; store_values puts the columns back.

// Decode-sized blocks ask for the lines `ahead` elements past the two rows
// (prefetch_ahead; 0: none).
inline void interleave_pairs(const uint16_t* vb, int64_t c0, int64_t n, int64_t D, float* vp, int64_t ahead,
                             const uint16_t* end) {
  for (int64_t j = 0; 2 * j < n; ++j) {
    const uint16_t* a = vb + (c0 + 2 * j) * D;
    const bool second = 2 * j + 1 < n;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      prefetch_ahead(a + d0, ahead, end);
      prefetch_ahead(a + D + d0, ahead, end);
      const __m512i va = load_pairs(a + d0), vb2 = second ? load_pairs(a + D + d0) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + j * D + d0, _mm512_unpacklo_epi16(va, vb2));
      _mm512_storeu_si512(vp + j * D + d0 + 16, _mm512_unpackhi_epi16(va, vb2));
    }
  }
}

// A row's weights of a chunk of n (<= kBlockKeys) keys as pair words into
// w (word j: keys 2 j, 2 j + 1), +-0 and the keys past n as +0; returns bit
// k set where key k's weight is live (not +-0; a NaN is live).
inline uint32_t pair_weights(const uint16_t* p, int64_t n, uint32_t* w) {
  const __mmask32 in = n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1);
  const __m512i words = _mm512_maskz_loadu_epi16(in, p);
  const __mmask32 live = _mm512_test_epi16_mask(words, _mm512_set1_epi16(0x7fff));
  _mm512_storeu_si512(w, _mm512_maskz_mov_epi16(live, words));
  return live;
}

// Rows [r0, r0 + ROWS), accumulator dwords [d0, d0 + 16 PIECES), over the
// pairs of a chunk in order: acc ([rows][D]) += p . v by vdpbf16ps. A row
// that weighs one key of a pair takes the other's value as +0; a row that
// weighs neither skips the pair; a pair no row weighs is not read.
template <int ROWS, int PIECES>
inline void values_group(float* acc, const uint32_t* w, const uint32_t* live, int r0, const float* vp,
                         int64_t pairs, int64_t D, int64_t d0) {
  __m512 a[ROWS][PIECES];
  for (int r = 0; r < ROWS; ++r)
    for (int k = 0; k < PIECES; ++k) a[r][k] = _mm512_loadu_ps(acc + (r0 + r) * D + d0 + 16 * k);
  uint32_t every = ~0u, some = 0;
  for (int r = 0; r < ROWS; ++r) every &= live[r0 + r], some |= live[r0 + r];
  const __m512i low = _mm512_set1_epi32(0xffff), high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t j = 0; j < pairs; ++j) {
    if (!((some >> (2 * j)) & 3u)) continue;
    const float* vj = vp + j * D + d0;
    __m512i wb[ROWS];
    for (int r = 0; r < ROWS; ++r) wb[r] = _mm512_set1_epi32(static_cast<int>(w[(r0 + r) * (kBlockKeys / 2) + j]));
    if (((every >> (2 * j)) & 3u) == 3u) {
      for (int k = 0; k < PIECES; ++k) {
        const __m512i vk = _mm512_castps_si512(_mm512_loadu_ps(vj + 16 * k));
        for (int r = 0; r < ROWS; ++r) a[r][k] = dp(a[r][k], wb[r], vk);
      }
    } else {
      for (int r = 0; r < ROWS; ++r) {
        const uint32_t lv = (live[r0 + r] >> (2 * j)) & 3u;
        if (lv == 0) continue;
        for (int k = 0; k < PIECES; ++k) {
          __m512i vk = _mm512_castps_si512(_mm512_loadu_ps(vj + 16 * k));
          if (lv == 1) vk = _mm512_and_si512(vk, low);
          else if (lv == 2) vk = _mm512_and_si512(vk, high);
          a[r][k] = dp(a[r][k], wb[r], vk);
        }
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int k = 0; k < PIECES; ++k) _mm512_storeu_ps(acc + (r0 + r) * D + d0 + 16 * k, a[r][k]);
}

// All D accumulator dwords of rows [r0, r0 + ROWS): passes of at most 16
// accumulators.
template <int ROWS>
inline void values_rows(float* acc, const uint32_t* w, const uint32_t* live, int r0, const float* vp, int64_t pairs,
                        int64_t D) {
  constexpr int kMax = ROWS == 4 ? 4 : 8;
  for (int64_t d0 = 0; d0 < D;) {
    const int64_t left = (D - d0) / 16;
    if (left >= 8 && kMax == 8) values_group<ROWS, kMax>(acc, w, live, r0, vp, pairs, D, d0), d0 += 16 * kMax;
    else if (left >= 4) values_group<ROWS, 4>(acc, w, live, r0, vp, pairs, D, d0), d0 += 16 * 4;
    else values_group<ROWS, 2>(acc, w, live, r0, vp, pairs, D, d0), d0 += 16 * 2;  // D is a multiple of 32
  }
}

// A row's D outputs from its accumulators in pair-row order, rounded to bf16.
inline void store_values(uint16_t* o, const float* acc, int64_t D) {
  // Output column e of a 32-column chunk: l = e / 8, t = e % 8; unpacklo's
  // dword 4 l + t for t < 4, unpackhi's 4 l + t - 4 (index + 16) after.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    const __m512 lo = _mm512_loadu_ps(acc + d0), hi = _mm512_loadu_ps(acc + d0 + 16);
    store16(o + d0, _mm512_permutex2var_ps(lo, first, hi));
    store16(o + d0 + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
}

// Values of `rows` rows (weights p[r], keys [0, ends[r]); ends null: all of
// [0, L)), kBlockKeys keys at a time, each chunk interleaved once when some
// group weighs it, then groups of 4 rows (2 and 1 for the rest).
void values_rows_of(const uint16_t* const* p, uint16_t* const* o, int rows, const int64_t* ends, const uint16_t* vb,
                    int64_t L, int64_t D, float* acc, float* vp, bool prefetch) {
  for (int64_t i = 0; i < rows * D; ++i) acc[i] = 0.0f;
  if (prefetch) prefetch_rows(vb, 0, kKvAheadRows, L, D);
  const int64_t ahead = prefetch ? kKvAheadRows * D : 0;
  for (int64_t c0 = 0; c0 < L; c0 += kBlockKeys) {
    const int64_t n = L - c0 < kBlockKeys ? L - c0 : kBlockKeys, pairs = (n + 1) / 2;
    bool interleaved = false;
    for_groups(rows, [&](auto g, int r0) {
      constexpr int ROWS = decltype(g)::value;
      if (ends && ends[r0] <= c0) return;
      uint32_t w[ROWS * (kBlockKeys / 2)], live[ROWS], any = 0;
      for (int r = 0; r < ROWS; ++r) {
        live[r] = pair_weights(p[r0 + r] + c0, n, w + r * (kBlockKeys / 2));
        any |= live[r];
      }
      if (any == 0) return;  // every row's weights are 0 here: nothing to add
      if (!interleaved) interleave_pairs(vb, c0, n, D, vp, ahead, vb + L * D), interleaved = true;
      values_rows<ROWS>(acc + r0 * D, w, live, 0, vp, pairs, D);
    });
  }
  for (int r = 0; r < rows; ++r) store_values(o[r], acc + r * D, D);
}

}  // namespace

void scores_block_avx512bf16(const uint16_t* const* q, const bool* const* masked, uint16_t* const* out, int rows,
                             const uint16_t* keys, int64_t L, int64_t D, float scale) {
  scores_block(q, masked, out, rows, keys, L, D, scale);
}

void values_block_avx512bf16(const uint16_t* const* probs, uint16_t* const* out, int rows, const uint16_t* values,
                             int64_t L, int64_t D, float* scratch) {
  values_rows_of(probs, out, rows, nullptr, values, L, D, scratch, scratch + kBlockRows * D, rows <= 4);
}

// Scores, softmax (softmax_row_avx512, the other kernels' bits) and values
// of up to kManyRows rows, each only as far as its group's last unmasked key
// (attention_avx512.cpp's attention_many_t).
void attention_many_avx512bf16(const uint16_t* const* q, const bool* const* m, uint16_t* const* o, int rows,
                               const uint16_t* kb, const uint16_t* vb, int64_t L, int64_t D, float scale,
                               float* scratch, uint16_t* scores) {
  float* acc = scratch;                    // the value accumulators: [rows][D]
  float* keys = scratch + kManyRows * D;   // the transposed keys [D / 2][16], then the pair rows [16][D]
  float* e = keys + kBlockKeys * D;        // [L]
  int64_t ends[kManyRows];
  for_group_ends(m, rows, L, [&](auto g, int r0, int64_t end) {
    for (int r = r0; r < r0 + decltype(g)::value; ++r) ends[r] = end;
  });
  uint16_t* s[kManyRows];
  for (int r = 0; r < rows; ++r) s[r] = scores + r * L;
  scores_many(q, m, s, rows, ends, kb, L, D, scale, keys);
  for (int r = 0; r < rows; ++r) {
    const int64_t scored = chunk_end(ends[r], 16, L), read = chunk_end(ends[r], kBlockKeys, L);
    softmax_row_avx512(s[r], s[r], scored, e);  // in place: it reads a row before writing it
    for (int64_t c = scored; c < read; ++c) s[r][c] = 0;
  }
  values_rows_of(s, o, rows, ends, vb, L, D, acc, keys, false);
}

}  // namespace dmi::kernels::detail
