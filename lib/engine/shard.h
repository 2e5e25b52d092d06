// Shards: dmi-run --shard K/N runs the K-th of N deterministic parts of a
// prompt set, so that a job array (Slurm) or MPI ranks capture one logical
// run in N files that `dmi-inspect merge` joins (docs/scale-out.md).
//
// Shards are contiguous ranges of prompts balanced by token count: prompt
// i weighs its prompt tokens plus max_new_tokens (what it can cost), and
// shard K takes the prompts whose weight midpoint falls in the K-th N-th of
// the total. Every shard sees every prompt, computes the same split, and
// keeps the global sequence ids in its file.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dmi::engine {

struct ShardSpec {
  std::int64_t index = 0, count = 1;
  // Where it came from: "--shard", or the environment variables read by
  // --shard auto (e.g. "SLURM_ARRAY_TASK_ID").
  std::string source = "--shard";
};

// Reads an environment variable (nullptr when unset); tests pass their own.
using EnvLookup = std::function<const char*(const char*)>;

// "K/N" (0 <= K < N) or "auto": a Slurm array task (SLURM_ARRAY_TASK_ID,
// _MIN, _MAX or _COUNT, _STEP), an Open MPI rank (OMPI_COMM_WORLD_RANK,
// _SIZE), an MPICH/PMI rank (PMI_RANK, PMI_SIZE) or a Slurm task
// (SLURM_PROCID, SLURM_NTASKS), first found first. Errors name the value.
ShardSpec parse_shard(const std::string& spec, const EnvLookup& env = {});

// The prompts of shard `index` of `count`: [begin, end).
struct ShardRange {
  std::size_t begin = 0, end = 0;
  std::int64_t weight = 0;  // its prompts' weights summed
};
// weights[i]: prompt i's weight (prompt tokens + max_new_tokens).
std::vector<ShardRange> split_shards(const std::vector<std::int64_t>& weights, std::int64_t count);

// The batches a shard runs: its range, batch_size prompts at a time.
std::vector<std::vector<std::size_t>> shard_batches(const ShardRange& r, std::int64_t batch_size);

// A shard of a run's prompts: its range, the batches it runs and the
// record its capture carries (root attribute "shard").
struct ShardPlan {
  ShardRange range;
  std::int64_t weight_total = 0;
  std::vector<std::vector<std::size_t>> batches;
  std::string record;
};
ShardPlan plan_shard(const ShardSpec& s, const std::vector<std::vector<std::int32_t>>& prompts,
                     std::int64_t max_new_tokens, std::int64_t batch_size);

// `{shard}` and `{shards}` in an output path become K and N.
std::string shard_output_path(const std::string& path, const ShardSpec& s);

// The root attribute "shard" of a shard's capture (JSON text).
std::string shard_record(const ShardSpec& s, const std::vector<ShardRange>& ranges, std::size_t n_prompts);

}  // namespace dmi::engine
