#include "analysis/attn_tracker.h"

#include <ATen/ATen.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "common/error.h"

namespace dmi::analysis {

std::vector<TrackerHead> read_tracker_heads(const std::string& path) {
  std::ifstream in(path);
  DMI_CHECK(in, "{}: cannot read the heads file", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    DMI_FAIL("{}: not JSON ({})", path, e.what());
  }
  DMI_CHECK(j.is_array() && !j.empty(), "{}: expected a non-empty list [[layer, head], ...]", path);
  std::vector<TrackerHead> out;
  for (std::size_t i = 0; i < j.size(); ++i) {
    const auto& e = j[i];
    DMI_CHECK(e.is_array() && e.size() == 2 && e[0].is_number_integer() && e[1].is_number_integer() &&
                  e[0].get<std::int64_t>() >= 0 && e[0].get<std::int64_t>() < 100000 && e[1].get<std::int64_t>() >= 0 &&
                  e[1].get<std::int64_t>() < 100000,
              "{}: entry {} is {}; each entry is [layer, head] (two integers from 0)", path, i,
              e.dump().substr(0, 60));
    out.push_back({static_cast<int>(e[0].get<std::int64_t>()), e[1].get<std::int64_t>()});
  }
  return out;
}

void write_tracker_heads(const std::string& path, const std::vector<TrackerHead>& heads) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& h : heads) j.push_back({h.layer, h.head});
  std::ofstream out(path, std::ios::trunc);
  DMI_CHECK(out, "{}: cannot write", path);
  out << j.dump() << "\n";
  DMI_CHECK(out.good(), "{}: write failed (disk full?)", path);
}

TokenSpan TokenSpan::parse(const std::string& s, const std::string& flag) {
  DMI_CHECK(!s.empty(), "{}: empty span (A:B token positions, or marker text)", flag);
  TokenSpan t;
  const auto colon = s.find(':');
  const bool range = colon != std::string::npos && s.find(':', colon + 1) == std::string::npos &&
                     s.find_first_not_of("0123456789:") == std::string::npos && s.size() > 1;
  if (!range) {
    t.marker = s;
    return t;
  }
  const std::string a = s.substr(0, colon), b = s.substr(colon + 1);
  DMI_CHECK(a.size() < 10 && b.size() < 10, "{}: {} is out of range", flag, s);
  t.begin = a.empty() ? 0 : std::stoll(a);
  t.end = b.empty() ? -1 : std::stoll(b);
  DMI_CHECK(t.end < 0 || t.begin < t.end, "{}: {} is an empty range", flag, s);
  return t;
}

std::pair<std::int64_t, std::int64_t> TokenSpan::resolve(const std::vector<std::int32_t>& prompt,
                                                         const io::Tokenizer* tok, std::size_t seq,
                                                         const std::string& flag) const {
  const auto n = static_cast<std::int64_t>(prompt.size());
  if (marker.empty()) {
    const std::int64_t e = end < 0 ? n : end;
    DMI_CHECK(begin < e && e <= n, "{} {}:{}: sequence {} has a prompt of {} tokens", flag, begin,
              end < 0 ? std::string() : std::to_string(end), seq, n);
    return {begin, e};
  }
  DMI_CHECK(tok, "{} '{}': marker spans need the tokenizer (--tokenizer)", flag, marker);
  // Character offsets of each token boundary in the decoded prompt.
  std::vector<std::size_t> at{0};
  for (std::int64_t i = 1; i <= n; ++i)
    at.push_back(tok->decode(std::vector<std::int32_t>(prompt.begin(), prompt.begin() + i)).size());
  const std::string text = tok->decode(prompt);
  const auto p = text.find(marker);
  DMI_CHECK(p != std::string::npos, "{} '{}': not in the prompt of sequence {}", flag, marker, seq);
  std::int64_t b = 0, e = n;
  while (b < n && at[b + 1] <= p) ++b;
  for (std::int64_t i = b; i <= n; ++i)
    if (at[i] >= p + marker.size()) {
      e = i;
      break;
    }
  return {b, std::max(e, b + 1)};
}

double tracker_focus(const float* row, std::int64_t width, std::pair<std::int64_t, std::int64_t> inst,
                     std::pair<std::int64_t, std::int64_t> data) {
  auto sum = [&](std::pair<std::int64_t, std::int64_t> s) {
    double acc = 0;
    for (std::int64_t k = s.first; k < s.second && k < width; ++k) acc += row[k];
    return acc;
  };
  const double i = sum(inst), d = sum(data);
  return i / (i + d);
}

double attention_entropy(const float* row, std::int64_t n) {
  double h = 0;
  for (std::int64_t k = 0; k < n; ++k)
    if (row[k] > 0) h -= static_cast<double>(row[k]) * std::log(static_cast<double>(row[k]));
  return h;
}

namespace {

// Per sequence and layer: the pattern row [H, W] of the last prompt token.
class PatternRows {
 public:
  explicit PatternRows(const sink::CaptureFile& f) : f_(f) {}
  const at::Tensor& get(int layer, std::size_t seq) {
    auto key = std::make_pair(layer, seq);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    const std::string site = fmt::format("blocks.{}.attn.hook_pattern", layer);
    DMI_CHECK(f_.has_site(site), "{}: no site {} (capture it with dmi-run --hooks pattern --tokens last-prompt)",
              f_.path(), site);
    const std::int32_t q = f_.prompt_length(seq) - 1;
    auto rows = f_.find_rows(site, static_cast<std::int32_t>(seq), q, q + 1);
    DMI_CHECK(!rows.empty(), "{}: {} has no row for sequence {} at its last prompt position {}", f_.path(), site, seq,
              q);
    return cache_.emplace(key, f_.read_rows(site, rows)[0].contiguous()).first->second;
  }

 private:
  const sink::CaptureFile& f_;
  std::map<std::pair<int, std::size_t>, at::Tensor> cache_;
};

double focus(const at::Tensor& row, std::int64_t h, std::pair<std::int64_t, std::int64_t> inst,
             std::pair<std::int64_t, std::int64_t> data, const std::string& path) {
  DMI_CHECK(h < row.size(0), "{}: head {} is out of range ({} heads)", path, h, row.size(0));
  return tracker_focus(row.data_ptr<float>() + h * row.size(1), row.size(1), inst, data);
}

std::vector<std::int32_t> prompt_of(const sink::CaptureFile& f, std::size_t seq) {
  auto t = f.tokens(seq);
  t.resize(static_cast<std::size_t>(f.prompt_length(seq)));
  return t;
}

}  // namespace

std::vector<TrackerSequence> attention_tracker(const sink::CaptureFile& f, const io::Tokenizer* tok,
                                               const TrackerOptions& o, const std::vector<std::size_t>& seqs) {
  DMI_CHECK(!o.heads.empty(), "no heads to track");
  std::vector<std::size_t> which = seqs;
  if (which.empty())
    for (std::size_t s = 0; s < f.n_sequences(); ++s) which.push_back(s);
  PatternRows rows(f);
  std::vector<TrackerSequence> out;
  for (std::size_t s : which) {
    DMI_CHECK(s < f.n_sequences(), "{}: no sequence {} ({} sequences)", f.path(), s, f.n_sequences());
    const auto prompt = prompt_of(f, s);
    TrackerSequence r;
    r.seq = s;
    r.query_pos = static_cast<std::int64_t>(prompt.size()) - 1;
    r.inst = o.inst.resolve(prompt, tok, s, "--inst");
    r.data = o.data.resolve(prompt, tok, s, "--data");
    for (const auto& h : o.heads) r.a.push_back(focus(rows.get(h.layer, s), h.head, r.inst, r.data, f.path()));
    for (double a : r.a) r.score += a;
    r.score /= static_cast<double>(r.a.size());
    r.flagged = r.score <= o.threshold;
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<HeadSeparation> separate_heads(const sink::CaptureFile& benign, const sink::CaptureFile& attack,
                                           const io::Tokenizer* tok, const TokenSpan& inst, const TokenSpan& data) {
  // Layers with patterns in both files; heads from the row shape.
  std::vector<std::pair<int, std::int64_t>> layers;
  for (const auto& e : benign.sites()) {
    if (e.name.size() < 18 || e.name.compare(e.name.size() - 18, 18, ".attn.hook_pattern") != 0) continue;
    if (!attack.has_site(e.name)) continue;
    DMI_CHECK(attack.site(e.name).row_shape[0] == e.row_shape[0], "{} and {}: {} has {} and {} heads", benign.path(),
              attack.path(), e.name, e.row_shape[0], attack.site(e.name).row_shape[0]);
    layers.push_back({e.layer, e.row_shape[0]});
  }
  DMI_CHECK(!layers.empty(), "{} and {} share no attention pattern site (capture with --hooks pattern --tokens "
            "last-prompt)", benign.path(), attack.path());
  DMI_CHECK(benign.n_sequences() > 0 && attack.n_sequences() > 0, "{} or {} has no sequences", benign.path(),
            attack.path());
  struct Moments {
    double mean = 0, std = 0;
  };
  auto moments = [&](const sink::CaptureFile& f, int layer, std::int64_t H) {
    PatternRows rows(f);
    std::vector<std::vector<double>> a(static_cast<std::size_t>(H));
    for (std::size_t s = 0; s < f.n_sequences(); ++s) {
      const auto prompt = prompt_of(f, s);
      const auto i = inst.resolve(prompt, tok, s, "--inst"), d = data.resolve(prompt, tok, s, "--data");
      for (std::int64_t h = 0; h < H; ++h) a[h].push_back(focus(rows.get(layer, s), h, i, d, f.path()));
    }
    std::vector<Moments> m(static_cast<std::size_t>(H));
    for (std::int64_t h = 0; h < H; ++h) {
      for (double v : a[h]) m[h].mean += v;
      m[h].mean /= static_cast<double>(a[h].size());
      for (double v : a[h]) m[h].std += (v - m[h].mean) * (v - m[h].mean);
      m[h].std = std::sqrt(m[h].std / static_cast<double>(a[h].size()));
    }
    return m;
  };
  std::vector<HeadSeparation> out;
  for (auto [layer, H] : layers) {
    const auto b = moments(benign, layer, H), x = moments(attack, layer, H);
    for (std::int64_t h = 0; h < H; ++h)
      out.push_back({{layer, h}, b[h].mean, b[h].std, x[h].mean, x[h].std, b[h].mean - x[h].mean});
  }
  return out;
}

std::vector<TrackerHead> select_heads(const std::vector<HeadSeparation>& s, double k) {
  std::vector<TrackerHead> out;
  for (const auto& h : s)
    if (h.diff > k * (h.std_benign + h.std_attack)) out.push_back(h.head);
  return out;
}

}  // namespace dmi::analysis
