#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>

#include "common/error.h"
#include "engine/bench.h"
#include "engine/generator.h"
#include "engine/sampler.h"
#include "model/causal_lm.h"
#include "test_util.h"

namespace {

using Logits = std::map<std::pair<std::size_t, std::int64_t>, at::Tensor>;

std::vector<dmi::engine::SequenceResult> run(dmi::model::CausalLM& m, const std::vector<std::vector<std::int32_t>>& p,
                                             std::int64_t batch, dmi::engine::SamplingOptions s, Logits* logits,
                                             std::int64_t n_new = 8) {
  dmi::engine::GenerateOptions o;
  o.max_new_tokens = n_new;
  o.batch_size = batch;
  o.sampling = s;
  if (logits)
    o.on_logits = [logits](std::size_t seq, std::int64_t step, const at::Tensor& row) {
      (*logits)[{seq, step}] = row.clone();
    };
  dmi::engine::Generator g(m, o);
  return g.generate(p);
}

const std::vector<std::vector<std::int32_t>> kPrompts = {
    {5, 17, 42, 99, 3, 250, 7, 11, 64, 128, 1, 33}, {9, 8, 7}, {200}, {60, 61, 62, 63, 64, 65, 66}, {4, 4}};

}  // namespace

TEST_CASE("batch invariance: a prompt's tokens and logits do not depend on its batch") {
  for (const auto& name : dmi::test::test_model_names()) {
    CAPTURE(name);
    auto m = dmi::model::load_model(dmi::test::test_models_dir() + "/" + name, at::kFloat);
    Logits batched;
    auto together = run(*m, kPrompts, 5, {}, &batched);
    double worst = 0;
    for (std::size_t i = 0; i < kPrompts.size(); ++i) {
      Logits alone_logits;
      auto alone = run(*m, {kPrompts[i]}, 1, {}, &alone_logits);
      CHECK(alone[0].output_ids == together[i].output_ids);
      for (const auto& [key, row] : alone_logits) {
        const at::Tensor& b = batched.at({i, key.second});
        worst = std::max(worst, ((row - b).abs().max() / row.abs().max()).item<double>());
      }
    }
    MESSAGE(fmt::format("{}: worst relative logit difference alone vs batched {:.3g}", name, worst));
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("sampling: the same seed gives the same output, alone or batched") {
  auto m = dmi::model::load_model(dmi::test::test_models_dir() + "/qwen3-untied-f32", at::kFloat);
  dmi::engine::SamplingOptions s{1.5, 50, 0.95, 1234};
  auto a = run(*m, kPrompts, 5, s, nullptr, 16);
  auto b = run(*m, kPrompts, 2, s, nullptr, 16);
  for (std::size_t i = 0; i < kPrompts.size(); ++i) CHECK(a[i].output_ids == b[i].output_ids);
  s.seed = 4321;
  auto c = run(*m, kPrompts, 5, s, nullptr, 16);
  auto greedy = run(*m, kPrompts, 5, {}, nullptr, 16);
  int differ_seed = 0, differ_greedy = 0;
  for (std::size_t i = 0; i < kPrompts.size(); ++i) {
    differ_seed += a[i].output_ids != c[i].output_ids;
    differ_greedy += a[i].output_ids != greedy[i].output_ids;
  }
  CHECK(differ_seed > 0);
  CHECK(differ_greedy > 0);
}

TEST_CASE("sampling: greedy picks std::max_element's index (ties, -inf, NaN, any length)") {
  dmi::engine::Sampler greedy({}, 0);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  auto want = [](const at::Tensor& t) {
    const float* x = t.data_ptr<float>();
    return static_cast<std::int32_t>(std::max_element(x, x + t.numel()) - x);
  };
  at::manual_seed(3);
  for (std::int64_t V : {1, 5, 16, 17, 40, 151936}) {
    CAPTURE(V);
    at::Tensor x = at::randn({V});
    CHECK(greedy.next(x) == want(x));
    at::Tensor ties = at::randint(0, 4, {V}).to(at::kFloat);  // many equal maxima: the first wins
    CHECK(greedy.next(ties) == want(ties));
    at::Tensor odd = at::randn({V});
    odd.masked_fill_(at::rand({V}) < 0.3, nan);
    odd.masked_fill_(at::rand({V}) < 0.3, -inf);
    if (V > 1) odd[0] = 0.0f;
    CHECK(greedy.next(odd) == want(odd));
    odd[0] = nan;  // a NaN in front wins, as with std::max_element
    CHECK(greedy.next(odd) == 0);
    at::Tensor masked = at::full({V}, -inf);
    CHECK(greedy.next(masked) == 0);
    masked[V - 1] = 1.0f;
    CHECK(greedy.next(masked) == V - 1);
  }
}

TEST_CASE("generation: stops at EOS and at max_new_tokens; rejects bad prompts") {
  auto m = dmi::model::load_model(dmi::test::test_models_dir() + "/llama-gqa-f32", at::kFloat);
  dmi::engine::GenerateOptions o;
  o.max_new_tokens = 6;
  // Make the first greedy token of prompt {200} an EOS token.
  dmi::engine::Generator probe(*m, o);
  auto first = probe.generate({{200}})[0].output_ids;
  REQUIRE(first.size() == 6);
  o.eos_ids = {first[2]};
  dmi::engine::Generator g(*m, o);
  auto r = g.generate({{200}, {9, 8, 7}});
  CHECK(r[0].finish_reason == "eos");
  const auto stop_at = std::find(first.begin(), first.end(), first[2]) - first.begin();
  CHECK(r[0].output_ids.size() == static_cast<std::size_t>(stop_at + 1));
  CHECK(r[0].output_ids.back() == first[2]);
  CHECK_THROWS_WITH_AS(g.generate({{300}}), doctest::Contains("token id 300 is out of range (vocab_size 256)"),
                       dmi::Error);
  CHECK_THROWS_WITH_AS(g.generate({std::vector<std::int32_t>(64, 1)}), doctest::Contains("the model's context is 64"),
                       dmi::Error);
  // Near the end of the context a sequence stops with reason "context".
  auto near = g.generate({std::vector<std::int32_t>(61, 1)});
  CHECK(near[0].output_ids.size() == 3);
  CHECK(near[0].finish_reason == "context");
}

TEST_CASE("bench: distribution-free confidence interval of a median") {
  using dmi::engine::median_ci95;
  CHECK(!median_ci95({1, 2, 3, 4, 5}));
  auto six = median_ci95({6, 1, 5, 2, 4, 3});
  REQUIRE(six);
  CHECK(six->first == 1);  // n = 6: P(X = 0) = 1/64 <= 2.5 %, so [x(1), x(6)]
  CHECK(six->second == 6);
  std::vector<double> v;
  for (int i = 12; i >= 1; --i) v.push_back(i);
  auto twelve = median_ci95(v);
  REQUIRE(twelve);
  CHECK(twelve->first == 3);  // n = 12: P(X <= 2) = 79/4096 <= 2.5 % < P(X <= 3), so [x(3), x(10)]
  CHECK(twelve->second == 10);
}

TEST_CASE("bench: the machine floor counts each model's work and takes the longer of reading and computing") {
  for (const auto& name : dmi::test::test_model_names()) {
    CAPTURE(name);
    const std::string dir = dmi::test::test_models_dir() + "/" + name;
    // From config.json, not from the model's own shapes.
    std::ifstream f(dir + "/config.json");
    const auto c = nlohmann::json::parse(f);
    const std::int64_t d = c["hidden_size"], F = c["intermediate_size"], V = c["vocab_size"],
                       layers = c["num_hidden_layers"], H = c["num_attention_heads"],
                       KV = c.value("num_key_value_heads", H), D = c.value("head_dim", d / H);
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      auto m = dmi::model::load_model(dir, dtype);
      const auto w = m->forward_work();
      CHECK(w.per_token == layers * (d * (H + 2 * KV) * D + H * D * d + 2 * d * F + F * d));
      CHECK(w.per_logits_row == d * V);
      CHECK(w.attention_per_position == layers * H * D * 2);
      CHECK(w.kv_bytes_per_position == layers * KV * D * 2 * (dtype == at::kFloat ? 4 : 2));
    }
  }
  dmi::engine::MachineFloor floor;
  floor.weight_bytes = 2e9;              // read in 100 ms at 20 GB/s
  floor.read_bandwidth_gbs = 20;
  floor.peak_macs_per_second = 1e11;     // 1e9 + 1e8 multiply-adds per token: 11 ms
  floor.work = {1'000'000'000, 100'000'000, 0, 0};
  CHECK(floor.compute_ms_per_token() == doctest::Approx(11.0));
  CHECK(floor.decode_step_ms(1, 100) == doctest::Approx(100.0));   // reading
  CHECK(floor.decode_step_ms(9, 100) == doctest::Approx(100.0));
  CHECK(floor.decode_step_ms(10, 100) == doctest::Approx(110.0));  // computing
  // 4 prompts of 50 tokens: 4 * (50e9 + 1e8) multiply-adds = 2.004 s > 0.1 s.
  CHECK(floor.prefill_tokens_per_second(4, 50) == doctest::Approx(200 / 2.004));
  // The KV cache: 1e6 bytes per position, read at every step; attention
  // 1e7 multiply-adds per position (0.1 ms each).
  floor.work.kv_bytes_per_position = 1'000'000;
  floor.work.attention_per_position = 10'000'000;
  CHECK(floor.decode_step_ms(2, 500) == doctest::Approx(150.0));  // (2e9 + 2 * 500 * 1e6) bytes at 20 GB/s
  CHECK(floor.decode_step_ms(8, 500) == doctest::Approx(488.0));  // 8 * 11 ms + 8 * 500 * 0.1 ms
  // 1 prompt of 3 tokens: 3e9 + 1e8 + (1 + 2 + 3) * 1e7 multiply-adds = 31.6 ms.
  CHECK(floor.prefill_tokens_per_second(1, 3) == doctest::Approx(3 / 0.1));  // reading the weights: 100 ms
  CHECK(floor.prefill_tokens_per_second(4, 50) == doctest::Approx(200 / (4 * (50e9 + 1e8 + 1275 * 1e7) / 1e11)));
  floor.peak_macs_per_second = 0;  // unknown: only the read floor
  CHECK(floor.decode_step_ms(64, 0) == doctest::Approx(100.0));
  CHECK(floor.prefill_tokens_per_second(4, 50) == doctest::Approx(2000.0));
}
