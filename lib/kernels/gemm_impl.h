// The per-ISA GEMM entry points behind kernels/linear.h. Internal: each is
// compiled in its own file with its own -m flags, so this header includes no
// C++ library code and defines nothing that could be emitted once per ISA
// and merged by the linker (only static inline helpers).
//
// Packed weight layout (one layout for every ISA, so a machine can run any
// kernel it supports on the same packed buffer):
//   W [N, K] (out_features, in_features) is cut into panels of kPanel = 64
//   output columns, N padded with zero columns to a multiple of 64.
//   bf16 weights: K padded to even Kp; panel p is [Kp/2][64][2] uint16, the
//     pair (W[n][k], W[n][k+1]) of column n next to each other (the operand
//     order of vdpbf16ps).
//   fp32 weights: panel p is [K][64] float.
// Every output y[m][n] is one fp32 accumulator summed over k in increasing
// order (bf16: the pair k, k+1 per step), whatever M, the row tile or the
// thread split: a row's result does not depend on the rows beside it. The
// scalar, AVX2 and AVX-512 kernels use the same fused multiply-adds in the
// same order and agree bit for bit; the AVX512-BF16 kernel (vdpbf16ps) and
// the SSE2 and AVX kernels (a multiply, then an add) round differently and
// agree with themselves (AVX and SSE2 with each other).
#pragma once

#include <stddef.h>
#include <stdint.h>
#include <string.h>

namespace dmi::kernels::detail {

constexpr int64_t kPanel = 64;
constexpr int64_t kRowBlock = 128;
// How far ahead (bytes) the kernels prefetch weights when few rows share them
// (decode, bound by memory bandwidth). Measured on the Qwen3-0.6B shape, batch
// 1, 2 threads (AVX512-BF16 EPYC): no prefetch 37 GB/s, 2 KiB 38, 4 KiB 46,
// 8 KiB 54, 16 KiB 55, 32 KiB 55 (what a 1 GiB sum() reads at: 57). Later,
// interleaved in one process (all projections, batch 1): 32 KiB took
// 0.83-0.93x the time of 16 KiB in 4 of 4 runs, but end to end (dmi-bench,
// 2 alternating rounds on a quiet machine) its TPOT was worse at batch 1
// and 8 in every round (25.3/26.0 vs 24.8/24.1 ms at batch 1): kept at 16.
// The AVX2 kernels measured their own on a Zen 3 EPYC (gemm_avx2.cpp).
constexpr int64_t kPrefetch = 16384;
// One k unit of a panel (a bf16 pair or one fp32 k, 64 columns) is 256
// bytes: four cache lines.
constexpr int kUnitLines = 4;

// Which of the four cache lines of each k unit a tile prefetches, kPrefetch
// (or the `ahead` a kernel gives at()) ahead of the unit it reads: lines
// [lo, hi). A whole-depth tile that streams a panel takes all four, the
// others none. Decode-sized batches share each unit's lines among their
// tiles by rows, so that memory is asked for at a steady rate while all the
// tiles compute; when only the first tile prefetched, memory idled while
// the others reused the block from L1 (Xeon, 4 + 4 rows). A short last tile
// takes no share (drive()).
// The AVX2 kernel's tiles walk a unit's four lines in four strips, one after
// the other (SSE2: eight, the first of each line prefetching), and spread
// the prefetches instead: each strip takes its own line, on the units k with k % parts == part, where drive() numbers the
// prefetching tiles 0 .. parts - 1 of a decode-sized batch (parts == 0: the
// tile prefetches nothing; a whole-depth tile that prefetches is part 0 of
// 1). Four lines per unit from the first strip alone, a burst of 64 or 128
// requests per k block, had kept batch-8 projections at 12-14 GB/s on a
// Zen 3 EPYC (docs/benchmarks.md, 2026-12-06 third session).
struct Prefetch {
  int lo = 0, hi = 0;
  int part = 0, parts = 0;
  inline void at(const void* unit, int64_t ahead = kPrefetch) const {
    const char* c = static_cast<const char*>(unit) + ahead;
    if (hi - lo == kUnitLines) {
      for (int i = 0; i < kUnitLines; ++i) __builtin_prefetch(c + 64 * i, 0, 3);
    } else {
      for (int i = lo; i < hi; ++i) __builtin_prefetch(c + 64 * i, 0, 3);
    }
  }
  // A strip's first unit in [k0, k1) with k % parts == part, whose lines it
  // prefetches, then every parts-th; k1 when it prefetches nothing.
  inline int64_t first_unit(int64_t k0, int64_t k1) const {
    if (parts <= 0) return k1;
    if (parts == 1) return k0;
    return k0 + (part - k0 % parts + parts) % parts;
  }
};
// A tile that streams whole units and prefetches all their lines.
constexpr Prefetch kWholeUnits{0, kUnitLines, 0, 1};

struct GemmArgs {
  const void* x = nullptr;  // [M, x_stride]: bf16 (uint16) for the bf16-dot kernel, else float
  int64_t x_stride = 0;     // elements between rows of x
  const void* w = nullptr;  // packed panels
  const float* bias = nullptr;  // [N] or null
  void* y = nullptr;        // [M, y_stride]: bf16 (uint16) if y_bf16, else float
  int64_t y_stride = 0;
  bool y_bf16 = false;
  int64_t M = 0, K = 0, N = 0;  // K: the packed depth (Kp for bf16 weights)
  int64_t panel_begin = 0, panel_end = 0;  // panels this call computes
};

// bf16 weights; x is bf16 pairs for _avx512bf16, float for the others.
void gemm_bf16w_avx512bf16(const GemmArgs& a);
void gemm_bf16w_avx512(const GemmArgs& a);
void gemm_bf16w_avx2(const GemmArgs& a);
void gemm_bf16w_avx(const GemmArgs& a);   // multiply, then add: the SSE2 kernels' bits (gemm_avx.cpp)
void gemm_bf16w_sse2(const GemmArgs& a);  // multiply, then add: its own bits (gemm_sse2.cpp)
void gemm_bf16w_scalar(const GemmArgs& a);
// fp32 weights, fp32 x.
void gemm_f32w_avx512(const GemmArgs& a);
void gemm_f32w_avx2(const GemmArgs& a);
void gemm_f32w_avx(const GemmArgs& a);
void gemm_f32w_sse2(const GemmArgs& a);
void gemm_f32w_scalar(const GemmArgs& a);

// The kernels' multiply-add instruction alone (vdpbf16ps, or the fp32 FMA of
// that width), `iterations` times in 12 independent chains; returns the
// multiply-adds done. For measure_peak_macs_per_second (kernels/linear.h).
int64_t peak_macs_avx512bf16(int64_t iterations);
int64_t peak_macs_avx512(int64_t iterations);
int64_t peak_macs_avx2(int64_t iterations);
int64_t peak_macs_avx(int64_t iterations);   // a multiply and an add
int64_t peak_macs_sse2(int64_t iterations);  // a multiply and an add

// Their loop: a = op(a) on 12 independent accumulators, `iterations` times.
// The chains outnumber latency x issue rate on the cores measured (Zen 4
// vdpbf16ps: ~6 cycles, one per cycle). Named variables, not an array: GCC
// kept an array of accumulators in memory, and the stores and reloads halved
// the rate. An empty asm "uses" each result, so that nothing is dropped or
// merged. Returns the multiply-adds done, macs_per_op per op.
template <class V, class Op>
static inline int64_t peak_chains(int64_t iterations, int64_t macs_per_op, Op op) {
  V a0{}, a1{}, a2{}, a3{}, a4{}, a5{}, a6{}, a7{}, a8{}, a9{}, a10{}, a11{};
  auto step = [&op](V& a) {
    a = op(a);
    __asm__ volatile("" : "+v"(a));
  };
  for (int64_t n = 0; n < iterations; ++n) {
    step(a0), step(a1), step(a2), step(a3), step(a4), step(a5);
    step(a6), step(a7), step(a8), step(a9), step(a10), step(a11);
  }
  return 12 * macs_per_op * iterations;
}

// One attention score row (kernels/ops.cpp): false when D is not a multiple
// of 16 (the caller falls back to the portable loop).
bool scores_row_avx512(const uint16_t* q, const uint16_t* keys, const bool* masked, uint16_t* out, int64_t L,
                       int64_t D, float scale);
bool scores_row_avx512(const float* q, const float* keys, const bool* masked, float* out, int64_t L, int64_t D,
                       float scale);

// Rows of one KV head computed together (attention_avx512.cpp): up to
// kBlockRows query rows against the same keys or values; row r reads q[r]
// (or probs[r]) and masked[r], writes out[r]. scratch holds
// (kBlockRows + kBlockKeys) * D floats; D a multiple of 16, at most
// kBlockMaxD. Same bits as the row functions.
constexpr int kBlockRows = 16;
constexpr int kBlockKeys = 32;  // keys widened to fp32 at a time (at most 32: a bit mask per row)
constexpr int64_t kBlockMaxD = 512;
void scores_block_avx512(const uint16_t* const* q, const bool* const* masked, uint16_t* const* out, int rows,
                         const uint16_t* keys, int64_t L, int64_t D, float scale, float* scratch);
void scores_block_avx512(const float* const* q, const bool* const* masked, float* const* out, int rows,
                         const float* keys, int64_t L, int64_t D, float scale, float* scratch);
void values_block_avx512(const uint16_t* const* probs, uint16_t* const* out, int rows, const uint16_t* values,
                         int64_t L, int64_t D, float* scratch);
void values_block_avx512(const float* const* probs, float* const* out, int rows, const float* values, int64_t L,
                         int64_t D, float* scratch);

// The same blocks with AVX2 (attention_avx2.cpp, 8-lane registers; D a
// multiple of 16, at most kBlockMaxD; the same scratch): the same bits.
void scores_block_avx2(const uint16_t* const* q, const bool* const* masked, uint16_t* const* out, int rows,
                       const uint16_t* keys, int64_t L, int64_t D, float scale, float* scratch);
void scores_block_avx2(const float* const* q, const bool* const* masked, float* const* out, int rows,
                       const float* keys, int64_t L, int64_t D, float scale, float* scratch);
void values_block_avx2(const uint16_t* const* probs, uint16_t* const* out, int rows, const uint16_t* values,
                       int64_t L, int64_t D, float* scratch);
void values_block_avx2(const float* const* probs, float* const* out, int rows, const float* values, int64_t L,
                       int64_t D, float* scratch);

// Up to kManyRows rows of one KV head (prefill), the same rows as a block's
// (the query heads of consecutive positions): scores, softmax and values in
// one call, each key and value chunk widened once for all of them and the
// keys transposed, so that a score tile's lanes are keys (no horizontal
// sums). The same bits as the block and row functions. scratch holds
// many_scratch_floats(D, L) floats; scores kManyRows * L elements.
constexpr int kManyRows = 128;
static inline int64_t many_scratch_floats(int64_t D, int64_t L) { return (kManyRows + kBlockKeys) * D + L; }
void attention_many_avx512(const uint16_t* const* q, const bool* const* masked, uint16_t* const* out, int rows,
                           const uint16_t* keys, const uint16_t* values, int64_t L, int64_t D, float scale,
                           float* scratch, uint16_t* scores);
void attention_many_avx512(const float* const* q, const bool* const* masked, float* const* out, int rows,
                           const float* keys, const float* values, int64_t L, int64_t D, float scale, float* scratch,
                           float* scores);

// bf16 attention on vdpbf16ps (attention_avx512bf16.cpp): the block and
// many-row calls above for bf16 rows, D a multiple of 32 (at most
// kBlockMaxD), the same scratch; bits of their own (that file's header),
// which decode, prefill, blocks and rows share.
void scores_block_avx512bf16(const uint16_t* const* q, const bool* const* masked, uint16_t* const* out, int rows,
                             const uint16_t* keys, int64_t L, int64_t D, float scale);
void values_block_avx512bf16(const uint16_t* const* probs, uint16_t* const* out, int rows, const uint16_t* values,
                             int64_t L, int64_t D, float* scratch);
void attention_many_avx512bf16(const uint16_t* const* q, const bool* const* masked, uint16_t* const* out, int rows,
                               const uint16_t* keys, const uint16_t* values, int64_t L, int64_t D, float scale,
                               float* scratch, uint16_t* scores);

// One softmax row (kernels/ops.cpp's softmax_row, the same bits): e holds n floats.
void softmax_row_avx512(const uint16_t* x, uint16_t* out, int64_t n, float* e);
void softmax_row_avx512(const float* x, float* out, int64_t n, float* e);

// One head's rotary input (kernels/ops.cpp's rms_norm_row with weight w,
// unless w is null, then rope_row; the same bits): false when D is not a
// multiple of 32 or over kBlockMaxD (the caller runs the row functions).
bool norm_rope_row_avx512(const uint16_t* x, const uint16_t* w, const uint16_t* cos, const uint16_t* sin,
                          uint16_t* out, int64_t D, float eps);
bool norm_rope_row_avx512(const float* x, const float* w, const float* cos, const float* sin, float* out, int64_t D,
                          float eps);

// float -> bfloat16, round to nearest even (NaN stays NaN): c10::BFloat16's rule.
static inline uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  const uint32_t nan_mask = 0u - static_cast<uint32_t>((u & 0x7fffffffu) > 0x7f800000u);  // no branch: vectorizes
  return static_cast<uint16_t>((rounded & ~nan_mask) | (quiet_nan & nan_mask));
}

// A bfloat16's value.
static inline float bf16_value(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// Asks for cache rows [from, to) of a block's keys or values (D elements
// each, clipped to its L rows) to be brought into the cache. Decode-sized
// blocks read their keys and values once each, from memory (the weights
// streamed since the last step have evicted them): the kernels ask for the
// first kKvAheadRows rows when they start, then (prefetch_ahead) the line
// kKvAheadRows rows past each line they read. The attention of a batch-8
// decode step (Qwen3-0.6B shape, context ~56) took 0.80-0.85x the time with
// the rows asked a chunk or two ahead than without (3 alternating runs, Zen 5
// EPYC; docs/benchmarks.md, 2026-12-05 second session).
template <class E>
static inline void prefetch_rows(const E* base, int64_t from, int64_t to, int64_t L, int64_t D) {
  if (to > L) to = L;
  if (from >= to) return;
  const char* b = reinterpret_cast<const char*>(base + from * D);
  const char* e = reinterpret_cast<const char*>(base + to * D);
  for (; b < e; b += 64) __builtin_prefetch(b, 0, 3);
}

// How far ahead (rows of the cache) decode-sized attention blocks ask for
// their keys and values.
constexpr int64_t kKvAheadRows = 32;

// The line `ahead` elements past p, unless that is at or past end (the
// block's last row): one request for each line a kernel reads, so that
// memory is asked at the rate the kernel reads. Asking for a whole chunk's
// rows at once (64 or 128 lines per chunk of 16 or 32 keys, prefetch_rows)
// had stalled the kernels at each chunk until most of them came. The
// attention of 28 layers at batch 8, context 1040 (Qwen3-0.6B shape, 954 MB
// of cache; Turin-like Zen 5, alternating processes): AVX-512F kernels
// 34.8-35.3 ms -> 29.0-29.7, vdpbf16ps 30.8-31.4 -> 29.7-30.2; at context
// 100 the same within the noise (docs/benchmarks.md, 2026-12-07 seventh
// session). The AVX2 kernels still ask a chunk ahead. ahead 0: nothing.
// Always inlined: as a plain inline function, GCC 12 at -O2 and -O3 split
// the comparison and the prefetch off into a function of its own (fnsplit,
// seen in -fdump-tree-all), and no prefetch was left in the kernels' code
// (counted in -S output; why the calls went was not established).
template <class E>
__attribute__((always_inline)) static inline void prefetch_ahead(const E* p, int64_t ahead, const E* end) {
  if (ahead > 0 && ahead < end - p) __builtin_prefetch(p + ahead, 0, 3);
}

// Writes the accumulators of rows [m0, m0 + mr) x panel p (acc[r][0..64))
// into y: bias added in fp32, columns beyond N dropped. Shared by every
// kernel so that the rounding is the same everywhere.
static inline void store_tile(const GemmArgs& a, int64_t m0, int mr, int64_t p, const float* acc) {
  const int64_t n0 = p * kPanel;
  const int64_t nn = a.N - n0 < kPanel ? a.N - n0 : kPanel;
  for (int r = 0; r < mr; ++r) {
    const float* src = acc + r * kPanel;
    if (a.y_bf16) {
      uint16_t* dst = static_cast<uint16_t*>(a.y) + (m0 + r) * a.y_stride + n0;
      for (int64_t j = 0; j < nn; ++j) dst[j] = to_bf16(a.bias ? src[j] + a.bias[n0 + j] : src[j]);
    } else {
      float* dst = static_cast<float*>(a.y) + (m0 + r) * a.y_stride + n0;
      for (int64_t j = 0; j < nn; ++j) dst[j] = a.bias ? src[j] + a.bias[n0 + j] : src[j];
    }
  }
}

// A tile computes rows [m0, m0 + MR) of panels [p, p + NP) over k units
// [k0, k1) (bf16 pairs, or fp32 k): tile(Int<MR>{}, Int<NP>{}, m0, p, k0, k1,
// acc, first, prefetch), where acc holds the tile's NP x MR x 64
// accumulators (panel q's row r at acc + 64 (q MR + r)), read unless first
// (then zero) and written back. NP is 1 except for the two-panel tiles of
// kernels with WideMR > 0 (below). Summing over k in order across calls
// keeps each output's one accumulator and one order: the same bits however
// k is split.
//
// Many rows (prefill): rows in blocks of about kRowBlock, a whole number of
// MaxMR-row tiles (the block's x stays in L2 while the thread's panels stream
// past it; a short tile only at the end of x: 128 rows in 6-row tiles had
// ended each block with a 2-row tile at ~2.5x the cost per row), each tile
// over the whole depth. PackedLinear::run calls with 120-row units (whole
// tiles of every kernel): one block each.
// Up to OneMR rows (batch-8 decode): one whole-depth tile, even where its
// accumulators outnumber the registers. At 8 rows the AVX-512 kernels hold
// 32 of them, and GCC keeps a few in L1 (a load, the multiply-add and a
// store per k unit), which costs less than stopping the weight stream for a
// short k-blocked tile: on the AVX512-BF16 EPYC the projections of a
// batch-8 step took 0.79-0.92x the time of 6 + 2-row tiles in k blocks
// (vdpbf16ps, fp32 and widening kernels), at 7 rows 0.62-0.84x, at 9 and 10
// rows 0.78-0.85x (vdpbf16ps and fp32; the widening kernel, which holds
// more, was 1.10x slower at 10). 11 rows tied, 12 took twice as long
// (docs/benchmarks.md, 2026-12-03 sixth session). AVX2 takes only one row
// this way: its multi-row tiles are strips of the panel, which a whole-depth
// tile would re-read from L2 while memory idles.
// Decode-sized batches (more than OneMR rows, at most kSmallM; tiles of up to
// SmallMR rows): every tile of a panel walks it kKBlock units at a time, so
// the weights stream from memory once and without pause (the tiles share
// each unit's prefetches by rows; each finds the current block in L1). Whole-depth tiles would leave
// memory idle while the second tile re-read the panel from L2 (~9 % of a
// batch-8 decode step).
constexpr int64_t kSmallM = 32;
constexpr int64_t kKBlock = 32;  // 8 KiB of a panel: 64 columns x 32 bf16 pairs or 32 floats

template <int N>
struct Int {
  static constexpr int value = N;
};

template <int R, class Fn>
static inline void tail_tile(Fn& fn, int64_t m, int64_t rest) {
  if constexpr (R > 0) {
    if (rest == R) fn(Int<R>{}, m);
    else tail_tile<R - 1>(fn, m, rest);
  }
}

// fn(Int<MR>{}, m) for tiles covering rows [mb, me).
template <int MaxMR, class Fn>
static inline void for_tiles(int64_t mb, int64_t me, Fn fn) {
  int64_t m = mb;
  for (; m + MaxMR <= me; m += MaxMR) fn(Int<MaxMR>{}, m);
  tail_tile<MaxMR - 1>(fn, m, me - m);
}

// One or two rows (batch-1 decode) on the AVX-512 kernels: a tile takes two
// neighbouring panels at once (NP = 2 in drive()), 8 or 16 accumulators. With
// one panel, each accumulator's multiply-adds wait on its previous one (four
// chains; the widening kernel adds two FMAs per k pair to each), and that
// latency showed through the weight stream in the model, though not in a
// projection alone. Batch-1 steps with two panels against one (Zen 5 EPYC,
// alternating runs; docs/benchmarks.md, 2026-12-04 second session): the
// widening kernel 0.89-0.97x the time in 7 of 7 rounds; vdpbf16ps 0.91-1.00x
// in 4 of 4 with a switch in one binary, but 1.02-1.18x in 4 rounds against
// the previous binary in a slow stretch; fp32 0.90-1.09x, faster in 3 of 4.
// Each output keeps its one accumulator and order: the same bits as one-panel
// tiles. Decode-sized chunks that leave a single panel take the one-panel tile.
constexpr int kWideMR = 2;

template <int MaxMR, int SmallMR = MaxMR, int OneMR = MaxMR, int WideMR = 0, class Tile>
static inline void drive(const GemmArgs& a, int64_t units, Tile tile) {
  static_assert(OneMR <= kSmallM, "a one-tile batch is a decode-sized one");
  static_assert(2 * WideMR <= OneMR, "two panels of a wide tile fit the accumulator buffer");
  if (a.M <= OneMR) {
    alignas(64) float acc[OneMR * kPanel];
    int64_t p = a.panel_begin;
    if constexpr (WideMR > 0) {
      if (a.M <= WideMR)
        for (; p + 2 <= a.panel_end; p += 2)
          for_tiles<WideMR>(0, a.M, [&](auto mr, int64_t m) {
            constexpr int MR = decltype(mr)::value;
            tile(mr, Int<2>{}, m, p, 0, units, acc, true, kWholeUnits);
            store_tile(a, m, MR, p, acc);
            store_tile(a, m, MR, p + 1, acc + MR * kPanel);
          });
    }
    for (; p < a.panel_end; ++p)
      for_tiles<OneMR>(0, a.M, [&](auto mr, int64_t m) {
        tile(mr, Int<1>{}, m, p, 0, units, acc, true, kWholeUnits);
        store_tile(a, m, decltype(mr)::value, p, acc);
      });
    return;
  }
  if (a.M <= kSmallM) {
    alignas(64) float acc[kSmallM * kPanel];
    // Indexed by the tile's first row; the same for every panel and k block.
    // The lines are split by rows among the first `rows` rows: all of them,
    // or all but a short last tile (fewer than half of SmallMR rows, after a
    // whole one: 6 + 6 + 2 at batch 14), which then requests nothing. On the
    // AVX512-BF16 EPYC such a tile's own share had made batch-8 decode steps
    // 1.10-1.18x as long when batch 8 ran 6 + 2 here (vdpbf16ps and fp32
    // kernels; docs/benchmarks.md, 2026-12-03), while even tiles (4 + 4 on
    // the widening kernels, 6 + 6 + 4 at batch 16) gain from sharing.
    Prefetch share[kSmallM];
    const int64_t tail = a.M % SmallMR;
    const int64_t rows = tail > 0 && 2 * tail < SmallMR && a.M > SmallMR ? a.M - tail : a.M;
    for_tiles<SmallMR>(0, a.M, [&](auto mr, int64_t m) {
      const int64_t b = m < rows ? m : rows, e = m + decltype(mr)::value < rows ? m + decltype(mr)::value : rows;
      const int parts = m < rows ? static_cast<int>((rows + SmallMR - 1) / SmallMR) : 0;  // 0: none (AVX2)
      share[m] = Prefetch{static_cast<int>(b * kUnitLines / rows), static_cast<int>(e * kUnitLines / rows),
                          static_cast<int>(m / SmallMR), parts};
    });
    for (int64_t p = a.panel_begin; p < a.panel_end; ++p) {
      for (int64_t k0 = 0; k0 < units; k0 += kKBlock) {
        const int64_t k1 = units < k0 + kKBlock ? units : k0 + kKBlock;
        for_tiles<SmallMR>(0, a.M, [&](auto mr, int64_t m) {
          tile(mr, Int<1>{}, m, p, k0, k1, acc + m * kPanel, k0 == 0, share[m]);
        });
      }
      store_tile(a, 0, static_cast<int>(a.M), p, acc);
    }
    return;
  }
  // Whole-depth tiles: the first tile of each row block brings the panel in
  // from memory, the block's other tiles find it in cache.
  alignas(64) float acc[MaxMR * kPanel];
  constexpr int64_t block = kRowBlock / MaxMR * MaxMR;  // whole tiles: a short one only at the end of x
  for (int64_t mb = 0; mb < a.M; mb += block) {
    const int64_t me = a.M < mb + block ? a.M : mb + block;
    for (int64_t p = a.panel_begin; p < a.panel_end; ++p)
      for_tiles<MaxMR>(mb, me, [&](auto mr, int64_t m) {
        tile(mr, Int<1>{}, m, p, 0, units, acc, true, m == mb ? kWholeUnits : Prefetch{});
        store_tile(a, m, decltype(mr)::value, p, acc);
      });
  }
}

}  // namespace dmi::kernels::detail
