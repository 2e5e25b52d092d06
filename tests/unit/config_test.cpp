#include <doctest/doctest.h>

#include "common/error.h"
#include "io/config.h"

using dmi::io::parse_config;

TEST_CASE("config: Hugging Face defaults per architecture") {
  auto q3 = parse_config(R"({"architectures":["Qwen3ForCausalLM"],"hidden_size":1024,"num_attention_heads":16,
                             "num_key_value_heads":8,"num_hidden_layers":28,"intermediate_size":3072,
                             "vocab_size":151936})", "q3/config.json");
  CHECK(q3.head_dim == 128);  // Qwen3 default, not hidden/heads = 64
  CHECK(q3.qk_norm);
  CHECK_FALSE(q3.qkv_bias);
  CHECK(q3.max_position_embeddings == 32768);
  auto q2 = parse_config(R"({"architectures":["Qwen2ForCausalLM"],"hidden_size":896,"num_attention_heads":14,
                             "num_key_value_heads":2})", "q2/config.json");
  CHECK(q2.head_dim == 64);
  CHECK(q2.qkv_bias);
  CHECK_FALSE(q2.o_bias);
  auto m = parse_config(R"({"architectures":["MistralForCausalLM"]})", "m/config.json");
  CHECK(m.num_kv_heads == 8);
  CHECK(m.sliding_window.value() == 4096);
  auto l = parse_config(R"({"architectures":["LlamaForCausalLM"],"num_attention_heads":32})", "l/config.json");
  CHECK(l.num_kv_heads == 32);
  CHECK(l.eos_token_ids == std::vector<std::int64_t>{2});
}

TEST_CASE("config: rope in both forms") {
  auto old = parse_config(R"({"architectures":["LlamaForCausalLM"],"rope_theta":500000.0,
      "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
                      "original_max_position_embeddings":8192},"eos_token_id":[128001,128009]})", "a");
  CHECK(old.rope.type == "llama3");
  CHECK(old.rope.theta == 500000.0);
  CHECK(old.rope.factor == 8.0);
  CHECK(old.eos_token_ids.size() == 2);
  auto neu = parse_config(R"({"architectures":["LlamaForCausalLM"],
      "rope_parameters":{"rope_type":"linear","factor":2.0,"rope_theta":1000.0}})", "b");
  CHECK(neu.rope.type == "linear");
  CHECK(neu.rope.theta == 1000.0);
  auto def = parse_config(R"({"architectures":["Qwen3ForCausalLM"],
      "rope_parameters":{"rope_type":"default","rope_theta":1000000.0}})", "c");
  CHECK(def.rope.type == "default");
  CHECK(def.rope.theta == 1000000.0);
}

TEST_CASE("config: errors name the file and field") {
  CHECK_THROWS_WITH_AS(parse_config("{", "x/config.json"), doctest::Contains("x/config.json: malformed JSON"),
                       dmi::Error);
  CHECK_THROWS_WITH_AS(parse_config(R"({"architectures":["GPT2LMHeadModel"]})", "x/config.json"),
                       doctest::Contains("architecture 'GPT2LMHeadModel' is not supported (supported: "
                                         "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"),
                       dmi::Error);
  CHECK_THROWS_WITH_AS(parse_config(R"({"architectures":["LlamaForCausalLM"],"hidden_size":-4})", "x"),
                       doctest::Contains("field 'hidden_size' must be a positive integer"), dmi::Error);
  CHECK_THROWS_WITH_AS(parse_config(R"({"architectures":["LlamaForCausalLM"],"rope_scaling":{"type":"yarn","factor":4}})", "x"),
                       doctest::Contains("rope_type 'yarn' is not supported"), dmi::Error);
  CHECK_THROWS_WITH_AS(parse_config(R"({"architectures":["LlamaForCausalLM"],"hidden_size":48,"num_attention_heads":6,"num_key_value_heads":4})", "x"),
                       doctest::Contains("not a multiple"), dmi::Error);
}

// Found by fuzz_config (tests/data/fuzz/config/regression-*): fields of an
// unexpected JSON type escaped as nlohmann exceptions ("internal error").
TEST_CASE("config: fields of the wrong JSON type are bad input") {
  const std::string llama = R"({"architectures":["LlamaForCausalLM"],)";
  CHECK_THROWS_WITH_AS(parse_config(llama + R"("rope_scaling":{"rope_type":4.0}})", "x"),
                       doctest::Contains("rope_scaling.rope_type' must be a string"), dmi::Error);
  CHECK_THROWS_WITH_AS(parse_config(llama + R"("hidden_act":1})", "x"), doctest::Contains("'hidden_act' must be a string"),
                       dmi::Error);
  CHECK_THROWS_WITH_AS(parse_config(llama + R"("rope_scaling":{"rope_type":"llama3","factor":8,"low_freq_factor":1,)"
                                            R"("high_freq_factor":4,"original_max_position_embeddings":1e300}})", "x"),
                       doctest::Contains("out of range"), dmi::Error);
  CHECK_THROWS_AS(parse_config(llama + R"("architectures":{}})", "x"), dmi::Error);
}
