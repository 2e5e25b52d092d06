// Patching metrics, Attention Tracker spans and focus, attention entropy:
// hand-computed expectations.
#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "analysis/attn_tracker.h"
#include "analysis/patching.h"
#include "common/error.h"

using namespace dmi::analysis;

TEST_CASE("patching: metrics, sites and directions") {
  const at::Tensor logits = at::tensor(std::vector<float>{1.0f, 3.0f, 0.0f}, at::kFloat);
  CHECK(patch_metric(PatchMetric::logit_diff, logits, 1, 0, {}) == 2.0);
  const double z = std::exp(1.0) + std::exp(3.0) + std::exp(0.0);
  CHECK(patch_metric(PatchMetric::logprob, logits, 1, -1, {}) == doctest::Approx(3.0 - std::log(z)).epsilon(1e-14));
  CHECK(patch_metric(PatchMetric::prob, logits, 0, -1, {}) == doctest::Approx(std::exp(1.0) / z).epsilon(1e-14));
  // KL of a distribution from itself is 0; from uniform to a peaked one, log(3) - H.
  const at::Tensor clean = at::log_softmax(logits.to(at::kDouble), 0);
  CHECK(patch_metric(PatchMetric::kl, logits, -1, -1, clean) == doctest::Approx(0.0).epsilon(1e-15));
  const at::Tensor uniform = at::full({3}, -std::log(3.0), at::kDouble);
  double want = 0;
  for (int i = 0; i < 3; ++i) want += (1.0 / 3) * (-std::log(3.0) - clean[i].item<double>());
  CHECK(patch_metric(PatchMetric::kl, logits, -1, -1, uniform) == doctest::Approx(want).epsilon(1e-14));

  const auto sites = parse_patch_sites("z,resid_pre,hook_mlp_out,z");
  REQUIRE(sites.size() == 3);
  CHECK(patch_site_short_name(sites[2]) == "mlp_out");
  CHECK(patch_site_per_head(dmi::hooks::Site::pattern));
  CHECK_FALSE(patch_site_per_head(dmi::hooks::Site::attn_out));
  CHECK_THROWS_WITH_AS(parse_patch_sites("resid_post"), doctest::Contains("resid_post"), dmi::Error);
  CHECK_THROWS_AS(parse_patch_metric("accuracy"), dmi::Error);
  CHECK(parse_patch_direction("noise") == PatchDirection::noise);
}

TEST_CASE("Attention Tracker: spans, focus, entropy") {
  auto r = TokenSpan::parse("2:5", "--inst");
  CHECK(r.marker.empty());
  CHECK(r.resolve({1, 2, 3, 4, 5, 6}, nullptr, 0, "--inst") == std::make_pair<std::int64_t, std::int64_t>(2, 5));
  CHECK(TokenSpan::parse("3:", "--data").resolve({1, 2, 3, 4, 5}, nullptr, 0, "--data").second == 5);
  CHECK_THROWS_WITH_AS(TokenSpan::parse("2:9", "--inst").resolve({1, 2, 3}, nullptr, 4, "--inst"),
                       doctest::Contains("sequence 4"), dmi::Error);
  CHECK_THROWS_AS(TokenSpan::parse("5:5", "--inst"), dmi::Error);
  CHECK(TokenSpan::parse("Ignore: 1", "--inst").marker == "Ignore: 1");
  CHECK_THROWS_WITH_AS(TokenSpan::parse("word", "--inst").resolve({1}, nullptr, 0, "--inst"),
                       doctest::Contains("tokenizer"), dmi::Error);

  const std::vector<float> row{0.1f, 0.2f, 0.3f, 0.4f, 0.0f};
  const double data = static_cast<double>(0.3f) + static_cast<double>(0.4f);
  CHECK(tracker_focus(row.data(), 5, {0, 2}, {2, 5}) ==
        doctest::Approx((static_cast<double>(0.1f) + static_cast<double>(0.2f)) /
                        (static_cast<double>(0.1f) + static_cast<double>(0.2f) + data)).epsilon(1e-15));
  // Entropy: uniform over 4 keys is log 4; zeros contribute nothing.
  const std::vector<float> u{0.25f, 0.25f, 0.25f, 0.25f, 0.0f};
  CHECK(attention_entropy(u.data(), 5) == doctest::Approx(std::log(4.0)).epsilon(1e-15));
  const std::vector<float> one{1.0f, 0.0f};
  CHECK(attention_entropy(one.data(), 2) == 0.0);
}
