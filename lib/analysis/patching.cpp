#include "analysis/patching.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "hooks/intervene.h"
#include "sink/result_file.h"

namespace dmi::analysis {

using hooks::Site;

PatchDirection parse_patch_direction(const std::string& s) {
  if (s == "denoise") return PatchDirection::denoise;
  if (s == "noise") return PatchDirection::noise;
  DMI_FAIL("--direction: '{}' is not denoise (clean into corrupt) or noise (corrupt into clean)", s);
}

PatchMetric parse_patch_metric(const std::string& s) {
  if (s == "logit-diff") return PatchMetric::logit_diff;
  if (s == "logprob") return PatchMetric::logprob;
  if (s == "prob") return PatchMetric::prob;
  if (s == "kl") return PatchMetric::kl;
  DMI_FAIL("--metric: '{}' is not logit-diff, logprob, prob or kl", s);
}

const char* patch_direction_name(PatchDirection d) { return d == PatchDirection::denoise ? "denoise" : "noise"; }

const char* patch_metric_name(PatchMetric m) {
  switch (m) {
    case PatchMetric::logit_diff: return "logit-diff";
    case PatchMetric::logprob: return "logprob";
    case PatchMetric::prob: return "prob";
    case PatchMetric::kl: return "kl";
  }
  return "?";
}

namespace {
const std::pair<const char*, Site> kPatchSites[] = {
    {"resid_pre", Site::resid_pre}, {"attn_out", Site::attn_out}, {"mlp_out", Site::mlp_out}, {"z", Site::z},
    {"pattern", Site::pattern}};
}  // namespace

std::vector<Site> parse_patch_sites(const std::string& list) {
  std::vector<Site> out;
  std::size_t a = 0;
  while (a <= list.size()) {
    std::size_t b = list.find(',', a);
    if (b == std::string::npos) b = list.size();
    const std::string item = list.substr(a, b - a);
    a = b + 1;
    if (item.empty()) continue;
    bool found = false;
    for (const auto& [name, site] : kPatchSites)
      if (item == name || item == hooks::site_suffix(site)) {
        if (std::find(out.begin(), out.end(), site) == out.end()) out.push_back(site);
        found = true;
      }
    DMI_CHECK(found, "--sites: '{}' is not a site dmi-patch sweeps (resid_pre, attn_out, mlp_out, z, pattern)",
              item.size() > 64 ? item.substr(0, 64) + "..." : item);
  }
  DMI_CHECK(!out.empty(), "--sites: no site given (resid_pre, attn_out, mlp_out, z, pattern)");
  return out;
}

std::string patch_site_short_name(Site s) {
  for (const auto& [name, site] : kPatchSites)
    if (site == s) return name;
  return hooks::site_suffix(s);
}

bool patch_site_per_head(Site s) { return s == Site::z || s == Site::pattern; }

double patch_metric(PatchMetric m, const at::Tensor& logits, std::int32_t answer, std::int32_t wrong,
                    const at::Tensor& clean_logp) {
  const at::Tensor l = logits.to(at::kDouble).contiguous();
  const double* p = l.data_ptr<double>();
  switch (m) {
    case PatchMetric::logit_diff: return p[answer] - p[wrong];
    case PatchMetric::logprob: return at::log_softmax(l, 0)[answer].item<double>();
    case PatchMetric::prob: return at::softmax(l, 0)[answer].item<double>();
    case PatchMetric::kl: {
      // KL(P_clean || P): 0 for the clean run, larger the further from it.
      const at::Tensor logp = at::log_softmax(l, 0);
      return (clean_logp.exp() * (clean_logp - logp)).sum().item<double>();
    }
  }
  return 0;
}

namespace {

// Keeps batch row 0 of every site the sweep patches, as float32 (the values
// a capture of that run would hold): [T, ...], or [H, T, T] for pattern.
class SiteRecorder final : public hooks::Observer {
 public:
  explicit SiteRecorder(const std::vector<Site>& sites) : sites_(sites) {}
  bool wants(Site s, int) const override { return std::find(sites_.begin(), sites_.end(), s) != sites_.end(); }
  void observe(Site s, int layer, const at::Tensor& t, const hooks::ForwardInfo&) override {
    rows[{s, layer}] = t[0].to(at::kFloat).contiguous().clone();  // [T, ...]
  }
  std::map<std::pair<Site, int>, at::Tensor> rows;

 private:
  std::vector<Site> sites_;
};

struct Run {
  at::Tensor logits;  // [vocab] float32, last position
  model::KVCache cache;
  std::map<std::pair<Site, int>, at::Tensor> rows;
};

// One prompt, batch 1, the whole prompt in one forward pass.
Run run_prompt(model::CausalLM& model, const std::vector<std::int32_t>& ids, const std::vector<Site>& record) {
  const std::int64_t T = static_cast<std::int64_t>(ids.size());
  Run r;
  r.cache = model.new_cache(1, T);
  model::ForwardInput in;
  in.ids = at::tensor(std::vector<std::int64_t>(ids.begin(), ids.end()), at::kLong).view({1, T});
  in.positions = at::arange(T, at::kLong).view({1, T});
  in.key_valid = at::ones({1, T}, at::kBool);
  hooks::ForwardInfo info{in.positions, in.key_valid, 0, {0}, -1, {}};
  in.info = &info;
  SiteRecorder rec(record);
  r.logits = model.forward(in, r.cache, record.empty() ? nullptr : &rec)[0][0].contiguous();
  r.rows = std::move(rec.rows);
  return r;
}

// A patched run: which pair, which cell.
struct Cell {
  std::size_t grid;  // index into PatchSweepOptions::sites
  int layer;
  std::int64_t col;  // position, or head
};

}  // namespace

PatchSweepResult patch_sweep(model::CausalLM& model, const std::vector<PatchPair>& pairs,
                             const PatchSweepOptions& opts) {
  DMI_CHECK(!pairs.empty(), "no prompt pairs");
  DMI_CHECK(!opts.sites.empty(), "no sites to patch");
  DMI_CHECK(model.supports_interventions(), "this model does not support patching (TorchScript archives have no "
            "write-capable HookPoints)");
  DMI_CHECK(opts.batch_size >= 1, "--batch-size must be at least 1");
  const std::int64_t T = static_cast<std::int64_t>(pairs[0].clean.size());
  const std::int64_t vocab = model.config().vocab_size;
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    DMI_CHECK(pairs[i].clean.size() == pairs[i].corrupt.size(), "pair {}: the clean prompt has {} tokens, the "
              "corrupted one {}; paired prompts must have the same length", i + 1, pairs[i].clean.size(),
              pairs[i].corrupt.size());
    DMI_CHECK(static_cast<std::int64_t>(pairs[i].clean.size()) == T, "pair {}: {} tokens, pair 1 has {}; every pair "
              "must have the same length (the grids share one position axis)", i + 1, pairs[i].clean.size(), T);
  }
  DMI_CHECK(T >= 1, "pair 1: empty prompts");
  const bool need_answer = opts.metric != PatchMetric::kl;
  const bool need_wrong = opts.metric == PatchMetric::logit_diff;
  DMI_CHECK(!need_answer || (opts.answer >= 0 && opts.answer < vocab), "--metric {} needs an answer token in the "
            "vocabulary (--answer or --answer-id; got id {})", patch_metric_name(opts.metric), opts.answer);
  DMI_CHECK(!need_wrong || (opts.wrong >= 0 && opts.wrong < vocab), "--metric logit-diff needs a wrong-answer token "
            "in the vocabulary (--wrong or --wrong-id; got id {})", opts.wrong);
  const int n_layers = static_cast<int>(model.config().num_layers);
  const std::int64_t n_heads = model.config().num_heads;

  // The two unpatched runs of each pair: metrics, the source's activations,
  // the base's KV cache.
  PatchSweepResult res;
  std::vector<Run> base(pairs.size()), source(pairs.size());
  std::vector<at::Tensor> clean_logp(pairs.size());
  const bool denoise = opts.direction == PatchDirection::denoise;
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    Run clean = run_prompt(model, pairs[i].clean, denoise ? opts.sites : std::vector<Site>{});
    Run corrupt = run_prompt(model, pairs[i].corrupt, denoise ? std::vector<Site>{} : opts.sites);
    if (opts.metric == PatchMetric::kl) clean_logp[i] = at::log_softmax(clean.logits.to(at::kDouble), 0);
    res.pair_clean.push_back(patch_metric(opts.metric, clean.logits, opts.answer, opts.wrong, clean_logp[i]));
    res.pair_corrupt.push_back(patch_metric(opts.metric, corrupt.logits, opts.answer, opts.wrong, clean_logp[i]));
    base[i] = std::move(denoise ? corrupt : clean);
    source[i] = std::move(denoise ? clean : corrupt);
    source[i].cache = {};
  }
  const double n = static_cast<double>(pairs.size());
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    res.m_clean += res.pair_clean[i] / n;
    res.m_corrupt += res.pair_corrupt[i] / n;
  }

  // Every cell, grouped by the cache column its rows start from.
  std::map<std::int64_t, std::vector<Cell>> by_start;
  for (std::size_t g = 0; g < opts.sites.size(); ++g) {
    const bool per_head = patch_site_per_head(opts.sites[g]);
    PatchGrid grid;
    grid.site = opts.sites[g];
    grid.per_head = per_head;
    const std::int64_t cols = per_head ? n_heads : T;
    grid.raw = at::zeros({n_layers, cols}, at::kDouble);
    res.grids.push_back(grid);
    for (int l = 0; l < n_layers; ++l)
      for (std::int64_t c = 0; c < cols; ++c) by_start[per_head || !opts.reuse_prefix ? 0 : c].push_back({g, l, c});
  }
  // (start, cell, pair) in run order: by start column.
  struct Job {
    std::int64_t start;
    Cell cell;
    std::size_t pair;
  };
  std::vector<Job> jobs;
  for (const auto& [start, cells] : by_start)
    for (const Cell& c : cells)
      for (std::size_t p = 0; p < pairs.size(); ++p) jobs.push_back({start, c, p});
  res.patched_runs = static_cast<std::int64_t>(jobs.size());
  res.tokens_naive = res.patched_runs * T;

  const auto t0 = std::chrono::steady_clock::now();
  std::size_t done = 0;
  while (done < jobs.size()) {
    if (opts.stop && opts.stop->load()) DMI_FAIL("interrupted");
    // A batch: the next batch_size jobs (in order of start column); all its
    // rows start at the first one's column, the smallest, so rows patched
    // later recompute a few more positions instead of leaving rows empty.
    const std::int64_t start = jobs[done].start;
    const std::size_t end = std::min(jobs.size(), done + static_cast<std::size_t>(opts.batch_size));
    const std::int64_t B = static_cast<std::int64_t>(end - done), Tc = T - start;

    model::KVCache cache = model.new_cache(B, T);
    std::vector<std::int64_t> ids(static_cast<std::size_t>(B * Tc));
    std::vector<hooks::Intervention> list;
    for (std::int64_t b = 0; b < B; ++b) {
      const Job& job = jobs[done + static_cast<std::size_t>(b)];
      const PatchPair& pair = pairs[job.pair];
      const auto& base_ids = denoise ? pair.corrupt : pair.clean;
      for (std::int64_t t = 0; t < Tc; ++t) ids[static_cast<std::size_t>(b * Tc + t)] = base_ids[start + t];
      if (start > 0)
        for (std::size_t li = 0; li < cache.k.size(); ++li) {
          cache.k[li][b].narrow(1, 0, start).copy_(base[job.pair].cache.k[li][0].narrow(1, 0, start));
          cache.v[li][b].narrow(1, 0, start).copy_(base[job.pair].cache.v[li][0].narrow(1, 0, start));
        }
      hooks::Intervention iv;
      iv.kind = hooks::Intervention::Kind::replace;
      const Site site = opts.sites[job.cell.grid];
      iv.label = "patch " + hooks::site_name(site, job.cell.layer);
      iv.sites = {{site, job.cell.layer}};
      if (patch_site_per_head(site)) {
        iv.heads = {job.cell.col};
      } else {
        iv.positions.kind = hooks::PositionSpec::Kind::ranges;
        iv.positions.ranges = {{job.cell.col, job.cell.col + 1}};
      }
      iv.only_seqs = std::set<std::int32_t>{static_cast<std::int32_t>(b)};
      const at::Tensor src = source[job.pair].rows.at({site, job.cell.layer});
      // A row by position: [d_model] or [H, D]; a pattern row [H, T] (keys by position).
      if (site == Site::pattern) iv.value = [src](Site, int, std::int32_t, std::int64_t p) { return src.select(1, p); };
      else iv.value = [src](Site, int, std::int32_t, std::int64_t p) { return src[p]; };
      list.push_back(std::move(iv));
    }
    hooks::Intervener intervener(std::move(list), std::vector<std::int64_t>(static_cast<std::size_t>(B), T));
    model::ForwardInput in;
    in.ids = at::tensor(ids, at::kLong).view({B, Tc});
    in.positions = at::arange(start, T, at::kLong).view({1, Tc}).expand({B, Tc}).contiguous();
    in.key_valid = at::ones({B, T}, at::kBool);
    in.start = start;
    std::vector<std::int32_t> seq(static_cast<std::size_t>(B));
    for (std::int64_t b = 0; b < B; ++b) seq[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(b);
    hooks::ForwardInfo info{in.positions, at::ones({B, Tc}, at::kBool), start, seq, -1, {}};
    in.info = &info;
    const at::Tensor logits = model.forward(in, cache, &intervener);  // [B, 1, vocab]
    for (std::int64_t b = 0; b < B; ++b) {
      const Job& job = jobs[done + static_cast<std::size_t>(b)];
      const double m = patch_metric(opts.metric, logits[b][0], opts.answer, opts.wrong, clean_logp[job.pair]);
      auto acc = res.grids[job.cell.grid].raw.accessor<double, 2>();
      acc[job.cell.layer][job.cell.col] += m / n;
    }
    res.forward_passes += 1;
    res.tokens_computed += B * Tc;
    done = end;
    if (opts.on_progress) opts.on_progress(done, jobs.size());
  }
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (auto& g : res.grids) g.norm = (g.raw - res.m_corrupt) / (res.m_clean - res.m_corrupt);
  return res;
}

void write_patch_file(const std::string& path, bool overwrite, const PatchSweepResult& r,
                      const PatchSweepOptions& o, const PatchFileInfo& info) {
  sink::ResultFile f(path, overwrite);
  for (const auto& g : r.grids) {
    const std::string base = "/patch/" + patch_site_short_name(g.site);
    f.dataset(base + "/raw", g.raw);
    f.dataset(base + "/norm", g.norm);
    f.attr(base, "site", std::string(hooks::site_suffix(g.site)));
    f.attr(base, "axes", std::string(g.per_head ? "layer,head" : "layer,position"));
  }
  f.strings("/tokens", info.tokens);
  nlohmann::json prompts = nlohmann::json::array();
  for (std::size_t i = 0; i < info.clean_texts.size(); ++i)
    prompts.push_back({{"clean", info.clean_texts[i]}, {"corrupt", info.corrupt_texts[i]}});
  f.attr("/", "format", std::string("dmi-patch"));
  f.attr("/", "format_version", std::int64_t{1});
  f.attr("/", "m_clean", r.m_clean);
  f.attr("/", "m_corrupt", r.m_corrupt);
  f.attr("/", "pair_m_clean", nlohmann::json(r.pair_clean).dump());
  f.attr("/", "pair_m_corrupt", nlohmann::json(r.pair_corrupt).dump());
  f.attr("/", "prompts", prompts.dump());
  f.attr("/", "tokens", nlohmann::json(info.tokens).dump());
  f.attr("/", "direction", std::string(patch_direction_name(o.direction)));
  f.attr("/", "metric", std::string(patch_metric_name(o.metric)));
  f.attr("/", "answer_id", std::int64_t{o.answer});
  f.attr("/", "wrong_id", std::int64_t{o.wrong});
  f.attr("/", "answer", info.answer);
  f.attr("/", "wrong", info.wrong);
  f.attr("/", "model", info.model_path);
  f.attr("/", "dtype", info.dtype);
  f.attr("/", "model_fingerprint", info.fingerprint_json);
  f.attr("/", "command_line", info.command_line);
  f.attr("/", "dmi_version", std::string(DMI_VERSION));
  f.attr("/", "patched_runs", r.patched_runs);
  f.attr("/", "tokens_computed", r.tokens_computed);
  f.attr("/", "tokens_naive", r.tokens_naive);
  f.close();
}

std::vector<PatchCell> top_patch_cells(const PatchSweepResult& r, std::size_t k) {
  std::vector<PatchCell> cells;
  for (const auto& g : r.grids) {
    auto raw = g.raw.accessor<double, 2>();
    auto norm = g.norm.accessor<double, 2>();
    for (std::int64_t l = 0; l < g.raw.size(0); ++l)
      for (std::int64_t c = 0; c < g.raw.size(1); ++c)
        cells.push_back({g.site, static_cast<int>(l), c, raw[l][c], norm[l][c]});
  }
  auto key = [](const PatchCell& c) { return std::isnan(c.norm) ? -1.0 : std::abs(c.norm); };
  std::stable_sort(cells.begin(), cells.end(), [&](const PatchCell& a, const PatchCell& b) { return key(a) > key(b); });
  if (cells.size() > k) cells.resize(k);
  return cells;
}

}  // namespace dmi::analysis

namespace dmi::analysis {

Heatmap patch_heatmap(const PatchGrid& g, const PatchSweepOptions& o, const PatchFileInfo& info,
                      const std::string& output) {
  Heatmap h;
  h.values = g.norm;
  h.map = Colormap::diverging;
  for (std::int64_t l = 0; l < g.norm.size(0); ++l) h.row_labels.push_back(std::to_string(l));
  for (std::int64_t c = 0; c < g.norm.size(1); ++c)
    h.col_labels.push_back(g.per_head || static_cast<std::size_t>(c) >= info.tokens.size()
                               ? std::to_string(c)
                               : fmt::format("{} {}", c, axis_label(info.tokens[static_cast<std::size_t>(c)])));
  const std::string base = std::filesystem::path(output).filename().string();
  h.title = fmt::format("{}: patching {}, {}", base,
                        hooks::is_layer_site(g.site) ? std::string("blocks.*.") + hooks::site_suffix(g.site)
                                                     : hooks::site_name(g.site, -1),
                        patch_direction_name(o.direction));
  h.subtitle = fmt::format("metric {}{}; normalised (m - corrupt) / (clean - corrupt)", patch_metric_name(o.metric),
                           info.answer.empty() ? "" : fmt::format(", answer {:?} vs {:?}", info.answer, info.wrong));
  h.row_axis = "layer";
  h.col_axis = g.per_head ? "head" : "position (token)";
  h.value_name = "normalised effect";
  return h;
}

}  // namespace dmi::analysis
