#include "analysis/stats.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <fnmatch.h>

#include <cmath>
#include <map>

#include "common/error.h"

namespace dmi::analysis {

void StatsAccumulator::add(const at::Tensor& values, const at::Tensor& mask) {
  at::Tensor v = values.to(at::kDouble).reshape({-1});
  if (mask.defined()) v = v.masked_select(mask.reshape({-1}));
  at::Tensor nan = at::isnan(v);
  at::Tensor inf = at::isinf(v);
  nan_ += nan.sum().item<std::int64_t>();
  inf_ += inf.sum().item<std::int64_t>();
  v = v.masked_select(at::logical_not(nan.logical_or(inf)));
  const std::int64_t n = v.numel();
  if (n == 0) return;
  const double bmean = v.mean().item<double>();
  const double bm2 = (v - bmean).pow(2).sum().item<double>();
  const double bmin = v.min().item<double>(), bmax = v.max().item<double>();
  sumsq_ += v.pow(2).sum().item<double>();
  if (n_ == 0) {
    min_ = bmin;
    max_ = bmax;
  } else {
    min_ = std::min(min_, bmin);
    max_ = std::max(max_, bmax);
  }
  // Chan et al.'s parallel combination of (count, mean, M2).
  const double delta = bmean - mean_;
  const std::int64_t total = n_ + n;
  mean_ += delta * n / total;
  m2_ += bm2 + delta * delta * static_cast<double>(n_) * n / total;
  n_ = total;
}

Stats StatsAccumulator::result() const {
  Stats s;
  s.count = n_;
  s.nan = nan_;
  s.inf = inf_;
  if (n_ == 0) return s;
  s.mean = mean_;
  s.std = std::sqrt(m2_ / n_);
  s.rms = std::sqrt(sumsq_ / n_);
  s.min = min_;
  s.max = max_;
  return s;
}

std::vector<std::string> match_sites(const sink::CaptureFile& f, const std::string& glob) {
  std::vector<std::string> out;
  for (const auto& s : f.sites())
    if (fnmatch(glob.c_str(), s.name.c_str(), 0) == 0) out.push_back(s.name);
  if (out.empty()) f.site(glob);  // throws with suggestions
  return out;
}

GroupBy parse_group_by(const std::string& s) {
  if (s.empty() || s == "none" || s == "site") return GroupBy::none;
  if (s == "layer") return GroupBy::layer;
  if (s == "seq") return GroupBy::seq;
  if (s == "pos") return GroupBy::pos;
  DMI_FAIL("--by '{}' is not one of layer, seq, pos", s);
}

at::Tensor attention_mask(const std::vector<std::int32_t>& pos, std::int64_t heads, std::int64_t width) {
  at::Tensor p = at::tensor(std::vector<std::int64_t>(pos.begin(), pos.end()), at::kLong).view({-1, 1, 1});
  at::Tensor k = at::arange(width, at::kLong).view({1, 1, width});
  return (k <= p).expand({static_cast<std::int64_t>(pos.size()), heads, width});
}

std::vector<std::pair<std::string, Stats>> site_stats(const sink::CaptureFile& f, const std::vector<std::string>& sites,
                                                      GroupBy by) {
  std::map<std::int64_t, StatsAccumulator> groups;  // key: layer, seq or pos
  std::vector<std::pair<std::string, Stats>> out;
  constexpr std::int64_t kBlockBytes = 64 << 20;
  for (const auto& name : sites) {
    const auto& e = f.site(name);
    std::int64_t per_row = 4;
    for (auto d : e.row_shape) per_row *= d;
    const std::int64_t block = std::max<std::int64_t>(1, kBlockBytes / per_row);
    const auto& seq = f.seq_of(name);
    const auto& pos = f.pos_of(name);
    StatsAccumulator site_acc;
    for (std::int64_t b = 0; b < e.rows; b += block) {
      const std::int64_t n = std::min(block, e.rows - b);
      at::Tensor x = f.read_block(name, b, n);
      std::vector<std::int32_t> bpos(pos.begin() + b, pos.begin() + b + n);
      at::Tensor mask = e.layout == "attention" ? attention_mask(bpos, e.row_shape[0], e.row_shape[1]) : at::Tensor();
      if (by == GroupBy::none) {
        site_acc.add(x, mask);
      } else if (by == GroupBy::layer) {
        groups[e.layer].add(x, mask);
      } else {
        for (std::int64_t r = 0; r < n; ++r)
          groups[by == GroupBy::seq ? seq[b + r] : pos[b + r]].add(x[r], mask.defined() ? mask[r] : at::Tensor());
      }
    }
    if (by == GroupBy::none) out.emplace_back(name, site_acc.result());
  }
  if (by == GroupBy::none) return out;
  const char* label = by == GroupBy::layer ? "layer" : by == GroupBy::seq ? "seq" : "pos";
  for (const auto& [k, acc] : groups) out.emplace_back(k < 0 && by == GroupBy::layer ? std::string("global") : fmt::format("{} {}", label, k), acc.result());
  return out;
}

}  // namespace dmi::analysis
