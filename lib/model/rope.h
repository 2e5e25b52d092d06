// Rotary position embeddings as Hugging Face computes them (default, linear
// and llama3 scaling), in float32.
#pragma once

#include <ATen/core/Tensor.h>

#include "io/config.h"

namespace dmi::model {

// inv_freq [head_dim / 2], float32.
at::Tensor rope_inv_freq(const io::RopeConfig& rope, std::int64_t head_dim);

// cos and sin for positions [B, T] (int64): each [B, T, 1, head_dim] in dtype,
// ready to broadcast over heads.
std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& inv_freq, const at::Tensor& positions,
                                              at::ScalarType dtype);

// Applied by kernels::rope (x * cos + rotate_half(x) * sin).

}  // namespace dmi::model
