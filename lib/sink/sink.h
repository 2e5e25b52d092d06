// Where captured records end up. The ring's writer thread is the only caller
// of write(); open() and close() run on the main thread before and after.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dmi::sink {

enum class Layout {
  dense,      // data [rows, ...row_shape]
  topk,       // payload [rows, 2, K] float32: values then ids; stored as data (values) + ids
  attention,  // data [rows, heads, max_len]: key position k of the same sequence, k <= pos
  // Not a site: the token log, one row per token chosen, (seq, pos) and the
  // token id (int32), stored as /token_log so that a running or killed
  // capture has its tokens (docs/capture-format.md). At most one per sink.
  token_log,
};

struct StreamInfo {
  std::string name;  // TransformerLens site name
  int layer = -1;    // -1 for global sites
  std::vector<std::int64_t> row_shape;  // per-row payload shape
  at::ScalarType dtype = at::kFloat;    // payload dtype (as stored)
  Layout layout = Layout::dense;
  // Rows this stream is expected to get, an upper bound (0: unknown): the
  // HDF5 sink sizes its chunks by it, so small captures stay small.
  std::int64_t expected_rows = 0;
};

// Root attributes, in order.
struct RunInfo {
  std::vector<std::pair<std::string, std::string>> text;
  std::vector<std::pair<std::string, std::int64_t>> ints;
  // The prompts, when known up front: written at creation (/sequences/
  // prompt_text, prompt_lengths, and the prompt tokens in /token_log), so a
  // capture that never closes still has them.
  std::vector<std::string> prompt_texts;
  std::vector<std::vector<std::int32_t>> prompt_ids;
};

struct SequenceInfo {
  std::string prompt, text, finish_reason;
  std::vector<std::int32_t> prompt_ids, output_ids;
  // Batch composition: batch number, row in it, left padding (-1: not run).
  std::int32_t batch = -1, row = -1, left_pad = -1;
};

// Results computed alongside a capture (monitors), stored in it at close:
// one group, its text attributes, and datasets of float64 (or int64).
struct ResultTable {
  std::string group;  // "monitors/attn-tracker"
  std::vector<std::pair<std::string, std::string>> attrs;
  struct Column {
    std::string name;
    std::vector<std::int64_t> shape;
    std::vector<double> values;
    bool integer = false;  // stored as int64
  };
  std::vector<Column> columns;
};

struct Finish {
  std::string status;  // complete | interrupted | failed
  std::uint64_t records_written = 0, records_dropped = 0;
  std::vector<std::uint64_t> dropped_per_stream;
  std::vector<SequenceInfo> sequences;
  std::string timings_json;  // root attribute "timings" when not empty
  std::vector<ResultTable> results;
};

class Sink {
 public:
  virtual ~Sink() = default;
  virtual void open(const std::vector<StreamInfo>& streams) = 0;
  virtual void write(std::uint16_t stream, std::int32_t step, std::uint32_t rows, const std::int32_t* seq,
                     const std::int32_t* pos, const void* data, std::size_t bytes) = 0;
  virtual void close(const Finish& finish) = 0;
};

// Runs the whole transport and discards the data (to separate transport cost
// from storage cost).
std::unique_ptr<Sink> make_null_sink();

}  // namespace dmi::sink
