#include "engine/sampler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace dmi::engine {

namespace {

// The first index of the largest logit: std::max_element's answer (a NaN
// never wins unless it comes first), in 16 lanes and blocks of 16 so that it
// vectorizes; the scalar scan was ~2 % of a batch-8 decode step's main thread.
std::int32_t argmax(const float* x, std::int64_t V) {
  if (std::isnan(x[0])) return 0;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float lanes[16];
  for (int j = 0; j < 16; ++j) lanes[j] = neg_inf;
  std::int64_t i = 0;
  for (; i + 16 <= V; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] = std::max(lanes[j], x[i + j]);
  for (int j = 0; i < V; ++i, ++j) lanes[j] = std::max(lanes[j], x[i]);
  float mx = neg_inf;
  for (int j = 0; j < 16; ++j) mx = std::max(mx, lanes[j]);
  std::int64_t b = 0;
  for (; b + 16 <= V; b += 16) {
    int hits = 0;
    for (int j = 0; j < 16; ++j) hits += x[b + j] == mx;
    if (hits) break;
  }
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
