// Prompt sources for dmi-run: text, token ids, and prompt files.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dmi::engine {

struct PromptSpec {
  std::string text;                // empty for id prompts
  std::vector<std::int32_t> ids;   // set for id prompts
  bool has_ids = false;
  std::vector<std::string> steer;  // JSONL "steer": [SPEC, ...], this prompt only
};

// "1,2,3" -> ids; errors name the bad element.
std::vector<std::int32_t> parse_id_list(const std::string& s);

// A prompts file: JSON Lines with {"text": ...} or {"ids": [...]} per line
// (optionally "steer": [SPEC, ...], --steer specs for that prompt alone)
// when its first non-blank line starts with '{', otherwise one prompt per
// line. Blank lines are skipped. Errors name the file and line; text must be
// valid UTF-8.
std::vector<PromptSpec> read_prompts_file(const std::string& path);

}  // namespace dmi::engine
