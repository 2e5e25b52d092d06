// dmi-inspect RUN.h5 report: one self-contained HTML page of a capture — no
// network, scripts and styles inline, a Content-Security-Policy that forbids
// any request. Per sequence: the text with token boundaries (prompt and
// generated marked); hovering a token shows its top next-token
// probabilities and its residual norm per layer (when captured); attention
// patterns of any captured layer and head with tokens on the axes and hover
// values, and all heads of a layer as small multiples; the run's settings,
// model, status and record counts. A size cap keeps big captures usable and
// says what it left out.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "sink/capture_file.h"

namespace dmi::analysis {

struct ReportOptions {
  std::vector<std::int64_t> seqs;    // empty: every sequence (within the cap)
  std::vector<std::int64_t> layers;  // attention layers; empty: every captured one (within the cap)
  double max_mb = 16;                // data embedded in the page, at most
  int top = 5;                       // next-token candidates per token
};

struct ReportResult {
  std::uint64_t bytes = 0;
  std::size_t sequences = 0, attention_maps = 0;  // (sequence, layer) patterns included
  std::vector<std::string> left_out;              // what the cap or the options left out, in words
};

// token_text(id): the token as text (a tokenizer's decoding, or "#id").
ReportResult write_report(const sink::CaptureFile& f, const std::function<std::string(std::int32_t)>& token_text,
                          const ReportOptions& o, const std::string& output);

}  // namespace dmi::analysis
