// Batched generation over a CausalLM: left-padded prefill into a
// preallocated KV cache, then one decode step per new token.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/sampler.h"
#include "model/causal_lm.h"

namespace dmi::engine {

struct GenerateOptions {
  std::int64_t max_new_tokens = 32;
  std::int64_t batch_size = 1;
  SamplingOptions sampling;
  std::vector<std::int64_t> eos_ids;  // generation of a sequence stops at any of these
  // Called with each sequence's logits row [vocab] (float32) before the token
  // at `step` (0 = the first generated token) is chosen. For tests and tools.
  std::function<void(std::size_t seq, std::int64_t step, const at::Tensor& logits)> on_logits;
  // Called after each decode step's sampling with the tokens chosen: their
  // sequences, positions and ids (the capture's token log).
  std::function<void(std::int32_t step, const std::vector<std::int32_t>& seq, const std::vector<std::int32_t>& pos,
                     const std::vector<std::int32_t>& ids)>
      on_tokens;
  // Called after each batch: (sequences done, total).
  std::function<void(std::size_t, std::size_t)> on_progress;
  // Set from another thread (a signal handler) to stop after the current step.
  const std::atomic<bool>* stop = nullptr;
  hooks::Observer* observer = nullptr;
  // Replay (engine/replay.h) reproduces a recorded run with these; all are
  // optional. batches: the batches to run, as indices into the prompts, each
  // prompt in at most one (default: consecutive groups of batch_size; a
  // prompt in no batch is not run: "skipped"). interrupt_after: per prompt, stop it as "interrupted" once it has this
  // many new tokens (-1: no limit).
  std::vector<std::vector<std::size_t>> batches;
  std::vector<std::int64_t> interrupt_after;
  // The finish_reason interrupt_after gives, per prompt (default
  // "interrupted"; replay reproduces a monitor's stop as "monitor").
  std::vector<std::string> interrupt_reason;
  // Asked after each token a sequence gets (with its index among the
  // prompts): true ends it with finish_reason "monitor" (dmi-run --monitor
  // ...,action=stop).
  std::function<bool(std::size_t seq)> stop_sequence;
};

struct SequenceResult {
  std::vector<std::int32_t> prompt_ids;
  std::vector<std::int32_t> output_ids;
  // "eos", "length", "context", "interrupted" (stopped, or its batch never
  // ran), or "skipped" (in none of GenerateOptions::batches)
  std::string finish_reason;
  // Where it ran: batch number, row in that batch, and left padding in
  // tokens; -1 for a prompt that never ran (interrupted before its batch).
  std::int32_t batch = -1, row = -1, left_pad = -1;
};

struct Timings {
  std::int64_t prefill_tokens = 0, decode_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  std::vector<double> step_seconds;  // each decode step: sampling + forward
};

class Generator {
 public:
  Generator(model::CausalLM& model, GenerateOptions opts);
  // Prompts are token ids, already checked against the vocabulary.
  std::vector<SequenceResult> generate(const std::vector<std::vector<std::int32_t>>& prompts);
  const Timings& timings() const { return timings_; }
  // The results so far: after generate() threw, the batches that finished
  // and the tokens of the one that failed (its live sequences still say
  // "interrupted", with batch >= 0).
  const std::vector<SequenceResult>& partial() const { return partial_; }

 private:
  void run_batch(const std::vector<std::vector<std::int32_t>>& prompts, const std::vector<std::size_t>& members,
                 std::int32_t batch_index, std::vector<SequenceResult>& out);
  model::CausalLM& model_;
  GenerateOptions opts_;
  Timings timings_;
  std::vector<SequenceResult> partial_;
};

}  // namespace dmi::engine
