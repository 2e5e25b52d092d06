#include "analysis/diff.h"

#include <ATen/ATen.h>
#include <fnmatch.h>

#include <algorithm>
#include <map>
#include <set>

#include "analysis/stats.h"

namespace dmi::analysis {

bool DiffReport::equal() const {
  if (sequences_only_a || sequences_only_b || !sites_only_a.empty() || !sites_only_b.empty()) return false;
  for (const auto& s : sequences)
    if (!s.equal) return false;
  for (const auto& s : sites)
    if (!s.equal()) return false;
  return true;
}

namespace {

SiteDiff compare_site(const sink::CaptureFile& fa, const sink::CaptureFile& fb, const std::string& name,
                      const DiffOptions& o) {
  SiteDiff d;
  d.site = name;
  const auto& ea = fa.site(name);
  const auto& eb = fb.site(name);
  // Attention rows are as wide as each file's longest sequence: compare the
  // common key positions (entries past pos are padding in both).
  const bool attention = ea.layout == "attention" && eb.layout == "attention";
  if (ea.layout != eb.layout || (!attention && ea.row_shape != eb.row_shape) ||
      (attention && ea.row_shape[0] != eb.row_shape[0])) {
    d.shape_mismatch = true;
    return d;
  }
  std::map<std::pair<std::int32_t, std::int32_t>, std::int64_t> rows_b;
  const auto& sb = fb.seq_of(name);
  const auto& pb = fb.pos_of(name);
  auto selected = [&](std::int32_t seq) { return o.seqs.empty() || o.seqs.count(seq) != 0; };
  for (std::size_t i = 0; i < sb.size(); ++i)
    if (selected(sb[i])) rows_b[{sb[i], pb[i]}] = static_cast<std::int64_t>(i);
  const auto& sa = fa.seq_of(name);
  const auto& pa = fa.pos_of(name);
  std::vector<std::int64_t> ra, rb;
  std::vector<std::pair<std::int32_t, std::int32_t>> keys;
  std::set<std::pair<std::int32_t, std::int32_t>> seen;
  for (std::size_t i = 0; i < sa.size(); ++i) {
    if (!selected(sa[i])) continue;
    auto k = std::make_pair(sa[i], pa[i]);
    seen.insert(k);
    auto it = rows_b.find(k);
    if (it == rows_b.end()) {
      ++d.rows_only_a;
      continue;
    }
    ra.push_back(static_cast<std::int64_t>(i));
    rb.push_back(it->second);
    keys.push_back(k);
  }
  for (const auto& [k, r] : rows_b)
    if (!seen.count(k)) ++d.rows_only_b;
  // Compare in (seq, pos) order, in blocks.
  std::vector<std::size_t> order(keys.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](auto x, auto y) { return keys[x] < keys[y]; });
  std::int64_t per_row = 1;
  for (auto x : ea.row_shape) per_row *= x;
  const std::size_t block = static_cast<std::size_t>(std::max<std::int64_t>(1, (16 << 20) / std::max<std::int64_t>(per_row, 1)));
  double sum_abs = 0, sum_sq_diff = 0, sum_sq_a = 0, dot = 0, sum_sq_b = 0;
  std::int64_t n = 0;
  for (std::size_t s = 0; s < order.size(); s += block) {
    std::vector<std::int64_t> ba, bb;
    std::vector<std::int32_t> bpos;
    for (std::size_t i = s; i < std::min(order.size(), s + block); ++i) {
      ba.push_back(ra[order[i]]);
      bb.push_back(rb[order[i]]);
      bpos.push_back(keys[order[i]].second);
    }
    at::Tensor ra32 = fa.read_rows(name, ba), rb32 = fb.read_rows(name, bb);
    if (attention) {
      const std::int64_t w = std::min(ra32.size(2), rb32.size(2));
      ra32 = ra32.narrow(2, 0, w).contiguous();
      rb32 = rb32.narrow(2, 0, w).contiguous();
    }
    at::Tensor xa = ra32.to(at::kDouble), xb = rb32.to(at::kDouble);
    // Identical entries (including equal infinities and NaN pairs) match;
    // bitwise, only identical bit patterns do.
    at::Tensor same = o.bitwise ? ra32.view(at::kInt).eq(rb32.view(at::kInt))
                                : xa.eq(xb).logical_or(at::isnan(xa).logical_and(at::isnan(xb)));
    at::Tensor fin = at::isfinite(xa).logical_and(at::isfinite(xb));
    at::Tensor diff = (xa - xb).abs().masked_fill(at::logical_not(fin), 0.0);
    at::Tensor tol = o.atol + o.rtol * xb.abs().masked_fill(at::logical_not(fin), 0.0);
    at::Tensor bad = o.bitwise ? same.logical_not()
                               : same.logical_not().logical_and(fin.logical_not().logical_or(diff > tol));
    const std::int64_t nbad = bad.sum().item<std::int64_t>();
    if (nbad > 0 && !d.first_mismatch) {
      at::Tensor row_bad = bad.reshape({bad.size(0), -1}).any(1);
      const std::int64_t r = row_bad.nonzero()[0][0].item<std::int64_t>();
      d.first_mismatch = keys[order[s + r]];
    }
    d.mismatches += nbad;
    at::Tensor fa_ = xa.masked_fill(at::logical_not(fin), 0.0), fb_ = xb.masked_fill(at::logical_not(fin), 0.0);
    d.max_abs = std::max(d.max_abs, diff.max().item<double>());
    d.max_ref = std::max(d.max_ref, fb_.abs().max().item<double>());
    sum_abs += diff.sum().item<double>();
    sum_sq_diff += diff.pow(2).sum().item<double>();
    sum_sq_a += fa_.pow(2).sum().item<double>();
    sum_sq_b += fb_.pow(2).sum().item<double>();
    dot += (fa_ * fb_).sum().item<double>();
    n += fin.sum().item<std::int64_t>();
  }
  d.rows = static_cast<std::int64_t>(keys.size());
  if (n > 0) {
    d.mean_abs = sum_abs / n;
    d.nmse = sum_sq_a > 0 ? sum_sq_diff / sum_sq_a : (sum_sq_diff > 0 ? INFINITY : 0.0);
    d.cosine = (sum_sq_a > 0 && sum_sq_b > 0) ? dot / std::sqrt(sum_sq_a * sum_sq_b) : (sum_sq_a == sum_sq_b ? 1.0 : 0.0);
  }
  return d;
}

}  // namespace

DiffReport diff_captures(const sink::CaptureFile& a, const sink::CaptureFile& b, const DiffOptions& opts) {
  DiffReport r;
  const std::size_t na = a.n_sequences(), nb = b.n_sequences();
  // Sequences a replay left out ("skipped") are not compared.
  DiffOptions o = opts;
  for (std::size_t s = 0; s < std::min(na, nb); ++s)
    if (a.finish_reason(s) == "skipped" || b.finish_reason(s) == "skipped") r.skipped.push_back(s);
  if (!r.skipped.empty()) {
    if (o.seqs.empty())
      for (std::size_t s = 0; s < std::max(na, nb); ++s) o.seqs.insert(static_cast<std::int32_t>(s));
    for (auto s : r.skipped) o.seqs.erase(static_cast<std::int32_t>(s));
    if (o.seqs.empty()) o.seqs.insert(-1);  // everything skipped: compare no row
  }
  for (std::size_t s = 0; s < std::min(na, nb); ++s) {
    if (!o.seqs.empty() && !o.seqs.count(static_cast<std::int32_t>(s))) continue;
    SequenceDiff sd;
    sd.seq = s;
    auto ta = a.tokens(s), tb = b.tokens(s);
    const auto pa = static_cast<std::size_t>(a.prompt_length(s)), pb = static_cast<std::size_t>(b.prompt_length(s));
    if (pa != pb || !std::equal(ta.begin(), ta.begin() + pa, tb.begin(), tb.begin() + pb)) {
      sd.equal = false;
      sd.prompt_differs = true;
    } else if (ta != tb) {
      sd.equal = false;
      std::size_t i = pa;
      while (i < ta.size() && i < tb.size() && ta[i] == tb[i]) ++i;
      sd.first_generated_diff = i - pa;
      sd.token_a = i < ta.size() ? ta[i] : -1;
      sd.token_b = i < tb.size() ? tb[i] : -1;
    }
    r.sequences.push_back(sd);
  }
  r.sequences_only_a = na > nb ? na - nb : 0;
  r.sequences_only_b = nb > na ? nb - na : 0;
  auto matches = [&](const std::string& n) { return fnmatch(o.sites_glob.c_str(), n.c_str(), 0) == 0; };
  for (const auto& s : a.sites()) {
    if (!matches(s.name)) continue;
    if (!b.has_site(s.name)) r.sites_only_a.push_back(s.name);
    else r.sites.push_back(compare_site(a, b, s.name, o));
  }
  for (const auto& s : b.sites())
    if (matches(s.name) && !a.has_site(s.name)) r.sites_only_b.push_back(s.name);
  return r;
}

}  // namespace dmi::analysis
