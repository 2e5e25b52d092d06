#include "model/rope.h"

#include <ATen/ATen.h>

#include <cmath>

namespace dmi::model {

at::Tensor rope_inv_freq(const io::RopeConfig& rope, std::int64_t head_dim) {
  at::Tensor exps = at::arange(0, head_dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(head_dim);
  at::Tensor inv = 1.0 / at::pow(rope.theta, exps);
  if (rope.type == "linear") return inv / rope.factor;
  if (rope.type == "llama3") {
    const double old = static_cast<double>(rope.original_max_position_embeddings);
    const double lo_wl = old / rope.low_freq_factor, hi_wl = old / rope.high_freq_factor;
    at::Tensor wavelen = 2 * M_PI / inv;
    at::Tensor out = at::where(wavelen > lo_wl, inv / rope.factor, inv);
    at::Tensor smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * out / rope.factor + smooth * out;
    at::Tensor medium = at::logical_not(wavelen < hi_wl).logical_and(at::logical_not(wavelen > lo_wl));
    return at::where(medium, smoothed, out);
  }
  return inv;
}

std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& inv_freq, const at::Tensor& positions,
                                              at::ScalarType dtype) {
  at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;  // [B, T, D/2]
  at::Tensor emb = at::cat({freqs, freqs}, -1).unsqueeze(2);             // [B, T, 1, D]
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

}  // namespace dmi::model
