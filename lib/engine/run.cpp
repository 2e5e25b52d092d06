#include "engine/run.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "engine/progress.h"
#include "engine/runtime.h"

namespace dmi::engine {

namespace {

bool is_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string dir_of(const std::string& p) {
  const auto slash = p.rfind('/');
  return slash == std::string::npos ? std::string(".") : p.substr(0, slash);
}

}  // namespace

LoadedModel load_for_run(const RunSettings& s, bool fingerprint) {
  LoadedModel m;
  m.tokenizer_path = s.tokenizer_path.empty() ? model::default_tokenizer_path(s.model_path) : s.tokenizer_path;
  const at::ScalarType dtype = s.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  model::LoadOptions lo;
  lo.hook_map = s.hook_map;
  lo.fingerprint = fingerprint;
  m.model = model::load_model(s.model_path, dtype, lo);
  m.tokenizer = std::make_unique<io::Tokenizer>(io::Tokenizer::load(m.tokenizer_path));
  DMI_CHECK(m.tokenizer->vocab_size() <= m.model->config().vocab_size,
            "{}: has token id {}, but the model's vocab_size is {} ({}): tokenizer and model do not match",
            m.tokenizer_path, m.tokenizer->vocab_size() - 1, m.model->config().vocab_size, s.model_path);
  if (fingerprint) {
    m.fingerprint = m.model->weights_fingerprint();
    // config.json: an HF directory's, or the one next to a TorchScript file
    // when there is one (otherwise it is inside the hashed archive).
    const bool torchscript = is_file(s.model_path);
    const std::string config = (torchscript ? dir_of(s.model_path) : s.model_path) + "/config.json";
    if (!torchscript || is_file(config)) m.fingerprint["config.json"] = io::sha256_file(config);
    m.fingerprint["tokenizer.json"] = io::sha256_file(m.tokenizer_path);
    const std::string tok_config = dir_of(m.tokenizer_path) + "/tokenizer_config.json";
    if (is_file(tok_config)) m.fingerprint["tokenizer_config.json"] = io::sha256_file(tok_config);
    if (!s.hook_map.empty()) m.fingerprint["hook_map"] = io::sha256_file(s.hook_map);
  }
  return m;
}

sink::RunInfo make_run_info(const RunSettings& s, const LoadedModel& m, std::int64_t attention_width,
                            const std::string& interventions_json) {
  const auto& cfg = m.model->config();
  const auto& c = s.capture;
  nlohmann::json fp(m.fingerprint);
  std::vector<std::int64_t> eos = s.ignore_eos ? std::vector<std::int64_t>{} : cfg.eos_token_ids;
  sink::RunInfo info;
  info.text = {{"tool", "dmi-run"},
               {"tool_version", DMI_VERSION},
               {"command_line", s.command_line},
               {"model_path", s.model_path},
               {"architecture", cfg.architecture},
               {"model_config", cfg.json_text},
               {"tokenizer_path", m.tokenizer_path},
               {"hook_map", s.hook_map},
               {"model_fingerprint", fp.dump()},
               {"selection", c.hooks},
               {"token_policy", c.tokens},
               {"logits", c.logits},
               {"capture_dtype", c.capture_dtype == "model" ? s.dtype : c.capture_dtype},
               {"compute_dtype", s.dtype},
               {"on_full", c.on_full},
               {"transport", c.transport},
               {"sampling", nlohmann::json{{"temperature", s.sampling.temperature},
                                           {"top_k", s.sampling.top_k},
                                           {"top_p", s.sampling.top_p}}
                                .dump()},
               {"eos_token_ids", nlohmann::json(eos).dump()},
               {"environment", environment_json(s.threads)},
               {"interventions", interventions_json}};
  info.ints = {{"every", c.every},
               {"seed", static_cast<std::int64_t>(s.sampling.seed)},
               {"max_new_tokens", s.max_new_tokens},
               {"batch_size", s.batch_size},
               {"threads", s.threads},
               {"ignore_eos", s.ignore_eos ? 1 : 0},
               {"add_special_tokens", s.add_special_tokens ? 1 : 0},
               {"capture_before_interventions", s.capture_before_interventions ? 1 : 0},
               {"n_layers", cfg.num_layers},
               {"attention_width", attention_width}};
  return info;
}

std::int64_t attention_width(const std::vector<std::vector<std::int32_t>>& prompts, std::int64_t max_new_tokens,
                             std::int64_t context) {
  std::int64_t width = 0;
  for (const auto& p : prompts)
    width = std::max<std::int64_t>(width, std::min<std::int64_t>(static_cast<std::int64_t>(p.size()) + max_new_tokens,
                                                                 context));
  return width;
}

std::vector<sink::SequenceInfo> sequence_infos(const Job& job, const std::vector<SequenceResult>& results,
                                               const io::Tokenizer& tok) {
  std::vector<sink::SequenceInfo> seqs;
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    sink::SequenceInfo si{job.prompt_texts.at(i), tok.decode(r.output_ids, true), r.finish_reason, r.prompt_ids,
                          r.output_ids};
    si.batch = r.batch;
    si.row = r.row;
    si.left_pad = r.left_pad;
    seqs.push_back(std::move(si));
  }
  return seqs;
}

hooks::Observer* Hooks::observer(hooks::Observer* capture) {
  if (!intervener) return capture;
  if (!chain) chain = std::make_unique<hooks::HookChain>(intervener.get(), capture, false);
  return chain.get();
}

std::unique_ptr<Hooks> make_hooks(const RunSettings& s, const LoadedModel& m,
                                  const std::vector<std::vector<std::int32_t>>& prompts) {
  auto h = std::make_unique<Hooks>();
  h->resolved.record_json = "[]";
  if (s.interventions.empty()) return h;
  DMI_CHECK(m.model->supports_interventions(),
            "--steer, --ablate and --patch need an HF model directory; TorchScript models are read-only");
  const hooks::SiteSpace space = m.model->site_space();
  h->resolved = resolve_interventions(s.interventions, {m.model->config(), space, *m.tokenizer, m.fingerprint}, prompts);
  std::vector<std::int64_t> plen;
  for (const auto& p : prompts) plen.push_back(static_cast<std::int64_t>(p.size()));
  h->intervener = std::make_unique<hooks::Intervener>(h->resolved.list, std::move(plen));
  return h;
}

std::string timings_json(const Timings& t) {
  return nlohmann::json{{"prefill_tokens", t.prefill_tokens},
                        {"prefill_seconds", t.prefill_seconds},
                        {"decode_tokens", t.decode_tokens},
                        {"decode_seconds", t.decode_seconds}}
      .dump();
}

RunOutput run_job(const RunSettings& s, LoadedModel& m, const Job& job, const std::atomic<bool>* stop,
                  Progress* progress) {
  const auto& cfg = m.model->config();
  DMI_CHECK(job.prompt_texts.size() == job.prompts.size(), "one prompt text per prompt");
  GenerateOptions opts;
  opts.max_new_tokens = s.max_new_tokens;
  opts.batch_size = s.batch_size;
  opts.sampling = s.sampling;
  if (!s.ignore_eos) opts.eos_ids = cfg.eos_token_ids;
  opts.stop = stop;
  // The prompts that run: those in job.batches when it is given (a shard,
  // a replay of some sequences), otherwise all.
  std::vector<std::size_t> running;
  for (const auto& b : job.batches) running.insert(running.end(), b.begin(), b.end());
  if (job.batches.empty())
    for (std::size_t i = 0; i < job.prompts.size(); ++i) running.push_back(i);
  if (progress) {
    progress->total = running.size();
    std::int64_t expected = 0;
    for (std::size_t i : running)
      expected += std::max<std::int64_t>(
          0, std::min<std::int64_t>(s.max_new_tokens,
                                    cfg.max_position_embeddings - static_cast<std::int64_t>(job.prompts.at(i).size())));
    progress->expected_tokens = expected;
    opts.on_progress = [progress](std::size_t done, std::size_t) { progress->done = done; };
  }
  opts.batches = job.batches;
  opts.interrupt_after = job.interrupt_after;
  opts.interrupt_reason = job.interrupt_reason;

  auto hooks = make_hooks(s, m, job.prompts);
  // Capture: the file is created only now, after all input was checked.
  std::unique_ptr<CaptureRun> capture;
  if (!s.capture.hooks.empty()) {
    const std::int64_t width = job.attention_width ? job.attention_width
                                                   : attention_width(job.prompts, s.max_new_tokens,
                                                                     cfg.max_position_embeddings);
    sink::RunInfo info = make_run_info(s, m, width, hooks->resolved.record_json);
    for (const auto& a : job.extra_attributes) info.text.push_back(a);
    info.prompt_texts = job.prompt_texts;
    info.prompt_ids = job.prompts;
    const at::ScalarType dtype = s.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
    capture = std::make_unique<CaptureRun>(s.capture, cfg, m.model->site_space(), dtype, width, info,
                                           m.tokenizer.get(), running);
    opts.on_tokens = [c = capture.get()](std::int32_t step, const std::vector<std::int32_t>& seq,
                                         const std::vector<std::int32_t>& pos, const std::vector<std::int32_t>& ids) {
      c->log_tokens(step, seq, pos, ids);
    };
    if (progress) capture->report(*progress);
    if (capture->stops_sequences())
      opts.stop_sequence = [c = capture.get()](std::size_t seq) { return c->monitor_stopped(seq); };
  }
  if (hooks->intervener)
    hooks->chain = std::make_unique<hooks::HookChain>(hooks->intervener.get(), capture ? capture->observer() : nullptr,
                                                      s.capture_before_interventions);
  opts.observer = hooks->observer(capture ? capture->observer() : nullptr);

  if (progress) {
    // Tokens as they are chosen; the capture's writer at most 5 times a second.
    opts.on_tokens = [log = std::move(opts.on_tokens), progress, c = capture.get(), last = 0.0](
                         std::int32_t step, const std::vector<std::int32_t>& seq, const std::vector<std::int32_t>& pos,
                         const std::vector<std::int32_t>& ids) mutable {
      if (log) log(step, seq, pos, ids);
      progress->tokens += static_cast<std::int64_t>(ids.size());
      const double t = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
      if (c && t - last >= 0.2) {
        c->report(*progress);
        last = t;
      }
    };
  }
  Generator gen(*m.model, opts);
  RunOutput out;
  try {
    out.results = gen.generate(job.prompts);
  } catch (...) {
    if (capture) {
      // The file stays readable and keeps what ran: sequences of the batch
      // that failed are recorded with finish_reason "failed".
      std::vector<SequenceResult> partial = gen.partial();
      for (auto& r : partial)
        if (r.batch >= 0 && r.finish_reason == "interrupted") r.finish_reason = "failed";
      try {
        capture->finish("failed", sequence_infos(job, partial, *m.tokenizer), timings_json(gen.timings()));
      } catch (...) {
      }
    }
    throw;
  }
  out.timings = gen.timings();
  if (capture) {
    out.capture = capture->finish(stop && stop->load() ? "interrupted" : "complete",
                                  sequence_infos(job, out.results, *m.tokenizer), timings_json(out.timings));
    out.capture_sites = capture->streams().size();
    if (progress) capture->report(*progress);
  }
  return out;
}

}  // namespace dmi::engine
