// Chat templates: a model's conversation format, rendered as Hugging Face's
// apply_chat_template does (io/jinja.h), then tokenized without adding
// special tokens (the template writes them).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "io/jinja.h"

namespace dmi::io {

class ChatTemplate {
 public:
  // The template of the tokenizer at tokenizer_json_path: chat_template.jinja
  // beside it if present, else tokenizer_config.json's "chat_template" (a
  // string, or a list of {"name", "template"}: the one named "default").
  // Errors name the file and say when the model has no chat template.
  static ChatTemplate load(const std::string& tokenizer_json_path);
  ChatTemplate(const std::string& source, const std::string& name, nlohmann::ordered_json special_tokens);

  // messages: [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...];
  // extra: more template variables (e.g. {"enable_thinking": false}).
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                     const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  JinjaTemplate tmpl_;
  nlohmann::ordered_json special_tokens_;  // bos_token, eos_token, ... as strings
};

// A conversation read from user input ("messages" in a prompts file):
// checks it is a non-empty list of objects with string "role" and "content"
// (other fields pass through); errors start with `where`.
void check_messages(const nlohmann::ordered_json& messages, const std::string& where);

}  // namespace dmi::io
