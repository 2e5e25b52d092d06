// dmi-run --plan: what a capture will cost before it runs — rows per site,
// the file's size, records, and the rates the writer must sustain at the
// machine's decode floor. A storage plan for big prompt sets and shards
// (docs/scale-out.md).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/capture_run.h"
#include "engine/run.h"
#include "hooks/selection.h"
#include "io/config.h"

namespace dmi::engine {

struct PlanInput {
  io::ModelConfig cfg;
  hooks::SiteSpace space;
  at::ScalarType model_dtype = at::kFloat;
  // Bytes of weights one decode step reads (0: estimate from cfg).
  std::size_t weight_bytes = 0;
  CaptureConfig capture;
  std::int64_t max_new_tokens = 32, batch_size = 1;
  std::vector<std::vector<std::int32_t>> prompts;  // all prompts (a shard's file records every one)
  std::vector<std::size_t> prompt_text_bytes;      // their text's UTF-8 bytes
  // The batches that run (a shard's); empty: all prompts, batch_size at a time.
  std::vector<std::vector<std::size_t>> batches;
  double read_bandwidth_gbs = 0;  // measured (engine::measure_read_bandwidth_gbs); 0: no rates
};

struct PlanSite {
  std::string name;
  std::vector<std::int64_t> row_shape;
  std::string dtype;
  std::int64_t rows = 0;       // at most
  std::int64_t row_bytes = 0;  // data (and ids) + seq + pos
};

struct Plan {
  std::size_t prompts = 0, running = 0;  // in the file / that run
  std::int64_t prompt_tokens = 0;        // of those that run
  std::int64_t max_tokens = 0;           // prompt + generated tokens of those that run, at most
  std::int64_t batches = 0, forward_passes = 0, decode_steps = 0;
  std::int64_t attention_width = 0;
  std::vector<PlanSite> sites;
  std::int64_t rows = 0;            // all sites
  std::int64_t records = 0;         // one per site per forward pass that captures rows
  std::uint64_t data_bytes = 0;     // site rows (data, ids, seq, pos)
  std::uint64_t sequence_bytes = 0; // /sequences and /token_log
  std::uint64_t metadata_bytes = 0; // HDF5 objects and attributes (estimated)
  std::uint64_t file_bytes = 0;     // the sum: an upper bound up to the metadata estimate
  std::uint64_t decode_step_bytes = 0;     // site bytes one decode step of a full batch adds
  std::int64_t decode_step_records = 0;    // records of one captured decode step
  std::size_t weight_bytes = 0;
  double read_bandwidth_gbs = 0, floor_ms = 0;
  double records_per_second = 0, bytes_per_second = 0;  // at the decode floor (upper bounds)
};

// What --plan needs of the model, without its weights: config, sites,
// tokenizer; a TorchScript model is loaded (its sites are in the archive).
struct PlanModel {
  io::ModelConfig cfg;
  hooks::SiteSpace space;
  std::size_t weight_bytes = 0;  // 0: estimate_weight_bytes
  std::unique_ptr<io::Tokenizer> tokenizer;
};
PlanModel load_plan_model(const RunSettings& s);

Plan make_plan(const PlanInput& in);
nlohmann::json plan_json(const Plan& p);
std::string plan_text(const Plan& p);

// Bytes of weights a decode step of this architecture reads: every layer's
// projections and norms plus the LM head (embedding rows are negligible).
std::size_t estimate_weight_bytes(const io::ModelConfig& cfg, at::ScalarType dtype);

}  // namespace dmi::engine
