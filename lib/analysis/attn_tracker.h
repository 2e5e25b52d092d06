// The Attention Tracker (Hung et al., "Attention Tracker: Detecting Prompt
// Injection Attacks in LLMs"), computed from a capture's attention patterns:
// for each listed (layer, head), the share of the last prompt token's
// attention that goes to the instruction rather than to the data,
//
//   a = attn(instruction) / (attn(instruction) + attn(data)),
//
// and the focus score, the mean of a over the heads. A low score (at most
// the threshold) flags the sequence: its instruction has been displaced.
// Head selection follows the paper: heads whose mean a over benign prompts
// exceeds the mean over attacks by more than k (sigma_benign + sigma_attack).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "io/tokenizer.h"
#include "sink/capture_file.h"

namespace dmi::analysis {

struct TrackerHead {
  int layer = 0;
  std::int64_t head = 0;
};

// A heads file: [[layer, head], ...] (the published important_heads lists).
// Errors name the file and the entry.
std::vector<TrackerHead> read_tracker_heads(const std::string& path);
void write_tracker_heads(const std::string& path, const std::vector<TrackerHead>& heads);

// A span of prompt tokens: "A:B" (positions, end exclusive; "A:" runs to the
// prompt's end), or marker text: the tokens that cover the first occurrence
// of that text in the prompt.
struct TokenSpan {
  std::int64_t begin = 0, end = -1;  // end -1: the prompt's end
  std::string marker;                // set for marker spans
  static TokenSpan parse(const std::string& s, const std::string& flag);
  // [begin, end) within a prompt; throws dmi::Error naming flag and sequence
  // when the marker is absent or the range is empty or out of the prompt.
  std::pair<std::int64_t, std::int64_t> resolve(const std::vector<std::int32_t>& prompt, const io::Tokenizer* tok,
                                                std::size_t seq, const std::string& flag) const;
};

struct TrackerOptions {
  std::vector<TrackerHead> heads;
  TokenSpan inst, data;
  double threshold = 0.5;
};

struct TrackerSequence {
  std::size_t seq = 0;
  std::int64_t query_pos = 0;  // the last prompt token
  std::pair<std::int64_t, std::int64_t> inst, data;
  std::vector<double> a;  // per head, in the order given
  double score = 0;
  bool flagged = false;
};

// a for one head: row holds the last prompt token's attention over key
// positions 0..width-1; summed in float64 in key order. The online monitor
// (analysis/monitors.h) and the offline command both call this.
double tracker_focus(const float* row, std::int64_t width, std::pair<std::int64_t, std::int64_t> inst,
                     std::pair<std::int64_t, std::int64_t> data);

// The entropy (nats) of one attention row over its first n keys, in
// float64 in key order; zero probabilities contribute nothing.
double attention_entropy(const float* row, std::int64_t n);

// Every sequence of the capture (or those listed). Needs
// blocks.L.attn.hook_pattern of each listed layer at each sequence's last
// prompt position (dmi-run --hooks pattern --tokens last-prompt); errors
// name the file, the site and the sequence.
std::vector<TrackerSequence> attention_tracker(const sink::CaptureFile& f, const io::Tokenizer* tok,
                                               const TrackerOptions& o, const std::vector<std::size_t>& seqs = {});

// Head selection from a benign and an attack capture: per (layer, head) of
// every layer both captures hold, the mean and standard deviation (over
// sequences, population) of a in each.
struct HeadSeparation {
  TrackerHead head;
  double mean_benign = 0, std_benign = 0, mean_attack = 0, std_attack = 0;
  // mean_benign - mean_attack
  double diff = 0;
};
std::vector<HeadSeparation> separate_heads(const sink::CaptureFile& benign, const sink::CaptureFile& attack,
                                           const io::Tokenizer* tok, const TokenSpan& inst, const TokenSpan& data);
// The heads whose diff > k (std_benign + std_attack), in (layer, head) order.
std::vector<TrackerHead> select_heads(const std::vector<HeadSeparation>& s, double k);

}  // namespace dmi::analysis
