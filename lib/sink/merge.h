// dmi-inspect merge: one logical capture over the files of a sharded run
// (dmi-run --shard K/N), as HDF5 virtual datasets over the shards' rows (no
// copy) or, with copy, one self-contained file. docs/scale-out.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dmi::sink {

struct MergeOptions {
  std::string output;
  std::vector<std::string> shards;
  bool copy = false;           // materialise the rows instead of mapping them
  bool allow_partial = false;  // merge even if some shards are missing (recorded in the file)
  bool overwrite = false;
  std::string command_line;
};

struct MergeResult {
  std::string output, mode, status;
  std::int64_t shards = 0, count = 0;     // merged / of how many
  std::vector<std::int64_t> missing;       // shard indices left out (--allow-partial)
  std::size_t sequences = 0, sites = 0;
  std::int64_t rows = 0;
  std::uint64_t file_bytes = 0;
};

// Checks that the shards belong together (model fingerprint, selection,
// settings, prompts, sites), that their sequence ranges are disjoint and
// (unless allow_partial) complete, then writes OUT (as OUT.partial, renamed
// when done). Errors name the file and what differs.
MergeResult merge_captures(const MergeOptions& o);

// A shard's "shard" attribute holds its record (non-negative integers index,
// count, begin, end, sequences); throws naming the file otherwise.
void check_shard_record(const std::string& path, const std::string& shard_json);

// A merged capture's "merged" attribute is a merge record (mode, count,
// shards with file, index and bytes, missing); for one with virtual datasets: the shard files it reads,
// resolved against its directory, with the size each had at the merge.
// Throws naming the first one that is missing or changed.
void check_merged_sources(const std::string& path, const std::string& merged_json);

}  // namespace dmi::sink
