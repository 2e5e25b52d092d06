// The engine against scripts/dmi_reference.py (Hugging Face semantics in
// Python torch): logits over prefill and every greedy decode step.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <map>

#include "engine/generator.h"
#include "model/causal_lm.h"
#include "test_util.h"

namespace {

at::Tensor to_tensor(const nlohmann::json& rows) {
  std::vector<float> flat;
  for (const auto& r : rows)
    for (const auto& v : r) flat.push_back(v.get<float>());
  return at::tensor(flat).view({static_cast<std::int64_t>(rows.size()), -1});
}

struct Errors {
  double max_abs = 0;
  bool tokens_equal = true;
};

// Runs all reference prompts in one mixed-length batch; compares prefill
// logits (all positions) and the logits before every greedy token.
Errors compare(const std::string& name, at::ScalarType dtype, const char* key) {
  const std::string dir = dmi::test::test_models_dir() + "/" + name;
  auto ref = dmi::test::read_json(dir + "/reference.json");
  auto model = dmi::model::load_model(dir, dtype);
  std::vector<std::vector<std::int32_t>> prompts;
  for (const auto& p : ref["prompts"]) prompts.push_back(p.get<std::vector<std::int32_t>>());
  Errors e;
  // Prefill logits at every prompt position, each prompt alone.
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const auto& p = prompts[i];
    const std::int64_t T = p.size();
    auto cache = model->new_cache(1, T);
    at::Tensor ids = at::tensor(std::vector<std::int64_t>(p.begin(), p.end())).view({1, T});
    dmi::model::ForwardInput in{ids, at::arange(T, at::kLong).view({1, T}), at::ones({1, T}, at::kBool), 0, true};
    at::Tensor got = model->forward(in, cache)[0];
    at::Tensor want = to_tensor(ref[key][i]["logits"]).narrow(0, 0, T);
    e.max_abs = std::max(e.max_abs, (got - want).abs().max().item<double>());
  }
  // Greedy decode in one batch: logits before each generated token.
  dmi::engine::GenerateOptions opts;
  opts.max_new_tokens = ref["n_new"].get<std::int64_t>();
  opts.batch_size = static_cast<std::int64_t>(prompts.size());
  opts.eos_ids = {255};
  std::map<std::pair<std::size_t, std::int64_t>, at::Tensor> rows;
  opts.on_logits = [&](std::size_t seq, std::int64_t step, const at::Tensor& row) { rows[{seq, step}] = row.clone(); };
  dmi::engine::Generator gen(*model, opts);
  auto results = gen.generate(prompts);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    auto want_ids = ref[key][i]["greedy"].get<std::vector<std::int32_t>>();
    e.tokens_equal &= results[i].output_ids == want_ids;
    at::Tensor want = to_tensor(ref[key][i]["logits"]);
    // Step s is comparable while both sides chose the same tokens before it.
    for (std::size_t s = 0; s < results[i].output_ids.size() && s < want_ids.size(); ++s) {
      at::Tensor diff = rows.at({i, s}) - want[prompts[i].size() - 1 + s];
      e.max_abs = std::max(e.max_abs, diff.abs().max().item<double>());
      if (results[i].output_ids[s] != want_ids[s]) break;
    }
  }
  MESSAGE(fmt::format("{} {}: max |logit - reference| = {:.3g}, greedy tokens {}", name, key, e.max_abs,
                      e.tokens_equal ? "equal" : "DIFFER"));
  return e;
}

}  // namespace

namespace {

// Listens to one site at every layer and changes nothing.
struct Listener : dmi::hooks::Observer {
  dmi::hooks::Site site;
  explicit Listener(dmi::hooks::Site s) : site(s) {}
  bool wants(dmi::hooks::Site s, int) const override { return s == site; }
  void observe(dmi::hooks::Site, int, const at::Tensor&, const dmi::hooks::ForwardInfo&) override {}
};

}  // namespace

TEST_CASE("forward: a listening HookPoint changes no bit of the logits (fused and separate paths agree)") {
  using dmi::hooks::Site;
  at::manual_seed(13);
  for (const auto& name : dmi::test::test_model_names()) {
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      CAPTURE(name);
      CAPTURE(c10::toString(dtype));
      auto model = dmi::model::load_model(dmi::test::test_models_dir() + "/" + name, dtype);
      const std::int64_t B = 2, T = 5;
      at::Tensor ids = at::randint(0, 200, {B, T + 1}, at::kLong);
      // Prefill of T tokens, then one decode step, with the given observer.
      auto run = [&](dmi::hooks::Observer* obs) {
        auto cache = model->new_cache(B, T + 1);
        dmi::hooks::ForwardInfo info;
        info.positions = at::arange(T, at::kLong).repeat({B, 1});
        info.valid = at::ones({B, T}, at::kBool);
        info.seq = {0, 1};
        dmi::model::ForwardInput pre{ids.narrow(1, 0, T), info.positions, at::ones({B, T}, at::kBool), 0, true, &info};
        at::Tensor a = model->forward(pre, cache, obs);
        dmi::hooks::ForwardInfo step = info;
        step.positions = at::full({B, 1}, T, at::kLong);
        step.valid = at::ones({B, 1}, at::kBool);
        step.step = 0;
        dmi::model::ForwardInput dec{ids.narrow(1, T, 1), step.positions, at::ones({B, T + 1}, at::kBool), T, true,
                                     &step};
        return at::cat({a, model->forward(dec, cache, obs)}, 1);
      };
      const at::Tensor plain = run(nullptr);
      for (Site s : {Site::rot_q, Site::rot_k, Site::q_normalized, Site::attn_scores}) {
        CAPTURE(dmi::hooks::site_name(s, 0));
        Listener listener(s);
        CHECK(at::equal(run(&listener).contiguous().view(at::kByte), plain.contiguous().view(at::kByte)));
      }
    }
  }
}

TEST_CASE("reference: fp32 logits within 1e-4 of Hugging Face semantics, all architectures") {
  for (const auto& name : dmi::test::test_model_names()) {
    CAPTURE(name);
    Errors e = compare(name, at::kFloat, "float32");
    CHECK(e.max_abs < 1e-4);
    CHECK(e.tokens_equal);
  }
}

TEST_CASE("reference: bf16 follows Hugging Face's bf16 numerics") {
  // bf16 rounding differs with batch shape, so only the logits' closeness is
  // checked (logits here are O(1..10); bf16 has 8 bits of mantissa).
  for (const auto& name : dmi::test::test_model_names()) {
    CAPTURE(name);
    Errors e = compare(name, at::kBFloat16, "bfloat16");
    CHECK(e.max_abs < 0.25);
  }
}
