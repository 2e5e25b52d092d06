// Interventions on toy tensors (hand-computed expectations), vector files
// round-tripped through every format, content hashes against known digests.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <string>

#include "common/error.h"
#include "hooks/intervene.h"
#include "io/fingerprint.h"
#include "io/vectors.h"

using dmi::hooks::ForwardInfo;
using dmi::hooks::Intervener;
using dmi::hooks::Intervention;
using dmi::hooks::PositionSpec;
using dmi::hooks::Site;
using dmi::hooks::SteerMode;

namespace {

std::string temp_path(const std::string& name) {
  return std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/dmi-unit-" +
         std::to_string(::getpid()) + "-" + name;
}

// Two sequences (ids 4 and 7, prompt lengths 2 and 3) in one prefill of 3
// columns: row 0 left-padded by one.
ForwardInfo prefill_info() {
  ForwardInfo info;
  info.positions = at::tensor(std::vector<std::int64_t>{0, 0, 1, 0, 1, 2}, at::kLong).view({2, 3});
  info.valid = at::tensor(std::vector<std::uint8_t>{0, 1, 1, 1, 1, 1}, at::kByte).to(at::kBool).view({2, 3});
  info.seq = {4, 7};
  return info;
}

std::vector<std::int64_t> prompt_lengths() {
  std::vector<std::int64_t> p(8, 0);
  p[4] = 2;
  p[7] = 3;
  return p;
}

Intervention steer(SteerMode mode, double scale, const std::string& pos) {
  Intervention iv;
  iv.label = "test";
  iv.mode = mode;
  iv.scale = scale;
  iv.direction[1] = at::tensor(std::vector<float>{3, 4}, at::kFloat);  // |v| = 5
  iv.target[1] = 2.0;
  iv.sites = {{Site::resid_post, 1}};
  iv.positions = PositionSpec::parse(pos);
  return iv;
}

}  // namespace

TEST_CASE("positions: every selector parses, bad ones name the value") {
  CHECK(PositionSpec::parse("all").kind == PositionSpec::Kind::all);
  CHECK(PositionSpec::parse("generated").kind == PositionSpec::Kind::generated);
  CHECK(PositionSpec::parse("last-prompt").kind == PositionSpec::Kind::last_prompt);
  auto p = PositionSpec::parse("1,4:6,9");
  REQUIRE(p.kind == PositionSpec::Kind::ranges);
  CHECK(p.ranges == std::vector<std::pair<std::int64_t, std::int64_t>>{{1, 2}, {4, 6}, {9, 10}});
  CHECK(PositionSpec::parse("after:[/INST]").text == "[/INST]");
  CHECK_THROWS_WITH_AS(PositionSpec::parse("5:2"), doctest::Contains("is empty"), dmi::Error);
  CHECK_THROWS_WITH_AS(PositionSpec::parse("x"), doctest::Contains("'x' is not a position"), dmi::Error);
  CHECK_THROWS_AS(PositionSpec::parse("after:"), dmi::Error);
}

TEST_CASE("steering modes on a toy residual stream") {
  ForwardInfo info = prefill_info();
  // h = [1, 2] at every token: h.u = (3 + 8) / 5 = 2.2, |h| = sqrt(5).
  at::Tensor h = at::ones({2, 3, 2}, at::kFloat);
  h.select(2, 1).fill_(2.0);
  auto run = [&](Intervention iv) {
    Intervener in({std::move(iv)}, prompt_lengths());
    in.begin_forward(info);
    REQUIRE(in.writes(Site::resid_post, 1));
    CHECK_FALSE(in.writes(Site::resid_post, 0));
    return in.intervene(Site::resid_post, 1, h, info);
  };
  at::Tensor y = run(steer(SteerMode::add, 2.0, "all"));
  CHECK(y[1][0][0].item<float>() == doctest::Approx(7.0));
  CHECK(y[1][0][1].item<float>() == doctest::Approx(10.0));
  y = run(steer(SteerMode::normadd, 1.0, "all"));  // h + sqrt(5) * (0.6, 0.8)
  CHECK(y[0][1][0].item<float>() == doctest::Approx(1 + std::sqrt(5.0) * 0.6));
  y = run(steer(SteerMode::set, 1.0, "all"));  // h + (2 - 2.2) u
  CHECK(y[0][2][0].item<float>() == doctest::Approx(1 - 0.2 * 0.6));
  CHECK(((y[0][2] * at::tensor(std::vector<float>{0.6f, 0.8f})).sum().item<float>()) == doctest::Approx(2.0));
  y = run(steer(SteerMode::ablate, 1.0, "all"));
  CHECK((y * at::tensor(std::vector<float>{0.6f, 0.8f})).sum(-1).abs().max().item<float>() < 1e-6);
  // scale 0: the very same tensor.
  CHECK(run(steer(SteerMode::add, 0.0, "all")).is_same(h));
  // Positions: sequence 4 (row 0) has prompt positions 0, 1 at columns 1, 2;
  // last-prompt touches column 2 of row 0 and column 2 of row 1 only.
  y = run(steer(SteerMode::add, 1.0, "last-prompt"));
  at::Tensor changed = (y - h).abs().sum(-1) > 0;
  CHECK(changed.equal(at::tensor(std::vector<std::uint8_t>{0, 0, 1, 0, 0, 1}, at::kByte).to(at::kBool).view({2, 3})));
  y = run(steer(SteerMode::add, 1.0, "1:2"));
  changed = (y - h).abs().sum(-1) > 0;
  CHECK(changed.equal(at::tensor(std::vector<std::uint8_t>{0, 0, 1, 0, 1, 0}, at::kByte).to(at::kBool).view({2, 3})));
  // Per-row: only sequence 7.
  Intervention only7 = steer(SteerMode::add, 1.0, "all");
  only7.only_seqs = std::set<std::int32_t>{7};
  y = run(only7);
  CHECK((y[0] - h[0]).abs().max().item<float>() == 0);
  CHECK((y[1] - h[1]).abs().min().item<float>() > 0);
  // bfloat16 in, bfloat16 out.
  Intervener in({steer(SteerMode::add, 1.0, "all")}, prompt_lengths());
  in.begin_forward(info);
  const bool bf16_out = in.intervene(Site::resid_post, 1, h.to(at::kBFloat16), info).scalar_type() == at::kBFloat16;
  CHECK(bf16_out);
}

TEST_CASE("head ablation and replacement on [B, T, H, D]") {
  ForwardInfo info = prefill_info();
  at::Tensor z = at::randn({2, 3, 4, 5});
  Intervention iv;
  iv.label = "test";
  iv.kind = Intervention::Kind::zero;
  iv.sites = {{Site::z, 0}};
  iv.heads = {1, 3};
  Intervener in({iv}, prompt_lengths());
  in.begin_forward(info);
  at::Tensor y = in.intervene(Site::z, 0, z, info);
  CHECK(y.select(2, 1).abs().max().item<float>() == 0);
  CHECK(y.select(2, 3).abs().max().item<float>() == 0);
  CHECK(y.select(2, 0).equal(z.select(2, 0)));
  Intervention rep;
  rep.label = "test";
  rep.kind = Intervention::Kind::replace;
  rep.sites = {{Site::z, 0}};
  rep.positions = PositionSpec::parse("prompt");
  rep.value = [](Site, int, std::int32_t seq, std::int64_t pos) { return at::full({4, 5}, seq * 10.0f + pos); };
  Intervener in2({rep}, prompt_lengths());
  in2.begin_forward(info);
  y = in2.intervene(Site::z, 0, z, info);
  CHECK(y[1][2][0][0].item<float>() == 72.0f);  // sequence 7, position 2
  CHECK(y[0][2][3][4].item<float>() == 41.0f);  // sequence 4, position 1
  CHECK(y[0][0].equal(z[0][0]));                // padding untouched
}

TEST_CASE("pattern rows replaced by key position, whatever the left padding") {
  ForwardInfo info = prefill_info();  // row 0: sequence 4, left-padded by one column
  at::Tensor p = at::rand({2, 2, 3, 3});  // [B, H, T, L]
  Intervention rep;
  rep.label = "test";
  rep.kind = Intervention::Kind::replace;
  rep.sites = {{Site::pattern, 0}};
  rep.heads = {1};
  // Key k of the source row holds 100 * seq + 10 * pos + k; width 4 (wider
  // than the live rows, as a capture's attention_width).
  rep.value = [](Site, int, std::int32_t seq, std::int64_t pos) {
    return (at::arange(4, at::kFloat) + 100.0f * seq + 10.0f * pos).view({1, 4}).expand({2, 4}).contiguous();
  };
  Intervener in({rep}, prompt_lengths());
  in.begin_forward(info);
  at::Tensor y = in.intervene(Site::pattern, 0, p, info);
  // Sequence 4, position 1 sits at column 2: keys 0, 1 at columns 1, 2; column 0 is padding (0).
  CHECK(y[0][1][2][0].item<float>() == 0.0f);
  CHECK(y[0][1][2][1].item<float>() == 410.0f);
  CHECK(y[0][1][2][2].item<float>() == 411.0f);
  // Sequence 7 (no padding), position 2: keys 0..2 at columns 0..2.
  CHECK(y[1][1][2][0].item<float>() == 720.0f);
  CHECK(y[1][1][2][2].item<float>() == 722.0f);
  CHECK(y.select(1, 0).equal(p.select(1, 0)));  // head 0 kept
  CHECK(y[0][1][0].equal(p[0][1][0]));           // the padding query row untouched
  // A source row narrower than the position needs is an error naming the site.
  Intervention narrow = rep;
  narrow.value = [](Site, int, std::int32_t, std::int64_t) { return at::zeros({2, 1}); };
  Intervener in2({narrow}, prompt_lengths());
  in2.begin_forward(info);
  CHECK_THROWS_WITH_AS(in2.intervene(Site::pattern, 0, p, info), doctest::Contains("hook_pattern"), dmi::Error);
}

TEST_CASE("vector files: safetensors and GGUF round trips, llama.cpp's rules") {
  dmi::io::SteeringVectors v;
  v.direction[1] = at::tensor(std::vector<float>{1, -2, 3}, at::kFloat);
  v.direction[2] = at::tensor(std::vector<float>{0.5f, 0, -1}, at::kFloat);
  v.target[2] = 1.25;
  v.metadata["method"] = "mean-diff";
  const std::string st = temp_path("v.safetensors"), gg = temp_path("v.gguf");
  dmi::io::save_steering_vectors(st, v);
  auto r = dmi::io::load_steering_vectors(st, 3, 4);
  CHECK(r.format == "dmi");
  CHECK(r.direction.at(1).equal(v.direction.at(1)));
  CHECK(r.target.at(2) == 1.25);
  CHECK(r.metadata.at("format") == "dmi-steering-vector");
  CHECK(r.metadata.at("method") == "mean-diff");
  dmi::io::save_gguf_control_vector(gg, v, "llama");
  auto g = dmi::io::load_steering_vectors(gg, 3, 4);
  CHECK(g.format == "gguf");
  CHECK(g.direction.at(2).equal(v.direction.at(2)));
  CHECK(g.metadata.at("controlvector.model_hint") == "llama");
  CHECK_THROWS_WITH_AS(dmi::io::load_steering_vectors(st, 4, 4), doctest::Contains("d_model is 4"), dmi::Error);
  CHECK_THROWS_WITH_AS(dmi::io::load_steering_vectors(st, 3, 2), doctest::Contains("direction.2"), dmi::Error);
  v.direction[0] = at::ones({3});
  CHECK_THROWS_WITH_AS(dmi::io::save_gguf_control_vector(gg, v, "x"), doctest::Contains("direction.0"), dmi::Error);
  ::unlink(st.c_str());
  ::unlink(gg.c_str());
}

TEST_CASE("content hashes: SHA-256 known digest, XXH3-128 of the same bytes, differences named") {
  const std::string p = temp_path("abc");
  std::ofstream(p, std::ios::binary) << "abc";
  CHECK(dmi::io::sha256_file(p) == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(dmi::io::xxh3_128_file(p) == dmi::io::xxh3_128("abc", 3));
  CHECK(dmi::io::xxh3_128("abc", 3) != dmi::io::xxh3_128("abd", 3));
  ::unlink(p.c_str());
  auto d = dmi::io::fingerprint_differences({{"a", "x"}, {"b", "y"}}, {{"a", "x"}, {"b", "z"}, {"c", "w"}});
  REQUIRE(d.size() == 2);
  CHECK(d[0].find("b: content differs") == 0);
  CHECK(d[1].find("c: present now") == 0);
}
