#include "io/config.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.h"

namespace dmi::io {

using nlohmann::json;

const std::vector<std::string>& supported_architectures() {
  static const std::vector<std::string> a = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                             "Qwen3ForCausalLM"};
  return a;
}

namespace {

// Hugging Face's defaults (transformers' Configuration classes).
json defaults_for(const std::string& arch) {
  if (arch == "LlamaForCausalLM")
    return {{"vocab_size", 32000}, {"hidden_size", 4096}, {"intermediate_size", 11008},
            {"num_hidden_layers", 32}, {"num_attention_heads", 32}, {"max_position_embeddings", 2048},
            {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0}, {"tie_word_embeddings", false},
            {"attention_bias", false}, {"hidden_act", "silu"}, {"bos_token_id", 1}, {"eos_token_id", 2}};
  if (arch == "MistralForCausalLM")
    return {{"vocab_size", 32000}, {"hidden_size", 4096}, {"intermediate_size", 14336},
            {"num_hidden_layers", 32}, {"num_attention_heads", 32}, {"num_key_value_heads", 8},
            {"max_position_embeddings", 4096 * 32}, {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0},
            {"tie_word_embeddings", false}, {"sliding_window", 4096}, {"hidden_act", "silu"},
            {"bos_token_id", 1}, {"eos_token_id", 2}};
  if (arch == "Qwen2ForCausalLM")
    return {{"vocab_size", 151936}, {"hidden_size", 4096}, {"intermediate_size", 22016},
            {"num_hidden_layers", 32}, {"num_attention_heads", 32}, {"num_key_value_heads", 32},
            {"max_position_embeddings", 32768}, {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0},
            {"tie_word_embeddings", false}, {"use_sliding_window", false}, {"hidden_act", "silu"}};
  // Qwen3ForCausalLM
  return {{"vocab_size", 151936}, {"hidden_size", 4096}, {"intermediate_size", 22016},
          {"num_hidden_layers", 32}, {"num_attention_heads", 32}, {"num_key_value_heads", 32},
          {"head_dim", 128}, {"max_position_embeddings", 32768}, {"rms_norm_eps", 1e-6},
          {"rope_theta", 10000.0}, {"tie_word_embeddings", false}, {"attention_bias", false},
          {"use_sliding_window", false}, {"hidden_act", "silu"}};
}

class Reader {
 public:
  Reader(const json& j, const std::string& path) : j_(j), path_(path) {}

  bool present(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }

  std::int64_t positive_int(const char* key) const {
    DMI_CHECK(present(key), "{}: missing field '{}'", path_, key);
    DMI_CHECK(j_[key].is_number_integer() && j_[key].get<std::int64_t>() > 0,
              "{}: field '{}' must be a positive integer, got {}", path_, key, j_[key].dump());
    return j_[key].get<std::int64_t>();
  }
  double number(const json& obj, const char* key, const std::string& where) const {
    DMI_CHECK(obj.contains(key) && obj[key].is_number(), "{}: field '{}{}' must be a number", path_, where, key);
    return obj[key].get<double>();
  }
  bool boolean(const char* key) const {
    if (!present(key)) return false;
    DMI_CHECK(j_[key].is_boolean(), "{}: field '{}' must be true or false", path_, key);
    return j_[key].get<bool>();
  }

 private:
  const json& j_;
  const std::string& path_;
};

std::vector<std::int64_t> token_ids(const json& v, const std::string& path, const char* key) {
  std::vector<std::int64_t> out;
  if (v.is_null()) return out;
  if (v.is_number_integer()) return {v.get<std::int64_t>()};
  DMI_CHECK(v.is_array(), "{}: field '{}' must be an integer or a list of integers", path, key);
  for (const auto& e : v) {
    DMI_CHECK(e.is_number_integer(), "{}: field '{}' must be an integer or a list of integers", path, key);
    out.push_back(e.get<std::int64_t>());
  }
  return out;
}

RopeConfig parse_rope(const json& j, const std::string& path, const Reader& r) {
  RopeConfig rope;
  // Newer transformers: everything under "rope_parameters"; older: rope_theta
  // at top level plus an optional "rope_scaling" object.
  const char* key = j.contains("rope_parameters") && !j["rope_parameters"].is_null() ? "rope_parameters"
                                                                                     : "rope_scaling";
  if (j.contains("rope_theta") && !j["rope_theta"].is_null()) rope.theta = r.number(j, "rope_theta", "");
  if (!j.contains(key) || j[key].is_null()) return rope;
  const json& s = j[key];
  DMI_CHECK(s.is_object(), "{}: field '{}' must be an object", path, key);
  std::string where = std::string(key) + ".";
  if (s.contains("rope_theta")) rope.theta = r.number(s, "rope_theta", where);
  std::string type = "default";
  for (const char* k : {"rope_type", "type"}) {
    if (!s.contains(k)) continue;
    DMI_CHECK(s[k].is_string(), "{}: field '{}{}' must be a string, got {}", path, where, k, s[k].dump());
    type = s[k].get<std::string>();
    break;
  }
  if (type == "default") return rope;
  rope.type = type;
  if (type == "linear") {
    rope.factor = r.number(s, "factor", where);
  } else if (type == "llama3") {
    rope.factor = r.number(s, "factor", where);
    rope.low_freq_factor = r.number(s, "low_freq_factor", where);
    rope.high_freq_factor = r.number(s, "high_freq_factor", where);
    const double original = r.number(s, "original_max_position_embeddings", where);
    DMI_CHECK(original >= 1 && original <= (1 << 30), "{}: {}original_max_position_embeddings {} is out of range",
              path, where, original);
    rope.original_max_position_embeddings = static_cast<std::int64_t>(original);
    DMI_CHECK(rope.high_freq_factor != rope.low_freq_factor,
              "{}: {}high_freq_factor must differ from low_freq_factor", path, where);
  } else {
    DMI_FAIL("{}: {}rope_type '{}' is not supported (supported: default, linear, llama3)", path, where, type);
  }
  DMI_CHECK(rope.factor > 0, "{}: {}factor must be positive", path, where);
  return rope;
}

}  // namespace

namespace {

json parse_object(const std::string& text, const std::string& path) {
  json raw;
  try {
    raw = json::parse(text);
  } catch (const json::exception& e) {
    DMI_FAIL("{}: malformed JSON: {}", path, e.what());
  }
  DMI_CHECK(raw.is_object(), "{}: config.json must be a JSON object", path);
  return raw;
}

void read_special_ids(const json& j, const std::string& path, ModelConfig& c) {
  if (j.contains("bos_token_id") && !j["bos_token_id"].is_null()) {
    auto b = token_ids(j["bos_token_id"], path, "bos_token_id");
    if (!b.empty()) c.bos_token_id = b[0];
  }
  if (j.contains("eos_token_id")) c.eos_token_ids = token_ids(j["eos_token_id"], path, "eos_token_id");
}

}  // namespace

namespace {

// The readers proper; the public functions turn any JSON type error they did
// not check for into a dmi::Error naming the file.
ModelConfig parse_generic_config_checked(const std::string& text, const std::string& path) {
  const json j = parse_object(text, path);
  ModelConfig c;
  c.path = path;
  c.json_text = text;
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string())
    c.architecture = j["architectures"][0].get<std::string>();
  Reader r(j, path);
  c.max_position_embeddings = r.positive_int("max_position_embeddings");
  std::int64_t* fields[] = {&c.vocab_size, &c.num_layers, &c.hidden_size, &c.intermediate_size,
                            &c.num_heads, &c.num_kv_heads, &c.head_dim};
  const char* keys[] = {"vocab_size", "num_hidden_layers", "hidden_size", "intermediate_size",
                        "num_attention_heads", "num_key_value_heads", "head_dim"};
  for (std::size_t k = 0; k < std::size(keys); ++k)
    if (r.present(keys[k])) *fields[k] = r.positive_int(keys[k]);
  read_special_ids(j, path, c);
  return c;
}

ModelConfig parse_config_checked(const std::string& text, const std::string& path) {
  const json raw = parse_object(text, path);
  DMI_CHECK(raw.contains("architectures") && raw["architectures"].is_array() && !raw["architectures"].empty() &&
                raw["architectures"][0].is_string(),
            "{}: missing field 'architectures' (supported: {})", path,
            fmt::join(supported_architectures(), ", "));
  ModelConfig c;
  c.path = path;
  c.json_text = text;
  c.architecture = raw["architectures"][0].get<std::string>();
  const auto& sup = supported_architectures();
  DMI_CHECK(std::find(sup.begin(), sup.end(), c.architecture) != sup.end(),
            "{}: architecture '{}' is not supported (supported: {})", path, c.architecture, fmt::join(sup, ", "));

  json j = defaults_for(c.architecture);
  for (auto it = raw.begin(); it != raw.end(); ++it)
    if (!it.value().is_null() || !j.contains(it.key())) j[it.key()] = it.value();
  Reader r(j, path);
  c.vocab_size = r.positive_int("vocab_size");
  c.hidden_size = r.positive_int("hidden_size");
  c.intermediate_size = r.positive_int("intermediate_size");
  c.num_layers = r.positive_int("num_hidden_layers");
  c.num_heads = r.positive_int("num_attention_heads");
  c.num_kv_heads = r.present("num_key_value_heads") ? r.positive_int("num_key_value_heads") : c.num_heads;
  c.head_dim = r.present("head_dim") ? r.positive_int("head_dim") : c.hidden_size / c.num_heads;
  DMI_CHECK(r.present("head_dim") || c.hidden_size % c.num_heads == 0,
            "{}: hidden_size {} is not divisible by num_attention_heads {}", path, c.hidden_size, c.num_heads);
  DMI_CHECK(c.num_heads % c.num_kv_heads == 0, "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}",
            path, c.num_heads, c.num_kv_heads);
  DMI_CHECK(c.head_dim % 2 == 0, "{}: head_dim {} must be even for rotary embeddings", path, c.head_dim);
  c.max_position_embeddings = r.positive_int("max_position_embeddings");
  c.rms_norm_eps = r.number(j, "rms_norm_eps", "");
  c.rope = parse_rope(j, path, r);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings");
  bool attention_bias = r.boolean("attention_bias");
  c.qkv_bias = c.architecture == "Qwen2ForCausalLM" || attention_bias;
  c.o_bias = c.architecture != "Qwen2ForCausalLM" && attention_bias;
  c.qk_norm = c.architecture == "Qwen3ForCausalLM";
  // Qwen2/Qwen3 apply a window only to layers past max_window_layers; no
  // released checkpoint turns it on, so refuse rather than approximate.
  DMI_CHECK(!r.boolean("use_sliding_window"), "{}: use_sliding_window=true is not supported", path);
  if (c.architecture == "MistralForCausalLM" && r.present("sliding_window"))
    c.sliding_window = r.positive_int("sliding_window");
  if (r.present("hidden_act")) {
    DMI_CHECK(j["hidden_act"].is_string(), "{}: field 'hidden_act' must be a string, got {}", path,
              j["hidden_act"].dump());
    c.hidden_act = j["hidden_act"].get<std::string>();
  }
  DMI_CHECK(c.hidden_act == "silu", "{}: hidden_act '{}' is not supported (supported: silu)", path, c.hidden_act);
  read_special_ids(j, path, c);
  if (r.present("torch_dtype") && j["torch_dtype"].is_string()) c.torch_dtype = j["torch_dtype"].get<std::string>();
  return c;
}

}  // namespace

ModelConfig parse_generic_config(const std::string& text, const std::string& path) {
  try {
    return parse_generic_config_checked(text, path);
  } catch (const json::exception& e) {
    DMI_FAIL("{}: {}", path, e.what());
  }
}

ModelConfig parse_config(const std::string& text, const std::string& path) {
  try {
    return parse_config_checked(text, path);
  } catch (const json::exception& e) {  // a field of an unexpected type not checked above
    DMI_FAIL("{}: {}", path, e.what());
  }
}

ModelConfig load_config(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DMI_CHECK(f, "{}: cannot read config.json", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_config(ss.str(), path);
}

}  // namespace dmi::io
