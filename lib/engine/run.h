// One dmi-run invocation as a library call: settings and prompts in,
// generated sequences and (optionally) a capture file out. dmi-run's flags
// map onto RunSettings; replay (engine/replay.h) rebuilds RunSettings from a
// capture's record and runs the same code.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/capture_run.h"
#include "engine/progress.h"
#include "engine/generator.h"
#include "engine/interventions.h"
#include "engine/sampler.h"
#include "io/fingerprint.h"
#include "io/tokenizer.h"
#include "model/causal_lm.h"

namespace dmi::engine {

// Everything that decides the numbers of a run (with the prompts), as
// recorded in a capture's root attributes (docs/capture-format.md).
struct RunSettings {
  std::string model_path;      // HF directory or TorchScript .pt
  std::string tokenizer_path;  // empty: model::default_tokenizer_path
  std::string hook_map;        // TorchScript only
  std::string dtype = "float32";
  int threads = 1;             // as configured (engine::configure_threads)
  std::int64_t max_new_tokens = 32, batch_size = 1;
  SamplingOptions sampling;
  bool ignore_eos = false;
  bool add_special_tokens = true;
  CaptureConfig capture;       // capture.hooks empty: nothing captured
  // --steer / --ablate / --patch in the order given (and per-row ones).
  std::vector<InterventionRequest> interventions;
  bool capture_before_interventions = false;
  std::string command_line;
};

// A model and tokenizer loaded for a run, with the fingerprint of the files
// they came from (when capturing).
struct LoadedModel {
  std::unique_ptr<model::CausalLM> model;
  std::unique_ptr<io::Tokenizer> tokenizer;
  std::string tokenizer_path;
  // config.json, tokenizer.json, tokenizer_config.json (SHA-256) and the
  // weight files or the archive (XXH3-128); empty unless fingerprinted.
  io::Fingerprint fingerprint;
};
LoadedModel load_for_run(const RunSettings& s, bool fingerprint);

// The prompts of a run and how to batch them.
struct Job {
  std::vector<std::vector<std::int32_t>> prompts;  // token ids, checked by the generator
  std::vector<std::string> prompt_texts;           // as given (text prompts) or decoded (id prompts)
  // Optional (replay): explicit batches and per-prompt interruption points;
  // see GenerateOptions.
  std::vector<std::vector<std::size_t>> batches;
  std::vector<std::int64_t> interrupt_after;
  std::vector<std::string> interrupt_reason;
  // Root attributes added to the capture's (replay_of, ...).
  std::vector<std::pair<std::string, std::string>> extra_attributes;
  // Attention row width of the capture; 0: the longest sequence this run can
  // produce.
  std::int64_t attention_width = 0;
};

struct RunOutput {
  std::vector<SequenceResult> results;
  Timings timings;
  std::optional<CaptureResult> capture;
  std::size_t capture_sites = 0;
};

// Generates (and captures, when s.capture.hooks is set). The capture file is
// created only once everything was checked; it is closed as "complete",
// "interrupted" (stop was set) or "failed" (an exception, rethrown).
// progress (may be null): sequences done, tokens, and the capture's writer,
// updated as the run goes (engine/progress.h).
RunOutput run_job(const RunSettings& s, LoadedModel& m, const Job& job, const std::atomic<bool>* stop,
                  Progress* progress);

// The width of a capture's attention rows: the longest sequence (prompt +
// max_new_tokens, within the model's context) any of the prompts can make.
std::int64_t attention_width(const std::vector<std::vector<std::int32_t>>& prompts, std::int64_t max_new_tokens,
                             std::int64_t context);

// The /sequences entries of a finished run.
std::vector<sink::SequenceInfo> sequence_infos(const Job& job, const std::vector<SequenceResult>& results,
                                               const io::Tokenizer& tok);

// {"prefill_tokens", "prefill_seconds", "decode_tokens", "decode_seconds"}
// as JSON text, for the capture's "timings" attribute.
std::string timings_json(const Timings& t);

// The capture's root attributes for a run (its record); interventions_json:
// the resolved interventions' record ("[]" when none).
sink::RunInfo make_run_info(const RunSettings& s, const LoadedModel& m, std::int64_t attention_width,
                            const std::string& interventions_json = "[]");

// The interventions of a run, resolved against its model and prompts, and
// the Observer the model gets: interventions in front of the capture.
struct Hooks {
  ResolvedInterventions resolved;
  std::unique_ptr<hooks::Intervener> intervener;
  std::unique_ptr<hooks::HookChain> chain;
  // The observer for the model: capture alone, interventions alone, or both.
  hooks::Observer* observer(hooks::Observer* capture);
};
std::unique_ptr<Hooks> make_hooks(const RunSettings& s, const LoadedModel& m,
                                  const std::vector<std::vector<std::int32_t>>& prompts);

}  // namespace dmi::engine
