#include "engine/shard.h"

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/error.h"

namespace dmi::engine {

namespace {

// A non-negative decimal integer, or nothing.
std::optional<std::int64_t> parse_count(const std::string& s) {
  if (s.empty() || s.size() > 12 || s.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoll(s);
}

// A variable that must hold a non-negative integer when set.
std::optional<std::int64_t> env_int(const EnvLookup& env, const char* name) {
  const char* v = env(name);
  if (!v) return std::nullopt;
  auto n = parse_count(v);
  DMI_CHECK(n, "--shard auto: {}='{}' is not a non-negative integer", name, v);
  return n;
}

ShardSpec from_env(const EnvLookup& env) {
  ShardSpec s;
  if (auto id = env_int(env, "SLURM_ARRAY_TASK_ID")) {
    const std::int64_t min = env_int(env, "SLURM_ARRAY_TASK_MIN").value_or(0);
    const std::int64_t step = env_int(env, "SLURM_ARRAY_TASK_STEP").value_or(1);
    DMI_CHECK(step >= 1, "--shard auto: SLURM_ARRAY_TASK_STEP=0");
    DMI_CHECK(*id >= min && (*id - min) % step == 0,
              "--shard auto: SLURM_ARRAY_TASK_ID={} is not in the array {}-...:{}", *id, min, step);
    s.index = (*id - min) / step;
    if (auto count = env_int(env, "SLURM_ARRAY_TASK_COUNT")) {
      s.count = *count;
    } else {
      auto max = env_int(env, "SLURM_ARRAY_TASK_MAX");
      DMI_CHECK(max && *max >= min, "--shard auto: SLURM_ARRAY_TASK_ID is set but neither SLURM_ARRAY_TASK_COUNT nor "
                "SLURM_ARRAY_TASK_MAX");
      s.count = (*max - min) / step + 1;
    }
    s.source = "SLURM_ARRAY_TASK_ID";
  } else if (auto rank = env_int(env, "OMPI_COMM_WORLD_RANK")) {
    auto size = env_int(env, "OMPI_COMM_WORLD_SIZE");
    DMI_CHECK(size, "--shard auto: OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not");
    s = {*rank, *size, "OMPI_COMM_WORLD_RANK"};
  } else if (auto prank = env_int(env, "PMI_RANK")) {
    auto size = env_int(env, "PMI_SIZE");
    DMI_CHECK(size, "--shard auto: PMI_RANK is set but PMI_SIZE is not");
    s = {*prank, *size, "PMI_RANK"};
  } else if (auto proc = env_int(env, "SLURM_PROCID")) {
    auto size = env_int(env, "SLURM_NTASKS");
    DMI_CHECK(size, "--shard auto: SLURM_PROCID is set but SLURM_NTASKS is not");
    s = {*proc, *size, "SLURM_PROCID"};
  } else {
    DMI_FAIL("--shard auto: no Slurm array task or MPI rank in the environment (SLURM_ARRAY_TASK_ID, "
             "OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID); give --shard K/N");
  }
  DMI_CHECK(s.count >= 1 && s.index < s.count, "--shard auto: {} gives shard {} of {}, which does not exist", s.source,
            s.index, s.count);
  return s;
}

}  // namespace

ShardSpec parse_shard(const std::string& spec, const EnvLookup& env) {
  if (spec == "auto") return from_env(env ? env : EnvLookup([](const char* n) { return std::getenv(n); }));
  const auto slash = spec.find('/');
  auto k = slash == std::string::npos ? std::nullopt : parse_count(spec.substr(0, slash));
  auto n = slash == std::string::npos ? std::nullopt : parse_count(spec.substr(slash + 1));
  DMI_CHECK(k && n, "--shard '{}' is not K/N (e.g. 0/4, shard 0 of 4) or auto", spec);
  DMI_CHECK(*n >= 1 && *k < *n, "--shard {}: K must be in 0..N-1 (shards are numbered from 0)", spec);
  return {*k, *n, "--shard"};
}

std::vector<ShardRange> split_shards(const std::vector<std::int64_t>& weights, std::int64_t count) {
  DMI_CHECK(count >= 1, "a prompt set splits into at least 1 shard, not {}", count);
  // Prompt i goes to the shard whose share of the total holds its weight's
  // midpoint: floor(count * (prefix + w/2) / total), monotone in i, so each
  // shard is a contiguous range and no shard exceeds its share by more than
  // one prompt's weight. In integers (2x to keep the half exact).
  std::int64_t total = 0;
  for (auto w : weights) {
    DMI_CHECK(w >= 0, "prompt weights are non-negative");
    total += w;
  }
  std::vector<ShardRange> out(static_cast<std::size_t>(count));
  std::int64_t prefix = 0;
  std::size_t i = 0;
  for (std::int64_t k = 0; k < count; ++k) {
    ShardRange& r = out[static_cast<std::size_t>(k)];
    r.begin = i;
    while (i < weights.size()) {
      const std::int64_t mid2 = 2 * prefix + weights[i];  // 2 * midpoint
      // shard of prompt i: floor(count * mid2 / (2 * total)); all-zero weights split by count
      const std::int64_t owner = total > 0 ? static_cast<std::int64_t>(
                                                 (static_cast<__int128>(count) * mid2) / (2 * static_cast<__int128>(total)))
                                           : static_cast<std::int64_t>(i * count / weights.size());
      if (std::min(owner, count - 1) != k) break;
      prefix += weights[i];
      r.weight += weights[i];
      ++i;
    }
    r.end = i;
  }
  return out;
}

std::vector<std::vector<std::size_t>> shard_batches(const ShardRange& r, std::int64_t batch_size) {
  DMI_CHECK(batch_size >= 1, "--batch-size must be at least 1");
  std::vector<std::vector<std::size_t>> out;
  for (std::size_t i = r.begin; i < r.end; ++i) {
    if ((i - r.begin) % static_cast<std::size_t>(batch_size) == 0) out.emplace_back();
    out.back().push_back(i);
  }
  return out;
}

ShardPlan plan_shard(const ShardSpec& s, const std::vector<std::vector<std::int32_t>>& prompts,
                     std::int64_t max_new_tokens, std::int64_t batch_size) {
  std::vector<std::int64_t> weights;
  for (const auto& p : prompts) weights.push_back(static_cast<std::int64_t>(p.size()) + max_new_tokens);
  const auto ranges = split_shards(weights, s.count);
  ShardPlan out;
  out.range = ranges.at(static_cast<std::size_t>(s.index));
  for (const auto& r : ranges) out.weight_total += r.weight;
  out.batches = shard_batches(out.range, batch_size);
  out.record = shard_record(s, ranges, prompts.size());
  return out;
}

std::string shard_output_path(const std::string& path, const ShardSpec& s) {
  std::string out = path;
  for (const auto& [key, value] : {std::pair<std::string, std::int64_t>{"{shard}", s.index}, {"{shards}", s.count}})
    for (std::size_t at = out.find(key); at != std::string::npos; at = out.find(key, at))
      out.replace(at, key.size(), std::to_string(value));
  return out;
}

std::string shard_record(const ShardSpec& s, const std::vector<ShardRange>& ranges, std::size_t n_prompts) {
  const ShardRange& r = ranges.at(static_cast<std::size_t>(s.index));
  std::int64_t total = 0;
  for (const auto& x : ranges) total += x.weight;
  return nlohmann::json{{"index", s.index},
                        {"count", s.count},
                        {"begin", r.begin},
                        {"end", r.end},
                        {"sequences", n_prompts},
                        {"weight", r.weight},
                        {"weight_total", total},
                        {"balance", "prompt tokens + max_new_tokens"},
                        {"source", s.source}}
      .dump();
}

}  // namespace dmi::engine
