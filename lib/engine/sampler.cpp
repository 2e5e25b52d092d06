#include "engine/sampler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace dmi::engine {

Sampler::Sampler(const SamplingOptions& opts, std::uint64_t sequence_index) : opts_(opts) {
  std::seed_seq seq{static_cast<std::uint32_t>(opts.seed), static_cast<std::uint32_t>(opts.seed >> 32),
                    static_cast<std::uint32_t>(sequence_index), static_cast<std::uint32_t>(sequence_index >> 32)};
  rng_.seed(seq);
}

std::int32_t Sampler::next(const at::Tensor& logits) {
  const float* x = logits.data_ptr<float>();
  const std::int64_t V = logits.numel();
  if (opts_.temperature <= 0.0) return static_cast<std::int32_t>(std::max_element(x, x + V) - x);
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
