#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>

#include "common/error.h"
#include "hooks/selection.h"
#include "io/hook_map.h"
#include "ring/ring.h"
#include "sink/sink.h"

using dmi::hooks::Selection;
using dmi::hooks::Site;
using dmi::hooks::SiteSpace;

TEST_CASE("selection: short names, full names, globs, layer sets, presets") {
  SiteSpace sp{4, false};
  auto s = Selection::parse("resid_post", sp);
  CHECK(s.size() == 4);
  CHECK(s.wants(Site::resid_post, 3));
  s = Selection::parse("blocks.2.attn.hook_pattern, ln_final.hook_normalized", sp);
  CHECK(s.size() == 2);
  CHECK(s.wants(Site::pattern, 2));
  CHECK_FALSE(s.wants(Site::pattern, 1));
  CHECK(s.wants(Site::ln_final, -1));
  s = Selection::parse("blocks.*.hook_resid_post", sp);
  CHECK(s.size() == 4);
  s = Selection::parse("blocks.{0-1,3}.attn.hook_pattern", sp);
  CHECK(s.size() == 3);
  CHECK_FALSE(s.wants(Site::pattern, 2));
  s = Selection::parse("residual", sp);
  CHECK(s.size() == 4 + 1 + 1);
  CHECK(s.wants(Site::resid_post, 3));
  CHECK_FALSE(s.wants(Site::resid_post, 2));
  s = Selection::parse("hf-hidden-states", sp);
  CHECK(s.size() == 1 + 3 + 1);
  CHECK(s.wants(Site::embed, -1));
  CHECK_FALSE(s.wants(Site::resid_post, 3));
  s = Selection::parse("kv", sp);
  CHECK(s.size() == 8);
  s = Selection::parse("full", sp);
  CHECK(s.size() == 3 + 4 * 18);  // no q/k norms in this model
  CHECK(Selection::parse("full", SiteSpace{4, true}).size() == 3 + 4 * 20);
  // forward order
  auto sites = Selection::parse("logits,blocks.1.hook_resid_pre,embed", sp).sites();
  REQUIRE(sites.size() == 3);
  CHECK((sites[0].first == Site::embed));
  CHECK((sites[2].first == Site::logits));
}

TEST_CASE("selection: unknown names suggest the nearest") {
  SiteSpace sp{4, false};
  CHECK_THROWS_WITH_AS(Selection::parse("resid_pots", sp), doctest::Contains("did you mean resid_post"), dmi::Error);
  CHECK_THROWS_WITH_AS(Selection::parse("blocks.9.hook_resid_post", sp), doctest::Contains("unknown site"), dmi::Error);
  CHECK_THROWS_WITH_AS(Selection::parse("blocks.{2-7}.hook_resid_post", sp), doctest::Contains("outside 0-3"),
                       dmi::Error);
  CHECK_THROWS_WITH_AS(Selection::parse("q_norm", sp), doctest::Contains("does not exist in this model"), dmi::Error);
}

TEST_CASE("site names: parse_site_name inverts site_name") {
  for (int s = 0; s < static_cast<int>(Site::kCount); ++s)
    for (int layer : {0, 7, 31}) {
      const Site site = static_cast<Site>(s);
      const std::string name = dmi::hooks::site_name(site, layer);
      Site got{};
      int got_layer = -2;
      REQUIRE(dmi::hooks::parse_site_name(name, got, got_layer));
      CHECK(got == site);
      CHECK(got_layer == (dmi::hooks::is_layer_site(site) ? layer : -1));
    }
  Site s{};
  int l = 0;
  for (const char* bad : {"blocks.3.hook_embed", "hook_resid_post", "blocks..hook_resid_post", "blocks.03.hook_resid_post",
                          "blocks.x.hook_resid_post", "blocks.1.hook_resid_pots", "resid_post", ""})
    CHECK_MESSAGE(!dmi::hooks::parse_site_name(bad, s, l), bad);
}

TEST_CASE("selection: a model that produces only some sites") {
  SiteSpace sp{2, false};
  sp.available.assign(static_cast<int>(Site::kCount), std::vector<bool>(2, false));
  sp.available[static_cast<int>(Site::resid_post)][0] = sp.available[static_cast<int>(Site::resid_post)][1] = true;
  sp.available[static_cast<int>(Site::logits)][0] = true;
  CHECK(Selection::parse("resid_post,logits", sp).size() == 3);
  CHECK(Selection::parse("full", sp).size() == 3);
  CHECK(Selection::parse("blocks.*", sp).size() == 2);
  CHECK(Selection::parse("residual", sp).size() == 1);  // resid_post of the last layer
  CHECK_THROWS_WITH_AS(Selection::parse("pattern", sp), doctest::Contains("not produced by this model; it has resid_post, logits"),
                       dmi::Error);
  CHECK_THROWS_WITH_AS(Selection::parse("blocks.0.hook_resid_pre", sp), doctest::Contains("not produced by this model"),
                       dmi::Error);
  CHECK_THROWS_WITH_AS(Selection::parse("blocks.0.hook_resid_pots", sp), doctest::Contains("did you mean blocks.0.hook_resid_post"),
                       dmi::Error);
}

TEST_CASE("hook maps: parsing and matching module paths") {
  auto m = dmi::io::parse_hook_map(R"({"format": "dmi-hook-map", "version": 1, "hooks": [
      {"module": "model.layers.{i}", "site": "blocks.{i}.hook_resid_post"},
      {"module": "model.layers.{i}", "input": 0, "site": "blocks.{i}.hook_resid_pre"},
      {"module": "model.norm", "output": 1, "site": "ln_final.hook_normalized"}]})",
                                   "m.json");
  REQUIRE(m.entries.size() == 3);
  auto hits = m.match("model.layers.12");
  REQUIRE(hits.size() == 2);
  CHECK(hits[0].site == "blocks.12.hook_resid_post");
  CHECK(!hits[0].entry->input);
  CHECK(hits[1].site == "blocks.12.hook_resid_pre");
  CHECK(hits[1].entry->input);
  CHECK(m.match("model.layers.x").empty());
  CHECK(m.match("model.layers.1.mlp").empty());
  CHECK(m.match("model.layers").empty());
  REQUIRE(m.match("model.norm").size() == 1);
  CHECK(m.match("model.norm")[0].entry->index == 1);
  auto bad = [](const char* text) { return dmi::io::parse_hook_map(text, "m.json"); };
  CHECK_THROWS_WITH_AS(bad(R"({"format": "x", "version": 1, "hooks": []})"), doctest::Contains("'format'"), dmi::Error);
  CHECK_THROWS_WITH_AS(bad(R"({"format": "dmi-hook-map", "version": 2, "hooks": []})"), doctest::Contains("'version'"),
                       dmi::Error);
  CHECK_THROWS_WITH_AS(bad(R"({"format": "dmi-hook-map", "version": 1, "hooks": []})"), doctest::Contains("non-empty"),
                       dmi::Error);
  CHECK_THROWS_WITH_AS(bad(R"({"format": "dmi-hook-map", "version": 1, "hooks": [{"module": "a", "site": "b", "outptu": 0}]})"),
                       doctest::Contains("hooks[0]: unknown field 'outptu'"), dmi::Error);
  CHECK_THROWS_WITH_AS(bad(R"({"format": "dmi-hook-map", "version": 1, "hooks": [{"module": "a", "site": "b", "input": 0, "output": 0}]})"),
                       doctest::Contains("not both"), dmi::Error);
  CHECK_THROWS_WITH_AS(bad(R"({"format": "dmi-hook-map", "version": 1, "hooks": [{"module": "a..b", "site": "hook_embed"}]})"),
                       doctest::Contains("malformed component"), dmi::Error);
  CHECK_THROWS_WITH_AS(bad(R"({"format": "dmi-hook-map", "version": 1, "hooks": [{"module": "a.{i}", "site": "hook_embed"}]})"),
                       doctest::Contains("'{i}' must appear once"), dmi::Error);
  // Found by fuzz_hooks: a number too large for any type is nlohmann's
  // out_of_range, not a parse_error, and escaped ("internal error").
  CHECK_THROWS_WITH_AS(bad(R"({"format": "dmi-hook-map", "version": -888888888888888888e8888})"),
                       doctest::Contains("not valid JSON"), dmi::Error);
  CHECK_THROWS_WITH_AS(bad(R"({"format": "dmi-hook-map", "version": 1, "hooks": [{"module": "a", "site": "b", "output": 4294967296}]})"),
                       doctest::Contains("from 0 to 1023"), dmi::Error);
  CHECK_THROWS_AS(bad(R"({"format": 2})"), dmi::Error);  // value() of the wrong type: a json::type_error
}

namespace {

// Records what reaches it; optionally slow, to make the ring fill up.
class TestSink final : public dmi::sink::Sink {
 public:
  std::vector<std::pair<int, float>> got;  // (stream, first value)
  int delay_ms = 0;
  void open(const std::vector<dmi::sink::StreamInfo>&) override {}
  void write(std::uint16_t stream, std::int32_t, std::uint32_t rows, const std::int32_t* seq, const std::int32_t*,
             const void* data, std::size_t bytes) override {
    if (delay_ms) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    CHECK(bytes == rows * 16 * sizeof(float));
    CHECK(seq[0] == static_cast<std::int32_t>(got.size()));
    got.emplace_back(stream, static_cast<const float*>(data)[0]);
  }
  void close(const dmi::sink::Finish&) override {}
};

void push_n(dmi::ring::Producer& p, int n, std::vector<bool>* accepted = nullptr) {
  for (int i = 0; i < n; ++i) {
    std::int32_t seq = i, pos = 0;
    dmi::ring::RecordMeta m{static_cast<std::uint16_t>(i % 3), 0, 1, &seq, &pos};
    bool ok = p.push(m, {16}, at::kFloat, [&](at::Tensor& dst) { dst.fill_(static_cast<float>(i)); });
    if (accepted) accepted->push_back(ok);
  }
}

}  // namespace

TEST_CASE("ring: block mode is lossless and in order, through many wrap-arounds") {
  TestSink sink;
  sink.delay_ms = 0;
  {
    // Arena of 4 spans: pushing 1000 records wraps ~250 times.
    dmi::ring::CpuRing ring(4 * 192, 1024, dmi::ring::OnFull::block, 3, sink);
    push_n(ring, 1000);
    ring.drain();
    auto st = ring.stats();
    CHECK(st.records_written == 1000);
    CHECK(st.records_dropped == 0);
    CHECK(st.high_water_bytes <= 4 * 192);
  }
  REQUIRE(sink.got.size() == 1000);
  for (int i = 0; i < 1000; ++i) CHECK(sink.got[i].second == static_cast<float>(i));
}

TEST_CASE("ring: drop mode never stalls and counts drops per stream") {
  TestSink sink;
  sink.delay_ms = 5;  // a slow disk
  dmi::ring::CpuRing ring(2 * 192, 1024, dmi::ring::OnFull::drop, 3, sink);
  std::vector<bool> accepted;
  push_n(ring, 60, &accepted);
  ring.drain();
  auto st = ring.stats();
  CHECK(st.records_dropped > 0);
  CHECK(st.records_written + st.records_dropped == 60);
  CHECK(st.dropped_per_stream[0] + st.dropped_per_stream[1] + st.dropped_per_stream[2] == st.records_dropped);
  CHECK(st.producer_wait_seconds == 0.0);  // the producer never waited for the sink
  CHECK(std::count(accepted.begin(), accepted.end(), false) == static_cast<long>(st.records_dropped));
}

TEST_CASE("ring: a record larger than the arena is an error in block mode") {
  TestSink sink;
  dmi::ring::CpuRing ring(128, 16, dmi::ring::OnFull::block, 1, sink);
  std::int32_t seq = 0, pos = 0;
  dmi::ring::RecordMeta m{0, 0, 1, &seq, &pos};
  CHECK_THROWS_WITH_AS(ring.push(m, {1024}, at::kFloat, [](at::Tensor&) {}), doctest::Contains("--ring-mb"),
                       dmi::Error);
}
