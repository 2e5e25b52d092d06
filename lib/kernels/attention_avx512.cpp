// AVX-512F attention: score rows (one query row against L cached keys), and
// blocks of rows that share a KV head (scores and probabilities·values). The
// same lane assignment and reduction tree as the portable dot() in ops.cpp
// (16 fp32 lanes, then +8, +4, +2, +1), the same summation order over keys in
// values_row, multiplies and adds unfused: the bits equal the portable code's.
// Compiled with -mavx512f; called only on CPUs that have it.
#include <immintrin.h>

#include "kernels/gemm_impl.h"

namespace dmi::kernels::detail {

namespace {

#include "kernels/attention_avx512_common.inc"

}  // namespace

bool scores_row_avx512(const uint16_t* q, const uint16_t* kb, const bool* m, uint16_t* o, int64_t L, int64_t D,
                       float scale) {
  if (D % 16 != 0 || D / 16 > kMaxChunks) return false;
  const int64_t chunks = D / 16;
  __m512 qv[kMaxChunks];
  for (int64_t i = 0; i < chunks; ++i) qv[i] = widen(q + 16 * i);
  const uint16_t neg_inf = 0xff80;
  for (int64_t c = 0; c < L; ++c) {
    if (m[c]) {
      o[c] = neg_inf;
      continue;
    }
    const uint16_t* k = kb + c * D;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < chunks; ++i) acc = _mm512_add_ps(acc, _mm512_mul_ps(qv[i], widen(k + 16 * i)));
    o[c] = to_bf16(bf16_value(to_bf16(reduce16(acc))) * scale);
  }
  return true;
}

bool scores_row_avx512(const float* q, const float* kb, const bool* m, float* o, int64_t L, int64_t D, float scale) {
  if (D % 16 != 0 || D / 16 > kMaxChunks) return false;
  const int64_t chunks = D / 16;
  __m512 qv[kMaxChunks];
  for (int64_t i = 0; i < chunks; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
  const uint32_t neg_inf_bits = 0xff800000u;
  float neg_inf;
  memcpy(&neg_inf, &neg_inf_bits, 4);
  for (int64_t c = 0; c < L; ++c) {
    if (m[c]) {
      o[c] = neg_inf;
      continue;
    }
    const float* k = kb + c * D;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < chunks; ++i) acc = _mm512_add_ps(acc, _mm512_mul_ps(qv[i], _mm512_loadu_ps(k + 16 * i)));
    o[c] = reduce16(acc) * scale;
  }
  return true;
}

// ---------------------------------------------------------------------------
// Blocks of rows. Every row of a block reads the same keys (query heads of one
// KV head, consecutive positions), so each key is widened to fp32 once per
// block instead of once per row, and 16 dot products are reduced together.

namespace {

// A row's weights of a chunk of n (<= kBlockKeys) keys in fp32 into pf;
// returns bit j set where weight j is live: not +-0 (a NaN is live).
template <class E>
inline uint32_t chunk_weights(const E* p, int64_t n, float* pf) {
  uint32_t live = 0;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 pc = load_f32(p + j);
    _mm512_store_ps(pf + j, pc);
    live |= static_cast<uint32_t>(_mm512_cmp_ps_mask(pc, _mm512_setzero_ps(), _CMP_NEQ_UQ)) << j;
  }
  for (; j < n; ++j) {
    pf[j] = value(p, j);
    live |= static_cast<uint32_t>(pf[j] != 0.0f) << j;
  }
  return live;
}

// The keys (or values) [c0, c0 + n) as fp32 rows D apart: bf16 widened into
// w, fp32 read where they lie.
inline const float* rows_f32(const float* kb, int64_t c0, int64_t, int64_t D, float*) { return kb + c0 * D; }
inline const float* rows_f32(const uint16_t* kb, int64_t c0, int64_t n, int64_t D, float* w) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(w + j * D + d, widen(kb + (c0 + j) * D + d));
  return w;
}

// Scores of rows [r0, r0 + ROWS) against the first n (<= 16) of 16 keys (K:
// fp32, or bf16 widened here in a register; D apart) in scores_tiles' tiles:
// each 16-lane chunk of a q row (qw: fp32, D apart) or of a key is loaded
// once per tile and used KEYS or ROWS times. Each line of a key read asks
// for the one `ahead` elements on (prefetch_ahead; 0: none).
template <int ROWS, class K, class E>
inline int scores_group(const float* qw, int r0, const __mmask16* masked, const K* keys, int n, int64_t chunks,
                        int64_t D, float scale, E* const* o, int64_t c0, int64_t ahead, const K* end) {
  constexpr int KEYS = 16 / ROWS;
  constexpr int64_t kChunksPerLine = 64 / (16 * sizeof(K));  // 1 (fp32) or 2 (bf16)
  return scores_tiles<ROWS>(r0, masked, n, scale, o, c0, [&](int k0, __m512* acc) {
    for (int64_t i = 0; i < chunks; ++i) {
      __m512 qv[ROWS];
      for (int r = 0; r < ROWS; ++r) qv[r] = _mm512_loadu_ps(qw + (r0 + r) * D + 16 * i);
      for (int j = 0; j < KEYS; ++j) {
        if (i % kChunksPerLine == 0) prefetch_ahead(keys + (k0 + j) * D + 16 * i, ahead, end);
        const __m512 kv = load_f32(keys + (k0 + j) * D + 16 * i);
        for (int r = 0; r < ROWS; ++r) acc[r * KEYS + j] = _mm512_add_ps(acc[r * KEYS + j], _mm512_mul_ps(qv[r], kv));
      }
    }
  });
}

// Blocks of rows that read the same keys, 16 keys at a time. Decode-sized
// blocks (up to 4 rows: the query heads of one KV head at one position) read
// each key chunk from the cache and widen it in a register for all their
// rows (a pass through the scratch buffer cost as much as the products at 2
// rows); larger ones (prefill) widen the 16 keys once into scratch for all
// their groups. Keys masked for every row are not read: causal prefill masks
// about half of each block's keys so. The last keys that fill no tile of a
// group go one at a time (scores_row_avx512): the same bits.
template <class E>
void scores_block_t(const E* const* q, const bool* const* m, E* const* o, int rows, const E* kb, int64_t L, int64_t D,
                    float scale, float* scratch) {
  const int64_t chunks = D / 16;
  float* qw = scratch;                   // [rows][D]
  float* kw = scratch + kBlockRows * D;  // [16][D]
  for (int r = 0; r < rows; ++r)
    for (int64_t i = 0; i < chunks; ++i) _mm512_storeu_ps(qw + r * D + 16 * i, load_f32(q[r] + 16 * i));
  for_score_chunks(m, o, rows, kb, L, D, [&](int64_t c0, int n, const __mmask16* masked) {
    auto groups = [&](const auto* keys, int64_t ahead, const auto* end) {
      for_groups(rows, [&](auto g, int r0) {
        const int done =
            scores_group<decltype(g)::value>(qw, r0, masked, keys, n, chunks, D, scale, o, c0, ahead, end);
        if (done < n)
          for (int r = r0; r < r0 + decltype(g)::value; ++r)
            scores_row_avx512(q[r], kb + (c0 + done) * D, m[r] + c0 + done, o[r] + c0 + done, n - done, D, scale);
      });
    };
    if (rows <= 4) groups(kb + c0 * D, kKvAheadRows * D, kb + L * D);
    else groups(rows_f32(kb, c0, n, D, kw), 0, kw);
  });
}

// Rows [r0, r0 + ROWS) of a block, columns [d0, d0 + 16 PIECES), over the n
// keys of a chunk: acc (the block's [rows][D] sums so far) += p * v for each
// key in order; v: the chunk's value rows (V: fp32, or bf16 widened here in
// a register; D apart); pf: the rows' weights in fp32, [rows][kBlockKeys];
// live[r] bit j: row r weighs key j (not 0). A row whose weight is 0 is left
// unchanged (values_row skips it), a key that no row of the group weighs is
// skipped: the same bits. Each key's lines ask for those `ahead` elements on
// (prefetch_ahead; 0: none), whether some row weighs the key or not.
template <int ROWS, int PIECES, class V>
inline void values_group(float* acc, const float* pf, const uint32_t* live, int r0, const V* v, int64_t n,
                         int64_t D, int64_t d0, int64_t ahead, const V* end) {
  __m512 a[ROWS][PIECES];
  for (int r = 0; r < ROWS; ++r)
    for (int k = 0; k < PIECES; ++k) a[r][k] = _mm512_loadu_ps(acc + (r0 + r) * D + d0 + 16 * k);
  uint32_t every = ~0u, some = 0;  // bit j: every row, some row of the group weighs key j
  for (int r = 0; r < ROWS; ++r) every &= live[r0 + r], some |= live[r0 + r];
  for (int64_t j = 0; j < n; ++j) {
    const V* vj = v + j * D + d0;
    if (ahead > 0)
      for (int64_t e = 0; e < 16 * PIECES; e += 64 / static_cast<int64_t>(sizeof(V))) prefetch_ahead(vj + e, ahead, end);
    if (!((some >> j) & 1u)) continue;
    __m512 pb[ROWS];
    for (int r = 0; r < ROWS; ++r) pb[r] = _mm512_set1_ps(pf[(r0 + r) * kBlockKeys + j]);
    if ((every >> j) & 1u) {
      for (int k = 0; k < PIECES; ++k) {
        const __m512 vk = load_f32(vj + 16 * k);
        for (int r = 0; r < ROWS; ++r) a[r][k] = _mm512_add_ps(a[r][k], _mm512_mul_ps(pb[r], vk));
      }
    } else {
      uint32_t group = 0;  // bit r: row r0 + r weighs key j
      for (int r = 0; r < ROWS; ++r) group |= ((live[r0 + r] >> j) & 1u) << r;
      for (int k = 0; k < PIECES; ++k) {
        const __m512 vk = load_f32(vj + 16 * k);
        for (int r = 0; r < ROWS; ++r) {
          const __mmask16 on = static_cast<__mmask16>(0u - ((group >> r) & 1u));
          a[r][k] = _mm512_mask_add_ps(a[r][k], on, a[r][k], _mm512_mul_ps(pb[r], vk));
        }
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int k = 0; k < PIECES; ++k) _mm512_storeu_ps(acc + (r0 + r) * D + d0 + 16 * k, a[r][k]);
}

// All D columns of rows [r0, r0 + ROWS): passes of at most 16 accumulators
// (8 chunks of 16 columns for 1 or 2 rows, 4 for 4 rows), fewer at the end.
template <int ROWS, class V>
inline void values_rows(float* acc, const float* pf, const uint32_t* live, int r0, const V* v, int64_t n, int64_t D,
                        int64_t ahead, const V* end) {
  constexpr int kMax = ROWS == 4 ? 4 : 8;
  for (int64_t d0 = 0; d0 < D;) {
    const int64_t left = (D - d0) / 16;
    if (left >= 8 && kMax == 8) values_group<ROWS, kMax>(acc, pf, live, r0, v, n, D, d0, ahead, end), d0 += 16 * kMax;
    else if (left >= 4) values_group<ROWS, 4>(acc, pf, live, r0, v, n, D, d0, ahead, end), d0 += 16 * 4;
    else if (left == 3) values_group<ROWS, 3>(acc, pf, live, r0, v, n, D, d0, ahead, end), d0 += 16 * 3;
    else if (left == 2) values_group<ROWS, 2>(acc, pf, live, r0, v, n, D, d0, ahead, end), d0 += 16 * 2;
    else values_group<ROWS, 1>(acc, pf, live, r0, v, n, D, d0, ahead, end), d0 += 16;
  }
}

// Blocks of values, kBlockKeys keys at a time, in groups of 4 rows (2 and 1
// for the rest) as register tiles of rows x 16-column chunks. Decode-sized
// blocks (up to 4 rows) widen each value chunk in a register for all their
// rows; larger ones widen the keys' value rows once into scratch for all
// their groups. Keys weighed by no row are not read.
template <class E>
void values_block_t(const E* const* p, E* const* o, int rows, const E* vb, int64_t L, int64_t D, float* scratch) {
  float* acc = scratch;                  // [rows][D]
  float* vw = scratch + kBlockRows * D;  // [kBlockKeys][D]
  for (int64_t i = 0; i < rows * D; ++i) acc[i] = 0.0f;
  alignas(64) float pf[kBlockRows * kBlockKeys];
  uint32_t live[kBlockRows];
  // Decode-sized blocks ask for their first values here, the rest as they
  // read them (values_group).
  if (rows <= 4) prefetch_rows(vb, 0, kKvAheadRows, L, D);
  for (int64_t c0 = 0; c0 < L; c0 += kBlockKeys) {
    const int64_t n = L - c0 < kBlockKeys ? L - c0 : kBlockKeys;
    uint32_t any = 0;
    for (int r = 0; r < rows; ++r) {
      live[r] = chunk_weights(p[r] + c0, n, pf + r * kBlockKeys);
      any |= live[r];
    }
    if (any == 0) continue;  // every row's weights are 0 here (masked): nothing to add
    auto groups = [&](const auto* v, int64_t ahead, const auto* end) {
      for_groups(rows, [&](auto g, int r0) { values_rows<decltype(g)::value>(acc, pf, live, r0, v, n, D, ahead, end); });
    };
    if (rows <= 4) groups(vb + c0 * D, kKvAheadRows * D, vb + L * D);
    else groups(rows_f32(vb, c0, n, D, vw), 0, vw);
  }
  for (int r = 0; r < rows; ++r) store_row(o[r], acc + r * D, D);
}

// ---------------------------------------------------------------------------
// Softmax rows: ops.cpp's softmax_row in 16-lane registers. Each lane does
// the same operations in the same order as the portable loop's lane (the
// maximum, the exps, the sum counted from the first unmasked column, the
// tree, the division), multiplies and adds unfused: the same bits.

// ops.cpp's fast_exp on 16 lanes: std::max(x, -87) is (-87 > x ? -87 : x),
// vmaxps(-87, x); std::min(y, 88) is vminps(88, y) (a NaN passes as it did).
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
  const __m512 shifter = _mm512_set1_ps(12582912.0f);
  const __m512 t = _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), shifter);
  const __m512 n = _mm512_sub_ps(t, shifter);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B400000)), _mm512_set1_epi32(127)),
      23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// Lane j set where x[j] is -inf (one bit pattern in each dtype).
inline __mmask16 neg_inf16(const float* x) {
  return _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(x), _mm512_set1_epi32(static_cast<int>(0xff800000u)));
}
inline __mmask16 neg_inf16(const uint16_t* x) {
  return _mm512_cmpeq_epi32_mask(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                                 _mm512_set1_epi32(0xff80));
}
inline bool is_neg_inf(float v) { return v == -__builtin_inff(); }

template <class E>
void softmax_row_t(const E* x, E* o, int64_t n, float* e) {
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  // The unmasked span [first, end), found as the portable loop finds it.
  int64_t end = n;
  while (end >= 16 && neg_inf16(x + end - 16) == 0xffff) end -= 16;
  while (end > 0 && is_neg_inf(value(x, end - 1))) --end;
  int64_t first = 0;
  while (first + 16 <= end && neg_inf16(x + first) == 0xffff) first += 16;
  while (first < end && is_neg_inf(value(x, first))) ++first;
  // The maximum per lane, then across lanes in lane order (std::max's rule:
  // vmaxps(v, m) is m < v ? v : m).
  __m512 mv = neg_inf;
  int64_t c = first;
  for (; c + 16 <= end; c += 16) mv = _mm512_max_ps(load_f32(x + c), mv);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, mv);
  for (int j = 0; c < end; ++c, ++j) lanes[j] = lanes[j] < value(x, c) ? value(x, c) : lanes[j];
  float mx = -__builtin_inff();
  for (int j = 0; j < 16; ++j) mx = mx < lanes[j] ? lanes[j] : mx;
  if (is_neg_inf(mx)) mx = 0.0f;  // a fully masked row: all zeros, not NaN
  // exp(x - max), 0 where x is -inf, and the sum in 16 lanes from `first`.
  const __m512 mxv = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  int64_t b = first;
  for (; b + 16 <= end; b += 16) {
    const __m512 v = load_f32(x + b);
    const __m512 ev = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, neg_inf, _CMP_EQ_OQ), fast_exp16(_mm512_sub_ps(v, mxv)),
                                           _mm512_setzero_ps());
    _mm512_storeu_ps(e + b, ev);
    sum = _mm512_add_ps(sum, ev);
  }
  if (b < end) {  // the last partial block, padded with -inf (exp 0)
    const int rest = static_cast<int>(end - b);
    const __mmask16 live = static_cast<__mmask16>((1u << rest) - 1);
    alignas(64) float pad[16];
    for (int j = 0; j < 16; ++j) pad[j] = j < rest ? value(x, b + j) : -__builtin_inff();
    const __m512 v = _mm512_load_ps(pad);
    const __m512 ev = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, neg_inf, _CMP_EQ_OQ), fast_exp16(_mm512_sub_ps(v, mxv)),
                                           _mm512_setzero_ps());
    _mm512_mask_storeu_ps(e + b, live, ev);
    sum = _mm512_mask_add_ps(sum, live, sum, ev);
  }
  const float total = reduce16(sum);
  const __m512 denom = _mm512_set1_ps(total > 0.0f ? total : 1.0f);
  for (c = 0; c < first; ++c) o[c] = E{};  // +0 in either dtype
  c = first;
  for (; c + 16 <= end; c += 16) store16(o + c, _mm512_div_ps(_mm512_loadu_ps(e + c), denom));
  if (c < end) {
    alignas(64) E tail[16];
    store16(tail, _mm512_div_ps(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (end - c)) - 1), e + c), denom));
    memcpy(o + c, tail, static_cast<size_t>(end - c) * sizeof(E));
  }
  for (c = end; c < n; ++c) o[c] = E{};
}

// ---------------------------------------------------------------------------
// q's and k's rows for attention (ops.cpp's rms_norm_row, then rope_row) in
// 16-lane registers, the same operations in the same order in each lane
// (multiplies and adds unfused, the same roundings to the dtype): the same bits.

template <class E>
bool norm_rope_row_t(const E* x, const E* w, const E* c, const E* s, E* o, int64_t D, float eps) {
  if (D % 32 != 0 || D / 16 > kMaxChunks) return false;
  const int64_t chunks = D / 16, half = chunks / 2;
  __m512 xv[kMaxChunks];
  for (int64_t i = 0; i < chunks; ++i) xv[i] = load_f32(x + 16 * i);
  if (w) {  // rms_norm_row: dot(x, x) in 16 lanes and the tree, then w * (x * inv rounded), rounded
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < chunks; ++i) acc = _mm512_add_ps(acc, _mm512_mul_ps(xv[i], xv[i]));
    const float mean = reduce16(acc) / static_cast<float>(D);
    const __m512 inv = _mm512_set1_ps(1.0f / __builtin_sqrtf(mean + eps));
    for (int64_t i = 0; i < chunks; ++i)
      xv[i] = round_to16(_mm512_mul_ps(load_f32(w + 16 * i), round_to16(_mm512_mul_ps(xv[i], inv), x)), x);
  }
  // rope_row: x * cos + rotate_half(x) * sin, each product and the sum rounded.
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u)));
  for (int64_t i = 0; i < chunks; ++i) {
    const __m512 other = i < half ? _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(xv[i + half]),
                                                                         _mm512_castps_si512(sign)))
                                  : xv[i - half];
    const __m512 a = round_to16(_mm512_mul_ps(xv[i], load_f32(c + 16 * i)), x);
    const __m512 b = round_to16(_mm512_mul_ps(other, load_f32(s + 16 * i)), x);
    store16(o + 16 * i, _mm512_add_ps(a, b));
  }
  return true;
}


// ---------------------------------------------------------------------------
// Many rows of one KV head (prefill: up to kManyRows rows, the query heads of
// consecutive positions): scores, softmax and values in one call. Each key
// chunk is widened and transposed once for all the rows, so a score tile
// needs no horizontal sums: lanes are keys.

// kt[d][j] = key c0 + j, element d, in fp32 (j < 16; zero past n): 16 keys
// transposed in 16 x 16 blocks.
template <class E>
inline void transpose_keys(const E* kb, int64_t c0, int n, int64_t D, float* kt) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512 r[16];
    for (int j = 0; j < 16; ++j) r[j] = j < n ? load_f32(kb + (c0 + j) * D + d0) : _mm512_setzero_ps();
    transpose16(r, kt + d0 * 16);
  }
}

// Lanes P, P + 8, P + 4 and P + 12 of the 16-lane dot products of ROWS q rows
// (qw: fp32, D apart) with 16 keys (kt), each lane summed over the chunks in
// order, q * k then +, unfused: dot()'s lanes, here one vector per lane with
// a key in each element. Returns, per row, (lane P + lane P + 8) + (lane
// P + 4 + lane P + 12): the tree's sum s4[P].
template <int ROWS, int P>
inline void dot_lanes(const float* qw, const float* kt, int64_t D, __m512* s4) {
  __m512 a0[ROWS], a1[ROWS], a2[ROWS], a3[ROWS];
  for (int r = 0; r < ROWS; ++r) a0[r] = a1[r] = a2[r] = a3[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < D; i += 16) {
    const __m512 k0 = _mm512_loadu_ps(kt + (i + P) * 16), k1 = _mm512_loadu_ps(kt + (i + P + 8) * 16);
    const __m512 k2 = _mm512_loadu_ps(kt + (i + P + 4) * 16), k3 = _mm512_loadu_ps(kt + (i + P + 12) * 16);
    for (int r = 0; r < ROWS; ++r) {
      const float* q = qw + r * D + i + P;
      a0[r] = _mm512_add_ps(a0[r], _mm512_mul_ps(_mm512_set1_ps(q[0]), k0));
      a1[r] = _mm512_add_ps(a1[r], _mm512_mul_ps(_mm512_set1_ps(q[8]), k1));
      a2[r] = _mm512_add_ps(a2[r], _mm512_mul_ps(_mm512_set1_ps(q[4]), k2));
      a3[r] = _mm512_add_ps(a3[r], _mm512_mul_ps(_mm512_set1_ps(q[12]), k3));
    }
  }
  for (int r = 0; r < ROWS; ++r) s4[r] = _mm512_add_ps(_mm512_add_ps(a0[r], a1[r]), _mm512_add_ps(a2[r], a3[r]));
}

// Scores of `rows` rows against keys [0, ends[r]) (the end of row r's group,
// the same for each of its rows; the 16-key chunk that holds the last one is
// written whole, nothing past it): 16 keys at a time, transposed once, then
// tiles of 4 rows (2 and 1 for the rest); a tile whose every score is masked
// writes -inf and computes nothing. The row functions' bits.
template <class E>
void scores_many_t(const E* const* q, const bool* const* m, E* const* o, int rows, const int64_t* ends,
                   const E* kb, int64_t L, int64_t D, float scale, float* qw, float* kt) {
  for (int r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(qw + r * D + d, load_f32(q[r] + d));
  for_score_chunks_many(m, o, rows, ends, L, [&](auto g, int r0, int64_t c0, int n, const __mmask16* masked, bool first) {
    if (first) transpose_keys(kb, c0, n, D, kt);
    constexpr int ROWS = decltype(g)::value;
    scores_tile<ROWS>([&](auto p, __m512* s4) { dot_lanes<ROWS, decltype(p)::value>(qw + r0 * D, kt, D, s4); },
                      masked, scale, o + r0, c0, n);
  });
}

// Values of `rows` rows (weights p, [rows][L]) over keys [0, ends[r]) (as
// for scores_many_t): kBlockKeys keys at a time, widened once for all the rows
// (bf16), then each group of 4 rows (2 and 1 for the rest) adds p * v into
// its accumulators in acc ([rows][D]) with values_rows, skipping keys that no
// row of the group weighs. A row's weights are read to the end of the
// kBlockKeys chunk that holds its group's end. values_row's bits.
template <class E>
void values_many_t(const E* const* p, E* const* o, int rows, const int64_t* ends, const E* vb, int64_t L, int64_t D,
                   float* acc, float* vw) {
  for (int64_t i = 0; i < rows * D; ++i) acc[i] = 0.0f;
  for (int64_t c0 = 0; c0 < L; c0 += kBlockKeys) {
    const int64_t n = L - c0 < kBlockKeys ? L - c0 : kBlockKeys;
    const float* v = nullptr;  // the chunk's values in fp32, once a group weighs them
    for_groups(rows, [&](auto g, int r0) {
      constexpr int ROWS = decltype(g)::value;
      if (ends[r0] <= c0) return;
      alignas(64) float pf[ROWS * kBlockKeys];
      uint32_t live[ROWS], any = 0;
      for (int r = 0; r < ROWS; ++r) {
        live[r] = chunk_weights(p[r0 + r] + c0, n, pf + r * kBlockKeys);
        any |= live[r];
      }
      if (any == 0) return;
      if (!v) v = rows_f32(vb, c0, n, D, vw);
      values_rows<ROWS>(acc + r0 * D, pf, live, 0, v, n, D, 0, v);
    });
  }
  for (int r = 0; r < rows; ++r) store_row(o[r], acc + r * D, D);
}

// Scores, softmax and values of up to kManyRows rows (attention_many_avx512).
// Each row's scores and weights are kept to the end of its group's keys,
// rounded up to the 16-key chunk the scores write and then to the
// kBlockKeys chunk the values read (zeros). The softmax of that prefix is
// the softmax of the whole row: past the group's end every score is -inf.
template <class E>
void attention_many_t(const E* const* q, const bool* const* m, E* const* o, int rows, const E* kb, const E* vb,
                      int64_t L, int64_t D, float scale, float* scratch, E* scores) {
  float* rows_f = scratch;                 // q rows in fp32, then the value accumulators: [rows][D]
  float* keys_f = scratch + kManyRows * D;  // the transposed keys [D][16], then kBlockKeys value rows
  float* e = keys_f + kBlockKeys * D;       // [L]
  int64_t ends[kManyRows];  // per row, its group's end
  for_group_ends(m, rows, L, [&](auto g, int r0, int64_t end) {
    for (int r = r0; r < r0 + decltype(g)::value; ++r) ends[r] = end;
  });
  E* s[kManyRows];
  for (int r = 0; r < rows; ++r) s[r] = scores + r * L;
  scores_many_t(q, m, s, rows, ends, kb, L, D, scale, rows_f, keys_f);
  for (int r = 0; r < rows; ++r) {
    const int64_t scored = chunk_end(ends[r], 16, L), read = chunk_end(ends[r], kBlockKeys, L);
    softmax_row_t(s[r], s[r], scored, e);  // in place: it reads a row before writing it
    for (int64_t c = scored; c < read; ++c) s[r][c] = E{};
  }
  values_many_t(s, o, rows, ends, vb, L, D, rows_f, keys_f);
}

}  // namespace

void scores_block_avx512(const uint16_t* const* q, const bool* const* masked, uint16_t* const* out, int rows,
                         const uint16_t* keys, int64_t L, int64_t D, float scale, float* scratch) {
  scores_block_t(q, masked, out, rows, keys, L, D, scale, scratch);
}
void scores_block_avx512(const float* const* q, const bool* const* masked, float* const* out, int rows,
                         const float* keys, int64_t L, int64_t D, float scale, float* scratch) {
  scores_block_t(q, masked, out, rows, keys, L, D, scale, scratch);
}
void values_block_avx512(const uint16_t* const* probs, uint16_t* const* out, int rows, const uint16_t* values,
                         int64_t L, int64_t D, float* scratch) {
  values_block_t(probs, out, rows, values, L, D, scratch);
}
void values_block_avx512(const float* const* probs, float* const* out, int rows, const float* values, int64_t L,
                         int64_t D, float* scratch) {
  values_block_t(probs, out, rows, values, L, D, scratch);
}
void softmax_row_avx512(const uint16_t* x, uint16_t* out, int64_t n, float* e) { softmax_row_t(x, out, n, e); }
void softmax_row_avx512(const float* x, float* out, int64_t n, float* e) { softmax_row_t(x, out, n, e); }
void attention_many_avx512(const uint16_t* const* q, const bool* const* masked, uint16_t* const* out, int rows,
                           const uint16_t* keys, const uint16_t* values, int64_t L, int64_t D, float scale,
                           float* scratch, uint16_t* scores) {
  attention_many_t(q, masked, out, rows, keys, values, L, D, scale, scratch, scores);
}
void attention_many_avx512(const float* const* q, const bool* const* masked, float* const* out, int rows,
                           const float* keys, const float* values, int64_t L, int64_t D, float scale, float* scratch,
                           float* scores) {
  attention_many_t(q, masked, out, rows, keys, values, L, D, scale, scratch, scores);
}
bool norm_rope_row_avx512(const uint16_t* x, const uint16_t* w, const uint16_t* cos, const uint16_t* sin,
                          uint16_t* out, int64_t D, float eps) {
  return norm_rope_row_t(x, w, cos, sin, out, D, eps);
}
bool norm_rope_row_avx512(const float* x, const float* w, const float* cos, const float* sin, float* out, int64_t D,
                          float eps) {
  return norm_rope_row_t(x, w, cos, sin, out, D, eps);
}

}  // namespace dmi::kernels::detail
