#include "hooks/selection.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <fnmatch.h>

#include <algorithm>
#include <limits>
#include <set>

#include "common/error.h"

namespace dmi::hooks {

namespace {

constexpr int kSites = static_cast<int>(Site::kCount);

// The edit distance of a and b, or limit + 1 as soon as it must exceed limit.
std::size_t edit_distance(const std::string& a, const std::string& b,
                          std::size_t limit = std::numeric_limits<std::size_t>::max() - 1) {
  if ((a.size() > b.size() ? a.size() - b.size() : b.size() - a.size()) > limit) return limit + 1;
  std::vector<std::size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    std::size_t row_min = cur[0];
    for (std::size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      row_min = std::min(row_min, cur[j]);
    }
    if (row_min > limit) return limit + 1;  // rows never decrease below their minimum
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// blocks.{0-3,10}.x -> the set of layers and the pattern with '*' for them.
bool expand_layer_set(const std::string& item, int n_layers, std::set<int>& layers, std::string& rest) {
  auto open = item.find('{');
  if (open == std::string::npos) return false;
  auto close = item.find('}', open);
  DMI_CHECK(close != std::string::npos, "--hooks: '{}' has '{{' without '}}'", item);
  std::string body = item.substr(open + 1, close - open - 1);
  std::size_t i = 0;
  while (i <= body.size()) {
    auto j = body.find(',', i);
    if (j == std::string::npos) j = body.size();
    std::string part = body.substr(i, j - i);
    auto dash = part.find('-');
    try {
      std::size_t used = 0;
      int lo = std::stoi(part, &used), hi = lo;
      if (dash != std::string::npos) hi = std::stoi(part.substr(dash + 1), &used), used += dash + 1;
      DMI_CHECK(used == part.size() && lo <= hi, "--hooks: '{}' is not a layer or range in '{}'", part, item);
      DMI_CHECK(lo >= 0 && hi < n_layers, "--hooks: layers {} in '{}' are outside 0-{}", part, item, n_layers - 1);
      for (int l = lo; l <= hi; ++l) layers.insert(l);
    } catch (const std::logic_error&) {
      DMI_FAIL("--hooks: '{}' is not a layer or range in '{}'", part, item);
    }
    i = j + 1;
  }
  rest = item.substr(0, open) + "*" + item.substr(close + 1);
  return true;
}

}  // namespace

const std::vector<std::pair<std::string, Site>>& short_site_names();

namespace {

// A name that exists in the TransformerLens scheme but not in this model.
[[noreturn]] void fail_absent(const std::string& item, const SiteSpace& space) {
  std::vector<std::string> have;
  for (const auto& [name, site] : short_site_names())
    if (space.has(site)) have.push_back(name);
  DMI_FAIL("--hooks: '{}' is not produced by this model; it has {}", item, fmt::join(have, ", "));
}

}  // namespace

const std::vector<std::pair<std::string, Site>>& short_site_names() {
  static const std::vector<std::pair<std::string, Site>> names = {
      {"embed", Site::embed},
      {"resid_pre", Site::resid_pre},
      {"ln1", Site::ln1_normalized},
      {"q", Site::q},
      {"k", Site::k},
      {"v", Site::v},
      {"q_norm", Site::q_normalized},
      {"k_norm", Site::k_normalized},
      {"rot_q", Site::rot_q},
      {"rot_k", Site::rot_k},
      {"attn_scores", Site::attn_scores},
      {"pattern", Site::pattern},
      {"z", Site::z},
      {"attn_out", Site::attn_out},
      {"resid_mid", Site::resid_mid},
      {"ln2", Site::ln2_normalized},
      {"mlp_pre", Site::mlp_pre},
      {"mlp_pre_linear", Site::mlp_pre_linear},
      {"mlp_post", Site::mlp_post},
      {"mlp_out", Site::mlp_out},
      {"resid_post", Site::resid_post},
      {"ln_final", Site::ln_final},
      {"logits", Site::logits},
  };
  return names;
}

const std::vector<std::string>& preset_names() {
  static const std::vector<std::string> p = {"residual", "attention", "mlp", "kv", "full", "hf-hidden-states"};
  return p;
}

bool SiteSpace::has(Site s) const {
  if (!is_layer_site(s)) return has(s, -1);
  for (int l = 0; l < n_layers; ++l)
    if (has(s, l)) return true;
  return false;
}

void Selection::add(Site s, int layer) {
  if (!space_.has(s, layer)) return;
  auto bit = bits_[static_cast<int>(s)][layer < 0 ? 0 : layer];
  if (!bit) {
    bits_[static_cast<int>(s)][layer < 0 ? 0 : layer] = true;
    ++count_;
  }
}

std::vector<std::int64_t> parse_index_set(const std::string& s, std::int64_t limit, const std::string& what) {
  std::set<std::int64_t> out;
  if (s == "all") {
    for (std::int64_t i = 0; i < limit; ++i) out.insert(i);
    return {out.begin(), out.end()};
  }
  auto num = [&](const std::string& t) {
    DMI_CHECK(!t.empty() && t.size() < 10 && t.find_first_not_of("0123456789") == std::string::npos,
              "{}={}: '{}' is not a number", what, s, t);
    const std::int64_t n = std::stoll(t);
    DMI_CHECK(n < limit, "{}={}: {} is out of range (0 to {})", what, s, n, limit - 1);
    return n;
  };
  std::size_t i = 0;
  while (i <= s.size()) {
    std::size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    const std::string item = s.substr(i, j - i);
    const auto d = item.find('-');
    const std::int64_t a = num(d == std::string::npos ? item : item.substr(0, d));
    const std::int64_t b = d == std::string::npos ? a : num(item.substr(d + 1));
    DMI_CHECK(a <= b, "{}={}: range {} is empty", what, s, item);
    for (auto k = a; k <= b; ++k) out.insert(k);
    i = j + 1;
  }
  return {out.begin(), out.end()};
}

std::vector<std::string> split_outside_braces(const std::string& spec) {
  std::vector<std::string> items;
  std::size_t i = 0;
  while (i <= spec.size()) {
    std::size_t j = i;
    int depth = 0;
    while (j < spec.size() && (spec[j] != ',' || depth > 0)) {
      depth += spec[j] == '{' ? 1 : spec[j] == '}' ? -1 : 0;
      ++j;
    }
    items.push_back(spec.substr(i, j - i));
    i = j + 1;
  }
  return items;
}

Selection Selection::parse(const std::string& spec, const SiteSpace& space) {
  Selection sel;
  sel.space_ = space;
  sel.bits_.assign(kSites, std::vector<bool>(std::max(space.n_layers, 1), false));
  const int L = space.n_layers;
  auto all_layers = [&](Site s) {
    if (!is_layer_site(s)) return sel.add(s, -1);
    for (int l = 0; l < L; ++l) sel.add(s, l);
  };
  // name -> (site, layer) for every site of this model
  std::vector<std::tuple<std::string, Site, int>> named;
  named.emplace_back(site_name(Site::embed, -1), Site::embed, -1);
  for (int l = 0; l < L; ++l)
    for (int s = 0; s < kSites; ++s)
      if (is_layer_site(static_cast<Site>(s))) named.emplace_back(site_name(static_cast<Site>(s), l), static_cast<Site>(s), l);
  named.emplace_back(site_name(Site::ln_final, -1), Site::ln_final, -1);
  named.emplace_back(site_name(Site::logits, -1), Site::logits, -1);

  for (std::string item : split_outside_braces(spec)) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty()) continue;

    if (item == "residual") {
      for (int l = 0; l < L; ++l) sel.add(Site::resid_pre, l);
      sel.add(Site::resid_post, L - 1);
      sel.add(Site::ln_final, -1);
      continue;
    }
    if (item == "attention") {
      for (Site s : {Site::q, Site::k, Site::v, Site::q_normalized, Site::k_normalized, Site::rot_q, Site::rot_k,
                     Site::attn_scores, Site::pattern, Site::z, Site::attn_out})
        all_layers(s);
      continue;
    }
    if (item == "mlp") {
      for (Site s : {Site::ln2_normalized, Site::mlp_pre, Site::mlp_pre_linear, Site::mlp_post, Site::mlp_out})
        all_layers(s);
      continue;
    }
    if (item == "kv") {
      all_layers(Site::rot_k);
      all_layers(Site::v);
      continue;
    }
    if (item == "full") {
      for (int s = 0; s < kSites; ++s) all_layers(static_cast<Site>(s));
      continue;
    }
    if (item == "hf-hidden-states") {
      // transformers' output_hidden_states: embeddings, the output of every
      // layer but the last, then the final norm's output.
      sel.add(Site::embed, -1);
      for (int l = 0; l + 1 < L; ++l) sel.add(Site::resid_post, l);
      sel.add(Site::ln_final, -1);
      continue;
    }
    auto sh = std::find_if(short_site_names().begin(), short_site_names().end(),
                           [&](const auto& p) { return p.first == item; });
    if (sh != short_site_names().end()) {
      if (!space.has(sh->second)) {
        DMI_CHECK(!space.available.empty(), "--hooks: '{}' does not exist in this model (no per-head q/k norms)", item);
        fail_absent(item, space);
      }
      all_layers(sh->second);
      continue;
    }
    std::set<int> layers;
    std::string pattern = item;
    const bool layer_set = expand_layer_set(item, L, layers, pattern);
    std::size_t matched = 0;
    std::size_t absent = 0;
    for (const auto& [name, site, layer] : named) {
      if (layer_set && !layers.count(layer)) continue;
      if (!space.has(site, layer)) {
        absent += fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
        continue;
      }
      if (layer_set && !layers.count(layer)) continue;
      if (fnmatch(pattern.c_str(), name.c_str(), 0) == 0) {
        sel.add(site, layer);
        ++matched;
      }
    }
    if (matched > 0) continue;
    if (absent > 0) fail_absent(item, space);
    // Nothing matched: suggest the nearest names (for what could be a typo:
    // the edit distance to every name costs length x names).
    DMI_CHECK(item.size() <= 96, "--hooks: unknown site '{}...' ({} bytes; site names are far shorter)",
              item.substr(0, 48), item.size());
    std::vector<std::pair<std::size_t, std::string>> cand;
    std::vector<std::size_t> top;  // the three smallest distances so far
    std::size_t limit = std::numeric_limits<std::size_t>::max() - 1;
    auto consider = [&](const std::string& name) {
      const std::size_t d = edit_distance(item, name, limit);
      if (d > limit) return;  // worse than three names already found
      cand.emplace_back(d, name);
      top.insert(std::upper_bound(top.begin(), top.end(), d), d);
      if (top.size() > 3) top.pop_back();
      if (top.size() == 3) limit = top.back();
    };
    for (const auto& [name, site, layer] : named)
      if (space.has(site, layer)) consider(name);
    for (const auto& [s, site] : short_site_names())
      if (space.has(site)) consider(s);
    for (const auto& p : preset_names()) consider(p);
    std::sort(cand.begin(), cand.end());
    std::vector<std::string> best;
    for (std::size_t k = 0; k < cand.size() && best.size() < 3; ++k) best.push_back(cand[k].second);
    DMI_FAIL("--hooks: unknown site '{}'; did you mean {}?", item, fmt::join(best, ", "));
  }
  return sel;
}

std::vector<std::pair<Site, int>> Selection::sites() const {
  std::vector<std::pair<Site, int>> out;
  if (bits_.empty()) return out;
  if (wants(Site::embed, -1)) out.emplace_back(Site::embed, -1);
  for (int l = 0; l < space_.n_layers; ++l)
    for (int s = 0; s < kSites; ++s) {
      Site site = static_cast<Site>(s);
      if (is_layer_site(site) && wants(site, l)) out.emplace_back(site, l);
    }
  if (wants(Site::ln_final, -1)) out.emplace_back(Site::ln_final, -1);
  if (wants(Site::logits, -1)) out.emplace_back(Site::logits, -1);
  return out;
}

}  // namespace dmi::hooks
