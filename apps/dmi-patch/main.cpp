// dmi-patch: activation-patching sweeps over clean/corrupted prompt pairs.
// A thin front end: flags in, analysis/patching.h, one line per error.
#include <ATen/ATen.h>
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <tuple>
#include <nlohmann/json.hpp>

#include "analysis/patching.h"
#include "app_main.h"
#include "common/error.h"
#include "engine/capture_run.h"
#include "engine/prompts.h"
#include "engine/run.h"
#include "engine/runtime.h"

namespace {

using dmi::apps::g_stop;

struct Args {
  std::string model, tokenizer, clean, corrupt, output, png, svg, dtype = "float32";
  std::string answer, wrong, sites = "resid_pre,attn_out,mlp_out", direction = "denoise", metric = "logit-diff";
  std::int32_t answer_id = -1, wrong_id = -1;
  std::int64_t batch_size = 8;
  int threads = 0, top = 10;
  bool json = false, quiet = false, overwrite = false, no_special = false, no_reuse = false;
  double progress_every = -1;
  std::string command_line;
};

using dmi::apps::default_model_dir;

// --answer TEXT must be one token of the vocabulary.
std::int32_t one_token(const dmi::io::Tokenizer& tok, const std::string& flag, const std::string& text) {
  const auto ids = tok.encode(text, /*add_special_tokens=*/false);
  DMI_CHECK(ids.size() == 1, "{} '{}' is {} tokens ({}); give a single token, or its id with {}-id", flag, text,
            ids.size(), fmt::join(ids, ","), flag);
  return ids[0];
}

std::vector<std::vector<std::int32_t>> read_prompts(const std::string& path, const std::string& flag,
                                                    const dmi::io::Tokenizer& tok, bool add_special,
                                                    std::vector<std::string>& texts) {
  std::vector<std::vector<std::int32_t>> out;
  for (const auto& p : dmi::engine::read_prompts_file(path)) {
    out.push_back(p.has_ids ? p.ids : tok.encode(p.text, add_special));
    texts.push_back(p.has_ids ? tok.decode(p.ids) : p.text);
    DMI_CHECK(p.steer.empty(), "{} {}: \"steer\" does not apply to dmi-patch", flag, path);
  }
  DMI_CHECK(!out.empty(), "{} {}: no prompts", flag, path);
  return out;
}

int run(const Args& a) {
  using namespace dmi;
  const int threads = engine::configure_threads(a.threads);
  analysis::PatchSweepOptions o;
  o.sites = analysis::parse_patch_sites(a.sites);
  o.direction = analysis::parse_patch_direction(a.direction);
  o.metric = analysis::parse_patch_metric(a.metric);
  o.batch_size = a.batch_size;
  o.reuse_prefix = !a.no_reuse;
  o.stop = &g_stop;
  engine::CaptureConfig out;
  out.output = a.output;
  out.overwrite = a.overwrite;
  engine::check_output_path(out);

  engine::RunSettings s;
  s.model_path = a.model.empty() ? default_model_dir() : a.model;
  s.tokenizer_path = a.tokenizer;
  s.dtype = a.dtype;
  s.threads = threads;
  engine::LoadedModel m = engine::load_for_run(s, /*fingerprint=*/true);
  const io::Tokenizer& tok = *m.tokenizer;
  const std::int64_t vocab = m.model->config().vocab_size;

  analysis::PatchFileInfo info;
  const auto clean = read_prompts(a.clean, "--clean", tok, !a.no_special, info.clean_texts);
  const auto corrupt = read_prompts(a.corrupt, "--corrupt", tok, !a.no_special, info.corrupt_texts);
  DMI_CHECK(clean.size() == corrupt.size(), "--clean {} has {} prompts, --corrupt {} has {}; they are paired by line",
            a.clean, clean.size(), a.corrupt, corrupt.size());
  std::vector<analysis::PatchPair> pairs;
  for (std::size_t i = 0; i < clean.size(); ++i) {
    DMI_CHECK(clean[i].size() == corrupt[i].size(), "pair {} (line {} of {} and {}): the clean prompt is {} tokens, "
              "the corrupted one {}; paired prompts must have the same length", i + 1, i + 1, a.clean, a.corrupt,
              clean[i].size(), corrupt[i].size());
    for (const auto* ids : {&clean[i], &corrupt[i]})
      for (auto id : *ids)
        DMI_CHECK(id >= 0 && id < vocab, "pair {}: token id {} is outside the vocabulary (size {})", i + 1, id, vocab);
    pairs.push_back({clean[i], corrupt[i]});
  }
  o.answer = !a.answer.empty() ? one_token(tok, "--answer", a.answer) : a.answer_id;
  o.wrong = !a.wrong.empty() ? one_token(tok, "--wrong", a.wrong) : a.wrong_id;
  if (o.answer >= 0) info.answer = tok.decode({o.answer});
  if (o.wrong >= 0) info.wrong = tok.decode({o.wrong});
  const auto& base = o.direction == analysis::PatchDirection::denoise ? pairs[0].corrupt : pairs[0].clean;
  for (auto id : base) info.tokens.push_back(tok.decode({id}));
  info.model_path = s.model_path;
  info.dtype = a.dtype;
  info.command_line = a.command_line;
  info.fingerprint_json = nlohmann::json(m.fingerprint).dump();

  engine::Progress progress;
  o.on_progress = [&](std::size_t done, std::size_t total) {
    progress.total = total;
    progress.done = done;
  };
  engine::ProgressLine line("dmi-patch", "patched runs", progress,
                            dmi::apps::progress_options(a.quiet, a.progress_every));
  analysis::PatchSweepResult r;
  try {
    r = analysis::patch_sweep(*m.model, pairs, o);
    line.stop();
  } catch (const dmi::Error&) {
    line.stop();
    if (!g_stop.load()) throw;
    std::fprintf(stderr, "dmi-patch: interrupted; %s not written\n", a.output.c_str());
    return dmi::apps::stopped_status();
  }
  analysis::write_patch_file(a.output, a.overwrite, r, o, info);

  // One labelled heatmap per site, as PNG and/or SVG.
  std::vector<std::string> pngs;
  nlohmann::json heatmaps = nlohmann::json::array();
  for (const auto& [dir, ext, flag] : {std::tuple{a.png, ".png", "--png"}, std::tuple{a.svg, ".svg", "--svg"}}) {
    if (dir.empty()) continue;
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0)
      DMI_CHECK(::mkdir(dir.c_str(), 0777) == 0, "{} {}: cannot create the directory: {}", flag, dir,
                std::strerror(errno));
    for (const auto& g : r.grids) {
      const std::string path = dir + "/" + analysis::patch_site_short_name(g.site) + ext;
      const auto geo = analysis::write_heatmap(path, analysis::patch_heatmap(g, o, info, a.output));
      pngs.push_back(path);
      heatmaps.push_back({{"file", path}, {"site", analysis::patch_site_short_name(g.site)}, {"width", geo.width},
                          {"height", geo.height}, {"grid_x", geo.grid_x}, {"grid_y", geo.grid_y},
                          {"cell", geo.cell}, {"rows", g.norm.size(0)}, {"cols", g.norm.size(1)}});
    }
  }

  const auto top = analysis::top_patch_cells(r, static_cast<std::size_t>(a.top));
  auto col_label = [&](const analysis::PatchCell& c) {
    return analysis::patch_site_per_head(c.site) ? fmt::format("head {}", c.col)
                                                 : fmt::format("pos {} {:?}", c.col, info.tokens[c.col]);
  };
  const double speedup = r.tokens_computed ? static_cast<double>(r.tokens_naive) / r.tokens_computed : 0.0;
  if (a.json) {
    nlohmann::json j;
    j["output"] = a.output;
    j["model"] = s.model_path;
    j["dtype"] = a.dtype;
    j["threads"] = threads;
    j["pairs"] = pairs.size();
    j["tokens"] = info.tokens;
    j["direction"] = analysis::patch_direction_name(o.direction);
    j["metric"] = analysis::patch_metric_name(o.metric);
    j["answer"] = {{"id", o.answer}, {"token", info.answer}};
    j["wrong"] = {{"id", o.wrong}, {"token", info.wrong}};
    j["m_clean"] = r.m_clean;
    j["m_corrupt"] = r.m_corrupt;
    j["sites"] = nlohmann::json::object();
    for (const auto& g : r.grids)
      j["sites"][analysis::patch_site_short_name(g.site)] = {
          {"axes", g.per_head ? "layer,head" : "layer,position"}, {"shape", {g.raw.size(0), g.raw.size(1)}}};
    j["top"] = nlohmann::json::array();
    for (const auto& c : top) {
      nlohmann::json e = {{"site", analysis::patch_site_short_name(c.site)}, {"layer", c.layer}, {"raw", c.raw},
                          {"norm", std::isnan(c.norm) ? nlohmann::json() : nlohmann::json(c.norm)}};
      if (analysis::patch_site_per_head(c.site)) e["head"] = c.col;
      else e["position"] = c.col, e["token"] = info.tokens[c.col];
      j["top"].push_back(e);
    }
    j["png"] = pngs;
    j["heatmaps"] = heatmaps;
    j["cost"] = {{"patched_runs", r.patched_runs}, {"forward_passes", r.forward_passes},
                 {"tokens_computed", r.tokens_computed}, {"tokens_naive", r.tokens_naive},
                 {"token_ratio", speedup}, {"seconds", r.seconds}, {"reuse_prefix", o.reuse_prefix}};
    std::cout << j.dump(2) << "\n";
  } else {
    std::printf("%s: %zu pair%s, %zu tokens, %s, metric %s: clean %.6g, corrupt %.6g\n", a.output.c_str(),
                pairs.size(), pairs.size() == 1 ? "" : "s", info.tokens.size(),
                analysis::patch_direction_name(o.direction), analysis::patch_metric_name(o.metric), r.m_clean,
                r.m_corrupt);
    if (!(r.m_clean != r.m_corrupt))
      std::printf("warning: the clean and corrupted runs score the same; norm is undefined (NaN)\n");
    std::printf("top cells (norm = (m - corrupt) / (clean - corrupt)):\n");
    for (const auto& c : top)
      std::printf("  %-9s layer %-3d %-24s norm %+.4f  raw %.6g\n", analysis::patch_site_short_name(c.site).c_str(),
                  c.layer, col_label(c).c_str(), c.norm, c.raw);
    for (const auto& p : pngs) std::printf("wrote %s\n", p.c_str());
  }
  if (!a.quiet)
    std::fprintf(stderr, "dmi-patch: %lld patched runs in %lld forward passes, %.2f s; %lld token positions "
                 "computed, %lld for full reruns (%.2fx fewer)\n", static_cast<long long>(r.patched_runs),
                 static_cast<long long>(r.forward_passes), r.seconds, static_cast<long long>(r.tokens_computed),
                 static_cast<long long>(r.tokens_naive), speedup);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dmi-patch: activation-patching sweeps. Runs clean and corrupted prompts, then patches one "
               "activation at a time (site x layer x position, or x head) from one run into the other and "
               "measures how much of the clean answer comes back."};
  app.footer(
      "Examples:\n"
      "  dmi-patch --clean clean.txt --corrupt corrupt.txt --answer ' Mary' --wrong ' John' -o ioi.h5\n"
      "  dmi-patch --clean c.txt --corrupt x.txt --answer-id 42 --wrong-id 7 --sites z,pattern -o heads.h5 --png plots/\n"
      "  dmi-patch --clean c.jsonl --corrupt x.jsonl --metric kl --direction noise -o noise.h5 --json\n"
      "\nThe prompt files are dmi-run's formats (one prompt per line, or JSONL with \"text\" or \"ids\"), paired\n"
      "by line; paired prompts must have the same number of tokens, and so must every pair. The output\n"
      "holds /patch/<site>/raw and /patch/<site>/norm: [layers, positions], or [layers, heads] for z and\n"
      "pattern (docs/patching.md).\n"
      "\nExit status: 0 ok, 2 bad input (one line on stderr), 130 interrupted (143 SIGTERM; nothing written),\n"
      "1 internal error.");
  Args a;
  app.add_option("-m,--model", a.model, "HF model directory (default: the embedded model in data/default-model)");
  app.add_option("--tokenizer", a.tokenizer, "tokenizer.json (default: MODEL/tokenizer.json)");
  app.add_option("--clean", a.clean, "clean prompts: one per line, or JSONL with \"text\" or \"ids\"")->required();
  app.add_option("--corrupt", a.corrupt, "corrupted prompts, paired with --clean by line")->required();
  auto* answer = app.add_option("--answer", a.answer, "the correct next token, as text (one token)");
  auto* answer_id = app.add_option("--answer-id", a.answer_id, "the correct next token, as an id")
      ->check(dmi::apps::kNonNegative);
  auto* wrong = app.add_option("--wrong", a.wrong, "the wrong next token (logit-diff), as text (one token)");
  auto* wrong_id = app.add_option("--wrong-id", a.wrong_id, "the wrong next token, as an id")
      ->check(dmi::apps::kNonNegative);
  answer->excludes(answer_id);
  wrong->excludes(wrong_id);
  app.add_option("--sites", a.sites, "sites to sweep: resid_pre, attn_out, mlp_out (layer x position), "
                 "z, pattern (layer x head)")->capture_default_str();
  app.add_option("--direction", a.direction, "denoise: clean activations into the corrupted run; noise: the "
                 "reverse")->capture_default_str()->check(CLI::IsMember({"denoise", "noise"}));
  app.add_option("--metric", a.metric, "logit-diff (answer - wrong), logprob, prob (of the answer), kl "
                 "(KL(clean || patched))")->capture_default_str()
      ->check(CLI::IsMember({"logit-diff", "logprob", "prob", "kl"}));
  app.add_option("-o,--output", a.output, "the HDF5 file to write")->required();
  app.add_flag("--overwrite", a.overwrite, "replace --output if it exists");
  app.add_option("--png", a.png, "directory for one labelled heatmap per site (norm, blue -1 .. red +1; layers down, "
                              "positions with tokens or heads across)");
  app.add_option("--svg", a.svg, "directory for the same heatmaps as SVG");
  app.add_option("--top", a.top, "cells listed in the summary")->capture_default_str()->check(dmi::apps::kNonNegative);
  app.add_option("-b,--batch-size", a.batch_size, "patched runs per forward pass")->capture_default_str()
      ->check(dmi::apps::kAtLeastOne);
  app.add_flag("--no-prefix-reuse", a.no_reuse, "recompute every patched run from position 0 (for comparison)");
  app.add_option("--dtype", a.dtype, "compute dtype")->capture_default_str()
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  app.add_option("-t,--threads", a.threads, "CPU threads (0 = all cores)")->capture_default_str()
      ->check(dmi::apps::kNonNegative);
  app.add_flag("--no-special-tokens", a.no_special, "do not add the tokenizer's special tokens (e.g. BOS) to prompts");
  app.add_flag("--json", a.json, "print a machine-readable summary on stdout");
  app.add_flag("-q,--quiet", a.quiet, "no progress or cost lines on stderr");
  dmi::apps::add_progress_every(app, a.progress_every);
  if (int rc = dmi::apps::parse_args("dmi-patch", app, argc, argv); rc >= 0) return rc;
  for (int i = 0; i < argc; ++i) a.command_line += (i ? " " : "") + std::string(argv[i]);
  dmi::engine::prepare_process_env(argc, argv, dmi::engine::math_owner_for(a.dtype, a.model));
  dmi::apps::install_stop_signals();
  return dmi::apps::guarded("dmi-patch", [&] { return run(a); });
}
