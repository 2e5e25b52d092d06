#include "sink/hdf5_sink.h"

#include <hdf5.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "sink/capture_file.h"
#include "sink/h5util.h"
#include "sink/liveness.h"
#include "sink/result_file.h"

namespace dmi::sink {

namespace h5 {

void write_sequences(hid_t file, const std::vector<SequenceInfo>& seqs, const std::string& path) {
  hid_t g = H5Lexists(file, "sequences", H5P_DEFAULT) > 0
                ? H5Gopen2(file, "sequences", H5P_DEFAULT)
                : H5Gcreate2(file, "sequences", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  DMI_CHECK(g >= 0, "{}: cannot create /sequences", path);
  for (const char* name : {"tokens", "offsets", "prompt_lengths", "prompt_text", "generated_text", "finish_reason",
                           "batch", "row", "left_pad"})
    if (H5Lexists(g, name, H5P_DEFAULT) > 0) H5Ldelete(g, name, H5P_DEFAULT);
  std::vector<std::int32_t> tokens, prompt_lengths, batch, row, left_pad;
  std::vector<std::int64_t> offsets{0};
  std::vector<std::string> prompts, texts, reasons;
  for (const auto& s : seqs) {
    tokens.insert(tokens.end(), s.prompt_ids.begin(), s.prompt_ids.end());
    tokens.insert(tokens.end(), s.output_ids.begin(), s.output_ids.end());
    offsets.push_back(static_cast<std::int64_t>(tokens.size()));
    prompt_lengths.push_back(static_cast<std::int32_t>(s.prompt_ids.size()));
    prompts.push_back(s.prompt);
    texts.push_back(s.text);
    reasons.push_back(s.finish_reason);
    batch.push_back(s.batch);
    row.push_back(s.row);
    left_pad.push_back(s.left_pad);
  }
  try {
    write_vector(g, "tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, tokens);
    write_vector(g, "offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, offsets);
    write_vector(g, "prompt_lengths", H5T_STD_I32LE, H5T_NATIVE_INT32, prompt_lengths);
    write_strings(g, "prompt_text", prompts);
    write_strings(g, "generated_text", texts);
    write_strings(g, "finish_reason", reasons);
    write_vector(g, "batch", H5T_STD_I32LE, H5T_NATIVE_INT32, batch);
    write_vector(g, "row", H5T_STD_I32LE, H5T_NATIVE_INT32, row);
    write_vector(g, "left_pad", H5T_STD_I32LE, H5T_NATIVE_INT32, left_pad);
  } catch (...) {
    H5Gclose(g);
    throw;
  }
  H5Gclose(g);
}

}  // namespace h5

namespace {

using namespace h5;

struct Compression {
  int gzip = 0;
  bool shuffle = false;
};

Compression parse_compression(const std::string& c) {
  Compression out;
  if (c == "none" || c.empty()) return out;
  std::string rest = c;
  if (rest.rfind("shuffle+", 0) == 0) {
    out.shuffle = true;
    rest = rest.substr(8);
  }
  if (rest.rfind("gzip:", 0) == 0 && rest.size() == 6 && rest[5] >= '1' && rest[5] <= '9') {
    out.gzip = rest[5] - '0';
    return out;
  }
  DMI_FAIL("--compression '{}' is not one of none, gzip:N, shuffle+gzip:N (N = 1..9)", c);
}

// A 16-bit float type: sign bit 15, exponent bits epos.., mantissa bits
// 0..msize-1. bfloat16 is (7, 8, 7, bias 127), IEEE half (10, 5, 10, bias 15);
// HDF5 1.10 predefines neither. Readers convert them like any float.
hid_t float16_type(std::size_t epos, std::size_t esize, std::size_t msize, std::size_t ebias) {
  hid_t t = H5Tcopy(H5T_IEEE_F32LE);
  H5Tset_fields(t, 15, epos, esize, 0, msize);
  H5Tset_offset(t, 0);
  H5Tset_precision(t, 16);
  H5Tset_size(t, 2);
  H5Tset_ebias(t, ebias);
  return t;
}

hid_t h5_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return H5Tcopy(H5T_IEEE_F32LE);
    case at::kHalf: return float16_type(10, 5, 10, 15);
    case at::kBFloat16: return float16_type(7, 8, 7, 127);
    case at::kInt: return H5Tcopy(H5T_STD_I32LE);
    default: DMI_FAIL("capture dtype {} has no HDF5 type", c10::toString(t));
  }
}

// A write the file system refused (typically: disk full).
struct WriteError {};

// An extendible [rows, ...] dataset, chunked along rows with whole rows in
// each chunk, appended to by the writer. Appends are staged until a chunk is
// full and then written as one chunk: without filters straight into the file
// (H5Dwrite_chunk: no hyperslab selection, no chunk cache, no second copy),
// with filters through one whole-chunk H5Dwrite. publish() writes the staged
// rows of the unfinished chunk too (at each flush), finish() at close.
class Table {
 public:
  // expected_rows (0: unknown) is how many rows the table will get, an upper
  // bound: the chunks of a table that will stay small are no larger than it.
  Table(hid_t group, const std::string& name, hid_t type, const std::vector<std::int64_t>& row_shape,
        const Compression& comp, std::int64_t expected_rows, std::size_t max_chunk_rows = 8192)
      : rank_(1 + static_cast<int>(row_shape.size())), direct_(!comp.shuffle && !comp.gzip) {
    std::vector<hsize_t> dims(rank_, 0), maxdims(rank_, H5S_UNLIMITED), chunk(rank_);
    row_bytes_ = H5Tget_size(type);
    for (std::size_t i = 0; i < row_shape.size(); ++i) {
      dims[i + 1] = maxdims[i + 1] = chunk[i + 1] = static_cast<hsize_t>(row_shape[i]);
      row_bytes_ *= static_cast<std::size_t>(row_shape[i]);
    }
    // Chunks of whole rows, at most ~128 KiB (a reader of a few rows reads
    // little). A chunk is stored whole, so when the rows the table will get
    // are known, they are split evenly into as few chunks as that allows: a
    // small capture is not mostly empty chunks.
    std::size_t rows = std::clamp<std::size_t>((128u << 10) / std::max<std::size_t>(row_bytes_, 1), 1, max_chunk_rows);
    if (expected_rows > 0) {
      const std::size_t e = static_cast<std::size_t>(expected_rows), chunks = (e + rows - 1) / rows;
      rows = (e + chunks - 1) / chunks;
    }
    chunk[0] = static_cast<hsize_t>(rows);
    chunk_rows_ = chunk[0];
    row_dims_.assign(dims.begin() + 1, dims.end());
    hid_t space = H5Screate_simple(rank_, dims.data(), maxdims.data());
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_chunk(dcpl, rank_, chunk.data());
    if (comp.shuffle) H5Pset_shuffle(dcpl);
    if (comp.gzip) H5Pset_deflate(dcpl, comp.gzip);
    id_ = H5Dcreate2(group, name.c_str(), type, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    H5Pclose(dcpl);
    H5Sclose(space);
    H5_CHECK(id_, "cannot create dataset '{}' in the capture file", name);
    type_ = H5Tcopy(type);
  }
  ~Table() {
    if (id_ >= 0) H5Dclose(id_);
    if (type_ >= 0) H5Tclose(type_);
  }
  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  void append(const void* data, hsize_t rows) {
    const auto* p = static_cast<const std::uint8_t*>(data);
    while (rows > 0) {
      if (staged_ == 0 && rows >= chunk_rows_) {  // whole chunks straight from the caller's buffer
        write_chunk(p, chunk_rows_);
        rows_ += chunk_rows_;
        p += chunk_rows_ * row_bytes_;
        rows -= chunk_rows_;
        continue;
      }
      if (stage_.empty()) stage_.resize(chunk_rows_ * row_bytes_);
      const hsize_t n = std::min(rows, chunk_rows_ - staged_);
      std::memcpy(stage_.data() + staged_ * row_bytes_, p, n * row_bytes_);
      staged_ += n;
      p += n * row_bytes_;
      rows -= n;
      if (staged_ == chunk_rows_) {
        write_chunk(stage_.data(), chunk_rows_);
        rows_ += chunk_rows_;
        staged_ = published_ = 0;
      }
    }
  }

  // Writes the staged rows of the unfinished chunk (they stay staged: the
  // chunk is written again when it fills).
  void publish() {
    if (staged_ == published_) return;
    write_chunk(stage_.data(), staged_);
    published_ = staged_;
  }

  // Writes the staged rows (the last chunk, partly filled).
  void finish() {
    publish();
    rows_ += staged_;
    staged_ = published_ = 0;
  }

  // Forgets the rows staged since the last publish() (after a failed write
  // there is no room for them).
  void discard() {
    rows_ += published_;
    staged_ = published_ = 0;
  }

  // Rows in the file (written, not only staged).
  hsize_t rows() const { return rows_ + published_; }

 private:
  void extend(hsize_t rows) {
    if (rows == extent_) return;
    std::vector<hsize_t> dims(rank_);
    dims[0] = rows;
    for (int i = 1; i < rank_; ++i) dims[i] = row_dims_[i - 1];
    if (H5Dset_extent(id_, dims.data()) < 0) throw WriteError();
    extent_ = rows;
  }

  // Writes `rows` rows (a whole chunk, or the first rows of one) as the
  // chunk starting at row rows_.
  void write_chunk(const void* data, hsize_t rows) {
    extend(rows_ + rows);
    std::vector<hsize_t> start(rank_, 0), count(rank_);
    start[0] = rows_;
    herr_t rc;
    if (direct_) {
      // The whole chunk buffer: rows past `rows` lie outside the extent.
      rc = H5Dwrite_chunk(id_, H5P_DEFAULT, 0, start.data(), chunk_rows_ * row_bytes_, data);
    } else {
      count[0] = rows;
      for (int i = 1; i < rank_; ++i) count[i] = row_dims_[i - 1];
      hid_t fspace = H5Dget_space(id_);
      H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
      hid_t mspace = H5Screate_simple(rank_, count.data(), nullptr);
      rc = H5Dwrite(id_, type_, mspace, fspace, H5P_DEFAULT, data);
      H5Sclose(mspace);
      H5Sclose(fspace);
    }
    if (rc < 0) {
      try {
        extend(this->rows());  // the rows in the file stay the ones written
      } catch (const WriteError&) {
      }
      throw WriteError();
    }
  }

  int rank_;
  bool direct_;
  std::vector<hsize_t> row_dims_;
  std::size_t row_bytes_ = 0;
  hsize_t chunk_rows_ = 1;
  hid_t id_ = -1, type_ = -1;
  hsize_t rows_ = 0;       // rows in whole chunks in the file
  hsize_t staged_ = 0;     // rows in stage_ (the chunk after rows_)
  hsize_t published_ = 0;  // of those, rows already written by publish()
  hsize_t extent_ = 0;     // the dataset's current extent
  std::vector<std::uint8_t> stage_;
};

struct Stream {
  StreamInfo info;
  hid_t group = -1;
  std::unique_ptr<Table> data, seq, pos, ids;
  std::vector<float> values_scratch;
  std::vector<std::int32_t> ids_scratch;
  ~Stream() {
    data.reset();
    seq.reset();
    pos.reset();
    ids.reset();
    if (group >= 0) H5Gclose(group);
  }
  std::vector<Table*> tables() const {
    std::vector<Table*> t;
    for (Table* x : {seq.get(), pos.get(), data.get(), ids.get()})
      if (x) t.push_back(x);
    return t;
  }
};

// Every table of a site ends with the same rows: those all of them hold
// (after a full disk or a kill they can differ by the last chunk). Returns
// the rows kept per site name.
std::vector<std::pair<std::string, std::int64_t>> align_site_rows(hid_t file) {
  std::vector<std::pair<std::string, std::int64_t>> out;
  if (H5Lexists(file, "sites", H5P_DEFAULT) <= 0) return out;
  hid_t sites = H5Gopen2(file, "sites", H5P_DEFAULT);
  hsize_t n = 0;
  H5Gget_num_objs(sites, &n);
  for (hsize_t i = 0; i < n; ++i) {
    char name[512];
    H5Gget_objname_by_idx(sites, i, name, sizeof name);
    hid_t g = H5Gopen2(sites, name, H5P_DEFAULT);
    std::vector<hid_t> ds;
    for (const char* t : {"data", "seq", "pos", "ids"})
      if (H5Lexists(g, t, H5P_DEFAULT) > 0) ds.push_back(H5Dopen2(g, t, H5P_DEFAULT));
    std::vector<std::vector<hsize_t>> dims(ds.size());
    hsize_t rows = ds.empty() ? 0 : std::numeric_limits<hsize_t>::max();
    for (std::size_t k = 0; k < ds.size(); ++k) {
      if (ds[k] >= 0) dims[k] = dims_of(ds[k]);
      rows = std::min<hsize_t>(rows, dims[k].empty() ? 0 : dims[k][0]);
    }
    for (std::size_t k = 0; k < ds.size(); ++k) {
      const hid_t d = ds[k];
      if (d < 0) continue;
      if (!dims[k].empty() && dims[k][0] > rows) {
        dims[k][0] = rows;
        H5Dset_extent(d, dims[k].data());
      }
      H5Dclose(d);
    }
    H5Gclose(g);
    out.emplace_back(name, static_cast<std::int64_t>(rows));
  }
  H5Gclose(sites);
  return out;
}

// /token_log: (seq, pos, token) of every token known, prompt tokens first.
struct TokenLog {
  hid_t group = -1;
  std::unique_ptr<Table> seq, pos, token;
  ~TokenLog() {
    seq.reset();
    pos.reset();
    token.reset();
    if (group >= 0) H5Gclose(group);
  }
  std::vector<Table*> tables() const { return {seq.get(), pos.get(), token.get()}; }
  void append(std::uint32_t rows, const std::int32_t* s, const std::int32_t* p, const std::int32_t* t) {
    seq->append(s, rows);
    pos->append(p, rows);
    token->append(t, rows);
  }
};

class Hdf5Sink final : public Sink {
 public:
  Hdf5Sink(const std::string& path, const RunInfo& info, const Hdf5Options& o)
      : path_(path), comp_(parse_compression(o.compression)), flush_every_(o.flush_every),
        prompt_ids_(info.prompt_ids) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);  // errors become dmi::Error below
    // Without HDF5's advisory file lock. HDF5 1.10.8's H5Fstart_swmr_write
    // drops the writer's lock and takes it again, and a SWMR reader that
    // opens the file in between (dmi-inspect --follow started before the
    // run) made that fail and ended the run. After SWMR writing starts the
    // file is unlocked anyway; until then the superblock's open-for-writing
    // flag keeps readers out. A regular file being replaced is unlinked
    // rather than truncated, so whoever still reads it keeps reading what
    // it held (a symbolic link is written through, as before).
    struct stat st {};
    if (::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::unlink(path.c_str()) != 0)
      DMI_FAIL("{}: cannot replace it: {}", path, std::strerror(errno));
    hid_t fapl = latest_fapl();
    H5Pset_file_locking(fapl, false, true);
    file_ = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
    H5Pclose(fapl);
    DMI_CHECK(file_ >= 0, "{}: cannot create capture file", path);
    set_attr_text(file_, "format", "dmi-capture");
    set_attr_int(file_, "format_version", kCaptureFormatVersion);
    for (const auto& [k, v] : info.text) set_attr_text(file_, k, v);
    for (const auto& [k, v] : info.ints) set_attr_int(file_, k, v);
    set_attr_text(file_, "compression", o.compression.empty() ? "none" : o.compression);
    set_attr_text(file_, "writer", writer_record());
    set_attr_text(file_, "status", "running");  // until close() says otherwise
    if (!info.prompt_texts.empty()) {
      hid_t g = H5Gcreate2(file_, "sequences", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      DMI_CHECK(g >= 0, "{}: cannot create /sequences", path_);
      write_strings(g, "prompt_text", info.prompt_texts);
      std::vector<std::int32_t> lengths;
      for (const auto& p : info.prompt_ids) lengths.push_back(static_cast<std::int32_t>(p.size()));
      write_vector(g, "prompt_lengths", H5T_STD_I32LE, H5T_NATIVE_INT32, lengths);
      H5Gclose(g);
    }
    reserve_space();
  }

  ~Hdf5Sink() override {
    release_reserve();
    streams_.clear();
    token_log_.reset();
    if (sites_ >= 0) H5Gclose(sites_);
    if (file_ >= 0) H5Fclose(file_);
  }

  void open(const std::vector<StreamInfo>& streams) override {
    sites_ = H5Gcreate2(file_, "sites", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    DMI_CHECK(sites_ >= 0, "{}: cannot create /sites", path_);
    std::int64_t site_index = 0;
    for (std::size_t i = 0; i < streams.size(); ++i) {
      const auto& si = streams[i];
      if (si.layout == Layout::token_log) {
        open_token_log(static_cast<std::uint16_t>(i), si.expected_rows);
        streams_.push_back(nullptr);
        continue;
      }
      site_streams_.emplace_back(i, si.name);
      auto s = std::make_unique<Stream>();
      s->info = si;
      s->group = H5Gcreate2(sites_, si.name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      DMI_CHECK(s->group >= 0, "{}: cannot create /sites/{}", path_, si.name);
      set_attr_text(s->group, "site", si.name);
      set_attr_int(s->group, "layer", si.layer);
      set_attr_int(s->group, "index", site_index++);
      set_attr_int(s->group, "records_dropped", 0);
      if (si.layout == Layout::topk) {
        const std::int64_t k = si.row_shape.back();
        hid_t f32 = H5Tcopy(H5T_IEEE_F32LE), i32 = H5Tcopy(H5T_STD_I32LE);
        s->data = std::make_unique<Table>(s->group, "data", f32, std::vector<std::int64_t>{k}, comp_, si.expected_rows);
        s->ids = std::make_unique<Table>(s->group, "ids", i32, std::vector<std::int64_t>{k}, comp_, si.expected_rows);
        H5Tclose(f32);
        H5Tclose(i32);
        set_attr_text(s->group, "layout", "topk");
      } else {
        hid_t t = h5_type(si.dtype);
        s->data = std::make_unique<Table>(s->group, "data", t, si.row_shape, comp_, si.expected_rows);
        H5Tclose(t);
        set_attr_text(s->group, "layout", si.layout == Layout::attention ? "attention" : "dense");
      }
      hid_t i32 = H5Tcopy(H5T_STD_I32LE);
      // Small index chunks (4 KiB): after a full disk they still fit in the
      // reserve, so the data rows that reached the disk stay addressable.
      s->seq = std::make_unique<Table>(s->group, "seq", i32, std::vector<std::int64_t>{}, comp_, si.expected_rows, 1024);
      s->pos = std::make_unique<Table>(s->group, "pos", i32, std::vector<std::int64_t>{}, comp_, si.expected_rows, 1024);
      H5Tclose(i32);
      streams_.push_back(std::move(s));
    }
    // From here on readers may open the file (SWMR); no object or attribute
    // is created until close() reopens it.
    try {
      if (token_log_)
        for (Table* t : token_log_->tables()) t->publish();
    } catch (const WriteError&) {
      DMI_FAIL("{}", write_failure());
    }
    H5_CHECK(H5Fflush(file_, H5F_SCOPE_GLOBAL), "{}", write_failure());
    H5_CHECK(H5Fstart_swmr_write(file_), "{}: cannot start SWMR writing ({})", path_, error_stack_text());
    last_flush_ = std::chrono::steady_clock::now();
  }

  void write(std::uint16_t stream, std::int32_t, std::uint32_t rows, const std::int32_t* seq,
             const std::int32_t* pos, const void* data, std::size_t bytes) override {
    if (!writer_quiet_) {  // HDF5's automatic error printing is per thread in thread-safe builds
      H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
      writer_quiet_ = true;
    }
    try {
      if (token_log_ && stream == token_stream_)
        token_log_->append(rows, seq, pos, static_cast<const std::int32_t*>(data));
      else
        append(stream, rows, seq, pos, data);
      if (std::chrono::steady_clock::now() - last_flush_ >= std::chrono::duration<double>(flush_every_)) flush();
    } catch (const WriteError&) {
      write_failed_ = true;
      throw Error(write_failure());
    }
  }

  void append(std::uint16_t stream, std::uint32_t rows, const std::int32_t* seq, const std::int32_t* pos,
              const void* data) {
    Stream& s = *streams_.at(stream);
    if (s.info.layout == Layout::topk) {
      const std::int64_t k = s.info.row_shape.back();
      const float* p = static_cast<const float*>(data);
      s.values_scratch.resize(rows * k);
      s.ids_scratch.resize(rows * k);
      for (std::uint32_t r = 0; r < rows; ++r)
        for (std::int64_t j = 0; j < k; ++j) {
          s.values_scratch[r * k + j] = p[r * 2 * k + j];
          s.ids_scratch[r * k + j] = static_cast<std::int32_t>(p[r * 2 * k + k + j]);
        }
      s.data->append(s.values_scratch.data(), rows);
      s.ids->append(s.ids_scratch.data(), rows);
    } else {
      s.data->append(data, rows);
    }
    s.seq->append(seq, rows);
    s.pos->append(pos, rows);
  }

  void close(const Finish& f) override {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    // The space held back at creation pays for the metadata written now, even
    // when the data filled the disk.
    release_reserve();
    bool lost = false;
    for (const auto& [t, index] : all_tables()) {
      // After a failed write, the reserve goes to the small index tables
      // (so the data rows on disk stay addressable) and the metadata; the
      // data's unpublished rows are dropped.
      if (lost || (write_failed_ && !index)) {
        t->discard();
        continue;
      }
      try {
        t->finish();
      } catch (const WriteError&) {
        lost = true;
      }
    }
    streams_.clear();
    token_log_.reset();
    if (sites_ >= 0) H5Gclose(sites_);
    sites_ = -1;
    // The SWMR writer can create nothing: close, and reopen as a plain
    // writer for the final record. A kill in between leaves a closed file
    // with status "running" whose writer is gone.
    herr_t rc = H5Fclose(file_);
    file_ = -1;
    H5_CHECK(rc, "{}: closing the capture file failed (disk full?)", path_);
    // Without HDF5's file lock: SWMR readers (h5py swmr=True, dmi-inspect
    // --follow) hold a shared lock for as long as they keep the file open.
    hid_t fapl = latest_fapl();
    H5Pset_file_locking(fapl, false, true);
    file_ = H5Fopen(path_.c_str(), H5F_ACC_RDWR, fapl);
    H5Pclose(fapl);
    DMI_CHECK(file_ >= 0, "{}: cannot reopen the capture file to finish it", path_);
    align_site_rows(file_);
    write_sequences(file_, f.sequences, path_);
    std::vector<std::int64_t> drops;
    for (const auto& [stream, name] : site_streams_) {
      const std::uint64_t d = stream < f.dropped_per_stream.size() ? f.dropped_per_stream[stream] : 0;
      hid_t g = H5Gopen2(file_, ("sites/" + name).c_str(), H5P_DEFAULT);
      if (g >= 0) {
        set_attr_int(g, "records_dropped", static_cast<std::int64_t>(d));
        H5Gclose(g);
      }
      drops.push_back(static_cast<std::int64_t>(d));
    }
    set_attr_ints(file_, "records_dropped_per_site", drops);
    set_attr_int(file_, "records_written", static_cast<std::int64_t>(f.records_written));
    set_attr_int(file_, "records_dropped", static_cast<std::int64_t>(f.records_dropped));
    if (!f.timings_json.empty()) set_attr_text(file_, "timings", f.timings_json);
    for (const auto& t : f.results) write_result_table(file_, t, path_);
    set_attr_text(file_, "status", f.status);
    rc = H5Fclose(file_);
    file_ = -1;
    H5_CHECK(rc, "{}: closing the capture file failed (disk full?)", path_);
  }

 private:
  void open_token_log(std::uint16_t stream, std::int64_t expected_rows) {
    token_stream_ = stream;
    token_log_ = std::make_unique<TokenLog>();
    token_log_->group = H5Gcreate2(file_, "token_log", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    DMI_CHECK(token_log_->group >= 0, "{}: cannot create /token_log", path_);
    hid_t i32 = H5Tcopy(H5T_STD_I32LE);
    const std::vector<std::int64_t> scalar;
    token_log_->seq = std::make_unique<Table>(token_log_->group, "seq", i32, scalar, comp_, expected_rows, 1024);
    token_log_->pos = std::make_unique<Table>(token_log_->group, "pos", i32, scalar, comp_, expected_rows, 1024);
    token_log_->token = std::make_unique<Table>(token_log_->group, "token", i32, scalar, comp_, expected_rows, 1024);
    H5Tclose(i32);
    for (std::size_t s = 0; s < prompt_ids_.size(); ++s) {
      const auto& ids = prompt_ids_[s];
      std::vector<std::int32_t> seq(ids.size(), static_cast<std::int32_t>(s)), pos(ids.size());
      for (std::size_t p = 0; p < ids.size(); ++p) pos[p] = static_cast<std::int32_t>(p);
      token_log_->append(static_cast<std::uint32_t>(ids.size()), seq.data(), pos.data(), ids.data());
    }
  }

  // Every table of the sites and the token log, with whether it is a small
  // index table (a site's seq or pos).
  std::vector<std::pair<Table*, bool>> all_tables() const {
    std::vector<std::pair<Table*, bool>> out;
    for (const auto& s : streams_)
      if (s)
        for (Table* t : s->tables()) out.emplace_back(t, t == s->seq.get() || t == s->pos.get());
    if (token_log_)
      for (Table* t : token_log_->tables()) out.emplace_back(t, false);
    return out;
  }

  // Makes every row written so far durable against a kill of this process
  // and visible to SWMR readers: the staged rows, HDF5's metadata, and the
  // file's pages on disk.
  void flush() {
    for (const auto& [t, index] : all_tables()) t->publish();
    if (H5Fflush(file_, H5F_SCOPE_LOCAL) < 0) throw WriteError();
    void* handle = nullptr;
    if (H5Fget_vfd_handle(file_, H5P_DEFAULT, &handle) >= 0 && handle) ::fdatasync(*static_cast<int*>(handle));
    last_flush_ = std::chrono::steady_clock::now();
  }

  // Holds back some free space in the output's directory (an unlinked file
  // with allocated blocks), given back at close: a full disk then still
  // leaves room to close the file readable.
  void reserve_space() {
    const auto slash = path_.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path_.substr(0, slash);
    struct statvfs vfs {};
    if (::statvfs(dir.c_str(), &vfs) != 0) return;
    const std::uint64_t free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    const std::uint64_t want = std::clamp<std::uint64_t>(free_bytes / 8, 1u << 20, 16u << 20);
    std::string tmpl = dir + "/.dmi-reserve-XXXXXX";
    std::vector<char> name(tmpl.begin(), tmpl.end());
    name.push_back('\0');
    const int fd = ::mkstemp(name.data());
    if (fd < 0) return;
    ::unlink(name.data());
    if (::posix_fallocate(fd, 0, static_cast<off_t>(want)) != 0) {
      ::close(fd);
      return;
    }
    reserve_fd_ = fd;
  }
  void release_reserve() {
    if (reserve_fd_ >= 0) ::close(reserve_fd_);
    reserve_fd_ = -1;
  }
  // What a refused write means: the disk is full, or another I/O error.
  std::string write_failure() const {
    const auto slash = path_.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path_.substr(0, slash);
    struct statvfs vfs {};
    if (::statvfs(dir.c_str(), &vfs) == 0 && static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize < (4u << 20))
      return fmt::format("{}: disk full ({} KiB left): capture stopped; the file is closed readable with status "
                         "failed", path_,
                         static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize / 1024);
    return fmt::format("{}: write failed (I/O error): capture stopped; the file is closed with status failed", path_);
  }

  std::string path_;
  Compression comp_;
  double flush_every_;
  std::vector<std::vector<std::int32_t>> prompt_ids_;
  int reserve_fd_ = -1;
  bool writer_quiet_ = false;
  bool write_failed_ = false;
  hid_t file_ = -1, sites_ = -1;
  std::vector<std::unique_ptr<Stream>> streams_;  // by stream id; null for the token log
  std::vector<std::pair<std::size_t, std::string>> site_streams_;  // (stream id, name) of each site, in order
  std::unique_ptr<TokenLog> token_log_;
  std::uint16_t token_stream_ = 0;
  std::chrono::steady_clock::time_point last_flush_;
};

// HDF5 closes files left open at exit; after a failed H5Fclose (a full disk)
// that walks freed state and crashes. dmi closes its files itself.
const bool kNoHdf5AtExit = (H5dont_atexit(), true);

}  // namespace

void validate_compression(const std::string& compression) { parse_compression(compression); }

std::unique_ptr<Sink> make_hdf5_sink(const std::string& path, const RunInfo& info, const Hdf5Options& options) {
  return std::make_unique<Hdf5Sink>(path, info, options);
}

RecoverResult recover_capture(const std::string& path,
                              const std::function<std::string(const std::vector<std::int32_t>&)>& decode) {
  std::vector<SequenceInfo> seqs;
  RecoverResult r;
  {
    // As a reader first: is it a capture whose writer is gone, and what
    // did its token log keep?
    auto f = CaptureFile::open(path);
    const std::string stored = f->text_attr("status"), writer = f->text_attr("writer");
    DMI_CHECK(stored == "running", "{}: status is '{}': nothing to recover (only a capture whose writer died, status "
              "running, needs it)", path, stored);
    DMI_CHECK(f->status() == "killed", "{}: {}", path,
              writer_alive(writer).has_value()
                  ? fmt::format("its writer is still running ({}); wait for it to finish", writer)
                  : fmt::format("written on another host ({}): recover it there, where dmi can tell whether its "
                                "writer still runs", writer));
    for (std::size_t s = 0; s < f->n_sequences(); ++s) {
      const auto ids = f->tokens(s);
      const auto plen = static_cast<std::size_t>(f->prompt_length(s));
      SequenceInfo si;
      si.prompt = f->prompt_text(s);
      si.prompt_ids.assign(ids.begin(), ids.begin() + plen);
      si.output_ids.assign(ids.begin() + plen, ids.end());
      if (decode) si.text = decode(si.output_ids);
      si.finish_reason = "killed";
      r.tokens += ids.size();
      seqs.push_back(std::move(si));
    }
    r.sequences = seqs.size();
  }
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  // Open for writing despite the open-for-writing flag the dead writer left
  // (what h5clear -s does, through the same file-access property).
  hid_t fapl = latest_fapl();
  hbool_t clear = true;
  H5Pset(fapl, "clear_status_flags", &clear);
  hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, fapl);
  H5Pclose(fapl);
  DMI_CHECK(file >= 0, "{}: cannot open it for writing to recover it (is another process reading it? otherwise try "
            "'h5clear -s {}', then recover again)", path, path);
  try {
    for (const auto& [name, rows] : align_site_rows(file)) {
      ++r.sites;
      r.rows += rows;
    }
    write_sequences(file, seqs, path);
    set_attr_text(file, "status", "killed");
    set_attr_text(file, "recovered",
                  nlohmann::json{{"tool", "dmi-inspect recover"}, {"tool_version", DMI_VERSION}, {"rows", r.rows},
                                 {"tokens", r.tokens}}
                      .dump());
  } catch (...) {
    H5Fclose(file);
    throw;
  }
  H5_CHECK(H5Fclose(file), "{}: closing the recovered capture failed (disk full?)", path);
  return r;
}

}  // namespace dmi::sink
