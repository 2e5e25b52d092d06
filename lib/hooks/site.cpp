#include "hooks/site.h"

#include "common/error.h"

#include <fmt/format.h>

namespace dmi::hooks {

const char* site_suffix(Site s) {
  switch (s) {
    case Site::embed: return "hook_embed";
    case Site::resid_pre: return "hook_resid_pre";
    case Site::ln1_normalized: return "ln1.hook_normalized";
    case Site::q: return "attn.hook_q";
    case Site::k: return "attn.hook_k";
    case Site::v: return "attn.hook_v";
    case Site::q_normalized: return "attn.q_norm.hook_normalized";
    case Site::k_normalized: return "attn.k_norm.hook_normalized";
    case Site::rot_q: return "attn.hook_rot_q";
    case Site::rot_k: return "attn.hook_rot_k";
    case Site::attn_scores: return "attn.hook_attn_scores";
    case Site::pattern: return "attn.hook_pattern";
    case Site::z: return "attn.hook_z";
    case Site::attn_out: return "hook_attn_out";
    case Site::resid_mid: return "hook_resid_mid";
    case Site::ln2_normalized: return "ln2.hook_normalized";
    case Site::mlp_pre: return "mlp.hook_pre";
    case Site::mlp_pre_linear: return "mlp.hook_pre_linear";
    case Site::mlp_post: return "mlp.hook_post";
    case Site::mlp_out: return "hook_mlp_out";
    case Site::resid_post: return "hook_resid_post";
    case Site::ln_final: return "ln_final.hook_normalized";
    case Site::logits: return "unembed.hook_out";
    case Site::kCount: break;
  }
  return "?";
}

bool is_layer_site(Site s) { return s != Site::embed && s != Site::ln_final && s != Site::logits; }

std::string site_name(Site s, int layer) {
  if (!is_layer_site(s)) return site_suffix(s);
  return fmt::format("blocks.{}.{}", layer, site_suffix(s));
}

bool parse_site_name(const std::string& name, Site& site, int& layer) {
  std::string suffix = name;
  layer = -1;
  if (name.rfind("blocks.", 0) == 0) {
    std::size_t i = 7, j = i;
    while (j < name.size() && name[j] >= '0' && name[j] <= '9') ++j;
    if (j == i || j - i > 6 || j >= name.size() || name[j] != '.' || (name[i] == '0' && j - i > 1)) return false;
    layer = std::stoi(name.substr(i, j - i));
    suffix = name.substr(j + 1);
  }
  for (int s = 0; s < static_cast<int>(Site::kCount); ++s) {
    const Site cand = static_cast<Site>(s);
    if (suffix == site_suffix(cand) && is_layer_site(cand) == (layer >= 0)) {
      site = cand;
      return true;
    }
  }
  return false;
}

Site residual_site(const std::string& name) {
  for (Site s : {Site::resid_pre, Site::resid_mid, Site::resid_post, Site::attn_out, Site::mlp_out}) {
    const std::string suffix = site_suffix(s);  // "hook_resid_post"
    if (name == suffix || name == suffix.substr(5)) return s;
  }
  DMI_FAIL("site={} is not residual-shaped (resid_post, resid_pre, resid_mid, attn_out, mlp_out)", name);
}

}  // namespace dmi::hooks
