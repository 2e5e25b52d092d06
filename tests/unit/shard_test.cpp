// engine/shard: --shard K/N and auto, the token-balanced split.
#include <doctest/doctest.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <string>

#include "common/error.h"
#include "engine/shard.h"

using dmi::engine::parse_shard;
using dmi::engine::split_shards;

namespace {
dmi::engine::EnvLookup env_of(std::map<std::string, std::string> vars) {
  auto held = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [held](const char* name) -> const char* {
    auto it = held->find(name);
    return it == held->end() ? nullptr : it->second.c_str();
  };
}
}  // namespace

TEST_CASE("shard: K/N and its errors") {
  auto s = parse_shard("2/5");
  CHECK(s.index == 2);
  CHECK(s.count == 5);
  CHECK(s.source == "--shard");
  for (const char* bad : {"5/5", "4/4", "x", "1", "1/", "/2", "-1/2", "1/0", "a/b", "1/2/3", " 1/2"})
    CHECK_THROWS_AS(parse_shard(bad), dmi::Error);
}

TEST_CASE("shard: auto from Slurm arrays, MPI ranks and Slurm tasks") {
  auto s = parse_shard("auto", env_of({{"SLURM_ARRAY_TASK_ID", "3"}, {"SLURM_ARRAY_TASK_COUNT", "4"}}));
  CHECK(s.index == 3);
  CHECK(s.count == 4);
  CHECK(s.source == "SLURM_ARRAY_TASK_ID");
  // --array=10-16:2 -> ids 10, 12, 14, 16: shards 0..3 of 4
  s = parse_shard("auto", env_of({{"SLURM_ARRAY_TASK_ID", "14"}, {"SLURM_ARRAY_TASK_MIN", "10"},
                                  {"SLURM_ARRAY_TASK_MAX", "16"}, {"SLURM_ARRAY_TASK_STEP", "2"}}));
  CHECK(s.index == 2);
  CHECK(s.count == 4);
  // The array wins over the task rank Slurm also sets inside an array task.
  s = parse_shard("auto", env_of({{"SLURM_ARRAY_TASK_ID", "1"}, {"SLURM_ARRAY_TASK_MAX", "1"},
                                  {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}));
  CHECK(s.index == 1);
  CHECK(s.count == 2);
  s = parse_shard("auto", env_of({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "3"}}));
  CHECK(s.index == 1);
  CHECK(s.count == 3);
  CHECK(s.source == "OMPI_COMM_WORLD_RANK");
  s = parse_shard("auto", env_of({{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}}));
  CHECK(s.source == "PMI_RANK");
  s = parse_shard("auto", env_of({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "8"}}));
  CHECK(s.index == 3);
  CHECK(s.count == 8);
  CHECK_THROWS_AS(parse_shard("auto", env_of({})), dmi::Error);
  CHECK_THROWS_AS(parse_shard("auto", env_of({{"SLURM_ARRAY_TASK_ID", "5"}, {"SLURM_ARRAY_TASK_COUNT", "3"}})),
                  dmi::Error);
  CHECK_THROWS_AS(parse_shard("auto", env_of({{"SLURM_ARRAY_TASK_ID", "x"}})), dmi::Error);
  CHECK_THROWS_AS(parse_shard("auto", env_of({{"SLURM_ARRAY_TASK_ID", "1"}})), dmi::Error);
  CHECK_THROWS_AS(parse_shard("auto", env_of({{"OMPI_COMM_WORLD_RANK", "1"}})), dmi::Error);
  CHECK_THROWS_AS(parse_shard("auto", env_of({{"SLURM_ARRAY_TASK_ID", "11"}, {"SLURM_ARRAY_TASK_MIN", "10"},
                                               {"SLURM_ARRAY_TASK_MAX", "16"}, {"SLURM_ARRAY_TASK_STEP", "2"}})),
                  dmi::Error);
}

TEST_CASE("shard: contiguous ranges that cover every prompt once, balanced by weight") {
  // Equal weights: equal counts.
  auto r = split_shards(std::vector<std::int64_t>(12, 10), 4);
  REQUIRE(r.size() == 4);
  for (int k = 0; k < 4; ++k) {
    CHECK(r[k].begin == static_cast<std::size_t>(3 * k));
    CHECK(r[k].end == static_cast<std::size_t>(3 * k + 3));
    CHECK(r[k].weight == 30);
  }
  // Many prompts of mixed weight: each shard is within one prompt of its share.
  std::vector<std::int64_t> w;
  std::uint32_t x = 12345;
  std::int64_t total = 0, biggest = 0;
  for (int i = 0; i < 1000; ++i) {
    x = x * 1103515245u + 12345u;
    w.push_back(1 + (x >> 16) % 300);
    total += w.back();
    biggest = std::max(biggest, w.back());
  }
  for (std::int64_t n : {1, 2, 3, 7, 64}) {
    r = split_shards(w, n);
    std::size_t next = 0;
    for (const auto& s : r) {
      CHECK(s.begin == next);
      next = s.end;
      CHECK(std::abs(s.weight * n - total) <= biggest * n);
    }
    CHECK(next == w.size());
  }
  // More shards than prompts: some are empty, none is lost.
  r = split_shards({5, 5, 5}, 5);
  std::size_t covered = 0;
  for (const auto& s : r) covered += s.end - s.begin;
  CHECK(covered == 3);
  CHECK(r.back().end == 3);
}

TEST_CASE("shard: output path placeholders") {
  dmi::engine::ShardSpec s{3, 8, "--shard"};
  CHECK(dmi::engine::shard_output_path("run-{shard}-of-{shards}.h5", s) == "run-3-of-8.h5");
  CHECK(dmi::engine::shard_output_path("plain.h5", s) == "plain.h5");
  CHECK(dmi::engine::shard_batches({4, 9, 0}, 2).size() == 3);
  CHECK(dmi::engine::shard_batches({4, 4, 0}, 2).empty());
}
