// Replay: re-run a capture from its own record (dmi-run --replay).
//
// exact   re-runs the recorded generation: the same prompts in the same
//         batches, rows and padding, the same sampling and seed, thread
//         count and dtypes, on the recorded model (checked by fingerprint).
//         On the same machine and build it is bit-identical.
// forced  teacher forcing: one forward pass per batch over each sequence's
//         recorded prompt and generated tokens, capturing any sites at the
//         recorded (seq, pos) keys; much faster than generating again.
//
// --verify then compares the replay with the source like dmi-diff: bit for
// bit when an exact replay ran on a model whose fingerprint matches,
// otherwise within dtype-aware tolerances (replay_tolerances).
#pragma once

#include <atomic>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "analysis/diff.h"
#include "engine/run.h"

namespace dmi::engine {

struct ReplayOptions {
  std::string source;          // the capture file to replay
  std::string mode = "exact";  // exact | forced
  std::string model;           // empty: the recorded model_path
  std::string tokenizer;       // empty: the recorded one (or the new model's)
  bool allow_mismatch = false; // replay on a model whose fingerprint differs
  CaptureConfig capture;       // start from recorded_capture_config(source)
  std::optional<int> threads;  // default: the recorded thread count
  std::optional<std::int64_t> batch_size;  // forced mode; default: the recorded one
  std::string seqs;            // "3,7", "10:20", "1,4:6"; empty: all
  bool verify = false;
  std::optional<double> atol, rtol;  // default: replay_tolerances()
  std::string command_line;
};

struct ReplayResult {
  std::string output;                  // the replay's capture ("" when discarded after --verify)
  std::string mode;
  std::vector<std::int32_t> replayed;  // sequence ids replayed
  std::vector<SequenceResult> results; // per sequence of the source (skipped ones too)
  Timings timings;
  std::optional<CaptureResult> capture;
  std::size_t capture_sites = 0;
  bool fingerprint_matched = false;
  std::vector<std::string> fingerprint_differences;
  std::vector<std::string> warnings;   // environment differences, version-1 sources
  double fingerprint_seconds = 0;
  std::size_t fingerprint_bytes = 0;
  std::string source_timings;          // the source's "timings" attribute (JSON text), if any
  std::unique_ptr<io::Tokenizer> tokenizer;  // the one the replay loaded, for decoding
  // --verify
  bool verified = false, equal = false, bitwise = false;
  double atol = 0, rtol = 0;
  analysis::DiffReport report;
};

// The compute dtype a capture was recorded with ("" if unreadable): dmi-run
// needs it before it sets up the process for that dtype.
std::string recorded_compute_dtype(const std::string& path);

// The capture settings a replay starts from: the source's selection, token
// policy, --every, logits, capture dtype and compression (lossless ring).
CaptureConfig recorded_capture_config(const std::string& path);

// Default --verify tolerances for a replay that cannot be bit-identical, by
// the coarser of the compute and capture dtypes (docs/replay.md).
std::pair<double, double> replay_tolerances(const std::string& compute_dtype, const std::string& capture_dtype);

// The hash of a capture's record (model fingerprint, settings, environment,
// tokens and batch composition), "xxh3-128:<hex>"; a replay stores it in
// replay_of.
std::string record_hash(const std::string& path);

// Runs the replay. Bad input (a non-dmi file, a missing or different model,
// --seq out of range, ...) throws dmi::Error before any output is created.
ReplayResult replay(const ReplayOptions& opts, const std::atomic<bool>* stop,
                    Progress* progress);

}  // namespace dmi::engine
