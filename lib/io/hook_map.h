// Hook maps: which submodule outputs (or inputs) of a TorchScript module are
// which TransformerLens sites, for modules exported without dmi::hook calls.
// The JSON format is schemas/dmi-hook-map.schema.json:
//
//   {"format": "dmi-hook-map", "version": 1,
//    "hooks": [{"module": "model.layers.{i}", "site": "blocks.{i}.hook_resid_post"},
//              {"module": "model.layers.{i}", "input": 0, "site": "blocks.{i}.hook_resid_pre"}]}
//
// "{i}" in a module path matches one all-digit path component and is
// substituted into the site name.
#pragma once

#include <string>
#include <vector>

namespace dmi::io {

struct HookMapEntry {
  std::string module;  // module path pattern
  std::string site;    // site name template
  bool input = false;  // hook argument `index` of forward (after self) instead of the output
  int index = 0;       // output: element of a returned tuple (0 for a plain tensor)
};

struct HookMatch {
  const HookMapEntry* entry;
  std::string site;  // with {i} substituted
};

struct HookMap {
  std::string path;
  std::vector<HookMapEntry> entries;
  // Entries whose module pattern matches `module_path` ("model.layers.3").
  std::vector<HookMatch> match(const std::string& module_path) const;
};

// Errors name the file and the entry at fault.
HookMap load_hook_map(const std::string& path);
HookMap parse_hook_map(const std::string& json_text, const std::string& path);

}  // namespace dmi::io
