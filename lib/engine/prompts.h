// Prompt sources for dmi-run: text, token ids, and prompt files.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dmi::engine {

struct PromptSpec {
  std::string text;                // empty for id prompts
  std::vector<std::int32_t> ids;   // set for id prompts
  bool has_ids = false;
  std::vector<std::string> steer;  // JSONL "steer": [SPEC, ...], this prompt only
  nlohmann::ordered_json messages;  // JSONL "messages": [...] (--chat); null otherwise
  bool chat = false;                // text is a rendered chat template: tokenize without special tokens
};

// --chat: every prompt becomes a conversation rendered with the model's chat
// template (io/chat_template.h) and its generation prompt: a JSONL
// "messages" list as given, a text prompt as one user turn after the
// --system turn, if any.
struct ChatSettings {
  bool enabled = false;
  bool has_system = false;
  std::string system;
};
// Checks the prompts fit the chat flags (before any model is loaded).
void check_chat(const std::vector<PromptSpec>& specs, const ChatSettings& chat);
// Checks, then (with --chat) renders each prompt's conversation with the
// template beside tokenizer_path.
void render_chat(std::vector<PromptSpec>& specs, const ChatSettings& chat, const std::string& tokenizer_path);

// "1,2,3" -> ids; errors name the bad element.
std::vector<std::int32_t> parse_id_list(const std::string& s);

// A prompts file: JSON Lines with {"text": ...}, {"ids": [...]} or
// {"messages": [{"role": ..., "content": ...}, ...]} (with --chat) per line
// (optionally "steer": [SPEC, ...], --steer specs for that prompt alone)
// when its first non-blank line starts with '{', otherwise one prompt per
// line. Blank lines are skipped. Errors name the file and line; text must be
// valid UTF-8.
std::vector<PromptSpec> read_prompts_file(const std::string& path);

}  // namespace dmi::engine
