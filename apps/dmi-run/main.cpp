// dmi-run: generate text with a Hugging Face model directory on LibTorch.
// A thin front end: flags in, library calls, one line per error.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <functional>
#include <optional>
#include <set>

#include "app_main.h"
#include "common/error.h"
#include "engine/capture_run.h"
#include "engine/generator.h"
#include "engine/prompts.h"
#include "engine/replay.h"
#include "engine/runtime.h"
#include "engine/shard.h"
#include "engine/plan.h"
#include "engine/bench.h"
#include "io/tokenizer.h"
#include "sink/capture_file.h"
#include "model/causal_lm.h"

namespace {

using dmi::apps::g_stop;
using dmi::apps::stopped_status;

using dmi::apps::default_model_dir;

constexpr const char* kDefaultPrompt = "LOVE, n.";

struct Args {
  std::string model, tokenizer, hook_map, prompts_file, dtype = "float32";
  std::vector<std::string> prompts, prompt_ids;
  std::int64_t max_new_tokens = 32, batch_size = 1, top_k = 0;
  double temperature = 0.0, top_p = 1.0;
  std::uint64_t seed = 0;
  int threads = 0;
  bool json = false, no_special = false, quiet = false, ignore_eos = false, plan = false;
  double progress_every = -1;
  dmi::engine::ChatSettings chat;
  dmi::engine::CaptureConfig capture;
  std::string command_line;
  // interventions, in the order given (read from argv: the order across flags matters)
  std::vector<dmi::engine::InterventionRequest> interventions;
  std::vector<std::string> steer, ablate, patch;
  bool capture_before = false;
  // --replay
  std::string replay, replay_mode = "exact", seqs;
  std::string shard;  // --shard K/N | auto
  bool verify = false, allow_mismatch = false;
  double atol = 0, rtol = 0;
  std::vector<CLI::Option*> capture_flags;     // given flags override the record's
  std::vector<CLI::Option*> recorded_settings;  // flags a replay takes from the record
  CLI::Option *threads_flag = nullptr, *batch_flag = nullptr, *atol_flag = nullptr, *rtol_flag = nullptr;
};

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") ==
                        std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Prints the generated sequences (text, or --json) and the capture line.
void report(const Args& a, const std::string& model_path, const std::string& architecture, int threads,
            const std::vector<dmi::engine::SequenceResult>& results, const std::vector<std::string>& prompt_texts,
            const std::vector<std::string>& prompt_display,
            const dmi::engine::Timings& t, const std::optional<dmi::engine::CaptureResult>& cap, std::size_t sites,
            const std::string& output, const dmi::io::Tokenizer& tok, nlohmann::json extra = {}) {
  auto rate = [](std::int64_t n, double s) { return s > 0 ? n / s : 0.0; };
  if (a.json) {
    nlohmann::json j;
    j["model"] = model_path;
    j["architecture"] = architecture;
    j["dtype"] = a.dtype;
    j["threads"] = threads;
    j["sampling"] = {{"temperature", a.temperature}, {"top_k", a.top_k}, {"top_p", a.top_p}, {"seed", a.seed}};
    j["sequences"] = nlohmann::json::array();
    for (std::size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      if (r.finish_reason == "skipped") continue;
      j["sequences"].push_back({{"index", i},
                                {"prompt", prompt_texts[i]},
                                {"prompt_ids", r.prompt_ids},
                                {"output_ids", r.output_ids},
                                {"text", tok.decode(r.output_ids, /*skip_special_tokens=*/true)},
                                {"finish_reason", r.finish_reason}});
    }
    j["timings"] = {{"prefill_tokens", t.prefill_tokens},
                    {"prefill_seconds", t.prefill_seconds},
                    {"prefill_tokens_per_second", rate(t.prefill_tokens, t.prefill_seconds)},
                    {"decode_tokens", t.decode_tokens},
                    {"decode_seconds", t.decode_seconds},
                    {"decode_tokens_per_second", rate(t.decode_tokens, t.decode_seconds)}};
    if (cap)
      j["capture"] = {{"output", output},
                      {"sink", a.capture.sink},
                      {"status", cap->status},
                      {"sites", sites},
                      {"records_written", cap->stats.records_written},
                      {"records_dropped", cap->stats.records_dropped},
                      {"bytes_written", cap->stats.bytes_written},
                      {"ring_high_water_bytes", cap->stats.high_water_bytes},
                      {"producer_wait_seconds", cap->stats.producer_wait_seconds},
                      {"sink_cpu_seconds", cap->stats.sink_cpu_seconds}};
    for (auto it = extra.begin(); it != extra.end(); ++it) j[it.key()] = it.value();
    std::cout << j.dump(2) << "\n";
    return;
  }
  std::size_t shown = 0;
  for (const auto& r : results) shown += r.finish_reason != "skipped";
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    if (r.finish_reason == "skipped") continue;
    if (shown > 1) std::cout << "[" << i << "] ";
    std::cout << prompt_display[i] << tok.decode(r.output_ids, true) << "\n";
  }
  if (cap && !a.quiet)
    std::fprintf(stderr, "dmi-run: captured %zu sites, %llu records (%llu dropped), %.1f MB -> %s [%s]\n", sites,
                 static_cast<unsigned long long>(cap->stats.records_written),
                 static_cast<unsigned long long>(cap->stats.records_dropped), cap->stats.bytes_written / 1e6,
                 output.empty() ? "null sink" : output.c_str(), cap->status.c_str());
  if (!a.quiet)
    std::fprintf(stderr, "dmi-run: prefill %lld tokens at %.1f tok/s, decode %lld tokens at %.1f tok/s\n",
                 static_cast<long long>(t.prefill_tokens), rate(t.prefill_tokens, t.prefill_seconds),
                 static_cast<long long>(t.decode_tokens), rate(t.decode_tokens, t.decode_seconds));
}

// --plan: the capture's rows, file size and rates, from the model's config
// and tokenizer (a TorchScript model is loaded for its sites); runs nothing.
int plan(const Args& a, const dmi::engine::RunSettings& s,
         const std::function<void(const dmi::io::Tokenizer&, dmi::engine::Job&)>& tokenize) {
  using namespace dmi;
  engine::PlanModel pm = engine::load_plan_model(s);
  engine::Job job;
  tokenize(*pm.tokenizer, job);
  engine::PlanInput in;
  in.cfg = pm.cfg;
  in.space = pm.space;
  in.weight_bytes = pm.weight_bytes;
  in.model_dtype = s.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  in.capture = s.capture;
  in.max_new_tokens = s.max_new_tokens;
  in.batch_size = s.batch_size;
  in.prompts = job.prompts;
  for (const auto& t : job.prompt_texts) in.prompt_text_bytes.push_back(t.size());
  in.batches = job.batches;
  in.read_bandwidth_gbs = engine::measure_read_bandwidth_gbs(std::size_t{256} << 20);  // ~0.5 s
  const engine::Plan p = engine::make_plan(in);
  if (a.json) {
    nlohmann::json j = engine::plan_json(p);
    j["model"] = s.model_path;
    j["selection"] = s.capture.hooks;
    j["output"] = a.capture.output.empty() ? nlohmann::json() : nlohmann::json(s.capture.output);
    std::cout << j.dump(2) << "\n";
  } else {
    fmt::print("plan for {}: --hooks {}, tokens {}, every {}, capture dtype {}\n",
               a.capture.output.empty() ? "a capture" : s.capture.output, s.capture.hooks, s.capture.tokens,
               s.capture.every, s.capture.capture_dtype == "model" ? s.dtype : s.capture.capture_dtype);
    fmt::print("{}", engine::plan_text(p));
  }
  return 0;
}

int run(const Args& a) {
  using namespace dmi;
  engine::RunSettings s;
  s.threads = engine::configure_threads(a.threads);
  const bool capturing = !a.capture.hooks.empty();
  std::optional<engine::ShardSpec> shard;
  if (!a.shard.empty()) shard = engine::parse_shard(a.shard);
  s.capture = a.capture;
  if (shard) s.capture.output = engine::shard_output_path(a.capture.output, *shard);
  DMI_CHECK(!a.plan || capturing, "--plan estimates a capture: it needs --hooks (which sites to capture)");
  if (a.plan && s.capture.output.empty()) s.capture.output = "plan.h5";  // never created
  if (capturing) {
    engine::validate_capture_config(s.capture);
    if (!a.plan) engine::check_output_path(s.capture);
  }
  DMI_CHECK(capturing || a.capture.output.empty(), "--output needs --hooks (which sites to capture)");
  DMI_CHECK(capturing || a.capture.monitors.empty(), "--monitor reads captured rows: it needs --hooks (e.g. --hooks "
            "pattern --tokens last-prompt)");
  s.model_path = a.model.empty() ? default_model_dir() : a.model;
  s.tokenizer_path = a.tokenizer;
  s.hook_map = a.hook_map;
  s.dtype = a.dtype;
  s.max_new_tokens = a.max_new_tokens;
  s.batch_size = a.batch_size;
  s.sampling = {a.temperature, a.top_k, a.top_p, a.seed};
  s.ignore_eos = a.ignore_eos;
  s.add_special_tokens = !a.no_special;
  s.command_line = a.command_line;
  s.interventions = a.interventions;
  s.capture_before_interventions = a.capture_before;
  for (const auto& r : s.interventions) engine::check_intervention_syntax(r);

  // Prompts first: they are cheap to check and the model is not.
  std::vector<engine::PromptSpec> specs;
  if (!a.prompts_file.empty()) specs = engine::read_prompts_file(a.prompts_file);
  for (const auto& p : a.prompts) {
    DMI_CHECK(io::valid_utf8(p), "--prompt is not valid UTF-8");
    specs.push_back({p, {}, false, {}});
  }
  for (const auto& p : a.prompt_ids) specs.push_back({"", engine::parse_id_list(p), true, {}});
  if (specs.empty()) specs.push_back({kDefaultPrompt, {}, false, {}});
  engine::render_chat(specs, a.chat,
                      s.tokenizer_path.empty() ? model::default_tokenizer_path(s.model_path) : s.tokenizer_path);
  for (std::size_t i = 0; i < specs.size(); ++i)
    for (const auto& spec : specs[i].steer) {
      s.interventions.push_back({"steer", spec, std::set<std::int32_t>{static_cast<std::int32_t>(i)}});
      engine::check_intervention_syntax(s.interventions.back());
    }

  auto tokenize = [&](const io::Tokenizer& tok, engine::Job& job) {
    for (std::size_t i = 0; i < specs.size(); ++i) {
      job.prompts.push_back(specs[i].has_ids ? specs[i].ids
                                             : tok.encode(specs[i].text, s.add_special_tokens && !specs[i].chat));
      DMI_CHECK(!job.prompts.back().empty(), "prompt {} is empty after tokenization", i);
      job.prompt_texts.push_back(specs[i].has_ids ? tok.decode(job.prompts.back()) : specs[i].text);
    }
    if (!shard) return;
    // Only this shard's prompts run; the others stay in the file as
    // "skipped", so sequence ids are the same in every shard.
    const engine::ShardPlan sp = engine::plan_shard(*shard, job.prompts, s.max_new_tokens, s.batch_size);
    job.batches = sp.batches;
    job.extra_attributes.emplace_back("shard", sp.record);
    if (!a.quiet)
      std::fprintf(stderr, "dmi-run: shard %lld of %lld (%s): prompts %zu..%zu of %zu, %lld of %lld tokens\n",
                   static_cast<long long>(shard->index), static_cast<long long>(shard->count), shard->source.c_str(),
                   sp.range.begin, sp.range.end, job.prompts.size(), static_cast<long long>(sp.range.weight),
                   static_cast<long long>(sp.weight_total));
  };
  if (a.plan) return plan(a, s, tokenize);

  // A capture records the model's fingerprint (for --replay); patches and
  // ablations check their reference captures against it.
  engine::LoadedModel m = engine::load_for_run(s, /*fingerprint=*/capturing || !s.interventions.empty());
  engine::Job job;
  tokenize(*m.tokenizer, job);
  dmi::apps::install_stop_signals();
  engine::Progress progress;
  engine::ProgressLine line("dmi-run", "sequences", progress, dmi::apps::progress_options(a.quiet, a.progress_every));
  engine::RunOutput out = engine::run_job(s, m, job, &g_stop, &progress);
  line.stop();
  std::vector<std::string> display;  // id prompts are shown without special tokens
  for (std::size_t i = 0; i < specs.size(); ++i)
    display.push_back(specs[i].has_ids ? m.tokenizer->decode(job.prompts[i], true) : specs[i].text);
  nlohmann::json extra;
  if (capturing)
    extra["fingerprint"] = {{"seconds", m.model->fingerprint_seconds()}, {"bytes", m.model->fingerprint_bytes()}};
  report(a, s.model_path, m.model->config().architecture, s.threads, out.results, job.prompt_texts, display,
         out.timings,
         out.capture, out.capture_sites, a.capture.sink == "hdf5" ? s.capture.output : std::string(), *m.tokenizer,
         extra);
  return g_stop.load() ? stopped_status() : 0;
}

nlohmann::json finite(double v) {
  return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(std::isnan(v) ? "nan" : "inf");
}

int run_replay(const Args& a) {
  using namespace dmi;
  for (const CLI::Option* o : a.recorded_settings)
    DMI_CHECK(o->count() == 0, "{} cannot be combined with --replay: a replay uses the recorded settings",
              o->get_name());
  engine::ReplayOptions o;
  o.source = a.replay;
  o.mode = a.replay_mode;
  o.model = a.model;
  o.tokenizer = a.tokenizer;
  o.allow_mismatch = a.allow_mismatch;
  o.capture = engine::recorded_capture_config(a.replay);
  auto given = [&](const std::string& name) {
    for (const CLI::Option* f : a.capture_flags)
      if (f->check_name(name) && f->count() > 0) return true;
    return false;
  };
  if (given("--hooks")) o.capture.hooks = a.capture.hooks;
  if (given("--output")) o.capture.output = a.capture.output;
  if (given("--tokens")) o.capture.tokens = a.capture.tokens;
  if (given("--every")) o.capture.every = a.capture.every;
  if (given("--logits")) o.capture.logits = a.capture.logits;
  if (given("--capture-dtype")) o.capture.capture_dtype = a.capture.capture_dtype;
  if (given("--compression")) o.capture.compression = a.capture.compression;
  if (given("--ring-mb")) o.capture.ring_mb = a.capture.ring_mb;
  o.capture.overwrite = a.capture.overwrite;
  o.capture.flush_every = a.capture.flush_every;
  DMI_CHECK(a.capture.sink == "hdf5" && a.capture.transport == "ring" && a.capture.on_full == "block",
            "--sink, --transport and --on-full cannot be combined with --replay (a replay writes a lossless HDF5 "
            "capture)");
  if (a.threads_flag->count()) o.threads = a.threads;
  if (a.batch_flag->count()) o.batch_size = a.batch_size;
  if (a.atol_flag->count()) o.atol = a.atol;
  if (a.rtol_flag->count()) o.rtol = a.rtol;
  o.seqs = a.seqs;
  o.verify = a.verify;
  o.command_line = a.command_line;
  dmi::apps::install_stop_signals();
  engine::Progress progress;
  engine::ProgressLine line("dmi-run", "sequences replayed", progress,
                            dmi::apps::progress_options(a.quiet, a.progress_every));
  engine::ReplayResult r = engine::replay(o, &g_stop, &progress);
  line.stop();
  if (!a.quiet)
    for (const auto& w : r.warnings) std::fprintf(stderr, "dmi-run: warning: %s\n", w.c_str());
  if (!a.quiet && !r.fingerprint_differences.empty())
    for (const auto& d : r.fingerprint_differences)
      std::fprintf(stderr, "dmi-run: warning: model differs (--allow-mismatch): %s\n", d.c_str());

  // The sequences as the source recorded them, for printing.
  auto src = sink::CaptureFile::open(a.replay);
  std::vector<std::string> texts;
  for (std::size_t i = 0; i < src->n_sequences(); ++i) texts.push_back(src->prompt_text(i));
  nlohmann::json rep{{"source", a.replay},
                     {"mode", r.mode},
                     {"sequences", r.replayed},
                     {"fingerprint_matched", r.fingerprint_matched},
                     {"fingerprint_differences", r.fingerprint_differences},
                     {"fingerprint_seconds", r.fingerprint_seconds},
                     {"fingerprint_bytes", r.fingerprint_bytes},
                     {"warnings", r.warnings}};
  if (!r.source_timings.empty()) rep["source_timings"] = nlohmann::json::parse(r.source_timings, nullptr, false);
  if (r.verified) {
    nlohmann::json v{{"equal", r.equal}, {"bitwise", r.bitwise}, {"atol", r.atol}, {"rtol", r.rtol}};
    v["sequences"] = nlohmann::json::array();
    for (const auto& sd : r.report.sequences) {
      nlohmann::json e{{"seq", sd.seq}, {"equal", sd.equal}};
      if (sd.first_generated_diff)
        e["first_diverging_generated_token"] = {
            {"index", *sd.first_generated_diff}, {"replay", sd.token_a}, {"source", sd.token_b}};
      v["sequences"].push_back(e);
    }
    v["sites"] = nlohmann::json::array();
    for (const auto& sd : r.report.sites) {
      nlohmann::json e{{"site", sd.site},         {"rows", sd.rows},
                       {"max_abs", finite(sd.max_abs)}, {"max_rel", finite(sd.max_rel())},
                       {"mismatches", sd.mismatches},   {"rows_only_replay", sd.rows_only_a},
                       {"rows_only_source", sd.rows_only_b}, {"shape_mismatch", sd.shape_mismatch}};
      if (sd.first_mismatch) e["first_mismatch"] = {{"seq", sd.first_mismatch->first}, {"pos", sd.first_mismatch->second}};
      v["sites"].push_back(e);
    }
    v["sites_only_replay"] = r.report.sites_only_a;
    v["sites_only_source"] = r.report.sites_only_b;
    rep["verify"] = v;
  }
  Args shown = a;
  shown.dtype = src->text_attr("compute_dtype");
  report(shown, src->text_attr("model_path"), src->text_attr("architecture"),
         static_cast<int>(src->int_attr("threads").value_or(0)), r.results, texts, texts, r.timings, r.capture,
         r.capture_sites, r.output, *r.tokenizer, a.json ? nlohmann::json{{"replay", rep}} : nlohmann::json{});
  if (!a.json && r.verified) {
    std::size_t w = 4;
    for (const auto& sd : r.report.sites) w = std::max(w, sd.site.size());
    for (const auto& sd : r.report.sequences)
      if (sd.prompt_differs) fmt::print("sequence {}: prompts differ\n", sd.seq);
      else if (sd.first_generated_diff)
        fmt::print("sequence {}: generated tokens diverge at generated token {} (replay {} vs source {})\n", sd.seq,
                   *sd.first_generated_diff, sd.token_a, sd.token_b);
    if (!a.quiet || !r.equal) {
      fmt::print("{:<{}} {:>7} {:>11} {:>11}  {}\n", "site", w, "rows", "max_abs", "max_rel", "result");
      for (const auto& sd : r.report.sites) {
        std::string verdict = sd.mismatches == 0 && !sd.shape_mismatch ? "ok" : "DIFF";
        if (sd.shape_mismatch) verdict += " (shapes differ)";
        else if (sd.first_mismatch)
          verdict += fmt::format(" (first at seq {} pos {}; {} elements)", sd.first_mismatch->first,
                                 sd.first_mismatch->second, sd.mismatches);
        if (sd.rows_only_a || sd.rows_only_b)
          verdict += fmt::format(" [{} rows only in the replay, {} only in the source]", sd.rows_only_a, sd.rows_only_b);
        fmt::print("{:<{}} {:>7} {:>11.4g} {:>11.4g}  {}\n", sd.site, w, sd.rows, sd.max_abs, sd.max_rel(), verdict);
      }
    }
    if (!r.report.sites_only_a.empty())
      fmt::print("{} site(s) only in the replay, not compared\n", r.report.sites_only_a.size());
    if (!r.report.sites_only_b.empty())
      fmt::print("{} site(s) only in the source, not compared: {}\n", r.report.sites_only_b.size(),
                 fmt::join(r.report.sites_only_b, ", "));
    fmt::print("replay {}: {} sequence(s), {} site(s) compared, {}\n", r.equal ? "verified" : "DIFFERS",
               r.report.sequences.size(), r.report.sites.size(),
               r.bitwise ? std::string("bit for bit") : fmt::format("atol {} rtol {}", r.atol, r.rtol));
  }
  if (g_stop.load()) return stopped_status();
  return r.verified && !r.equal ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "dmi-run: generate text with a Hugging Face model (config.json + safetensors + tokenizer.json) or a "
      "TorchScript model (.pt), capturing what it computes."};
  app.footer(
      "Examples:\n"
      "  dmi-run                                   # the embedded default model, default prompt\n"
      "  dmi-run --prompt 'LAWYER, n.' --max-new-tokens 40\n"
      "  dmi-run --model ./Qwen3-0.6B --dtype bfloat16 --prompt 'Hello' --json\n"
      "  dmi-run --prompts prompts.jsonl --batch-size 8 --temperature 0.8 --top-p 0.9 --seed 1\n"
      "  dmi-run --prompt-ids 1,2,3 --max-new-tokens 8\n"
      "  dmi-run --model ./Qwen3-0.6B --chat --system 'Be brief.' --prompt 'What is a KV cache?'\n"
      "  dmi-run --model ./Qwen3-0.6B --chat --prompts chats.jsonl   # {\"messages\": [{\"role\": ..., \"content\": ...}]}\n"
      "  dmi-run --hooks residual -o run.h5                 # capture residual streams to HDF5\n"
      "  dmi-run --hooks 'blocks.{0-1}.attn.hook_pattern,logits' --logits topk:20 -o attn.h5\n"
      "  dmi-run --hooks full --sink null --json             # transport only, data discarded\n"
      "  dmi-run --model model.pt --hooks resid_post -o ts.h5   # TorchScript (docs/torchscript.md)\n"
      "  dmi-run --model plain.pt --hook-map layers.json --hooks resid_post -o ts.h5\n"
      "  dmi-run --steer happy.safetensors,scale=4,layers=2-3 --prompt 'LOVE, n.'   # steering\n"
      "  dmi-run --ablate 'blocks.1.attn.hook_z,heads=0=zero' --hooks z -o abl.h5\n"
      "  dmi-run --patch clean.h5,site=blocks.0.hook_resid_pre --prompt-ids 5,6,7 -o patched.h5\n"
      "  dmi-run --prompts p.txt --hooks pattern --tokens last-prompt -n 1 -o run.h5 \\\n"
      "          --monitor attn-tracker:heads=heads.json,inst=0:16,data=16:   # prompt-injection detection\n"
      "  dmi-run --prompts big.txt --hooks residual -o big.h5 --progress-every 60 2> log.txt   # a line a minute\n"
      "  dmi-run --prompts big.jsonl --hooks residual --shard 2/8 -o part-{shard}.h5   # shard 2 of 8 (scale-out)\n"
      "  dmi-run --prompts big.jsonl --hooks residual --plan            # expected rows and file size, runs nothing\n"
      "  dmi-run --replay run.h5 --verify                   # re-run a capture, prove it bit-identical\n"
      "  dmi-run --replay run.h5 --replay-mode forced --hooks full -o deep.h5 --seq 3,7   # add sites\n"
      "\nExit status: 0 ok, 2 bad input (one line on stderr), 130 interrupted (143 SIGTERM), 1 internal error;\n"
      "with --replay --verify: 0 equal, 1 different, 2 bad input or internal error.");
  Args a;
  app.add_option("-m,--model", a.model,
                 "HF model directory, or a TorchScript .pt file (default: the embedded model in data/default-model)");
  app.add_option("--tokenizer", a.tokenizer,
                 "tokenizer.json (default: MODEL/tokenizer.json, or tokenizer.json next to a .pt file)");
  auto* hook_map = app.add_option("--hook-map", a.hook_map,
                 "TorchScript only: JSON mapping submodule outputs to sites, inserted as hooks "
                 "(schemas/dmi-hook-map.schema.json)");
  auto* prompt = app.add_option("-p,--prompt", a.prompts, "prompt text (repeatable)");
  auto* chat = app.add_flag("--chat", a.chat.enabled,
                            "render each prompt with the model's chat template (tokenizer_config.json) as a user turn, "
                            "or a JSONL \"messages\" list, with the assistant's generation prompt");
  auto* system = app.add_option("--system", a.chat.system, "with --chat: the system turn before each prompt's messages")
                     ->each([&a](const std::string&) { a.chat.has_system = true; });
  auto* prompts = app.add_option("--prompts", a.prompts_file,
                                 "file of prompts: one per line, or JSONL with \"text\", \"ids\" or (--chat) \"messages\"");
  auto* prompt_ids = app.add_option("--prompt-ids", a.prompt_ids, "prompt as comma-separated token ids (repeatable)");
  auto* max_new = app.add_option("-n,--max-new-tokens", a.max_new_tokens, "tokens to generate per sequence")
      ->capture_default_str()->check(dmi::apps::kNonNegative);
  a.batch_flag = app.add_option("-b,--batch-size", a.batch_size, "sequences per batch")->capture_default_str()
      ->check(dmi::apps::kAtLeastOne);
  auto* dtype = app.add_option("--dtype", a.dtype, "compute dtype")->capture_default_str()
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  auto* temperature = app.add_option("--temperature", a.temperature, "0 = greedy")->capture_default_str()->check(dmi::apps::kNonNegative);
  auto* top_k = app.add_option("--top-k", a.top_k, "sample from the k most likely tokens (0 = off)")->capture_default_str()
      ->check(dmi::apps::kNonNegative);
  auto* top_p = app.add_option("--top-p", a.top_p, "nucleus sampling mass (1 = off)")->capture_default_str()
      ->check(dmi::apps::number_check(0, 1, true, "in (0, 1]"));
  auto* seed = app.add_option("--seed", a.seed, "sampling seed; the same seed gives the same output")->capture_default_str();
  a.threads_flag = app.add_option("-t,--threads", a.threads, "CPU threads (0 = all cores)")->capture_default_str()
      ->check(dmi::apps::kNonNegative);
  auto* no_special = app.add_flag("--no-special-tokens", a.no_special, "do not add the tokenizer's special tokens (e.g. BOS) to prompts");
  auto* ignore_eos = app.add_flag("--ignore-eos", a.ignore_eos, "keep generating past end-of-sequence tokens");
  app.add_flag("--json", a.json, "print a machine-readable summary on stdout");
  auto* cap = app.add_option_group("Capture", "what to capture and where (see docs/capture-format.md)");
  a.capture_flags.push_back(cap->add_option("--hooks", a.capture.hooks,
                  "sites: short names (resid_post, pattern, ...), full names, globs (blocks.*.hook_resid_post), "
                  "layer sets (blocks.{0-3,10}.attn.hook_pattern), presets (residual, attention, mlp, kv, full, "
                  "hf-hidden-states); comma-separated"));
  a.capture_flags.push_back(cap->add_option("-o,--output", a.capture.output, "capture file (HDF5, format dmi-capture v2)"));
  a.capture_flags.push_back(
      cap->add_option("--tokens", a.capture.tokens, "which tokens: all, prompt, generated, last-prompt")
          ->capture_default_str());
  a.capture_flags.push_back(cap->add_option("--every", a.capture.every, "capture every N-th decode step")
                                ->capture_default_str()
                                ->check(dmi::apps::kAtLeastOne));
  a.capture_flags.push_back(
      cap->add_option("--logits", a.capture.logits, "full, or topk:K (values + ids)")->capture_default_str());
  a.capture_flags.push_back(
      cap->add_option("--capture-dtype", a.capture.capture_dtype, "model, float32, float16, bfloat16")
          ->capture_default_str());
  a.capture_flags.push_back(cap->add_option("--ring-mb", a.capture.ring_mb, "payload ring budget in MiB")
                                ->capture_default_str()
                                ->check(dmi::apps::kPositive));
  cap->add_flag("--overwrite", a.capture.overwrite, "replace --output if it exists (otherwise an existing file is an error)");
  cap->add_option("--flush-every", a.capture.flush_every,
                  "seconds between flushes of the capture file: a kill loses at most the last interval, and live "
                  "readers (dmi-inspect --follow, h5py swmr=True) see rows this often")
      ->capture_default_str()
      ->check(dmi::apps::kPositive);
  cap->add_option("--monitor", a.capture.monitors,
                  "online monitor over the captured rows, on the writer thread (repeatable; docs/monitors.md): "
                  "attn-tracker:heads=FILE,inst=SPAN,data=SPAN[,threshold=0.5], "
                  "attn-entropy[:layers=L][,window=16][,threshold=0.5], "
                  "resid-norm[:site=resid_post][,layers=L][,z=4][,warmup=32]; each also [,name=N][,action=log|stop] "
                  "(stop ends a flagged sequence: finish_reason monitor)")
      ->allow_extra_args(false);
  cap->add_option("--monitor-log", a.capture.monitor_log, "write the monitors' JSON lines here instead of stderr");
  cap->add_option("--on-full", a.capture.on_full, "block (lossless) or drop (never stalls; drops are counted)")
      ->capture_default_str();
  cap->add_option("--sink", a.capture.sink, "hdf5, or null (transport only, data discarded)")->capture_default_str();
  a.capture_flags.push_back(
      cap->add_option("--compression", a.capture.compression, "none, gzip:N or shuffle+gzip:N")->capture_default_str());
  cap->add_option("--transport", a.capture.transport,
                  "ring (async Ring², the default), or for comparison: sync (hooks write inline), materialize "
                  "(keep everything, write at the end)")
      ->capture_default_str();
  auto* iv = app.add_option_group("Interventions", "steer, ablate and patch sites (docs/steering.md); applied in "
                                                   "the order given, recorded in the capture, reproduced by --replay");
  auto* steer = iv->add_option("--steer", a.steer,
                               "FILE[,scale=A][,layers=0-3,10][,pos=all|prompt|generated|last-prompt|a:b|1,4|after:TEXT]"
                               "[,mode=add|normadd|set|ablate][,site=resid_post|resid_pre|resid_mid|attn_out|mlp_out]"
                               "[,target=C]: add a steering vector (safetensors, GGUF or HDF5) at block outputs (repeatable)")
                    ->allow_extra_args(false);
  auto* ablate = iv->add_option("--ablate", a.ablate,
                                "SITE[,heads=0,2][,pos=..]=zero|mean:REF.h5|posmean:REF.h5|resample:REF.h5[:SEQ] "
                                "(repeatable)")
                     ->allow_extra_args(false);
  auto* patch = iv->add_option("--patch", a.patch,
                               "SRC.h5[,site=SITES][,heads=H][,pos=..][,src-seq=N][,src-pos=N]: replace activations with SRC's "
                               "captured ones (repeatable)")
                    ->allow_extra_args(false);
  auto* before = iv->add_flag("--capture-before-interventions", a.capture_before,
                              "captured sites record values before the interventions at that site (default: after)");
  auto* rep = app.add_option_group("Replay", "re-run a capture from its own record (docs/replay.md)");
  rep->add_option("--replay", a.replay,
                  "capture file to replay: its prompts, batches, sampling, seed, dtypes and threads, on its model "
                  "(checked by fingerprint); --hooks/-o/--tokens/--logits choose what the replay captures");
  rep->add_option("--replay-mode", a.replay_mode,
                  "exact: generate again, bit-identical on the same machine; forced: teacher-forced, one forward "
                  "pass per batch over the recorded tokens")
      ->capture_default_str()
      ->check(CLI::IsMember({"exact", "forced"}));
  rep->add_flag("--verify", a.verify,
                "compare the replay with the source (tokens, every site in both): exit 0 equal, 1 different; "
                "bit for bit for exact replays of a matching model");
  rep->add_flag("--allow-mismatch", a.allow_mismatch, "replay even if the model's fingerprint differs");
  rep->add_option("--seq", a.seqs, "replay these sequences only: 3,7 or 10:20 (exact mode replays their whole batches)");
  a.atol_flag = rep->add_option("--atol", a.atol, "--verify absolute tolerance (default: by dtype, docs/replay.md)")
                    ->check(dmi::apps::kNonNegative);
  a.rtol_flag = rep->add_option("--rtol", a.rtol, "--verify relative tolerance (default: by dtype)")
                    ->check(dmi::apps::kNonNegative);
  app.add_flag("--plan", a.plan,
               "print the capture's expected rows per site, file size, records and rates at this machine's decode "
               "floor, from the model's config and the prompts; runs nothing (with --shard: that shard's)");
  auto* shard = app.add_option("--shard", a.shard,
                                "K/N: run only shard K (0..N-1) of N, contiguous prompt ranges balanced by tokens, with "
                                "global sequence ids (join with dmi-inspect merge); auto: from a Slurm array task or MPI "
                                "rank. {shard} and {shards} in -o become K and N (docs/scale-out.md)");
  a.recorded_settings = {hook_map, prompt, prompts, prompt_ids, max_new, dtype, temperature, top_k, top_p, seed,
                         no_special, ignore_eos, steer, ablate, patch, before, chat, system, shard};
  app.add_flag("-q,--quiet", a.quiet, "no progress or timing lines on stderr");
  dmi::apps::add_progress_every(app, a.progress_every);
  for (int i = 0; i < argc; ++i) a.command_line += (i ? " " : "") + shell_quote(argv[i]);
  if (int rc = dmi::apps::parse_args("dmi-run", app, argc, argv); rc >= 0) return rc;
  if (a.top_p <= 0.0) {
    std::fprintf(stderr, "dmi-run: error: --top-p must be in (0, 1] (see --help)\n");
    return 2;
  }
  // Interventions in argv order (CLI11 groups values per flag).
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    for (const char* kind : {"steer", "ablate", "patch"}) {
      const std::string flag = std::string("--") + kind;
      if (arg == flag && i + 1 < argc) a.interventions.push_back({kind, argv[i + 1], std::nullopt});
      else if (arg.rfind(flag + "=", 0) == 0) a.interventions.push_back({kind, arg.substr(flag.size() + 1), std::nullopt});
    }
  }
  const bool replaying = !a.replay.empty();
  if (!replaying && (a.verify || a.allow_mismatch || !a.seqs.empty() || a.atol_flag->count() || a.rtol_flag->count())) {
    std::fprintf(stderr, "dmi-run: error: --verify, --allow-mismatch, --seq, --atol and --rtol need --replay FILE "
                         "(see --help)\n");
    return 2;
  }
  if (replaying && a.plan) {
    std::fprintf(stderr, "dmi-run: error: --plan does not apply to --replay (the source's summary shows what it "
                         "holds: dmi-inspect FILE summary)\n");
    return 2;
  }
  if (replaying && (!a.capture.monitors.empty() || !a.capture.monitor_log.empty())) {
    std::fprintf(stderr, "dmi-run: error: --monitor does not apply to --replay (run the monitors on a new run, or "
                         "dmi-inspect attn-tracker on the capture)\n");
    return 2;
  }
  // A replay runs with the recorded compute dtype's thread set-up.
  std::string dtype_for_env = a.dtype;
  if (replaying)
    if (auto d = dmi::engine::recorded_compute_dtype(a.replay); !d.empty()) dtype_for_env = d;
  dmi::engine::prepare_process_env(argc, argv, dmi::engine::math_owner_for(dtype_for_env, a.model));
  // With --verify, status 1 means "different": internal errors are 2 then.
  if (replaying) return dmi::apps::guarded("dmi-run", [&] { return run_replay(a); }, a.verify ? 2 : 1);
  return dmi::apps::guarded("dmi-run", [&] { return run(a); });
}
