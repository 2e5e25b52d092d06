// Which sites to capture: parsed from --hooks.
//
// A spec is a comma-separated list of
//   short names    resid_post, pattern, rot_k, logits, ...   (every layer)
//   full names     blocks.3.hook_resid_post, ln_final.hook_normalized
//   globs          blocks.*.hook_resid_post, *mlp*
//   layer sets     blocks.{0-3,10}.attn.hook_pattern
//   presets        residual, attention, mlp, kv, full, hf-hidden-states
// Unknown names are errors that suggest the nearest valid ones.
#pragma once

#include <string>
#include <vector>

#include "hooks/site.h"

namespace dmi::hooks {

// The sites a model has (Qwen3's q/k norms only where present; for
// TorchScript models, the sites its hook calls produce).
struct SiteSpace {
  int n_layers = 0;
  bool qk_norm = false;
  // [site][max(layer, 0)]: the sites that exist; empty means all of them.
  std::vector<std::vector<bool>> available;
  bool has(Site s, int layer) const {
    if (!qk_norm && (s == Site::q_normalized || s == Site::k_normalized)) return false;
    return available.empty() || available[static_cast<int>(s)][layer < 0 ? 0 : layer];
  }
  // The site exists at some layer.
  bool has(Site s) const;
};

class Selection {
 public:
  Selection() = default;
  static Selection parse(const std::string& spec, const SiteSpace& space);

  bool wants(Site s, int layer) const {
    return bits_.empty() ? false : bits_[static_cast<int>(s)][layer < 0 ? 0 : layer];
  }
  bool empty() const { return count_ == 0; }
  std::size_t size() const { return count_; }
  // Selected (site, layer) pairs in forward order; layer -1 for global sites.
  std::vector<std::pair<Site, int>> sites() const;

 private:
  void add(Site s, int layer);
  SiteSpace space_;
  std::vector<std::vector<bool>> bits_;  // [site][layer]
  std::size_t count_ = 0;
};

// Splits a comma-separated spec on the commas outside braces
// ("blocks.{0-3,10}.attn.hook_z,heads=1" -> 2 items), untrimmed.
std::vector<std::string> split_outside_braces(const std::string& spec);

// "0-3,10" (inclusive ranges and single numbers) or "all" -> the indices,
// each below limit. Errors name `what` (e.g. "layers") and the value.
std::vector<std::int64_t> parse_index_set(const std::string& s, std::int64_t limit, const std::string& what);

// Short names accepted by --hooks ("resid_post", "pattern", ...), with sites.
const std::vector<std::pair<std::string, Site>>& short_site_names();
const std::vector<std::string>& preset_names();

}  // namespace dmi::hooks
