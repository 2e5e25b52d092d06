#include "io/chat_template.h"

#include <fstream>
#include <sstream>

#include "common/error.h"

namespace dmi::io {

using json = nlohmann::ordered_json;

namespace {
std::string dir_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}
bool read_text(const std::string& path, std::string& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::ostringstream s;
  s << f.rdbuf();
  out = s.str();
  return true;
}
}  // namespace

ChatTemplate::ChatTemplate(const std::string& source, const std::string& name, json special_tokens)
    : name_(name), tmpl_(source, name), special_tokens_(std::move(special_tokens)) {}

ChatTemplate ChatTemplate::load(const std::string& tokenizer_json_path) {
  const std::string dir = dir_of(tokenizer_json_path);
  const std::string config_path = dir + "/tokenizer_config.json";
  json config = json::object();
  std::string text;
  if (read_text(config_path, text)) {
    try {
      config = json::parse(text);
    } catch (const json::exception& e) {
      DMI_FAIL("{}: malformed JSON: {}", config_path, e.what());
    }
    DMI_CHECK(config.is_object(), "{}: not a JSON object", config_path);
  }
  // Special tokens the template may write: strings, or {"content": ...}.
  json special = json::object();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    if (!config.contains(key)) continue;
    const json& v = config[key];
    if (v.is_string()) special[key] = v;
    else if (v.is_object() && v.contains("content") && v["content"].is_string()) special[key] = v["content"];
  }
  const std::string jinja_path = dir + "/chat_template.jinja";
  if (read_text(jinja_path, text)) return ChatTemplate(text, jinja_path, special);
  DMI_CHECK(config.contains("chat_template") && !config["chat_template"].is_null(),
            "{}: the model has no chat template (no \"chat_template\" in tokenizer_config.json, no "
            "chat_template.jinja); give plain prompts without --chat",
            config_path);
  const json& t = config["chat_template"];
  if (t.is_string()) return ChatTemplate(t.get<std::string>(), config_path, special);
  DMI_CHECK(t.is_array(), "{}: \"chat_template\" must be a string or a list of {{\"name\", \"template\"}}",
            config_path);
  for (const auto& e : t)
    if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
      return ChatTemplate(e["template"].get<std::string>(), config_path + " (\"default\" template)", special);
  DMI_FAIL("{}: \"chat_template\" lists no template named \"default\"", config_path);
}

std::string ChatTemplate::render(const json& messages, bool add_generation_prompt, const json& extra) const {
  check_messages(messages, name_);
  json vars = special_tokens_;
  vars["messages"] = messages;
  vars["add_generation_prompt"] = add_generation_prompt;
  for (auto it = extra.begin(); it != extra.end(); ++it) vars[it.key()] = it.value();
  return tmpl_.render(vars);
}

void check_messages(const json& messages, const std::string& where) {
  DMI_CHECK(messages.is_array() && !messages.empty(), "{}: \"messages\" must be a non-empty list", where);
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    DMI_CHECK(m.is_object(), "{}: messages[{}] must be an object with \"role\" and \"content\"", where, i);
    DMI_CHECK(m.contains("role") && m["role"].is_string(), "{}: messages[{}] needs a string \"role\"", where, i);
    DMI_CHECK(m.contains("content") && m["content"].is_string(), "{}: messages[{}] needs a string \"content\"",
              where, i);
  }
}

}  // namespace dmi::io
