// Summary statistics and comparisons over capture files (dmi-inspect,
// dmi-diff). Data is streamed in blocks of rows, so memory stays bounded.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "sink/capture_file.h"

namespace dmi::analysis {

struct Stats {
  std::int64_t count = 0;  // finite values
  double mean = 0, std = 0, rms = 0, min = 0, max = 0;
  std::int64_t nan = 0, inf = 0;
};

// Accumulates values in double precision (Welford for mean/variance).
class StatsAccumulator {
 public:
  // values: float32, any shape; mask (optional, bool, same shape) selects
  // entries that exist (attention rows hold only keys 0..pos).
  void add(const at::Tensor& values, const at::Tensor& mask = {});
  Stats result() const;

 private:
  std::int64_t n_ = 0, nan_ = 0, inf_ = 0;
  double mean_ = 0, m2_ = 0, sumsq_ = 0, min_ = 0, max_ = 0;
};

// Sites whose names match a glob (fnmatch), in forward order; a plain name
// must exist. Throws dmi::Error naming near matches when nothing matches.
std::vector<std::string> match_sites(const sink::CaptureFile& f, const std::string& glob);

enum class GroupBy { none, layer, seq, pos };
GroupBy parse_group_by(const std::string& s);

// One line per group: (label, stats). none: one line per site.
std::vector<std::pair<std::string, Stats>> site_stats(const sink::CaptureFile& f, const std::vector<std::string>& sites,
                                                      GroupBy by);

// The mask of existing entries for attention rows [n, H, W]: key <= pos.
at::Tensor attention_mask(const std::vector<std::int32_t>& pos, std::int64_t heads, std::int64_t width);

}  // namespace dmi::analysis
