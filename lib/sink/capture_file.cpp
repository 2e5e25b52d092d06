#include "sink/capture_file.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>
#include <hdf5.h>
#include <sys/stat.h>

#include <algorithm>
#include <numeric>

#include "common/error.h"
#include "sink/h5util.h"
#include "sink/hdf5_sink.h"
#include "sink/liveness.h"
#include "sink/merge.h"

namespace dmi::sink {

namespace {

using namespace h5;

template <typename T>
std::vector<T> read_all(hid_t loc, const std::string& name, hid_t mem_type, const std::string& path) {
  H5Handle d{H5Dopen2(loc, name.c_str(), H5P_DEFAULT), H5Dclose};
  DMI_CHECK(d.id >= 0, "{}: missing dataset '{}': not a complete dmi capture", path, name);
  auto dims = dims_of(d.id);
  hsize_t n = 1;
  for (auto x : dims) {
    DMI_CHECK(x < (1ull << 31) && n * x < (1ull << 31), "{}: dataset '{}' claims more than 2^31 elements: corrupt "
              "capture", path, name);
    n *= x;
  }
  std::vector<T> out(n);
  if (n) DMI_CHECK(H5Dread(d.id, mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) >= 0,
                   "{}: cannot read '{}' (file truncated?)", path, name);
  return out;
}

std::vector<std::string> read_strings(hid_t loc, const std::string& name, const std::string& path) {
  H5Handle d{H5Dopen2(loc, name.c_str(), H5P_DEFAULT), H5Dclose};
  DMI_CHECK(d.id >= 0, "{}: missing dataset '{}': not a complete dmi capture", path, name);
  auto dims = dims_of(d.id);
  DMI_CHECK(dims.size() == 1 && dims[0] < (1ull << 31), "{}: '{}' is not a list of strings: corrupt capture", path,
            name);
  const std::size_t n = dims[0];
  H5Handle mt{H5Tcopy(H5T_C_S1), H5Tclose};
  H5Tset_size(mt.id, H5T_VARIABLE);
  H5Tset_cset(mt.id, H5T_CSET_UTF8);
  std::vector<char*> ptrs(n, nullptr);
  std::vector<std::string> out;
  if (n == 0) return out;
  DMI_CHECK(H5Dread(d.id, mt.id, H5S_ALL, H5S_ALL, H5P_DEFAULT, ptrs.data()) >= 0, "{}: cannot read '{}'", path,
            name);
  for (char* p : ptrs) out.emplace_back(p ? p : "");
  H5Handle space{H5Dget_space(d.id), H5Sclose};
  H5Dvlen_reclaim(mt.id, space.id, H5P_DEFAULT, ptrs.data());
  return out;
}

// The stored type of a site's data ("" for a type no capture has).
std::string dtype_name(hid_t t) {
  const auto cls = H5Tget_class(t);
  const std::size_t size = H5Tget_size(t);
  if (cls == H5T_INTEGER) return size <= 4 ? "int32" : "int64";
  if (cls != H5T_FLOAT) return "";
  if (size == 4) return "float32";
  if (size == 8) return "float64";
  if (size != 2) return "";
  size_t spos, epos, esize, mpos, msize;
  H5Tget_fields(t, &spos, &epos, &esize, &mpos, &msize);
  return esize == 8 ? "bfloat16" : "float16";
}

}  // namespace

std::unique_ptr<CaptureFile> CaptureFile::open(const std::string& path) {
  struct stat st {};
  DMI_CHECK(::stat(path.c_str(), &st) == 0, "{}: no such file", path);
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  DMI_CHECK(H5Fis_hdf5(path.c_str()) > 0, "{}: not an HDF5 file (a dmi capture is written by dmi-run --hooks ... -o FILE)",
            path);
  std::unique_ptr<CaptureFile> f(new CaptureFile());
  f->path_ = path;
  f->file_ = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f->file_ < 0) {
    // A capture being written (or whose writer died): HDF5 refuses plain
    // readers while its open-for-writing flag is set, and lets SWMR readers in.
    f->file_ = H5Fopen(path.c_str(), H5F_ACC_RDONLY | H5F_ACC_SWMR_READ, H5P_DEFAULT);
    f->swmr_ = f->file_ >= 0;
  }
  DMI_CHECK(f->file_ >= 0, "{}: cannot open: truncated or corrupt HDF5 file (or its writer is closing it: try again)",
            path);
  const hid_t file = f->file_;
  DMI_CHECK(read_text_attr(file, "format") == "dmi-capture", "{}: not a dmi capture (no format=\"dmi-capture\" attribute)",
            path);
  auto version = read_int_attr(file, "format_version");
  DMI_CHECK(version && *version >= kOldestReadableFormatVersion && *version <= kCaptureFormatVersion,
            "{}: capture format version {} is not supported (this dmi reads versions {} to {}); re-run dmi-run to "
            "regenerate it",
            path, version ? std::to_string(*version) : "missing", kOldestReadableFormatVersion, kCaptureFormatVersion);
  f->format_version_ = static_cast<int>(*version);
  f->status_ = read_text_attr(file, "status");
  // A merged capture (dmi-inspect merge) reads its rows from its shards:
  // refuse it when one is gone rather than read HDF5's fill values.
  if (const std::string merged = read_text_attr(file, "merged"); !merged.empty()) check_merged_sources(path, merged);
  if (const std::string shard = read_text_attr(file, "shard"); !shard.empty()) check_shard_record(path, shard);
  if (f->status_ == "running" && writer_alive(read_text_attr(file, "writer")) == false) f->status_ = "killed";

  const bool closed = H5Lexists(file, "sequences", H5P_DEFAULT) > 0 &&
                      H5Lexists(file, "sequences/tokens", H5P_DEFAULT) > 0;
  if (!closed) {
    f->read_token_log();
  } else {
    H5Handle g{H5Gopen2(file, "sequences", H5P_DEFAULT), H5Gclose};
    f->tokens_ = read_all<std::int32_t>(g.id, "tokens", H5T_NATIVE_INT32, path);
    f->offsets_ = read_all<std::int64_t>(g.id, "offsets", H5T_NATIVE_INT64, path);
    f->prompt_lengths_ = read_all<std::int32_t>(g.id, "prompt_lengths", H5T_NATIVE_INT32, path);
    f->prompt_text_ = read_strings(g.id, "prompt_text", path);
    f->generated_text_ = read_strings(g.id, "generated_text", path);
    f->finish_reason_ = read_strings(g.id, "finish_reason", path);
    const std::size_t n = f->prompt_lengths_.size();
    if (H5Lexists(g.id, "batch", H5P_DEFAULT) > 0) {
      f->batch_ = read_all<std::int32_t>(g.id, "batch", H5T_NATIVE_INT32, path);
      f->row_ = read_all<std::int32_t>(g.id, "row", H5T_NATIVE_INT32, path);
      f->left_pad_ = read_all<std::int32_t>(g.id, "left_pad", H5T_NATIVE_INT32, path);
      DMI_CHECK(f->batch_.size() == n && f->row_.size() == n && f->left_pad_.size() == n,
                "{}: /sequences/batch, row and left_pad disagree in length with prompt_lengths: corrupt capture", path);
    }
    DMI_CHECK(f->offsets_.size() == n + 1 && f->prompt_text_.size() == n && f->generated_text_.size() == n &&
                  f->finish_reason_.size() == n && f->offsets_.front() == 0 &&
                  f->offsets_.back() == static_cast<std::int64_t>(f->tokens_.size()),
              "{}: /sequences datasets disagree in length: corrupt capture", path);
    for (std::size_t i = 0; i < n; ++i)
      DMI_CHECK(f->offsets_[i + 1] >= f->offsets_[i] && f->prompt_lengths_[i] >= 0 &&
                    f->prompt_lengths_[i] <= f->offsets_[i + 1] - f->offsets_[i],
                "{}: /sequences: sequence {} has offsets {}..{} and prompt length {}: corrupt capture", path, i,
                f->offsets_[i], f->offsets_[i + 1], f->prompt_lengths_[i]);
  }
  if (H5Lexists(file, "sites", H5P_DEFAULT) > 0) {
    H5Handle sites{H5Gopen2(file, "sites", H5P_DEFAULT), H5Gclose};
    hsize_t n = 0;
    H5Gget_num_objs(sites.id, &n);
    std::vector<std::string> names;
    for (hsize_t i = 0; i < n; ++i) {
      char buf[512];
      H5Gget_objname_by_idx(sites.id, i, buf, sizeof buf);
      names.emplace_back(buf);
    }
    for (const auto& name : names) {
      H5Handle g{H5Gopen2(sites.id, name.c_str(), H5P_DEFAULT), H5Gclose};
      SiteEntry e;
      e.name = name;
      e.layer = static_cast<int>(read_int_attr(g.id, "layer").value_or(-1));
      e.layout = read_text_attr(g.id, "layout");
      if (e.layout.empty()) e.layout = "dense";
      e.records_dropped = read_int_attr(g.id, "records_dropped").value_or(0);
      e.index = read_int_attr(g.id, "index").value_or(0);
      H5Handle d{H5Dopen2(g.id, "data", H5P_DEFAULT), H5Dclose};
      DMI_CHECK(d.id >= 0, "{}: /sites/{} has no data", path, name);
      auto dims = dims_of(d.id);
      DMI_CHECK(!dims.empty(), "{}: /sites/{}/data has no rows dimension", path, name);
      e.rows = static_cast<std::int64_t>(dims[0]);
      // A run that failed on a full disk, or a live or killed one, can leave
      // data, seq and pos of different lengths: the rows are those all
      // three (and ids) hold.
      for (const char* ds : {"seq", "pos", "ids"}) {
        if (std::string(ds) == "ids" && e.layout != "topk") continue;
        H5Handle x{H5Lexists(g.id, ds, H5P_DEFAULT) > 0 ? H5Dopen2(g.id, ds, H5P_DEFAULT) : -1, H5Dclose};
        const auto xd = x.id >= 0 ? dims_of(x.id) : std::vector<hsize_t>();
        H5Handle xt{x.id >= 0 ? H5Dget_type(x.id) : -1, H5Tclose};
        DMI_CHECK(x.id >= 0 && xd.size() == (std::string(ds) == "ids" ? 2u : 1u) && xt.id >= 0 &&
                      H5Tget_class(xt.id) == H5T_INTEGER,
                  "{}: /sites/{}/{} is missing or not an integer {}: corrupt capture", path, name, ds,
                  std::string(ds) == "ids" ? "[rows, K] table" : "vector");
        if (std::string(ds) == "ids")
          DMI_CHECK(dims.size() == 2 && xd[1] == dims[1], "{}: /sites/{}: ids and data of a topk site differ in K: "
                    "corrupt capture", path, name);
        e.rows = std::min<std::int64_t>(e.rows, static_cast<std::int64_t>(xd[0]));
      }
      e.row_shape.assign(dims.begin() + 1, dims.end());
      std::uint64_t per_row_elements = 1;
      for (auto x : e.row_shape) {
        DMI_CHECK(x >= 1 && x <= (std::int64_t{1} << 26) && per_row_elements * static_cast<std::uint64_t>(x) <= (1ull << 26),
                  "{}: /sites/{}/data rows of shape [{}] are empty or implausibly large: corrupt capture", path, name,
                  fmt::join(e.row_shape, ", "));
        per_row_elements *= static_cast<std::uint64_t>(x);
      }
      const std::size_t want_rank = e.layout == "attention" ? 3 : e.layout == "topk" ? 2 : 0;
      DMI_CHECK(e.layout == "dense" || e.layout == "attention" || e.layout == "topk",
                "{}: /sites/{} has layout '{}' (dense, attention or topk): corrupt capture", path, name, e.layout);
      DMI_CHECK(want_rank == 0 || dims.size() == want_rank, "{}: /sites/{} ({} layout) has data of rank {}: corrupt "
                "capture", path, name, e.layout, dims.size());
      H5Handle t{H5Dget_type(d.id), H5Tclose};
      e.dtype = dtype_name(t.id);
      DMI_CHECK(!e.dtype.empty(), "{}: /sites/{}/data is not a float or integer dataset: corrupt capture", path, name);
      std::uint64_t per_row = H5Tget_size(t.id);
      for (auto x : e.row_shape) per_row *= static_cast<std::uint64_t>(x);
      e.raw_bytes = per_row * e.rows + 8ull * e.rows;  // data + seq + pos
      for (const char* ds : {"data", "seq", "pos", "ids"}) {
        if (H5Lexists(g.id, ds, H5P_DEFAULT) <= 0) continue;
        H5Handle x{H5Dopen2(g.id, ds, H5P_DEFAULT), H5Dclose};
        H5Handle dcpl{H5Dget_create_plist(x.id), H5Pclose};
        // A virtual dataset (a merged capture) stores nothing itself: its
        // rows are in the shard files.
        if (H5Pget_layout(dcpl.id) == H5D_VIRTUAL) e.virtual_rows = true;
        e.stored_bytes += H5Dget_storage_size(x.id);
        if (std::string(ds) == "ids" && e.layout == "topk") e.raw_bytes += 4ull * e.rows * e.row_shape.back();
      }
      f->sites_.push_back(std::move(e));
    }
    // Forward order: the writer numbers sites in the order it created them.
    std::stable_sort(f->sites_.begin(), f->sites_.end(),
                     [](const SiteEntry& a, const SiteEntry& b) { return a.index < b.index; });
    f->site_index_.clear();
    for (std::size_t i = 0; i < f->sites_.size(); ++i) f->site_index_[f->sites_[i].name] = i;
  }
  return f;
}

void CaptureFile::read_token_log() {
  const hid_t file = file_;
  if (H5Lexists(file, "sequences", H5P_DEFAULT) > 0) {
    H5Handle g{H5Gopen2(file, "sequences", H5P_DEFAULT), H5Gclose};
    if (H5Lexists(g.id, "prompt_lengths", H5P_DEFAULT) > 0)
      prompt_lengths_ = read_all<std::int32_t>(g.id, "prompt_lengths", H5T_NATIVE_INT32, path_);
    if (H5Lexists(g.id, "prompt_text", H5P_DEFAULT) > 0) prompt_text_ = read_strings(g.id, "prompt_text", path_);
  }
  std::vector<std::int32_t> seq, pos, token;
  if (H5Lexists(file, "token_log", H5P_DEFAULT) > 0) {
    H5Handle g{H5Gopen2(file, "token_log", H5P_DEFAULT), H5Gclose};
    seq = read_all<std::int32_t>(g.id, "seq", H5T_NATIVE_INT32, path_);
    pos = read_all<std::int32_t>(g.id, "pos", H5T_NATIVE_INT32, path_);
    token = read_all<std::int32_t>(g.id, "token", H5T_NATIVE_INT32, path_);
  }
  // The rows all three hold (a live writer extends them one after another).
  const std::size_t rows = std::min({seq.size(), pos.size(), token.size()});
  // Every sequence logs its prompt at creation and its tokens from position
  // 0 on, so sequence ids and positions stay below the rows.
  const std::size_t limit = std::max(rows, prompt_lengths_.size());
  std::size_t n = prompt_lengths_.size();
  for (std::size_t i = 0; i < rows; ++i) {
    DMI_CHECK(seq[i] >= 0 && static_cast<std::size_t>(seq[i]) < limit && pos[i] >= 0 &&
                  static_cast<std::size_t>(pos[i]) < limit,
              "{}: /token_log row {} has sequence {} position {}: corrupt capture", path_, i, seq[i], pos[i]);
    n = std::max<std::size_t>(n, static_cast<std::size_t>(seq[i]) + 1);
  }
  // Each sequence's tokens by position, up to the first one not logged.
  std::vector<std::vector<std::int32_t>> ids(n);
  std::vector<std::vector<char>> have(n);
  for (std::size_t i = 0; i < rows; ++i) {
    auto& v = ids[seq[i]];
    auto& h = have[seq[i]];
    if (v.size() <= static_cast<std::size_t>(pos[i])) {
      v.resize(pos[i] + 1);
      h.resize(pos[i] + 1, 0);
    }
    v[pos[i]] = token[i];
    h[pos[i]] = 1;
  }
  prompt_lengths_.resize(n, 0);
  prompt_text_.resize(n);
  offsets_.assign(1, 0);
  for (std::size_t s = 0; s < n; ++s) {
    const auto known = std::find(have[s].begin(), have[s].end(), 0) - have[s].begin();
    tokens_.insert(tokens_.end(), ids[s].begin(), ids[s].begin() + known);
    offsets_.push_back(static_cast<std::int64_t>(tokens_.size()));
    prompt_lengths_[s] = std::clamp<std::int32_t>(prompt_lengths_[s], 0, static_cast<std::int32_t>(known));
  }
  generated_text_.assign(n, "");
  finish_reason_.assign(n, status_);
  if (n == 0) offsets_.clear();
}

CaptureFile::~CaptureFile() {
  if (file_ >= 0) H5Fclose(file_);
}

std::string CaptureFile::text_attr(const std::string& name) const { return read_text_attr(file_, name); }
std::optional<std::int64_t> CaptureFile::int_attr(const std::string& name) const {
  return read_int_attr(file_, name);
}

bool CaptureFile::has_site(const std::string& name) const { return site_index_.count(name) != 0; }

const SiteEntry& CaptureFile::site(const std::string& name) const {
  auto it = site_index_.find(name);
  if (it != site_index_.end()) return sites_[it->second];
  std::vector<std::string> near;
  for (const auto& s : sites_)
    if (s.name.find(name) != std::string::npos || name.find(s.name) != std::string::npos) near.push_back(s.name);
  if (near.size() > 5) near.resize(5);
  DMI_FAIL("{}: no site '{}' in this capture{}{}", path_, name, near.empty() ? "" : "; similar: ",
           fmt::join(near, ", "));
}

std::vector<std::int32_t> CaptureFile::tokens(std::size_t seq) const {
  DMI_CHECK(seq < n_sequences(), "{}: sequence {} does not exist (the file has {})", path_, seq, n_sequences());
  return std::vector<std::int32_t>(tokens_.begin() + offsets_[seq], tokens_.begin() + offsets_[seq + 1]);
}

const std::vector<std::int32_t>& CaptureFile::seq_of(const std::string& name) const {
  auto it = index_cache_.find(name);
  if (it == index_cache_.end()) {
    site(name);  // validates the name
    H5Handle g{H5Gopen2(file_, ("sites/" + name).c_str(), H5P_DEFAULT), H5Gclose};
    auto seq = read_all<std::int32_t>(g.id, "seq", H5T_NATIVE_INT32, path_);
    auto pos = read_all<std::int32_t>(g.id, "pos", H5T_NATIVE_INT32, path_);
    const auto rows = static_cast<std::size_t>(site(name).rows);
    if (seq.size() > rows) seq.resize(rows);
    if (pos.size() > rows) pos.resize(rows);
    it = index_cache_.emplace(name, std::make_pair(std::move(seq), std::move(pos))).first;
  }
  return it->second.first;
}

const std::vector<std::int32_t>& CaptureFile::pos_of(const std::string& name) const {
  seq_of(name);
  return index_cache_.at(name).second;
}

std::vector<std::int64_t> CaptureFile::find_rows(const std::string& name, std::optional<std::int32_t> seq,
                                                 std::int32_t lo, std::int32_t hi) const {
  const auto& s = seq_of(name);
  const auto& p = pos_of(name);
  std::vector<std::int64_t> rows;
  for (std::size_t i = 0; i < s.size(); ++i)
    if ((!seq || s[i] == *seq) && p[i] >= lo && p[i] < hi) rows.push_back(static_cast<std::int64_t>(i));
  std::stable_sort(rows.begin(), rows.end(), [&](std::int64_t a, std::int64_t b) {
    return s[a] != s[b] ? s[a] < s[b] : p[a] < p[b];
  });
  return rows;
}

at::Tensor CaptureFile::read_selected(const std::string& name, const std::string& dataset,
                                      const std::vector<std::int64_t>& rows, bool ints) const {
  const SiteEntry& e = site(name);
  H5Handle d{H5Dopen2(file_, ("sites/" + name + "/" + dataset).c_str(), H5P_DEFAULT), H5Dclose};
  DMI_CHECK(d.id >= 0, "{}: /sites/{} has no '{}'", path_, name, dataset);
  auto dims = dims_of(d.id);
  std::vector<std::int64_t> shape{static_cast<std::int64_t>(rows.size())};
  std::int64_t per_row = 1;
  for (std::size_t i = 1; i < dims.size(); ++i) {
    shape.push_back(static_cast<std::int64_t>(dims[i]));
    per_row *= static_cast<std::int64_t>(dims[i]);
  }
  at::Tensor out = at::empty(shape, ints ? at::kInt : at::kFloat);
  if (rows.empty()) return out;
  H5Handle fspace{H5Dget_space(d.id), H5Sclose};
  const hid_t mem_type = ints ? H5T_NATIVE_INT32 : H5T_NATIVE_FLOAT;
  auto* base = static_cast<std::uint8_t*>(out.data_ptr());
  const std::size_t elem = 4;
  // One read per run of consecutive rows: only the chunks holding them are
  // touched (the chunk cache serves neighbours).
  std::size_t i = 0;
  while (i < rows.size()) {
    std::size_t j = i + 1;
    while (j < rows.size() && rows[j] == rows[j - 1] + 1) ++j;
    DMI_CHECK(rows[i] >= 0 && rows[j - 1] < e.rows, "{}: row {} of {} is out of range", path_, rows[j - 1], name);
    std::vector<hsize_t> start(dims.size(), 0), count(dims.begin(), dims.end());
    start[0] = static_cast<hsize_t>(rows[i]);
    count[0] = j - i;
    H5Sselect_hyperslab(fspace.id, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
    H5Handle mspace{H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr), H5Sclose};
    DMI_CHECK(H5Dread(d.id, mem_type, mspace.id, fspace.id, H5P_DEFAULT, base + i * per_row * elem) >= 0,
              "{}: cannot read rows of {} (file truncated or corrupt?)", path_, name);
    i = j;
  }
  return out;
}

at::Tensor CaptureFile::read_rows(const std::string& name, const std::vector<std::int64_t>& rows) const {
  return read_selected(name, "data", rows, false);
}

at::Tensor CaptureFile::read_block(const std::string& name, std::int64_t begin, std::int64_t n) const {
  std::vector<std::int64_t> rows(static_cast<std::size_t>(n));
  std::iota(rows.begin(), rows.end(), begin);
  return read_selected(name, "data", rows, false);
}

at::Tensor CaptureFile::read_seq_block(const std::string& name, std::int64_t begin, std::int64_t n) const {
  std::vector<std::int64_t> rows(static_cast<std::size_t>(n));
  std::iota(rows.begin(), rows.end(), begin);
  return read_selected(name, "seq", rows, true);
}

at::Tensor CaptureFile::read_ids(const std::string& name, const std::vector<std::int64_t>& rows) const {
  DMI_CHECK(site(name).layout == "topk", "{}: site {} stores full logits, not top-k ids", path_, name);
  return read_selected(name, "ids", rows, true);
}

}  // namespace dmi::sink
