// Next-token choice: greedy, or temperature / top-k / top-p sampling in
// Hugging Face's order. Each sequence has its own generator seeded from
// (seed, sequence index), so a sequence's samples do not depend on its batch.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <random>

namespace dmi::engine {

struct SamplingOptions {
  double temperature = 0.0;  // 0: greedy
  std::int64_t top_k = 0;    // 0: off
  double top_p = 1.0;        // 1: off
  std::uint64_t seed = 0;
};

class Sampler {
 public:
  Sampler(const SamplingOptions& opts, std::uint64_t sequence_index);
  // logits: [vocab] float32, contiguous.
  std::int32_t next(const at::Tensor& logits);

 private:
  SamplingOptions opts_;
  std::mt19937_64 rng_;
};

}  // namespace dmi::engine
