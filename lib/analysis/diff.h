// Comparing two capture files site by site, row by (sequence, position).
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "sink/capture_file.h"

namespace dmi::analysis {

struct SequenceDiff {
  std::size_t seq = 0;
  bool equal = true;
  // Index into the generated tokens of the first difference (or the prompt
  // differs: prompt_differs).
  bool prompt_differs = false;
  std::optional<std::size_t> first_generated_diff;
  std::int32_t token_a = -1, token_b = -1;
};

struct SiteDiff {
  std::string site;
  std::int64_t rows = 0;                   // compared (present in both)
  std::int64_t rows_only_a = 0, rows_only_b = 0;
  double max_abs = 0, mean_abs = 0, nmse = 0, cosine = 1;
  double max_ref = 0;  // max |b| over finite entries; max_abs / max_ref is the relative error
  double max_rel() const { return max_ref > 0 ? max_abs / max_ref : (max_abs > 0 ? INFINITY : 0.0); }
  std::int64_t mismatches = 0;             // elements beyond atol + rtol * |b|
  std::optional<std::pair<std::int32_t, std::int32_t>> first_mismatch;  // (seq, pos)
  bool shape_mismatch = false;
  bool equal() const { return !shape_mismatch && mismatches == 0 && rows_only_a == 0 && rows_only_b == 0; }
};

struct DiffReport {
  std::vector<SequenceDiff> sequences;
  std::size_t sequences_only_a = 0, sequences_only_b = 0;
  std::vector<std::size_t> skipped;  // sequences a replay left out (finish_reason "skipped"), not compared
  std::vector<std::string> sites_only_a, sites_only_b;
  std::vector<SiteDiff> sites;
  bool equal() const;
};

struct DiffOptions {
  std::string sites_glob = "*";
  double atol = 0, rtol = 0;
  // Compare the stored values bit for bit (as float32 bit patterns: +0 and
  // -0 differ, NaN payloads count) instead of within atol/rtol.
  bool bitwise = false;
  // Only these sequences (tokens and rows); all when empty.
  std::set<std::int32_t> seqs;
};

DiffReport diff_captures(const sink::CaptureFile& a, const sink::CaptureFile& b, const DiffOptions& opts);

}  // namespace dmi::analysis
