// dmi-run: generate text with a Hugging Face model directory on LibTorch.
// A thin front end: flags in, library calls, one line per error.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "app_main.h"
#include "common/error.h"
#include "engine/capture_run.h"
#include "engine/generator.h"
#include "engine/prompts.h"
#include "engine/runtime.h"
#include "io/tokenizer.h"
#include "model/causal_lm.h"

namespace {

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }

std::string default_model_dir() {
  if (const char* env = std::getenv("DMI_DEFAULT_MODEL")) return env;
  return std::string(DMI_SOURCE_DIR) + "/data/default-model";
}

constexpr const char* kDefaultPrompt = "LOVE, n.";

struct Args {
  std::string model, tokenizer, hook_map, prompts_file, dtype = "float32";
  std::vector<std::string> prompts, prompt_ids;
  std::int64_t max_new_tokens = 32, batch_size = 1, top_k = 0;
  double temperature = 0.0, top_p = 1.0;
  std::uint64_t seed = 0;
  int threads = 0;
  bool json = false, no_special = false, quiet = false, ignore_eos = false;
  dmi::engine::CaptureConfig capture;
  std::string command_line;
};

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,+@%") ==
                        std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

int run(const Args& a) {
  using namespace dmi;
  const int threads = engine::configure_threads(a.threads);
  const bool capturing = !a.capture.hooks.empty();
  if (capturing) engine::validate_capture_config(a.capture);
  DMI_CHECK(capturing || a.capture.output.empty(), "--output needs --hooks (which sites to capture)");
  const std::string model_dir = a.model.empty() ? default_model_dir() : a.model;
  const at::ScalarType dtype = a.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;

  // Prompts first: they are cheap to check and the model is not.
  std::vector<engine::PromptSpec> specs;
  if (!a.prompts_file.empty()) specs = engine::read_prompts_file(a.prompts_file);
  for (const auto& p : a.prompts) {
    DMI_CHECK(io::valid_utf8(p), "--prompt is not valid UTF-8");
    specs.push_back({p, {}, false});
  }
  for (const auto& p : a.prompt_ids) specs.push_back({"", engine::parse_id_list(p), true});
  if (specs.empty()) specs.push_back({kDefaultPrompt, {}, false});

  const std::string tok_path = a.tokenizer.empty() ? model::default_tokenizer_path(model_dir) : a.tokenizer;
  auto model = model::load_model(model_dir, dtype, {a.hook_map});
  io::Tokenizer tok = io::Tokenizer::load(tok_path);
  const auto& cfg = model->config();

  std::vector<std::vector<std::int32_t>> ids;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    ids.push_back(specs[i].has_ids ? specs[i].ids : tok.encode(specs[i].text, !a.no_special));
    DMI_CHECK(!ids.back().empty(), "prompt {} is empty after tokenization", i);
  }

  engine::GenerateOptions opts;
  opts.max_new_tokens = a.max_new_tokens;
  opts.batch_size = a.batch_size;
  opts.sampling = {a.temperature, a.top_k, a.top_p, a.seed};
  if (!a.ignore_eos) opts.eos_ids = cfg.eos_token_ids;
  opts.stop = &g_stop;
  const bool show_progress = !a.quiet && specs.size() > static_cast<std::size_t>(a.batch_size);
  if (show_progress)
    opts.on_progress = [](std::size_t done, std::size_t total) {
      std::fprintf(stderr, "dmi-run: %zu/%zu sequences\n", done, total);
    };
  // Capture: the file is created only now, after all input was checked.
  std::unique_ptr<engine::CaptureRun> capture;
  if (capturing) {
    std::int64_t longest = 0;
    for (const auto& p : ids)
      longest = std::max<std::int64_t>(
          longest, std::min<std::int64_t>(p.size() + a.max_new_tokens, cfg.max_position_embeddings));
    sink::RunInfo info;
    info.text = {{"tool", "dmi-run"},
                 {"tool_version", DMI_VERSION},
                 {"command_line", a.command_line},
                 {"model_path", model_dir},
                 {"architecture", cfg.architecture},
                 {"model_config", cfg.json_text},
                 {"tokenizer_path", tok_path},
                 {"selection", a.capture.hooks},
                 {"token_policy", a.capture.tokens},
                 {"logits", a.capture.logits},
                 {"capture_dtype", a.capture.capture_dtype == "model" ? a.dtype : a.capture.capture_dtype},
                 {"compute_dtype", a.dtype},
                 {"on_full", a.capture.on_full},
                 {"sampling", nlohmann::json{{"temperature", a.temperature}, {"top_k", a.top_k}, {"top_p", a.top_p}}.dump()}};
    info.ints = {{"every", a.capture.every},
                 {"seed", static_cast<std::int64_t>(a.seed)},
                 {"max_new_tokens", a.max_new_tokens},
                 {"batch_size", a.batch_size},
                 {"n_layers", cfg.num_layers},
                 {"attention_width", longest}};
    capture = std::make_unique<engine::CaptureRun>(a.capture, cfg, model->site_space(), dtype, longest, info);
    opts.observer = capture->observer();
  }

  engine::Generator gen(*model, opts);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::vector<engine::SequenceResult> results;
  try {
    results = gen.generate(ids);
  } catch (...) {
    if (capture) capture->finish("failed", {});  // the file stays readable
    throw;
  }
  const auto& t = gen.timings();
  std::optional<engine::CaptureResult> cap;
  if (capture) {
    std::vector<sink::SequenceInfo> seqs;
    for (std::size_t i = 0; i < results.size(); ++i)
      seqs.push_back({specs[i].has_ids ? tok.decode(results[i].prompt_ids) : specs[i].text,
                      tok.decode(results[i].output_ids, true), results[i].finish_reason, results[i].prompt_ids,
                      results[i].output_ids});
    cap = capture->finish(g_stop.load() ? "interrupted" : "complete", seqs);
  }

  if (a.json) {
    nlohmann::json j;
    j["model"] = model_dir;
    j["architecture"] = cfg.architecture;
    j["dtype"] = a.dtype;
    j["threads"] = threads;
    j["sampling"] = {{"temperature", a.temperature}, {"top_k", a.top_k}, {"top_p", a.top_p}, {"seed", a.seed}};
    j["sequences"] = nlohmann::json::array();
    for (std::size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      j["sequences"].push_back({{"index", i},
                                {"prompt", specs[i].has_ids ? tok.decode(r.prompt_ids) : specs[i].text},
                                {"prompt_ids", r.prompt_ids},
                                {"output_ids", r.output_ids},
                                {"text", tok.decode(r.output_ids, /*skip_special_tokens=*/true)},
                                {"finish_reason", r.finish_reason}});
    }
    auto rate = [](std::int64_t n, double s) { return s > 0 ? n / s : 0.0; };
    j["timings"] = {{"prefill_tokens", t.prefill_tokens},
                    {"prefill_seconds", t.prefill_seconds},
                    {"prefill_tokens_per_second", rate(t.prefill_tokens, t.prefill_seconds)},
                    {"decode_tokens", t.decode_tokens},
                    {"decode_seconds", t.decode_seconds},
                    {"decode_tokens_per_second", rate(t.decode_tokens, t.decode_seconds)}};
    if (cap)
      j["capture"] = {{"output", a.capture.sink == "hdf5" ? a.capture.output : std::string()},
                      {"sink", a.capture.sink},
                      {"status", cap->status},
                      {"sites", capture->streams().size()},
                      {"records_written", cap->stats.records_written},
                      {"records_dropped", cap->stats.records_dropped},
                      {"bytes_written", cap->stats.bytes_written},
                      {"ring_high_water_bytes", cap->stats.high_water_bytes},
                      {"producer_wait_seconds", cap->stats.producer_wait_seconds},
                      {"sink_cpu_seconds", cap->stats.sink_cpu_seconds}};
    std::cout << j.dump(2) << "\n";
  } else {
    for (std::size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      std::string prompt = specs[i].has_ids ? tok.decode(r.prompt_ids, true) : specs[i].text;
      if (results.size() > 1) std::cout << "[" << i << "] ";
      std::cout << prompt << tok.decode(r.output_ids, true) << "\n";
    }
    if (cap && !a.quiet)
      std::fprintf(stderr, "dmi-run: captured %zu sites, %llu records (%llu dropped), %.1f MB -> %s [%s]\n",
                   capture->streams().size(), static_cast<unsigned long long>(cap->stats.records_written),
                   static_cast<unsigned long long>(cap->stats.records_dropped), cap->stats.bytes_written / 1e6,
                   a.capture.sink == "hdf5" ? a.capture.output.c_str() : "null sink", cap->status.c_str());
    if (!a.quiet)
      std::fprintf(stderr, "dmi-run: prefill %lld tokens at %.1f tok/s, decode %lld tokens at %.1f tok/s\n",
                   static_cast<long long>(t.prefill_tokens), t.prefill_seconds > 0 ? t.prefill_tokens / t.prefill_seconds : 0.0,
                   static_cast<long long>(t.decode_tokens), t.decode_seconds > 0 ? t.decode_tokens / t.decode_seconds : 0.0);
  }
  return g_stop.load() ? 130 : 0;
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
      "  dmi-run --hooks residual -o run.h5                 # capture residual streams to HDF5\n"
      "  dmi-run --hooks 'blocks.{0-1}.attn.hook_pattern,logits' --logits topk:20 -o attn.h5\n"
      "  dmi-run --hooks full --sink null --json             # transport only, data discarded\n"
      "  dmi-run --model model.pt --hooks resid_post -o ts.h5   # TorchScript (docs/torchscript.md)\n"
      "  dmi-run --model plain.pt --hook-map layers.json --hooks resid_post -o ts.h5\n"
      "\nExit status: 0 ok, 2 bad input (one line on stderr), 130 interrupted, 1 internal error.");
  Args a;
  app.add_option("-m,--model", a.model,
                 "HF model directory, or a TorchScript .pt file (default: the embedded model in data/default-model)");
  app.add_option("--tokenizer", a.tokenizer,
                 "tokenizer.json (default: MODEL/tokenizer.json, or tokenizer.json next to a .pt file)");
  app.add_option("--hook-map", a.hook_map,
                 "TorchScript only: JSON mapping submodule outputs to sites, inserted as hooks "
                 "(schemas/dmi-hook-map.schema.json)");
  app.add_option("-p,--prompt", a.prompts, "prompt text (repeatable)");
  app.add_option("--prompts", a.prompts_file, "file of prompts: one per line, or JSONL with \"text\" or \"ids\"");
  app.add_option("--prompt-ids", a.prompt_ids, "prompt as comma-separated token ids (repeatable)");
  app.add_option("-n,--max-new-tokens", a.max_new_tokens, "tokens to generate per sequence")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("-b,--batch-size", a.batch_size, "sequences per batch")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--dtype", a.dtype, "compute dtype")->capture_default_str()
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  app.add_option("--temperature", a.temperature, "0 = greedy")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--top-k", a.top_k, "sample from the k most likely tokens (0 = off)")->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--top-p", a.top_p, "nucleus sampling mass (1 = off)")->capture_default_str()
      ->check(CLI::Range(0.0, 1.0).description("in (0, 1]"));
  app.add_option("--seed", a.seed, "sampling seed; the same seed gives the same output")->capture_default_str();
  app.add_option("-t,--threads", a.threads, "CPU threads (0 = all cores)")->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--no-special-tokens", a.no_special, "do not add the tokenizer's special tokens (e.g. BOS) to prompts");
  app.add_flag("--ignore-eos", a.ignore_eos, "keep generating past end-of-sequence tokens");
  app.add_flag("--json", a.json, "print a machine-readable summary on stdout");
  auto* cap = app.add_option_group("Capture", "what to capture and where (see docs/capture-format.md)");
  cap->add_option("--hooks", a.capture.hooks,
                  "sites: short names (resid_post, pattern, ...), full names, globs (blocks.*.hook_resid_post), "
                  "layer sets (blocks.{0-3,10}.attn.hook_pattern), presets (residual, attention, mlp, kv, full, "
                  "hf-hidden-states); comma-separated");
  cap->add_option("-o,--output", a.capture.output, "capture file (HDF5, format dmi-capture v1)");
  cap->add_option("--tokens", a.capture.tokens, "which tokens: all, prompt, generated, last-prompt")
      ->capture_default_str();
  cap->add_option("--every", a.capture.every, "capture every N-th decode step")->capture_default_str()
      ->check(CLI::PositiveNumber);
  cap->add_option("--logits", a.capture.logits, "full, or topk:K (values + ids)")->capture_default_str();
  cap->add_option("--capture-dtype", a.capture.capture_dtype, "model, float32, float16, bfloat16")
      ->capture_default_str();
  cap->add_option("--ring-mb", a.capture.ring_mb, "payload ring budget in MiB")->capture_default_str()
      ->check(CLI::PositiveNumber);
  cap->add_option("--on-full", a.capture.on_full, "block (lossless) or drop (never stalls; drops are counted)")
      ->capture_default_str();
  cap->add_option("--sink", a.capture.sink, "hdf5, or null (transport only, data discarded)")->capture_default_str();
  cap->add_option("--compression", a.capture.compression, "none, gzip:N or shuffle+gzip:N")->capture_default_str();
  cap->add_option("--transport", a.capture.transport,
                  "ring (async Ring², the default), or for comparison: sync (hooks write inline), materialize "
                  "(keep everything, write at the end)")
      ->capture_default_str();
  app.add_flag("-q,--quiet", a.quiet, "no progress or timing lines on stderr");
  for (int i = 0; i < argc; ++i) a.command_line += (i ? " " : "") + shell_quote(argv[i]);
  if (int rc = dmi::apps::parse_args("dmi-run", app, argc, argv); rc >= 0) return rc;
  if (a.top_p <= 0.0) {
    std::fprintf(stderr, "dmi-run: error: --top-p must be in (0, 1] (see --help)\n");
    return 2;
  }
  dmi::engine::prepare_process_env(argc, argv, dmi::engine::math_owner_for(a.dtype));
  return dmi::apps::guarded("dmi-run", [&] { return run(a); });
}
