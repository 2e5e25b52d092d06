// Reading dmi-capture files (docs/capture-format.md): the library behind
// dmi-inspect, dmi-diff and the tests. Reading is lazy: opening reads the
// attributes and the small per-row index (seq, pos); data rows are read
// only when asked for, with HDF5 selections that touch only the chunks
// holding them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dmi::sink {

struct SiteEntry {
  std::string name;
  int layer = -1;
  std::string layout;                  // dense | attention | topk
  std::vector<std::int64_t> row_shape; // per-row shape of data
  std::string dtype;                   // float32 | float16 | bfloat16
  std::int64_t rows = 0;
  std::uint64_t stored_bytes = 0, raw_bytes = 0;
  std::int64_t records_dropped = 0;
  std::int64_t index = 0;  // position in forward order
  bool virtual_rows = false;  // rows mapped from other files (a merged capture; stored_bytes 0)
};

class CaptureFile {
 public:
  // Throws dmi::Error for a missing/unreadable file, a file that is not a
  // dmi capture, or another format version (naming what to do).
  static std::unique_ptr<CaptureFile> open(const std::string& path);
  ~CaptureFile();

  const std::string& path() const { return path_; }
  // complete | interrupted | failed; running while its writer runs; killed
  // when the writer died before closing it (stored status "running" and the
  // writer process gone), or after recovery (sink/hdf5_sink.h).
  const std::string& status() const { return status_; }
  // Opened as an SWMR reader: the file was still open for writing (a live
  // run, or a dead writer's file not yet recovered).
  bool opened_live() const { return swmr_; }
  std::string text_attr(const std::string& name) const;  // "" when absent
  std::optional<std::int64_t> int_attr(const std::string& name) const;

  const std::vector<SiteEntry>& sites() const { return sites_; }
  const SiteEntry& site(const std::string& name) const;  // throws naming near matches
  bool has_site(const std::string& name) const;

  // Sequences. A capture that was not closed has no /sequences record: its
  // sequences come from the token log (prompt and generated tokens so far;
  // no generated text; finish_reason = status()).
  std::size_t n_sequences() const { return offsets_.empty() ? 0 : offsets_.size() - 1; }
  std::vector<std::int32_t> tokens(std::size_t seq) const;
  std::int32_t prompt_length(std::size_t seq) const { return prompt_lengths_.at(seq); }
  const std::string& prompt_text(std::size_t seq) const { return prompt_text_.at(seq); }
  const std::string& generated_text(std::size_t seq) const { return generated_text_.at(seq); }
  const std::string& finish_reason(std::size_t seq) const { return finish_reason_.at(seq); }
  bool has_sequences() const { return !offsets_.empty(); }
  int format_version() const { return format_version_; }
  // Batch composition (format 2): batch number, row, left padding per
  // sequence, -1 where it did not run; empty for version 1 files.
  const std::vector<std::int32_t>& batch_of() const { return batch_; }
  const std::vector<std::int32_t>& row_of() const { return row_; }
  const std::vector<std::int32_t>& left_pad_of() const { return left_pad_; }

  // The per-row index of a site.
  const std::vector<std::int32_t>& seq_of(const std::string& site) const;
  const std::vector<std::int32_t>& pos_of(const std::string& site) const;
  // Rows of `site` for sequence `seq` (all if nullopt) with pos in [pos_lo,
  // pos_hi), ordered by (seq, pos).
  std::vector<std::int64_t> find_rows(const std::string& site, std::optional<std::int32_t> seq,
                                      std::int32_t pos_lo = 0,
                                      std::int32_t pos_hi = std::numeric_limits<std::int32_t>::max()) const;
  // data rows as float32 [n, ...row_shape]; reads only those rows.
  at::Tensor read_rows(const std::string& site, const std::vector<std::int64_t>& rows) const;
  // A contiguous block of rows [begin, begin + n).
  at::Tensor read_block(const std::string& site, std::int64_t begin, std::int64_t n) const;
  // The seq column of rows [begin, begin + n) as int32, read from the file
  // (seq_of caches a site's whole index; this reads only the block).
  at::Tensor read_seq_block(const std::string& site, std::int64_t begin, std::int64_t n) const;
  // topk sites: the ids [n, K] of those rows.
  at::Tensor read_ids(const std::string& site, const std::vector<std::int64_t>& rows) const;

 private:
  CaptureFile() = default;
  void read_token_log();
  at::Tensor read_selected(const std::string& site, const std::string& dataset,
                           const std::vector<std::int64_t>& rows, bool ints) const;
  std::string path_;
  std::int64_t file_ = -1;  // hid_t
  std::vector<SiteEntry> sites_;
  std::map<std::string, std::size_t> site_index_;
  mutable std::map<std::string, std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>>> index_cache_;
  int format_version_ = 0;
  bool swmr_ = false;
  std::string status_;
  std::vector<std::int32_t> tokens_, prompt_lengths_, batch_, row_, left_pad_;
  std::vector<std::int64_t> offsets_;
  std::vector<std::string> prompt_text_, generated_text_, finish_reason_;
};

}  // namespace dmi::sink
