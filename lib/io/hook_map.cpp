#include "io/hook_map.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/error.h"

namespace dmi::io {

using nlohmann::json;

namespace {

std::vector<std::string> split_path(const std::string& s) {
  std::vector<std::string> out;
  std::size_t i = 0;
  while (true) {
    auto j = s.find('.', i);
    out.push_back(s.substr(i, j == std::string::npos ? std::string::npos : j - i));
    if (j == std::string::npos) return out;
    i = j + 1;
  }
}

std::size_t count_of(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (auto p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

}  // namespace

std::vector<HookMatch> HookMap::match(const std::string& module_path) const {
  std::vector<HookMatch> out;
  const auto parts = split_path(module_path);
  for (const auto& e : entries) {
    const auto pat = split_path(e.module);
    if (pat.size() != parts.size()) continue;
    std::string index;
    bool ok = true;
    for (std::size_t k = 0; k < pat.size() && ok; ++k) {
      if (pat[k] == "{i}") {
        ok = !parts[k].empty() && parts[k].find_first_not_of("0123456789") == std::string::npos;
        index = parts[k];
      } else {
        ok = pat[k] == parts[k];
      }
    }
    if (!ok) continue;
    std::string site = e.site;
    if (auto p = site.find("{i}"); p != std::string::npos) site.replace(p, 3, index);
    out.push_back({&e, site});
  }
  return out;
}

namespace {

HookMap parse_checked(const std::string& text, const std::string& path) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {  // parse errors, and numbers too large for any type (out_of_range)
    DMI_FAIL("{}: not valid JSON ({})", path, e.what());
  }
  DMI_CHECK(j.is_object(), "{}: a hook map must be a JSON object", path);
  DMI_CHECK(j.value("format", "") == "dmi-hook-map", "{}: field 'format' must be \"dmi-hook-map\"", path);
  DMI_CHECK(j.contains("version") && j["version"] == 1, "{}: field 'version' must be 1 (this dmi reads version 1)",
            path);
  for (const auto& [k, v] : j.items())
    DMI_CHECK(k == "format" || k == "version" || k == "hooks" || k == "description", "{}: unknown field '{}'", path, k);
  DMI_CHECK(j.contains("hooks") && j["hooks"].is_array() && !j["hooks"].empty(),
            "{}: field 'hooks' must be a non-empty array", path);
  HookMap m;
  m.path = path;
  for (std::size_t n = 0; n < j["hooks"].size(); ++n) {
    const json& h = j["hooks"][n];
    const std::string where = fmt::format("{}: hooks[{}]", path, n);
    DMI_CHECK(h.is_object(), "{} must be an object", where);
    for (const auto& [k, v] : h.items())
      DMI_CHECK(k == "module" || k == "site" || k == "output" || k == "input", "{}: unknown field '{}'", where, k);
    DMI_CHECK(h.contains("module") && h["module"].is_string() && !h["module"].get<std::string>().empty(),
              "{}: 'module' must be a module path such as \"model.layers.{{i}}\"", where);
    DMI_CHECK(h.contains("site") && h["site"].is_string(), "{}: 'site' must be a site name such as \"blocks.{{i}}.hook_resid_post\"",
              where);
    HookMapEntry e;
    e.module = h["module"];
    e.site = h["site"];
    DMI_CHECK(!(h.contains("output") && h.contains("input")), "{}: give 'output' or 'input', not both", where);
    for (const char* key : {"output", "input"})
      if (h.contains(key)) {
        DMI_CHECK(h[key].is_number_integer() && h[key].get<std::int64_t>() >= 0 && h[key].get<std::int64_t>() < 1024,
                  "{}: '{}' must be an integer from 0 to 1023", where, key);
        e.input = std::string(key) == "input";
        e.index = static_cast<int>(h[key].get<std::int64_t>());
      }
    const std::size_t in_module = count_of(e.module, "{i}"), in_site = count_of(e.site, "{i}");
    DMI_CHECK(in_module <= 1 && in_module == in_site,
              "{}: '{{i}}' must appear once in both 'module' and 'site' or in neither ('{}' -> '{}')", where, e.module,
              e.site);
    for (const auto& part : split_path(e.module))
      DMI_CHECK(!part.empty() && (part == "{i}" || part.find_first_of("{}*") == std::string::npos),
                "{}: module path '{}' has an empty or malformed component", where, e.module);
    m.entries.push_back(std::move(e));
  }
  return m;
}

}  // namespace

HookMap parse_hook_map(const std::string& text, const std::string& path) {
  try {
    return parse_checked(text, path);
  } catch (const json::exception& e) {  // a field of an unexpected JSON type ({"format": 2})
    DMI_FAIL("{}: {}", path, e.what());
  }
}

HookMap load_hook_map(const std::string& path) {
  std::ifstream f(path);
  DMI_CHECK(f, "{}: cannot open hook map", path);
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_hook_map(ss.str(), path);
}

}  // namespace dmi::io
