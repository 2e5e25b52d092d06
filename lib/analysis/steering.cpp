#include "analysis/steering.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include <map>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "hooks/selection.h"
#include "hooks/site.h"
#include "sink/capture_file.h"

namespace dmi::analysis {

namespace {

std::string site_suffix_of(const std::string& short_name) {
  try {
    return hooks::site_suffix(hooks::residual_site(short_name));
  } catch (const Error& e) {
    DMI_FAIL("--site: {}", e.what());
  }
}

std::vector<int> parse_layers(const std::string& s, int n_layers) {
  std::vector<int> out;
  for (auto l : hooks::parse_index_set(s, n_layers, "--layers")) out.push_back(static_cast<int>(l));
  return out;
}

// The rows a pair contributes for one sequence: row indices of the site.
std::vector<std::int64_t> select_rows(const sink::CaptureFile& f, const std::string& site, std::size_t seq,
                                      const std::string& select) {
  std::vector<std::int64_t> rows = f.find_rows(site, static_cast<std::int32_t>(seq));
  DMI_CHECK(!rows.empty(), "{}: {} has no rows for sequence {}", f.path(), site, seq);
  const auto& pos = f.pos_of(site);
  if (select == "all") return rows;
  std::int64_t want = -1;
  if (select == "last") return {rows.back()};
  if (select == "last-prompt") want = f.prompt_length(seq) - 1;
  else if (select.rfind("pos:", 0) == 0) {
    const std::string k = select.substr(4);
    DMI_CHECK(!k.empty() && k.size() < 9 && k.find_first_not_of("0123456789") == std::string::npos,
              "--select {}: K is not a position", select);
    want = std::stoll(k);
  } else {
    DMI_FAIL("--select {} is not last-prompt, last, all or pos:K", select);
  }
  for (auto r : rows)
    if (pos[r] == want) return {r};
  DMI_FAIL("{}: {} has no row for sequence {} at position {} (--select {})", f.path(), site, seq, want, select);
}

// First right-singular vector of m [n, d] (float64), by SVD.
at::Tensor first_component(const at::Tensor& m) {
  auto svd = at::linalg_svd(m, /*full_matrices=*/false);
  return std::get<2>(svd)[0];
}

}  // namespace

io::SteeringVectors make_steering_vector(const MakeVectorOptions& o) {
  auto P = sink::CaptureFile::open(o.pos_file);
  auto N = sink::CaptureFile::open(o.neg_file);
  DMI_CHECK(P->text_attr("model_config") == N->text_attr("model_config") &&
                P->text_attr("model_fingerprint") == N->text_attr("model_fingerprint"),
            "{} and {} come from different models", o.pos_file, o.neg_file);
  DMI_CHECK(P->n_sequences() == N->n_sequences() && P->n_sequences() > 0,
            "{} has {} sequences and {} has {}: pairs need equal counts", o.pos_file, P->n_sequences(), o.neg_file,
            N->n_sequences());
  DMI_CHECK(o.method == "mean-diff" || o.method == "pca-diff" || o.method == "pca-center",
            "--method {} is not mean-diff, pca-diff or pca-center", o.method);
  const std::string suffix = site_suffix_of(o.site);
  const int n_layers = static_cast<int>(P->int_attr("n_layers").value_or(0));
  io::SteeringVectors v;
  std::size_t pairs = 0;
  for (int layer : parse_layers(o.layers, n_layers)) {
    const std::string site = fmt::format("blocks.{}.{}", layer, suffix);
    DMI_CHECK(P->has_site(site) && N->has_site(site), "{} is not in both captures (capture it with --hooks {})", site,
              o.site);
    std::vector<at::Tensor> pos_rows, neg_rows;
    for (std::size_t s = 0; s < P->n_sequences(); ++s) {
      auto rp = select_rows(*P, site, s, o.select), rn = select_rows(*N, site, s, o.select);
      DMI_CHECK(rp.size() == rn.size(), "sequence {}: {} has {} rows of {}, {} has {}: pairs need equal counts", s,
                o.pos_file, rp.size(), site, o.neg_file, rn.size());
      pos_rows.push_back(P->read_rows(site, rp));
      neg_rows.push_back(N->read_rows(site, rn));
    }
    const at::Tensor pos = at::cat(pos_rows).to(at::kDouble), neg = at::cat(neg_rows).to(at::kDouble);
    const at::Tensor diff = pos - neg;  // [pairs, d]
    pairs = static_cast<std::size_t>(diff.size(0));
    at::Tensor dir;
    if (o.method == "mean-diff") {
      dir = diff.mean(0);
    } else {
      dir = o.method == "pca-diff" ? first_component(diff - diff.mean(0, true)) : first_component(diff);
      // Sign: positives project above their negatives in most pairs.
      const double higher = ((pos.matmul(dir) > neg.matmul(dir)).to(at::kDouble)).mean().item<double>();
      if (higher < 0.5) dir = -dir;
    }
    if (o.normalize) {
      const double n = dir.norm().item<double>();
      DMI_CHECK(n > 0, "layer {}: the direction is zero and cannot be normalised", layer);
      dir = dir / n;
    }
    v.direction[layer] = dir.to(at::kFloat);
  }
  v.metadata = {{"model_hint", P->text_attr("architecture")},
                {"site", o.site},
                {"method", o.method},
                {"select", o.select},
                {"pairs", std::to_string(pairs)},
                {"normalization", o.normalize ? "unit" : "none"},
                {"positive", o.pos_file},
                {"negative", o.neg_file}};
  v.format = "dmi";
  return v;
}

std::vector<VectorLayerInfo> describe_steering_vector(const io::SteeringVectors& v, const std::string& capture,
                                                      const std::string& site, double scale) {
  std::unique_ptr<sink::CaptureFile> f;
  if (!capture.empty()) f = sink::CaptureFile::open(capture);
  const std::string suffix = site_suffix_of(site);
  std::vector<VectorLayerInfo> out;
  const at::Tensor* prev = nullptr;
  int prev_layer = -2;
  for (const auto& [layer, t] : v.direction) {
    VectorLayerInfo info;
    info.layer = layer;
    const at::Tensor d = t.to(at::kDouble);
    info.norm = d.norm().item<double>();
    if (prev && prev_layer == layer - 1) {
      const at::Tensor p = prev->to(at::kDouble);
      const double denom = info.norm * p.norm().item<double>();
      if (denom > 0) info.cos_prev = d.dot(p).item<double>() / denom;
    }
    if (f) {
      const std::string name = fmt::format("blocks.{}.{}", layer, suffix);
      if (f->has_site(name)) {
        const auto& e = f->site(name);
        DMI_CHECK(!e.row_shape.empty() && e.row_shape[0] == t.size(0), "{}: {} has rows of {} elements, the vector {}",
                  capture, name, e.row_shape.empty() ? 0 : e.row_shape[0], t.size(0));
        double sum = 0;
        std::int64_t n = 0;
        for (std::int64_t b = 0; b < e.rows; b += 4096) {
          const std::int64_t k = std::min<std::int64_t>(4096, e.rows - b);
          sum += f->read_block(name, b, k).to(at::kDouble).norm(2, {1}).sum().item<double>();
          n += k;
        }
        if (n > 0) {
          info.mean_h_norm = sum / n;
          if (*info.mean_h_norm > 0) info.ratio = scale * info.norm / *info.mean_h_norm;
        }
      }
    }
    out.push_back(info);
    prev = &t;
    prev_layer = layer;
  }
  return out;
}

}  // namespace dmi::analysis
