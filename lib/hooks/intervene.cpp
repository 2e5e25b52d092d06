#include "hooks/intervene.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include <chrono>
#include <limits>

#include "common/error.h"

namespace dmi::hooks {

namespace {

std::int64_t parse_index(const std::string& s, const std::string& whole) {
  DMI_CHECK(!s.empty() && s.size() < 10 && s.find_first_not_of("0123456789") == std::string::npos,
            "pos={}: '{}' is not a position (0-based)", whole, s);
  return std::stoll(s);
}

bool head_site(Site s) {
  switch (s) {
    case Site::q:
    case Site::k:
    case Site::v:
    case Site::q_normalized:
    case Site::k_normalized:
    case Site::rot_q:
    case Site::rot_k:
    case Site::z:
    case Site::attn_scores:
    case Site::pattern: return true;
    default: return false;
  }
}

bool attention_layout(Site s) { return s == Site::attn_scores || s == Site::pattern; }

}  // namespace

PositionSpec PositionSpec::parse(const std::string& s) {
  PositionSpec p;
  if (s == "all") return p;
  if (s == "prompt") {
    p.kind = Kind::prompt;
    return p;
  }
  if (s == "generated") {
    p.kind = Kind::generated;
    return p;
  }
  if (s == "last-prompt") {
    p.kind = Kind::last_prompt;
    return p;
  }
  if (s.rfind("after:", 0) == 0) {
    p.kind = Kind::after;
    p.text = s.substr(6);
    DMI_CHECK(!p.text.empty(), "pos=after: needs a text (pos=after:TEXT)");
    return p;
  }
  p.kind = Kind::ranges;
  std::size_t i = 0;
  while (i <= s.size()) {
    std::size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    const std::string item = s.substr(i, j - i);
    if (auto c = item.find(':'); c != std::string::npos) {
      const std::int64_t a = parse_index(item.substr(0, c), s), b = parse_index(item.substr(c + 1), s);
      DMI_CHECK(a < b, "pos={}: range {} is empty (a:b means a <= pos < b)", s, item);
      p.ranges.emplace_back(a, b);
    } else {
      const std::int64_t a = parse_index(item, s);
      p.ranges.emplace_back(a, a + 1);
    }
    i = j + 1;
  }
  return p;
}

bool PositionSpec::selects(std::int64_t p, std::int64_t plen, std::int64_t after_start) const {
  switch (kind) {
    case Kind::all: return true;
    case Kind::prompt: return p < plen;
    case Kind::generated: return p >= plen;
    case Kind::last_prompt: return p == plen - 1;
    case Kind::ranges:
      for (auto [a, e] : ranges)
        if (p >= a && p < e) return true;
      return false;
    case Kind::after: return after_start >= 0 && p >= after_start;
  }
  return false;
}

SteerMode parse_steer_mode(const std::string& s) {
  if (s == "add") return SteerMode::add;
  if (s == "normadd") return SteerMode::normadd;
  if (s == "set") return SteerMode::set;
  if (s == "ablate") return SteerMode::ablate;
  DMI_FAIL("mode={} is not one of add, normadd, set, ablate", s);
}

const char* steer_mode_name(SteerMode m) {
  switch (m) {
    case SteerMode::add: return "add";
    case SteerMode::normadd: return "normadd";
    case SteerMode::set: return "set";
    case SteerMode::ablate: return "ablate";
  }
  return "?";
}

Intervener::Intervener(std::vector<Intervention> interventions, std::vector<std::int64_t> prompt_len)
    : list_(std::move(interventions)), prompt_len_(std::move(prompt_len)), writes_(static_cast<int>(Site::kCount)) {
  for (const auto& iv : list_)
    for (auto [site, layer] : iv.sites) writes_[static_cast<int>(site)].insert(layer < 0 ? -1 : layer);
  mask_ready_.assign(list_.size(), false);
  masks_.resize(list_.size());
}

void Intervener::begin_forward(const ForwardInfo&) {
  std::fill(mask_ready_.begin(), mask_ready_.end(), false);
}

const at::Tensor& Intervener::mask(std::size_t i, const ForwardInfo& info) {
  if (mask_ready_[i]) return masks_[i];
  mask_ready_[i] = true;
  const Intervention& iv = list_[i];
  masks_[i] = at::Tensor();
  if (iv.positions.kind == PositionSpec::Kind::all && !iv.only_seqs) return masks_[i];
  const std::int64_t B = info.positions.size(0), T = info.positions.size(1);
  at::Tensor m = at::zeros({B, T}, at::kBool);
  auto ma = m.accessor<bool, 2>();
  auto pa = info.positions.accessor<std::int64_t, 2>();
  auto va = info.valid.accessor<bool, 2>();
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int32_t seq = info.seq[b];
    if (iv.only_seqs && !iv.only_seqs->count(seq)) continue;
    const std::int64_t plen = seq >= 0 && static_cast<std::size_t>(seq) < prompt_len_.size() ? prompt_len_[seq] : 0;
    for (std::int64_t t = 0; t < T; ++t) {
      if (!va[b][t]) continue;
      const std::int64_t p = pa[b][t];
      auto it = iv.after_start.find(seq);
      ma[b][t] = iv.positions.selects(p, plen, it == iv.after_start.end() ? -1 : it->second);
    }
  }
  masks_[i] = m;
  return masks_[i];
}

at::Tensor Intervener::intervene(Site site, int layer, const at::Tensor& t, const ForwardInfo& info) {
  const auto t0 = std::chrono::steady_clock::now();
  at::Tensor x = t;
  for (std::size_t i = 0; i < list_.size(); ++i) {
    const auto& iv = list_[i];
    bool here = false;
    for (auto [s, l] : iv.sites) here = here || (s == site && l == layer);
    if (here) x = apply(iv, i, site, layer, x, info);
  }
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return x;
}

at::Tensor Intervener::apply(const Intervention& iv, std::size_t i, Site site, int layer, const at::Tensor& t,
                             const ForwardInfo& info) {
  const at::Tensor& m = mask(i, info);  // [B, T] or undefined (every token)
  const bool attention = attention_layout(site);
  // The mask broadcast to t: [B, T, 1...] or, for attention sites, [B, 1, T, 1].
  auto expand = [&](const at::Tensor& mm) {
    if (attention) return mm.view({mm.size(0), 1, mm.size(1), 1});
    std::vector<std::int64_t> shape{mm.size(0), mm.size(1)};
    for (std::int64_t d = 2; d < t.dim(); ++d) shape.push_back(1);
    return mm.view(shape);
  };
  if (iv.kind == Intervention::Kind::steer) {
    if (iv.scale == 0.0 && (iv.mode == SteerMode::add || iv.mode == SteerMode::normadd)) return t;
    auto it = iv.direction.find(layer);
    if (it == iv.direction.end()) return t;
    // Float32 arithmetic whatever the model's dtype, then back.
    const at::Tensor x = t.to(at::kFloat);
    const at::Tensor& v = it->second;
    at::Tensor y;
    switch (iv.mode) {
      case SteerMode::add: y = x + iv.scale * v; break;
      case SteerMode::normadd: y = x + (iv.scale * at::linalg_vector_norm(x, 2, {-1}, true)) * (v / v.norm()); break;
      case SteerMode::set: {
        const at::Tensor u = v / v.norm();
        auto c = iv.target.find(layer);
        DMI_CHECK(c != iv.target.end(), "{}: mode=set needs target.{} in the file or target=", iv.label, layer);
        y = x + (c->second - (x * u).sum(-1, true)) * u;
        break;
      }
      case SteerMode::ablate: {
        const at::Tensor u = v / v.norm();
        y = x - (x * u).sum(-1, true) * u;
        break;
      }
    }
    y = y.to(t.scalar_type());
    return m.defined() ? at::where(expand(m), y, t) : y;
  }
  // Head selection: heads are dim 2 of [B, T, H, D], dim 1 of [B, H, T, L].
  at::Tensor sel = m.defined() ? expand(m) : at::ones({1}, at::kBool);
  if (!iv.heads.empty() && head_site(site)) {
    const std::int64_t H = attention ? t.size(1) : t.size(2);
    at::Tensor hm = at::zeros({H}, at::kBool);
    for (auto h : iv.heads) {
      DMI_CHECK(h >= 0 && h < H, "{}: head {} is out of range ({} has {} heads)", iv.label, h, site_name(site, layer), H);
      hm[h] = true;
    }
    sel = sel.logical_and(attention ? hm.view({1, H, 1, 1}) : hm.view({1, 1, H, 1}));
  }
  if (iv.kind == Intervention::Kind::zero) return at::where(sel, at::zeros({}, t.options()), t);
  // replace: the rows from value(), token by token.
  at::Tensor r = t.clone();
  auto pa = info.positions.accessor<std::int64_t, 2>();
  auto va = info.valid.accessor<bool, 2>();
  const bool* mp = m.defined() ? m.data_ptr<bool>() : nullptr;
  const std::int64_t B = t.size(0), T = info.positions.size(1);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t tt = 0; tt < T; ++tt) {
      if (!va[b][tt] || (mp && !mp[b * T + tt])) continue;
      const std::int64_t p = pa[b][tt];
      const at::Tensor v = iv.value(site, layer, info.seq[b], p);
      if (!attention) {
        r[b][tt].copy_(v.view(t[b][tt].sizes()));
        continue;
      }
      // Attention rows [H, W] are indexed by key position; the live row
      // [H, L] by cache column, which is position + left padding.
      const std::int64_t H = t.size(1), L = t.size(3), pad = info.start + tt - p;
      DMI_CHECK(v.dim() == 2 && v.size(0) == H && v.size(1) > p, "{}: the row for {} at position {} has shape [{}], "
                "want [{}, at least {}]", iv.label, site_name(site, layer), p, fmt::join(v.sizes(), ", "), H, p + 1);
      at::Tensor dst = r[b].select(1, tt);
      dst.fill_(site == Site::attn_scores ? -std::numeric_limits<float>::infinity() : 0.0);
      const std::int64_t n = std::min(L - pad, v.size(1));
      dst.narrow(1, pad, n).copy_(v.narrow(1, 0, n));
    }
  if (iv.heads.empty() || !head_site(site)) return r;
  return at::where(sel, r, t);
}

void HookChain::begin_forward(const ForwardInfo& info) {
  if (iv_) iv_->begin_forward(info);
  if (cap_) cap_->begin_forward(info);
}

at::Tensor HookChain::intervene(Site site, int layer, const at::Tensor& t, const ForwardInfo& info) {
  if (before_ && cap_ && cap_->wants(site, layer)) cap_->observe(site, layer, t, info);
  return iv_->intervene(site, layer, t, info);
}

}  // namespace dmi::hooks
