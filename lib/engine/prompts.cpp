#include "engine/prompts.h"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "io/chat_template.h"
#include "io/tokenizer.h"

namespace dmi::engine {

std::vector<std::int32_t> parse_id_list(const std::string& s) {
  std::vector<std::int32_t> ids;
  std::size_t i = 0;
  while (i <= s.size()) {
    std::size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string tok = s.substr(i, j - i);
    while (!tok.empty() && tok.front() == ' ') tok.erase(0, 1);
    while (!tok.empty() && tok.back() == ' ') tok.pop_back();
    DMI_CHECK(!tok.empty() && tok.find_first_not_of("0123456789") == std::string::npos && tok.size() < 10,
              "token id list '{}': '{}' is not a non-negative integer", s, tok);
    ids.push_back(static_cast<std::int32_t>(std::stol(tok)));
    i = j + 1;
  }
  return ids;
}

std::vector<PromptSpec> read_prompts_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DMI_CHECK(f, "{}: cannot read prompts file", path);
  std::vector<PromptSpec> out;
  std::string line;
  int lineno = 0;
  int jsonl = -1;  // unknown until the first non-blank line
  while (std::getline(f, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    DMI_CHECK(io::valid_utf8(line), "{}:{}: not valid UTF-8", path, lineno);
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    if (jsonl < 0) jsonl = line[line.find_first_not_of(" \t")] == '{';
    PromptSpec p;
    if (!jsonl) {
      p.text = line;
      out.push_back(std::move(p));
      continue;
    }
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      DMI_FAIL("{}:{}: malformed JSON line: {}", path, lineno, e.what());
    }
    DMI_CHECK(j.is_object() && j.contains("text") + j.contains("ids") + j.contains("messages") == 1,
              "{}:{}: each JSON line needs exactly one of \"text\", \"ids\" or \"messages\"", path, lineno);
    if (j.contains("steer")) {
      DMI_CHECK(j["steer"].is_array(), "{}:{}: \"steer\" must be a list of --steer specs", path, lineno);
      for (const auto& v : j["steer"]) {
        DMI_CHECK(v.is_string() && !v.get<std::string>().empty(), "{}:{}: \"steer\" must hold non-empty strings",
                  path, lineno);
        p.steer.push_back(v.get<std::string>());
      }
    }
    if (j.contains("messages")) {
      p.messages = nlohmann::ordered_json::parse(line)["messages"];  // keeps the keys' order
      io::check_messages(p.messages, fmt::format("{}:{}", path, lineno));
    } else if (j.contains("text")) {
      DMI_CHECK(j["text"].is_string(), "{}:{}: \"text\" must be a string", path, lineno);
      p.text = j["text"].get<std::string>();
    } else {
      DMI_CHECK(j["ids"].is_array() && !j["ids"].empty(), "{}:{}: \"ids\" must be a non-empty list", path, lineno);
      for (const auto& v : j["ids"]) {
        DMI_CHECK(v.is_number_integer() && v.get<std::int64_t>() >= 0 && v.get<std::int64_t>() < (1ll << 31),
                  "{}:{}: \"ids\" must hold non-negative integers", path, lineno);
        p.ids.push_back(v.get<std::int32_t>());
      }
      p.has_ids = true;
    }
    out.push_back(std::move(p));
  }
  DMI_CHECK(!out.empty(), "{}: no prompts in file", path);
  return out;
}

void check_chat(const std::vector<PromptSpec>& specs, const ChatSettings& chat) {
  DMI_CHECK(chat.enabled || !chat.has_system, "--system needs --chat (it is the conversation's system turn)");
  for (std::size_t i = 0; i < specs.size(); ++i) {
    DMI_CHECK(chat.enabled || specs[i].messages.is_null(),
              "prompt {} is a \"messages\" conversation: render it with the model's chat template by adding --chat", i);
    DMI_CHECK(!chat.enabled || !specs[i].has_ids,
              "prompt {} is token ids: --chat renders text or \"messages\" prompts, not ids", i);
  }
}

void render_chat(std::vector<PromptSpec>& specs, const ChatSettings& chat, const std::string& tokenizer_path) {
  check_chat(specs, chat);
  if (!chat.enabled) return;
  const io::ChatTemplate tmpl = io::ChatTemplate::load(tokenizer_path);
  for (auto& p : specs) {
    nlohmann::ordered_json messages = p.messages;
    if (messages.is_null()) {
      messages = nlohmann::ordered_json::array();
      if (chat.has_system) messages.push_back({{"role", "system"}, {"content", chat.system}});
      messages.push_back({{"role", "user"}, {"content", p.text}});
    } else if (chat.has_system && messages[0].value("role", "") != "system") {
      messages.insert(messages.begin(), {{"role", "system"}, {"content", chat.system}});
    }
    p.text = tmpl.render(messages, /*add_generation_prompt=*/true);
    p.chat = true;
  }
}

}  // namespace dmi::engine
