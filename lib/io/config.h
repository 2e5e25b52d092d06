// config.json of a Hugging Face decoder, with Hugging Face's per-architecture
// defaults applied for missing keys.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dmi::io {

struct RopeConfig {
  std::string type = "default";  // default | linear | llama3
  double theta = 10000.0;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  std::int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  std::string path;          // the config.json read
  std::string json_text;     // its text, verbatim
  std::string architecture;  // e.g. "Qwen3ForCausalLM"
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_layers = 0;
  std::int64_t num_heads = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  RopeConfig rope;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // q/k/v projections carry biases (Qwen2, attention_bias)
  bool o_bias = false;    // o_proj carries a bias (attention_bias on Llama/Mistral)
  bool qk_norm = false;   // per-head RMSNorm on q and k before rotary (Qwen3)
  std::optional<std::int64_t> sliding_window;
  std::string hidden_act = "silu";
  std::optional<std::int64_t> bos_token_id;
  std::vector<std::int64_t> eos_token_ids;
  std::string torch_dtype;
};

const std::vector<std::string>& supported_architectures();

// Reads and validates config.json; errors name the file and the field.
ModelConfig load_config(const std::string& path);
ModelConfig parse_config(const std::string& json_text, const std::string& path);
// The metadata of a model dmi does not implement (TorchScript): only
// max_position_embeddings is required; architectures, vocab_size,
// num_hidden_layers, hidden_size, intermediate_size, num_attention_heads,
// num_key_value_heads, head_dim, bos_token_id and eos_token_id are read when
// present (the caller checks them against the module).
ModelConfig parse_generic_config(const std::string& json_text, const std::string& path);

}  // namespace dmi::io
