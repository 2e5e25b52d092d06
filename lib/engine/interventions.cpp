#include "engine/interventions.h"

#include <ATen/ATen.h>
#include <limits.h>
#include <stdlib.h>

#include <cmath>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "hooks/capture.h"
#include "io/vectors.h"
#include "sink/capture_file.h"

namespace dmi::engine {

using hooks::Intervention;
using hooks::Site;
using nlohmann::json;

namespace {

std::string abs_path(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : p;
}

// Items split on commas outside braces; an item without '=' continues the
// previous item (pos=1,4,9), except the first.
std::vector<std::string> split_spec(const std::string& spec) {
  std::vector<std::string> items;
  for (auto& r : hooks::split_outside_braces(spec)) {
    if (!items.empty() && r.find('=') == std::string::npos) items.back() += "," + r;
    else items.push_back(r);
  }
  return items;
}

std::map<std::string, std::string> key_values(const std::vector<std::string>& items, const std::string& flag,
                                              const std::string& spec, const std::set<std::string>& allowed) {
  std::map<std::string, std::string> kv;
  for (std::size_t i = 1; i < items.size(); ++i) {
    const auto eq = items[i].find('=');
    const std::string k = items[i].substr(0, eq), v = items[i].substr(eq + 1);
    DMI_CHECK(allowed.count(k), "{} '{}': unknown key '{}' (allowed: {})", flag, spec, k,
              fmt::format("{}", fmt::join(allowed, ", ")));
    DMI_CHECK(!kv.count(k), "{} '{}': '{}' given twice", flag, spec, k);
    DMI_CHECK(!v.empty(), "{} '{}': '{}=' needs a value", flag, spec, k);
    kv[k] = v;
  }
  return kv;
}

std::set<std::int64_t> parse_index_set(const std::string& s, std::int64_t limit, const std::string& what,
                                       const std::string& flag) {
  try {
    const auto v = hooks::parse_index_set(s, limit, what);
    return {v.begin(), v.end()};
  } catch (const Error& e) {
    DMI_FAIL("{}: {}", flag, e.what());
  }
}

Site residual_site(const std::string& s, const std::string& flag) {
  try {
    return hooks::residual_site(s);
  } catch (const Error& e) {
    DMI_FAIL("{}: {}", flag, e.what());
  }
}

std::vector<std::pair<Site, int>> parse_sites(const std::string& spec, const hooks::SiteSpace& space,
                                              const std::string& flag) {
  try {
    return hooks::Selection::parse(spec, space).sites();
  } catch (const Error& e) {
    DMI_FAIL("{}: {}", flag, e.what());
  }
}

// REF / SRC captures must come from this model.
void check_same_model(const sink::CaptureFile& f, const ModelView& m, const std::string& flag) {
  const std::string recorded = f.text_attr("model_fingerprint");
  if (!recorded.empty() && !m.fingerprint.empty()) {
    io::Fingerprint fp;
    const json j = json::parse(recorded, nullptr, false);
    if (j.is_object())
      for (auto it = j.begin(); it != j.end(); ++it)
        if (it.key() != "tokenizer.json" && it.key() != "tokenizer_config.json") fp[it.key()] = it.value().get<std::string>();
    io::Fingerprint now;
    for (const auto& [k, v] : m.fingerprint)
      if (k != "tokenizer.json" && k != "tokenizer_config.json") now[k] = v;
    const auto d = io::fingerprint_differences(fp, now);
    DMI_CHECK(d.empty(), "{}: {} was captured from another model ({})", flag, f.path(), fmt::join(d, "; "));
    return;
  }
  DMI_CHECK(f.text_attr("model_config") == m.config.json_text,
            "{}: {} was captured from another model (its config.json differs)", flag, f.path());
}

// The rows of one site of a reference capture, in memory.
struct RefSite {
  at::Tensor rows;  // [n, ...row_shape] float32
  std::map<std::pair<std::int32_t, std::int64_t>, std::int64_t> index;
};

struct RefFile {
  std::unique_ptr<sink::CaptureFile> file;
  std::map<std::string, RefSite> sites;
  const RefSite& site(Site s, int layer, const ModelView& m, const std::string& flag) {
    const std::string name = hooks::site_name(s, layer);
    auto it = sites.find(name);
    if (it != sites.end()) return it->second;
    DMI_CHECK(file->has_site(name), "{}: {} has no site {}", flag, file->path(), name);
    const auto& e = file->site(name);
    // Attention rows (pattern, attn_scores; --patch only) are [heads, width]
    // of any width: the intervention checks each row covers its position.
    const bool attention = e.layout == "attention" && (s == Site::pattern || s == Site::attn_scores);
    DMI_CHECK(e.layout == "dense" || attention, "{}: {} in {} has the {} layout; only dense and attention sites can "
              "be patched or mean/resample-ablated", flag, name, file->path(), e.layout);
    const auto want = hooks::site_row_shape(s, m.config, attention && !e.row_shape.empty() ? e.row_shape.back() : 1);
    DMI_CHECK(e.row_shape == want, "{}: {} in {} has rows of shape [{}], this model's are [{}]", flag, name,
              file->path(), fmt::join(e.row_shape, ", "), fmt::join(want, ", "));
    RefSite r;
    r.rows = file->read_block(name, 0, e.rows);
    const auto& seq = file->seq_of(name);
    const auto& pos = file->pos_of(name);
    for (std::size_t i = 0; i < seq.size(); ++i) r.index[{seq[i], pos[i]}] = static_cast<std::int64_t>(i);
    return sites.emplace(name, std::move(r)).first->second;
  }
};

std::shared_ptr<RefFile> open_ref(const std::string& path, const ModelView& m, const std::string& flag) {
  auto r = std::make_shared<RefFile>();
  try {
    r->file = sink::CaptureFile::open(path);
  } catch (const Error& e) {
    DMI_FAIL("{}: {}", flag, e.what());
  }
  check_same_model(*r->file, m, flag);
  return r;
}

json file_record(const std::string& path) { return {{"file", abs_path(path)}, {"file_hash", io::xxh3_128_file(path)}}; }

// after:TEXT: per sequence, the first position after TEXT's last occurrence.
std::map<std::int32_t, std::int64_t> after_positions(const std::string& text, const ModelView& m,
                                                     const std::vector<std::vector<std::int32_t>>& prompts,
                                                     const std::optional<std::set<std::int32_t>>& only,
                                                     const std::string& flag) {
  DMI_CHECK(io::valid_utf8(text), "{}: pos=after: text is not valid UTF-8", flag);
  const auto needle = m.tokenizer.encode(text, /*add_special_tokens=*/false);
  DMI_CHECK(!needle.empty(), "{}: pos=after:{} has no tokens", flag, text);
  std::map<std::int32_t, std::int64_t> out;
  for (std::size_t s = 0; s < prompts.size(); ++s) {
    if (only && !only->count(static_cast<std::int32_t>(s))) continue;
    const auto& p = prompts[s];
    std::int64_t found = -1;
    for (std::int64_t i = static_cast<std::int64_t>(p.size()) - static_cast<std::int64_t>(needle.size()); i >= 0; --i)
      if (std::equal(needle.begin(), needle.end(), p.begin() + i)) {
        found = i;
        break;
      }
    DMI_CHECK(found >= 0, "{}: prompt {} does not contain the tokens of '{}' ({}), so pos=after: has no position there",
              flag, s, text, fmt::join(needle, ","));
    out[static_cast<std::int32_t>(s)] = found + static_cast<std::int64_t>(needle.size());
  }
  return out;
}

Intervention resolve_steer(const InterventionRequest& r, const ModelView& m,
                           const std::vector<std::vector<std::int32_t>>& prompts, json& rec) {
  const std::string flag = "--steer " + r.spec;
  const auto items = split_spec(r.spec);
  auto kv = key_values(items, "--steer", r.spec, {"scale", "layers", "pos", "mode", "site", "target"});
  Intervention iv;
  iv.kind = Intervention::Kind::steer;
  iv.label = flag;
  const std::string file = items[0];
  io::SteeringVectors v = io::load_steering_vectors(file, m.config.hidden_size, m.config.num_layers);
  if (kv.count("scale")) {
    try {
      std::size_t used = 0;
      iv.scale = std::stod(kv["scale"], &used);
      DMI_CHECK(used == kv["scale"].size(), "");
    } catch (const std::exception&) {
      DMI_FAIL("{}: scale={} is not a number", flag, kv["scale"]);
    }
    DMI_CHECK(std::isfinite(iv.scale), "{}: scale={} is not finite", flag, kv["scale"]);
  }
  if (kv.count("mode")) iv.mode = hooks::parse_steer_mode(kv["mode"]);
  const Site site = kv.count("site") ? residual_site(kv["site"], flag) : Site::resid_post;
  std::set<std::int64_t> layers;
  if (kv.count("layers")) {
    layers = parse_index_set(kv["layers"], m.config.num_layers, "layers", flag);
    for (auto l : layers)
      DMI_CHECK(v.direction.count(static_cast<int>(l)), "{}: layers={} names layer {}, but {} has no direction.{}",
                flag, kv["layers"], l, file, l);
  } else {
    for (const auto& [l, t] : v.direction) layers.insert(l);
  }
  for (auto l : layers) {
    const int layer = static_cast<int>(l);
    const at::Tensor& d = v.direction.at(layer);
    if (iv.mode != hooks::SteerMode::add)
      DMI_CHECK(d.norm().item<double>() > 0, "{}: direction.{} in {} is zero; mode={} needs a direction", flag, layer,
                file, hooks::steer_mode_name(iv.mode));
    iv.direction[layer] = d;
    iv.sites.emplace_back(site, layer);
  }
  if (kv.count("target")) {
    double c = 0;
    try {
      c = std::stod(kv["target"]);
    } catch (const std::exception&) {
      DMI_FAIL("{}: target={} is not a number", flag, kv["target"]);
    }
    for (auto l : layers) iv.target[static_cast<int>(l)] = c;
  } else {
    for (const auto& [l, c] : v.target) iv.target[l] = c;
  }
  if (iv.mode == hooks::SteerMode::set)
    for (auto l : layers)
      DMI_CHECK(iv.target.count(static_cast<int>(l)), "{}: mode=set needs target.{} in {} or target=", flag, l, file);
  iv.positions = hooks::PositionSpec::parse(kv.count("pos") ? kv["pos"] : "all");
  if (iv.positions.kind == hooks::PositionSpec::Kind::after)
    iv.after_start = after_positions(iv.positions.text, m, prompts, r.only_seqs, flag);
  rec = file_record(file);
  rec["resolved_spec"] = abs_path(file) + r.spec.substr(items[0].size());
  rec["vector_format"] = v.format;
  return iv;
}

// heads=H for sites with a head axis; errors name the flag and the site.
std::vector<std::int64_t> parse_heads(const std::string& value, const std::vector<std::pair<Site, int>>& sites,
                                      const ModelView& m, const std::string& flag) {
  std::int64_t most = 0;
  for (auto [s, l] : sites) {
    const bool heads_site = s == Site::q || s == Site::k || s == Site::v || s == Site::rot_q || s == Site::rot_k ||
                            s == Site::z || s == Site::pattern || s == Site::attn_scores ||
                            s == Site::q_normalized || s == Site::k_normalized;
    DMI_CHECK(heads_site, "{}: heads= applies to z, q, k, v, rot_q, rot_k and pattern, not {}", flag,
              hooks::site_name(s, l));
    most = std::max(most, hooks::site_row_shape(s, m.config, 1)[0]);
  }
  std::vector<std::int64_t> heads;
  for (auto h : parse_index_set(value, most, "heads", flag)) heads.push_back(h);
  for (auto [s, l] : sites) {
    const auto shape = hooks::site_row_shape(s, m.config, 1);
    for (auto h : heads)
      DMI_CHECK(h < shape[0], "{}: head {} is out of range for {} ({} heads{})", flag, h, hooks::site_name(s, l),
                shape[0], shape[0] == m.config.num_kv_heads && s != Site::z ? ", key/value heads under GQA" : "");
  }
  return heads;
}

Intervention resolve_ablate(const InterventionRequest& r, const ModelView& m, json& rec) {
  const std::string flag = "--ablate " + r.spec;
  std::size_t at = std::string::npos;
  for (const char* method : {"=zero", "=mean:", "=posmean:", "=resample:"}) {
    const auto k = r.spec.rfind(method);
    if (k != std::string::npos && (at == std::string::npos || k > at)) at = k;
  }
  DMI_CHECK(at != std::string::npos && at > 0,
            "{}: expected SITE[,heads=..][,pos=..]=zero|mean:REF.h5|posmean:REF.h5|resample:REF.h5", flag);
  const std::string left = r.spec.substr(0, at), method = r.spec.substr(at + 1);
  const auto items = split_spec(left);
  auto kv = key_values(items, "--ablate", r.spec, {"heads", "pos"});
  Intervention iv;
  iv.label = flag;
  iv.sites = parse_sites(items[0], m.space, flag);
  DMI_CHECK(!iv.sites.empty(), "{}: {} selects no site", flag, items[0]);
  iv.positions = hooks::PositionSpec::parse(kv.count("pos") ? kv["pos"] : "all");
  DMI_CHECK(iv.positions.kind != hooks::PositionSpec::Kind::after, "{}: pos=after: applies to --steer only", flag);
  if (kv.count("heads")) iv.heads = parse_heads(kv["heads"], iv.sites, m, flag);
  rec = json::object();
  if (method == "zero") {
    iv.kind = Intervention::Kind::zero;
    rec["resolved_spec"] = r.spec;
    return iv;
  }
  iv.kind = Intervention::Kind::replace;
  const auto colon = method.find(':');
  const std::string how = method.substr(0, colon);
  std::string path = method.substr(colon + 1);
  std::optional<std::int32_t> fixed_seq;
  if (how == "resample") {
    // resample:REF.h5[:SEQ]
    const auto c2 = path.rfind(':');
    if (c2 != std::string::npos && path.find_first_not_of("0123456789", c2 + 1) == std::string::npos &&
        c2 + 1 < path.size()) {
      fixed_seq = std::stoi(path.substr(c2 + 1));
      path = path.substr(0, c2);
    }
  }
  auto ref = open_ref(path, m, flag);
  for (auto [s, l] : iv.sites) {
    DMI_CHECK(s != Site::pattern && s != Site::attn_scores, "{}: {} takes zero ablation only", flag,
              hooks::site_name(s, l));
    ref->site(s, l, m, flag);  // loads and checks now
  }
  const std::int32_t n_ref = static_cast<std::int32_t>(ref->file->n_sequences());
  if (fixed_seq) DMI_CHECK(*fixed_seq < n_ref, "{}: {} has no sequence {}", flag, path, *fixed_seq);
  std::map<std::string, at::Tensor> means;
  std::map<std::string, std::map<std::int64_t, at::Tensor>> pos_means;
  for (auto [s, l] : iv.sites) {
    const RefSite& rs = ref->site(s, l, m, flag);
    DMI_CHECK(rs.rows.size(0) > 0, "{}: {} has no rows of {}", flag, path, hooks::site_name(s, l));
    if (how == "mean") {
      means[hooks::site_name(s, l)] = rs.rows.mean(0);
    } else if (how == "posmean") {
      std::map<std::int64_t, std::vector<std::int64_t>> by_pos;
      for (const auto& [k, i] : rs.index) by_pos[k.second].push_back(i);
      for (const auto& [p, rows] : by_pos)
        pos_means[hooks::site_name(s, l)][p] = rs.rows.index_select(0, at::tensor(rows, at::kLong)).mean(0);
    }
  }
  if (how == "mean") {
    iv.value = [means, flag](Site s, int l, std::int32_t, std::int64_t) { return means.at(hooks::site_name(s, l)); };
  } else if (how == "posmean") {
    iv.value = [pos_means, flag, path](Site s, int l, std::int32_t, std::int64_t p) {
      const auto& byp = pos_means.at(hooks::site_name(s, l));
      auto it = byp.find(p);
      DMI_CHECK(it != byp.end(), "{}: {} has no rows of {} at position {}", flag, path, hooks::site_name(s, l), p);
      return it->second;
    };
  } else {
    DMI_CHECK(how == "resample", "{}: '{}' is not zero, mean:REF.h5, posmean:REF.h5 or resample:REF.h5", flag, method);
    iv.value = [ref, flag, path, fixed_seq, n_ref](Site s, int l, std::int32_t seq, std::int64_t p) {
      const std::int32_t src = fixed_seq ? *fixed_seq : (seq + 1) % n_ref;
      const RefSite& rs = ref->sites.at(hooks::site_name(s, l));
      auto it = rs.index.find({src, p});
      DMI_CHECK(it != rs.index.end(), "{}: {} has no row of {} for sequence {} position {}", flag, path,
                hooks::site_name(s, l), src, p);
      return rs.rows[it->second];
    };
  }
  rec = file_record(path);
  rec["resolved_spec"] = left + "=" + how + ":" + abs_path(path) + (fixed_seq ? ":" + std::to_string(*fixed_seq) : "");
  return iv;
}

Intervention resolve_patch(const InterventionRequest& r, const ModelView& m,
                           const std::vector<std::vector<std::int32_t>>& prompts, json& rec) {
  const std::string flag = "--patch " + r.spec;
  const auto items = split_spec(r.spec);
  auto kv = key_values(items, "--patch", r.spec, {"site", "pos", "src-seq", "src-pos", "heads"});
  const std::string path = items[0];
  auto ref = open_ref(path, m, flag);
  Intervention iv;
  iv.kind = Intervention::Kind::replace;
  iv.label = flag;
  if (kv.count("site")) {
    iv.sites = parse_sites(kv["site"], m.space, flag);
  } else {
    DMI_CHECK(ref->file->sites().size() == 1, "{}: {} has {} sites; name one with site=", flag, path,
              ref->file->sites().size());
    Site s;
    int l;
    DMI_CHECK(hooks::parse_site_name(ref->file->sites()[0].name, s, l), "{}: {}: unknown site", flag, path);
    iv.sites = {{s, l}};
  }
  for (auto [s, l] : iv.sites) ref->site(s, l, m, flag);
  if (kv.count("heads")) iv.heads = parse_heads(kv["heads"], iv.sites, m, flag);
  iv.positions = hooks::PositionSpec::parse(kv.count("pos") ? kv["pos"] : "all");
  DMI_CHECK(iv.positions.kind != hooks::PositionSpec::Kind::after, "{}: pos=after: applies to --steer only", flag);
  auto number = [&](const std::string& k) -> std::optional<std::int64_t> {
    if (!kv.count(k)) return std::nullopt;
    DMI_CHECK(kv[k].size() < 10 && kv[k].find_first_not_of("0123456789") == std::string::npos, "{}: {}={} is not a "
              "number", flag, k, kv[k]);
    return std::stoll(kv[k]);
  };
  const auto src_seq = number("src-seq"), src_pos = number("src-pos");
  if (src_seq)
    DMI_CHECK(*src_seq < static_cast<std::int64_t>(ref->file->n_sequences()), "{}: {} has no sequence {}", flag, path,
              *src_seq);
  // Prompt positions can be checked now; generated ones when they come.
  for (std::size_t s = 0; s < prompts.size() && iv.positions.kind != hooks::PositionSpec::Kind::generated; ++s) {
    if (r.only_seqs && !r.only_seqs->count(static_cast<std::int32_t>(s))) continue;
    for (auto [site, l] : iv.sites) {
      const RefSite& rs = ref->sites.at(hooks::site_name(site, l));
      for (std::int64_t p = 0; p < static_cast<std::int64_t>(prompts[s].size()); ++p) {
        if (!iv.positions.selects(p, static_cast<std::int64_t>(prompts[s].size()))) continue;
        const std::pair<std::int32_t, std::int64_t> key{src_seq ? static_cast<std::int32_t>(*src_seq)
                                                                : static_cast<std::int32_t>(s),
                                                        src_pos ? *src_pos : p};
        DMI_CHECK(rs.index.count(key), "{}: {} has no row of {} for sequence {} position {}", flag, path,
                  hooks::site_name(site, l), key.first, key.second);
      }
    }
  }
  iv.value = [ref, flag, path, src_seq, src_pos](Site s, int l, std::int32_t seq, std::int64_t p) {
    const RefSite& rs = ref->sites.at(hooks::site_name(s, l));
    const std::pair<std::int32_t, std::int64_t> key{src_seq ? static_cast<std::int32_t>(*src_seq) : seq,
                                                    src_pos ? *src_pos : p};
    auto it = rs.index.find(key);
    DMI_CHECK(it != rs.index.end(), "{}: {} has no row of {} for sequence {} position {}", flag, path,
              hooks::site_name(s, l), key.first, key.second);
    return rs.rows[it->second];
  };
  rec = file_record(path);
  rec["resolved_spec"] = abs_path(path) + r.spec.substr(items[0].size());
  return iv;
}

}  // namespace

void check_intervention_syntax(const InterventionRequest& r) {
  DMI_CHECK(r.kind == "steer" || r.kind == "ablate" || r.kind == "patch", "unknown intervention '{}'", r.kind);
  DMI_CHECK(!r.spec.empty(), "--{} needs a value (see --help)", r.kind);
  if (r.kind == "steer") {
    const auto items = split_spec(r.spec);
    auto kv = key_values(items, "--steer", r.spec, {"scale", "layers", "pos", "mode", "site", "target"});
    if (kv.count("mode")) hooks::parse_steer_mode(kv["mode"]);
    if (kv.count("pos")) hooks::PositionSpec::parse(kv["pos"]);
    if (kv.count("site")) residual_site(kv["site"], "--steer " + r.spec);
  }
}

ResolvedInterventions resolve_interventions(const std::vector<InterventionRequest>& requests, const ModelView& m,
                                            const std::vector<std::vector<std::int32_t>>& prompts) {
  ResolvedInterventions out;
  json record = json::array();
  for (const auto& r : requests) {
    check_intervention_syntax(r);
    json rec;
    Intervention iv = r.kind == "steer"    ? resolve_steer(r, m, prompts, rec)
                      : r.kind == "ablate" ? resolve_ablate(r, m, rec)
                                           : resolve_patch(r, m, prompts, rec);
    iv.only_seqs = r.only_seqs;
    rec["kind"] = r.kind;
    rec["spec"] = r.spec;
    rec["sequences"] = r.only_seqs ? json(std::vector<std::int32_t>(r.only_seqs->begin(), r.only_seqs->end())) : json();
    record.push_back(rec);
    out.list.push_back(std::move(iv));
  }
  out.record_json = record.dump();
  return out;
}

std::vector<InterventionRequest> recorded_interventions(const std::string& json_text, const std::string& capture_path,
                                                        bool allow_changed) {
  std::vector<InterventionRequest> out;
  if (json_text.empty()) return out;
  const json j = json::parse(json_text, nullptr, false);
  DMI_CHECK(j.is_array(), "{}: root attribute 'interventions' is not a JSON array: corrupt capture", capture_path);
  for (const auto& e : j) {
    DMI_CHECK(e.is_object() && e.contains("kind") && e.contains("resolved_spec"),
              "{}: an entry of 'interventions' lacks kind or resolved_spec: corrupt capture", capture_path);
    if (e.contains("file") && !allow_changed) {
      const std::string file = e["file"].get<std::string>();
      std::string now;
      try {
        now = io::xxh3_128_file(file);
      } catch (const Error&) {
        DMI_FAIL("{}: the {} file {} recorded in {} cannot be read", file, e["kind"].get<std::string>(), file,
                 capture_path);
      }
      DMI_CHECK(now == e.value("file_hash", std::string()),
                "{}: the {} file changed since {} was captured (recorded {}, now {}); pass --allow-mismatch to "
                "replay anyway", file, e["kind"].get<std::string>(), capture_path, e.value("file_hash", std::string()),
                now);
    }
    InterventionRequest r;
    r.kind = e["kind"].get<std::string>();
    r.spec = e["resolved_spec"].get<std::string>();
    if (e.contains("sequences") && e["sequences"].is_array()) {
      std::set<std::int32_t> s;
      for (const auto& x : e["sequences"]) s.insert(x.get<std::int32_t>());
      r.only_seqs = s;
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace dmi::engine
