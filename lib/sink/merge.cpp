#include "sink/merge.h"

#include <hdf5.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "common/error.h"
#include "sink/capture_file.h"
#include "sink/h5util.h"
#include "sink/liveness.h"

namespace dmi::sink {

namespace {

using namespace h5;
namespace fs = std::filesystem;
using nlohmann::json;

// Root attributes that decide a capture's numbers and layout: the shards of
// one capture agree on every one of them.
const char* const kSameText[] = {"model_fingerprint", "architecture", "model_config", "hook_map",
                                 "selection",    "token_policy",  "logits",            "capture_dtype",
                                 "compute_dtype", "sampling",     "eos_token_ids",     "interventions"};
const char* const kSameInt[] = {"format_version", "every",      "seed",
                                "max_new_tokens", "batch_size", "ignore_eos",
                                "add_special_tokens", "capture_before_interventions", "n_layers",
                                "attention_width"};
// Root attributes of a shard the merged file does not take from shard 0.
const std::set<std::string> kOwnRootAttributes = {"shard",   "status",  "records_written", "records_dropped",
                                                  "records_dropped_per_site", "timings", "writer"};

struct Shard {
  std::string path;
  std::unique_ptr<CaptureFile> f;
  hid_t file = -1;  // raw access to datasets and attributes
  std::int64_t index = 0, count = 0, sequences = 0;
  std::size_t begin = 0, end = 0;
  Shard() = default;
  Shard(const Shard&) = delete;
  ~Shard() {
    if (file >= 0) H5Fclose(file);
  }
};

std::uint64_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : 0;
}

std::vector<std::int64_t> read_int_array_attr(hid_t loc, const std::string& name) {
  if (H5Aexists(loc, name.c_str()) <= 0) return {};
  H5Handle a{H5Aopen(loc, name.c_str(), H5P_DEFAULT), H5Aclose};
  H5Handle s{H5Aget_space(a.id), H5Sclose};
  const hssize_t n = H5Sget_simple_extent_npoints(s.id);
  std::vector<std::int64_t> v(static_cast<std::size_t>(std::max<hssize_t>(n, 0)));
  if (!v.empty() && H5Aread(a.id, H5T_NATIVE_INT64, v.data()) < 0) return {};
  return v;
}

herr_t collect_name(hid_t, const char* name, const H5A_info_t*, void* out) {
  static_cast<std::vector<std::string>*>(out)->emplace_back(name);
  return 0;
}

// Text, integer and integer-array attributes (all a capture has), except `skip`.
void copy_attributes(hid_t src, hid_t dst, const std::set<std::string>& skip) {
  std::vector<std::string> names;
  H5Aiterate2(src, H5_INDEX_CRT_ORDER, H5_ITER_INC, nullptr, collect_name, &names);
  if (names.empty())  // files without creation order tracking iterate by name
    H5Aiterate2(src, H5_INDEX_NAME, H5_ITER_INC, nullptr, collect_name, &names);
  for (const auto& name : names) {
    if (skip.count(name)) continue;
    H5Handle a{H5Aopen(src, name.c_str(), H5P_DEFAULT), H5Aclose};
    H5Handle t{H5Aget_type(a.id), H5Tclose};
    H5Handle s{H5Aget_space(a.id), H5Sclose};
    if (H5Tget_class(t.id) == H5T_STRING) {
      set_attr_text(dst, name, read_text_attr(src, name));
    } else if (H5Tget_class(t.id) == H5T_INTEGER) {
      if (H5Sget_simple_extent_type(s.id) == H5S_SCALAR)
        set_attr_int(dst, name, read_int_attr(src, name).value_or(0));
      else
        set_attr_ints(dst, name, read_int_array_attr(src, name));
    }
  }
}

// "%" starts a printf-style pattern in a virtual dataset's source names.
std::string escape_vds_name(const std::string& s) {
  std::string out;
  for (char c : s) out += c == '%' ? std::string("%%") : std::string(1, c);
  return out;
}

// The shard files as the merged file names them: relative to its directory
// when possible, so that the merged file and its shards move together.
std::string stored_name(const std::string& shard, const std::string& output) {
  std::error_code ec;
  const fs::path dir = fs::absolute(fs::path(output), ec).parent_path();
  const fs::path abs = fs::absolute(fs::path(shard), ec).lexically_normal();
  const fs::path rel = abs.lexically_relative(dir);
  return rel.empty() ? abs.string() : rel.string();
}

// The path of a shard named in a merged file, resolved against its directory.
std::string resolve(const std::string& stored, const std::string& merged_path) {
  const fs::path p(stored);
  if (p.is_absolute()) return stored;
  const fs::path dir = fs::path(merged_path).parent_path();
  return (dir.empty() ? p : dir / p).lexically_normal().string();
}

void load_shard(Shard& s, const std::string& path) {
  s.path = path;
  s.f = CaptureFile::open(path);
  DMI_CHECK(!s.f->opened_live(), "{}: still open for writing (status {}): wait for its run to finish, or 'dmi-inspect "
            "{} recover' if its writer died", path, s.f->status(), path);
  const std::string rec = s.f->text_attr("shard");
  DMI_CHECK(!rec.empty(), "{}: not a shard (no 'shard' attribute; shards are written by dmi-run --shard K/N)", path);
  const json j = json::parse(rec, nullptr, false);
  DMI_CHECK(j.is_object() && j.contains("index") && j.contains("count") && j.contains("begin") && j.contains("end") &&
                j.contains("sequences"),
            "{}: its 'shard' attribute is not a shard record: {}", path, rec);
  s.index = j["index"].get<std::int64_t>();
  s.count = j["count"].get<std::int64_t>();
  s.begin = j["begin"].get<std::size_t>();
  s.end = j["end"].get<std::size_t>();
  s.sequences = j["sequences"].get<std::int64_t>();
  DMI_CHECK(s.count >= 1 && s.index >= 0 && s.index < s.count && s.begin <= s.end &&
                static_cast<std::int64_t>(s.end) <= s.sequences &&
                static_cast<std::int64_t>(s.f->n_sequences()) == s.sequences,
            "{}: shard record {} does not fit its {} sequences: corrupt shard", path, rec, s.f->n_sequences());
  for (std::size_t i = 0; i < s.f->n_sequences(); ++i) {
    const bool mine = i >= s.begin && i < s.end;
    DMI_CHECK(mine != (s.f->finish_reason(i) == "skipped"),
              "{}: sequence {} is '{}', but the shard holds prompts {}..{}: corrupt shard", path, i,
              s.f->finish_reason(i), s.begin, s.end);
  }
  s.file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  DMI_CHECK(s.file >= 0, "{}: cannot open", path);
}

// A shard must agree with the first on everything that decides the numbers.
void check_same(const Shard& first, const Shard& s) {
  DMI_CHECK(s.count == first.count && s.sequences == first.sequences,
            "{} is shard {} of {} over {} prompts, but {} is shard {} of {} over {}: not shards of one run", s.path,
            s.index, s.count, s.sequences, first.path, first.index, first.count, first.sequences);
  for (const char* k : kSameText)
    DMI_CHECK(s.f->text_attr(k) == first.f->text_attr(k), "{} and {} differ in {}{}: shards of one capture share the "
              "model, selection and settings", first.path, s.path, k,
              std::string(k) == "model_fingerprint" ? " (different model files)" : "");
  for (const char* k : kSameInt)
    DMI_CHECK(s.f->int_attr(k) == first.f->int_attr(k), "{} and {} differ in {} ({} vs {}): shards of one capture "
              "share the model, selection and settings", first.path, s.path, k, first.f->int_attr(k).value_or(-1),
              s.f->int_attr(k).value_or(-1));
  const auto& a = first.f->sites();
  const auto& b = s.f->sites();
  for (std::size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    DMI_CHECK(i < a.size() && i < b.size() && a[i].name == b[i].name,
              "{} and {} capture different sites ({} vs {})", first.path, s.path,
              i < a.size() ? a[i].name : "nothing", i < b.size() ? b[i].name : "nothing");
    DMI_CHECK(a[i].layout == b[i].layout && a[i].row_shape == b[i].row_shape && a[i].dtype == b[i].dtype,
              "{} and {} store {} differently (shape, dtype or layout)", first.path, s.path, a[i].name);
  }
  for (std::size_t i = 0; i < first.f->n_sequences(); ++i) {
    const auto ta = first.f->tokens(i), tb = s.f->tokens(i);
    const auto pa = static_cast<std::size_t>(first.f->prompt_length(i)), pb = static_cast<std::size_t>(s.f->prompt_length(i));
    DMI_CHECK(pa == pb && std::equal(ta.begin(), ta.begin() + pa, tb.begin()),
              "{} and {} have different prompts (prompt {} differs): shards of one run share the prompt set",
              first.path, s.path, i);
  }
}

// Every row a shard holds belongs to one of its own sequences. Reads each
// site's seq column a block at a time (not the reader's cached index: a
// big shard has millions of rows per site).
void check_rows(const Shard& s) {
  constexpr std::int64_t kBlock = 1 << 20;
  for (const auto& e : s.f->sites())
    for (std::int64_t at = 0; at < e.rows; at += kBlock) {
      const at::Tensor seq = s.f->read_seq_block(e.name, at, std::min(kBlock, e.rows - at));
      const std::int32_t* q = seq.data_ptr<std::int32_t>();
      for (std::int64_t i = 0; i < seq.numel(); ++i)
        DMI_CHECK(q[i] >= 0 && static_cast<std::size_t>(q[i]) >= s.begin && static_cast<std::size_t>(q[i]) < s.end,
                  "{}: /sites/{} has rows of sequence {}, outside its shard's prompts {}..{}: corrupt shard", s.path,
                  e.name, q[i], s.begin, s.end);
    }
}

// One dataset of a site over all shards: virtual (a mapping per shard) or copied.
void merge_dataset(hid_t group, const std::string& site, const std::string& name,
                   const std::vector<const Shard*>& shards, const std::vector<std::int64_t>& rows, bool copy,
                   const std::string& output, const std::string& out_path) {
  const std::string src_name = "/sites/" + site + "/" + name;
  H5Handle src0{H5Dopen2(shards[0]->file, src_name.c_str(), H5P_DEFAULT), H5Dclose};
  DMI_CHECK(src0.id >= 0, "{}: missing {}", shards[0]->path, src_name);
  H5Handle type{H5Dget_type(src0.id), H5Tclose};
  std::vector<hsize_t> dims = dims_of(src0.id);
  DMI_CHECK(!dims.empty(), "{}: {} has no rows dimension", shards[0]->path, src_name);
  hsize_t total = 0;
  for (auto r : rows) total += static_cast<hsize_t>(r);
  dims[0] = total;
  const int rank = static_cast<int>(dims.size());
  hsize_t row_elems = 1;
  for (int i = 1; i < rank; ++i) row_elems *= dims[i];

  if (!copy) {
    H5Handle vspace{H5Screate_simple(rank, dims.data(), nullptr), H5Sclose};
    H5Handle dcpl{H5Pcreate(H5P_DATASET_CREATE), H5Pclose};
    // What a reader gets if a shard file goes missing: NaN rows, sequence
    // and position -1 (dmi's reader refuses such a file first).
    if (H5Tget_class(type.id) == H5T_FLOAT) {
      const float nan = std::nanf("");
      H5Pset_fill_value(dcpl.id, H5T_NATIVE_FLOAT, &nan);
    } else {
      const std::int32_t minus_one = -1;
      H5Pset_fill_value(dcpl.id, H5T_NATIVE_INT32, &minus_one);
    }
    hsize_t offset = 0;
    for (std::size_t k = 0; k < shards.size(); ++k) {
      if (rows[k] == 0) continue;
      std::vector<hsize_t> start(rank, 0), count(dims);
      start[0] = offset;
      count[0] = static_cast<hsize_t>(rows[k]);
      H5Sselect_hyperslab(vspace.id, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
      H5Handle src{H5Dopen2(shards[k]->file, src_name.c_str(), H5P_DEFAULT), H5Dclose};
      H5Handle sspace{H5Dget_space(src.id), H5Sclose};
      start[0] = 0;
      H5Sselect_hyperslab(sspace.id, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
      H5_CHECK(H5Pset_virtual(dcpl.id, vspace.id, escape_vds_name(stored_name(shards[k]->path, output)).c_str(),
                              escape_vds_name(src_name).c_str(), sspace.id),
               "{}: cannot map {} of {}", out_path, src_name, shards[k]->path);
      offset += count[0];
    }
    H5Sselect_all(vspace.id);
    H5Handle d{H5Dcreate2(group, name.c_str(), type.id, vspace.id, H5P_DEFAULT, dcpl.id, H5P_DEFAULT), H5Dclose};
    DMI_CHECK(d.id >= 0, "{}: cannot create the virtual dataset {}", out_path, src_name);
    return;
  }
  // Copy: the shards' chunking and filters, rows read and written a block at a time.
  H5Handle dcpl{H5Dget_create_plist(src0.id), H5Pclose};
  std::vector<hsize_t> maxdims(dims);
  maxdims[0] = H5S_UNLIMITED;
  H5Handle space{H5Screate_simple(rank, dims.data(), maxdims.data()), H5Sclose};
  H5Handle d{H5Dcreate2(group, name.c_str(), type.id, space.id, H5P_DEFAULT, dcpl.id, H5P_DEFAULT), H5Dclose};
  DMI_CHECK(d.id >= 0, "{}: cannot create {}", out_path, src_name);
  const std::size_t row_bytes = H5Tget_size(type.id) * row_elems;
  const hsize_t block = std::max<hsize_t>(1, (64u << 20) / std::max<std::size_t>(row_bytes, 1));
  std::vector<unsigned char> buf;
  hsize_t offset = 0;
  for (std::size_t k = 0; k < shards.size(); ++k) {
    H5Handle src{H5Dopen2(shards[k]->file, src_name.c_str(), H5P_DEFAULT), H5Dclose};
    H5Handle sspace{H5Dget_space(src.id), H5Sclose};
    for (hsize_t r = 0; r < static_cast<hsize_t>(rows[k]); r += block) {
      std::vector<hsize_t> start(rank, 0), count(dims);
      count[0] = std::min<hsize_t>(block, static_cast<hsize_t>(rows[k]) - r);
      buf.resize(count[0] * row_bytes);
      start[0] = r;
      H5Sselect_hyperslab(sspace.id, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
      H5Handle mspace{H5Screate_simple(rank, count.data(), nullptr), H5Sclose};
      H5_CHECK(H5Dread(src.id, type.id, mspace.id, sspace.id, H5P_DEFAULT, buf.data()), "{}: cannot read {}",
               shards[k]->path, src_name);
      start[0] = offset + r;
      H5Sselect_hyperslab(space.id, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
      H5_CHECK(H5Dwrite(d.id, type.id, mspace.id, space.id, H5P_DEFAULT, buf.data()),
               "{}: cannot write {} (disk full?)", out_path, src_name);
    }
    offset += static_cast<hsize_t>(rows[k]);
  }
}

std::string combined_status(const std::vector<std::unique_ptr<Shard>>& shards) {
  std::string status = "complete";
  for (const char* worst : {"interrupted", "killed", "failed"})
    for (const auto& s : shards)
      if (s->f->status() == worst) status = worst;
  return status;
}

}  // namespace

MergeResult merge_captures(const MergeOptions& o) {
  DMI_CHECK(!o.output.empty(), "merge needs an output file");
  DMI_CHECK(!o.shards.empty(), "merge needs the shard files (dmi-inspect merge OUT.h5 SHARD.h5...)");
  struct stat st {};
  DMI_CHECK(o.overwrite || ::stat(o.output.c_str(), &st) != 0, "{} exists; pass --overwrite to replace it", o.output);
  std::vector<std::unique_ptr<Shard>> shards;
  for (const auto& p : o.shards) {
    std::error_code ec;
    DMI_CHECK(!fs::equivalent(p, o.output, ec), "{} is one of the shards; merge into another file", o.output);
    shards.push_back(std::make_unique<Shard>());
    load_shard(*shards.back(), p);
  }
  std::sort(shards.begin(), shards.end(), [](const auto& a, const auto& b) { return a->index < b->index; });
  const Shard& first = *shards[0];
  for (std::size_t k = 1; k < shards.size(); ++k) {
    DMI_CHECK(shards[k]->index != shards[k - 1]->index, "{} and {} are both shard {} of {}: each shard once",
              shards[k - 1]->path, shards[k]->path, shards[k]->index, shards[k]->count);
    check_same(first, *shards[k]);
    DMI_CHECK(shards[k]->begin >= shards[k - 1]->end, "{} (prompts {}..{}) and {} (prompts {}..{}) overlap",
              shards[k - 1]->path, shards[k - 1]->begin, shards[k - 1]->end, shards[k]->path, shards[k]->begin,
              shards[k]->end);
  }
  // Which shards and prompts are missing.
  MergeResult res;
  res.count = first.count;
  res.shards = static_cast<std::int64_t>(shards.size());
  std::set<std::int64_t> have;
  for (const auto& s : shards) have.insert(s->index);
  for (std::int64_t k = 0; k < first.count; ++k)
    if (!have.count(k)) res.missing.push_back(k);
  std::vector<int> owner(static_cast<std::size_t>(first.sequences), -1);
  for (std::size_t k = 0; k < shards.size(); ++k)
    for (std::size_t i = shards[k]->begin; i < shards[k]->end; ++i) owner[i] = static_cast<int>(k);
  if (!res.missing.empty() && !o.allow_partial) {
    // The prompts nobody holds, around the first missing shard.
    std::size_t lo = 0, hi = owner.size();
    for (const auto& s : shards)
      if (s->index < res.missing[0]) lo = std::max(lo, s->end);
      else hi = std::min(hi, s->begin);
    DMI_FAIL("shard {} of {} is missing (prompts {}..{}){}: pass its file, or --allow-partial to merge without it",
             res.missing[0], first.count, lo, hi,
             res.missing.size() > 1 ? fmt::format(", and {} more", res.missing.size() - 1) : "");
  }
  for (const auto& s : shards) check_rows(*s);
  DMI_CHECK(H5Lexists(first.file, "monitors", H5P_DEFAULT) <= 0,
            "{}: has monitor results (/monitors), which merge cannot combine; run the monitors offline on the merged "
            "capture (docs/monitors.md)", first.path);

  const std::string tmp = o.output + ".partial";
  std::remove(tmp.c_str());
  hid_t fapl = latest_fapl();
  hid_t out = H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
  H5Pclose(fapl);
  DMI_CHECK(out >= 0, "{}: cannot create the file: {}", tmp, std::strerror(errno));
  try {
    copy_attributes(first.file, out, kOwnRootAttributes);
    res.status = combined_status(shards);
    set_attr_text(out, "status", res.status);
    set_attr_text(out, "writer", writer_record());
    std::int64_t written = 0, dropped = 0;
    std::vector<std::int64_t> per_site;
    json timings = json::object();
    json list = json::array();
    for (const auto& s : shards) {
      written += s->f->int_attr("records_written").value_or(0);
      dropped += s->f->int_attr("records_dropped").value_or(0);
      const auto d = read_int_array_attr(s->file, "records_dropped_per_site");
      per_site.resize(std::max(per_site.size(), d.size()), 0);
      for (std::size_t i = 0; i < d.size(); ++i) per_site[i] += d[i];
      const json t = json::parse(s->f->text_attr("timings"), nullptr, false);
      if (t.is_object())
        for (auto it = t.begin(); it != t.end(); ++it)
          if (it.value().is_number()) timings[it.key()] = timings.value(it.key(), 0.0) + it.value().get<double>();
      list.push_back({{"index", s->index},
                      {"file", stored_name(s->path, o.output)},
                      {"begin", s->begin},
                      {"end", s->end},
                      {"status", s->f->status()},
                      {"bytes", file_size(s->path)},
                      {"records_written", s->f->int_attr("records_written").value_or(0)},
                      {"command_line", s->f->text_attr("command_line")},
                      {"environment", json::parse(s->f->text_attr("environment"), nullptr, false)}});
    }
    set_attr_int(out, "records_written", written);
    set_attr_int(out, "records_dropped", dropped);
    set_attr_ints(out, "records_dropped_per_site", per_site);
    if (!timings.empty()) set_attr_text(out, "timings", timings.dump());
    res.mode = o.copy ? "copy" : "virtual";
    set_attr_text(out, "merged", json{{"tool", "dmi-inspect merge"},
                                      {"tool_version", DMI_VERSION},
                                      {"command_line", o.command_line},
                                      {"mode", res.mode},
                                      {"count", first.count},
                                      {"shards", list},
                                      {"missing", res.missing},
                                      {"allow_partial", o.allow_partial}}
                                     .dump());

    // /sequences from each sequence's shard; batches renumbered so that each
    // shard's batches stay distinct (a replay reruns them as they ran).
    std::vector<std::int32_t> batch_offset(shards.size(), 0);
    for (std::size_t k = 1; k < shards.size(); ++k) {
      std::int32_t top = -1;
      for (auto b : shards[k - 1]->f->batch_of()) top = std::max(top, b);
      batch_offset[k] = batch_offset[k - 1] + top + 1;
    }
    std::vector<SequenceInfo> seqs;
    std::vector<std::int32_t> log_seq, log_pos, log_token;
    for (std::size_t i = 0; i < owner.size(); ++i) {
      const CaptureFile& f = owner[i] >= 0 ? *shards[static_cast<std::size_t>(owner[i])]->f : *first.f;
      const auto ids = f.tokens(i);
      const auto plen = static_cast<std::size_t>(f.prompt_length(i));
      SequenceInfo si;
      si.prompt = f.prompt_text(i);
      si.prompt_ids.assign(ids.begin(), ids.begin() + plen);
      if (owner[i] >= 0) {
        si.output_ids.assign(ids.begin() + plen, ids.end());
        si.text = f.generated_text(i);
        si.finish_reason = f.finish_reason(i);
        if (!f.batch_of().empty() && f.batch_of()[i] >= 0) {
          si.batch = f.batch_of()[i] + batch_offset[static_cast<std::size_t>(owner[i])];
          si.row = f.row_of()[i];
          si.left_pad = f.left_pad_of()[i];
        }
      } else {
        si.finish_reason = "missing";  // its shard was not merged (--allow-partial)
      }
      for (std::size_t p = 0; p < plen + si.output_ids.size(); ++p) {
        log_seq.push_back(static_cast<std::int32_t>(i));
        log_pos.push_back(static_cast<std::int32_t>(p));
        log_token.push_back(ids[p]);
      }
      seqs.push_back(std::move(si));
    }
    write_sequences(out, seqs, tmp);
    res.sequences = seqs.size();
    {
      H5Handle g{H5Gcreate2(out, "token_log", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose};
      DMI_CHECK(g.id >= 0, "{}: cannot create /token_log", tmp);
      write_vector(g.id, "seq", H5T_STD_I32LE, H5T_NATIVE_INT32, log_seq);
      write_vector(g.id, "pos", H5T_STD_I32LE, H5T_NATIVE_INT32, log_pos);
      write_vector(g.id, "token", H5T_STD_I32LE, H5T_NATIVE_INT32, log_token);
    }

    // /sites, in forward order.
    H5Handle sites{H5Gcreate2(out, "sites", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose};
    DMI_CHECK(sites.id >= 0, "{}: cannot create /sites", tmp);
    std::vector<const Shard*> order;
    for (const auto& s : shards) order.push_back(s.get());
    for (const auto& e : first.f->sites()) {
      H5Handle g{H5Gcreate2(sites.id, e.name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose};
      DMI_CHECK(g.id >= 0, "{}: cannot create /sites/{}", tmp, e.name);
      H5Handle src{H5Gopen2(first.file, ("sites/" + e.name).c_str(), H5P_DEFAULT), H5Gclose};
      copy_attributes(src.id, g.id, {"records_dropped"});
      std::vector<std::int64_t> rows;
      std::int64_t dropped_here = 0;
      for (const auto& s : shards) {
        rows.push_back(s->f->site(e.name).rows);
        dropped_here += s->f->site(e.name).records_dropped;
        res.rows += rows.back();
      }
      set_attr_int(g.id, "records_dropped", dropped_here);
      for (const char* ds : {"data", "seq", "pos", "ids"}) {
        if (std::string(ds) == "ids" && e.layout != "topk") continue;
        merge_dataset(g.id, e.name, ds, order, rows, o.copy, o.output, tmp);
      }
      ++res.sites;
    }
  } catch (...) {
    H5Fclose(out);
    std::remove(tmp.c_str());
    throw;
  }
  DMI_CHECK(H5Fclose(out) >= 0, "{}: cannot close (disk full?)", tmp);
  DMI_CHECK(std::rename(tmp.c_str(), o.output.c_str()) == 0, "{}: cannot rename to {}: {}", tmp, o.output,
            std::strerror(errno));
  res.output = o.output;
  res.file_bytes = file_size(o.output);
  return res;
}

void check_shard_record(const std::string& path, const std::string& shard_json) {
  const json j = json::parse(shard_json, nullptr, false);
  bool ok = j.is_object();
  for (const char* k : {"index", "count", "begin", "end", "sequences"})
    ok = ok && j.contains(k) && j[k].is_number_integer() && j[k].get<std::int64_t>() >= 0;
  DMI_CHECK(ok, "{}: its 'shard' attribute is not a shard record (index, count, begin, end, sequences): corrupt "
            "shard", path);
}

void check_merged_sources(const std::string& path, const std::string& merged_json) {
  const json j = json::parse(merged_json, nullptr, false);
  bool ok = j.is_object() && j.contains("mode") && j["mode"].is_string() && j.contains("count") &&
            j["count"].is_number_integer() && j.contains("shards") && j["shards"].is_array() &&
            j.contains("missing") && j["missing"].is_array();
  for (const auto& s : ok ? j["shards"] : json::array())
    ok = ok && s.is_object() && s.contains("file") && s["file"].is_string() && s.contains("index") &&
         s["index"].is_number_integer() && s.contains("bytes") && s["bytes"].is_number_unsigned();
  DMI_CHECK(ok, "{}: its 'merged' attribute is not a merge record (mode, count, shards with file, index and bytes, "
            "missing): corrupt merged capture", path);
  if (j["mode"].get<std::string>() != "virtual") return;
  for (const auto& s : j["shards"]) {
    const std::string stored = s["file"].get<std::string>();
    const std::string file = resolve(stored, path);
    struct stat st {};
    DMI_CHECK(::stat(file.c_str(), &st) == 0,
              "{}: its shard {} of {} ({}) is missing: a merged capture reads its rows from the shard files; keep them "
              "beside it (as merged), or merge with --copy", path, s.value("index", -1), j.value("count", -1), file);
    const auto bytes = s.value("bytes", std::uint64_t{0});
    DMI_CHECK(static_cast<std::uint64_t>(st.st_size) == bytes,
              "{}: its shard {} ({}) changed since the merge ({} bytes, then {}): merge again", path,
              s.value("index", -1), file, st.st_size, bytes);
  }
}

}  // namespace dmi::sink
