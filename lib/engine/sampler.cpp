#include "engine/sampler.h"

#include <ATen/ATen.h>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace dmi::engine {

namespace {

// The first index of the largest logit: std::max_element's answer (a NaN
// never wins unless it comes first). SSE2 intrinsics (every x86-64 CPU):
// GCC 12 left the plain loop scalar (maxss; it vectorizes a float maximum
// only under -ffinite-math-only -fno-signed-zeros), 56 us a 151936-logit
// row against 14.7 now, while the other thread of a batch-8 decode step
// waited (docs/benchmarks.md, 2026-12-07 fifth session).
// maxps returns its second operand when either is NaN: the lanes skip NaNs.
std::int32_t argmax(const float* x, std::int64_t V) {
  if (std::isnan(x[0])) return 0;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float mx = neg_inf;
  std::int64_t i = 0;
#ifdef __SSE2__
  __m128 m0 = _mm_set1_ps(neg_inf), m1 = m0, m2 = m0, m3 = m0;
  for (; i + 16 <= V; i += 16) {
    m0 = _mm_max_ps(_mm_loadu_ps(x + i), m0);
    m1 = _mm_max_ps(_mm_loadu_ps(x + i + 4), m1);
    m2 = _mm_max_ps(_mm_loadu_ps(x + i + 8), m2);
    m3 = _mm_max_ps(_mm_loadu_ps(x + i + 12), m3);
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3)));
  for (float v : lanes) mx = std::max(mx, v);
#endif
  for (; i < V; ++i) mx = std::max(mx, x[i]);
  std::int64_t b = 0;
#ifdef __SSE2__
  const __m128 want = _mm_set1_ps(mx);
  for (; b + 16 <= V; b += 16) {
    const __m128 h0 = _mm_or_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + b), want), _mm_cmpeq_ps(_mm_loadu_ps(x + b + 4), want));
    const __m128 h1 = _mm_or_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + b + 8), want), _mm_cmpeq_ps(_mm_loadu_ps(x + b + 12), want));
    if (_mm_movemask_ps(_mm_or_ps(h0, h1))) break;
  }
#endif
  for (; b < V; ++b)
    if (x[b] == mx) return static_cast<std::int32_t>(b);
  return 0;  // unreachable: mx is one of x (or -inf, and then x[0] is -inf)
}

}  // namespace

Sampler::Sampler(const SamplingOptions& opts, std::uint64_t sequence_index) : opts_(opts) {
  std::seed_seq seq{static_cast<std::uint32_t>(opts.seed), static_cast<std::uint32_t>(opts.seed >> 32),
                    static_cast<std::uint32_t>(sequence_index), static_cast<std::uint32_t>(sequence_index >> 32)};
  rng_.seed(seq);
}

std::int32_t Sampler::next(const at::Tensor& logits) {
  const float* x = logits.data_ptr<float>();
  const std::int64_t V = logits.numel();
  if (opts_.temperature <= 0.0) return argmax(x, V);
  std::vector<std::int32_t> idx(V);
  std::iota(idx.begin(), idx.end(), 0);
  auto by_logit = [x](std::int32_t a, std::int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  std::int64_t keep = V;
  if (opts_.top_k > 0 && opts_.top_k < V) {
    keep = opts_.top_k;
    std::partial_sort(idx.begin(), idx.begin() + keep, idx.end(), by_logit);
  } else {
    std::sort(idx.begin(), idx.end(), by_logit);
  }
  // Softmax over the kept tokens at this temperature (in double).
  std::vector<double> p(keep);
  const double mx = x[idx[0]] / opts_.temperature;
  double sum = 0;
  for (std::int64_t i = 0; i < keep; ++i) sum += p[i] = std::exp(x[idx[i]] / opts_.temperature - mx);
  for (auto& v : p) v /= sum;
  if (opts_.top_p < 1.0) {
    // Smallest prefix whose mass reaches top_p (always at least one token).
    double cum = 0;
    std::int64_t n = 0;
    while (n < keep) {
      cum += p[n++];
      if (cum >= opts_.top_p) break;
    }
    keep = n;
    p.resize(keep);
  }
  std::discrete_distribution<std::int64_t> dist(p.begin(), p.end());
  return idx[dist(rng_)];
}

}  // namespace dmi::engine
