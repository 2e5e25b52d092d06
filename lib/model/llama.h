// The Llama family: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
// Qwen3ForCausalLM. One decoder; variants come from config and weights.
#pragma once

#include "io/weights.h"
#include "kernels/linear.h"
#include "model/causal_lm.h"

namespace dmi::model {

class LlamaFamily final : public CausalLM {
 public:
  LlamaFamily(io::ModelConfig cfg, const io::WeightStore& weights, at::ScalarType dtype);

  const io::ModelConfig& config() const override { return cfg_; }
  at::ScalarType dtype() const override { return dtype_; }
  KVCache new_cache(std::int64_t batch, std::int64_t capacity) const override;
  at::Tensor forward(const ForwardInput& in, KVCache& cache, hooks::Observer* observer) override;
  std::size_t weight_bytes() const override { return weight_bytes_; }
  std::string kernels() const override { return kernels::describe(lm_head_.isa(), dtype_); }
  kernels::Isa kernel_isa() const override { return lm_head_.isa(); }
  ForwardWork forward_work() const override;
  bool attention_arithmetic_applies() const override;

 private:
  struct Layer {
    at::Tensor ln1, q_norm, k_norm, ln2;
    kernels::PackedLinear qkv, o, gate_up, down;
  };
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) const;
  at::Tensor forward_pass(const ForwardInput& in, KVCache& cache, hooks::Observer* observer);

  io::ModelConfig cfg_;
  at::ScalarType dtype_;
  at::Tensor embed_, final_norm_, inv_freq_;
  kernels::PackedLinear lm_head_;
  std::vector<Layer> layers_;
  std::size_t weight_bytes_ = 0;
};

}  // namespace dmi::model
