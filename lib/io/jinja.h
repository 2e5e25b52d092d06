// A small Jinja interpreter for chat templates (tokenizer_config.json's
// "chat_template"), with the whitespace settings Hugging Face renders them
// with (trim_blocks, lstrip_blocks) and the subset of Jinja chat templates
// use: if/elif/else, for (loop.*, else, an if filter, break/continue), set
// (including namespace attributes and {% set %}...{% endset %}), expressions
// with Python's operators, literals, slices, string and dict methods, common
// filters and tests, namespace(), range(), raise_exception(),
// strftime_now(). Anything else (macros, includes, call blocks, ...) is a
// one-line dmi::Error naming the construct and its line.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace dmi::io {

class JinjaTemplate {
 public:
  // Parses source; name is used in error messages ("tokenizer_config.json").
  JinjaTemplate(std::string_view source, std::string name);
  // Renders with the given variables (a JSON object; keys in order).
  std::string render(const nlohmann::ordered_json& variables) const;

  struct Node;

 private:
  std::string name_;
  std::shared_ptr<const Node> root_;
};

}  // namespace dmi::io
