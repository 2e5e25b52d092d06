// dmi-inspect: query a dmi capture file. A thin front end over
// sink::CaptureFile and analysis/.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "analysis/attn_tracker.h"
#include "analysis/follow.h"
#include "analysis/heatmap.h"
#include "analysis/report.h"
#include "hooks/selection.h"
#include "analysis/stats.h"
#include "analysis/steering.h"
#include "app_main.h"
#include "common/error.h"
#include "io/tokenizer.h"
#include "io/vectors.h"
#include "sink/capture_file.h"
#include "sink/merge.h"
#include "sink/hdf5_sink.h"

using nlohmann::json;
using dmi::sink::CaptureFile;

namespace {

struct Options {
  std::string file, tokenizer, site, match = "*", pos, index, format = "table", npy, png, svg, by;
  int seq = -1, layer = -1, head = -1, qpos = -1, top = 10;
  bool json = false, follow = false;
  double interval = 0.5;
};

// The tokenizer named in the file (or --tokenizer), if it can be loaded.
std::unique_ptr<dmi::io::Tokenizer> load_tokenizer(const CaptureFile& f, const Options& o) {
  std::string path = o.tokenizer.empty() ? f.text_attr("tokenizer_path") : o.tokenizer;
  if (path.empty()) return nullptr;
  try {
    return std::make_unique<dmi::io::Tokenizer>(dmi::io::Tokenizer::load(path));
  } catch (const dmi::Error&) {
    if (!o.tokenizer.empty()) throw;
    std::fprintf(stderr, "dmi-inspect: note: tokenizer %s not readable; showing token ids only (use --tokenizer)\n",
                 path.c_str());
    return nullptr;
  }
}

std::string token_text(const dmi::io::Tokenizer* tok, std::int32_t id) {
  return tok ? tok->decode({id}) : fmt::format("#{}", id);
}

// "A:B", "A:" or ":B" (end exclusive).
std::pair<std::int32_t, std::int32_t> parse_range(const std::string& s) {
  if (s.empty()) return {0, std::numeric_limits<std::int32_t>::max()};
  auto colon = s.find(':');
  try {
    if (colon == std::string::npos) {
      int p = std::stoi(s);
      return {p, p + 1};
    }
    std::string a = s.substr(0, colon), b = s.substr(colon + 1);
    return {a.empty() ? 0 : std::stoi(a), b.empty() ? std::numeric_limits<std::int32_t>::max() : std::stoi(b)};
  } catch (const std::logic_error&) {
    DMI_FAIL("'{}' is not a position or range A:B", s);
  }
}

// --index "2,0:8": per row dimension an index or a range.
at::Tensor apply_index(at::Tensor x, const std::string& spec) {
  if (spec.empty()) return x;
  std::vector<std::string> parts;
  std::size_t i = 0;
  while (i <= spec.size()) {
    auto j = spec.find(',', i);
    if (j == std::string::npos) j = spec.size();
    parts.push_back(spec.substr(i, j - i));
    i = j + 1;
  }
  DMI_CHECK(static_cast<std::int64_t>(parts.size()) <= x.dim() - 1, "--index '{}' has {} parts; rows have {} dimensions",
            spec, parts.size(), x.dim() - 1);
  std::int64_t dim = 1;
  for (const auto& p : parts) {
    const std::int64_t size = x.size(dim);
    if (p.find(':') == std::string::npos) {
      auto [a, b] = parse_range(p);
      DMI_CHECK(a >= 0 && a < size, "--index {} is out of range for a dimension of size {}", a, size);
      x = x.select(dim, a);
    } else {
      auto [a, b] = parse_range(p);
      b = std::min<std::int64_t>(b, size);
      DMI_CHECK(a >= 0 && a < b, "--index range '{}' is empty or out of range (size {})", p, size);
      x = x.narrow(dim, a, b - a);
      ++dim;
    }
  }
  return x;
}

json nested(const at::Tensor& t) {
  if (t.dim() == 0) {
    double v = t.item<double>();
    return std::isfinite(v) ? json(v) : json(std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf"));
  }
  json a = json::array();
  for (std::int64_t i = 0; i < t.size(0); ++i) a.push_back(nested(t[i]));
  return a;
}

void write_npy(const std::string& path, const at::Tensor& t) {
  at::Tensor x = t.to(at::kFloat).contiguous();
  std::string shape;
  for (auto d : x.sizes()) shape += std::to_string(d) + ", ";
  if (x.dim() == 1) shape = std::to_string(x.size(0)) + ",";
  else if (!shape.empty()) shape.resize(shape.size() - 2);
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + shape + "), }";
  while ((10 + header.size() + 1) % 64) header += ' ';
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  DMI_CHECK(f, "{}: cannot write", path);
  f.write("\x93NUMPY\x01\x00", 8);
  const std::uint16_t n = static_cast<std::uint16_t>(header.size());
  f.write(reinterpret_cast<const char*>(&n), 2);
  f << header;
  f.write(static_cast<const char*>(x.data_ptr()), static_cast<std::streamsize>(x.numel() * 4));
  DMI_CHECK(f.good(), "{}: write failed (disk full?)", path);
}

std::string fmt_bytes(std::uint64_t b) {
  if (b >= (1ull << 30)) return fmt::format("{:.2f} GiB", b / double(1ull << 30));
  if (b >= (1ull << 20)) return fmt::format("{:.1f} MiB", b / double(1ull << 20));
  if (b >= 1024) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{} B", b);
}

json stats_json(const dmi::analysis::Stats& s) {
  return {{"count", s.count}, {"mean", s.mean}, {"std", s.std}, {"rms", s.rms},
          {"min", s.min},     {"max", s.max},   {"nan", s.nan}, {"inf", s.inf}};
}

int cmd_summary(const CaptureFile& f, const Options& o) {
  json j;
  for (const char* k : {"model_path", "architecture", "compute_dtype", "capture_dtype", "selection", "token_policy",
                        "logits", "command_line", "tool_version"})
    j[k] = f.text_attr(k);
  j["status"] = f.status();
  if (f.status() == "running" || f.status() == "killed")
    if (auto w = json::parse(f.text_attr("writer"), nullptr, false); w.is_object()) j["writer"] = w;
  for (const char* k : {"every", "records_written", "records_dropped", "seed"}) j[k] = f.int_attr(k).value_or(0);
  j["sequences"] = f.n_sequences();
  j["format_version"] = f.format_version();
  // The run record (format 2): what a replay needs, and where a replay came from.
  j["fingerprinted"] = !f.text_attr("model_fingerprint").empty();
  if (auto t = f.int_attr("threads")) j["threads"] = *t;
  if (auto b = f.int_attr("batch_size")) j["batch_size"] = *b;
  if (auto r = json::parse(f.text_attr("replay_of"), nullptr, false); r.is_object()) j["replay_of"] = r;
  if (auto r = json::parse(f.text_attr("shard"), nullptr, false); r.is_object()) j["shard"] = r;
  if (auto r = json::parse(f.text_attr("merged"), nullptr, false); r.is_object()) j["merged"] = r;
  if (auto iv = json::parse(f.text_attr("interventions"), nullptr, false); iv.is_array() && !iv.empty()) {
    j["interventions"] = json::array();
    for (const auto& e : iv) j["interventions"].push_back(fmt::format("--{} {}", e.value("kind", std::string("?")),
                                                                       e.value("spec", std::string("?"))));
  }
  std::uint64_t stored = 0, raw = 0;
  j["sites"] = json::array();
  for (const auto& s : f.sites()) {
    stored += s.stored_bytes;
    raw += s.raw_bytes;
    j["sites"].push_back({{"name", s.name}, {"layer", s.layer}, {"layout", s.layout}, {"rows", s.rows},
                          {"shape", s.row_shape}, {"dtype", s.dtype}, {"stored_bytes", s.stored_bytes},
                          {"raw_bytes", s.raw_bytes}, {"records_dropped", s.records_dropped}});
  }
  j["stored_bytes"] = stored;
  j["raw_bytes"] = raw;
  if (o.json) {
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  fmt::print("{}\n", f.path());
  fmt::print("  model        {} ({})\n", j["model_path"].get<std::string>(), j["architecture"].get<std::string>());
  fmt::print("  dtypes       compute {}, capture {}\n", j["compute_dtype"].get<std::string>(),
             j["capture_dtype"].get<std::string>());
  fmt::print("  selection    {}\n", j["selection"].get<std::string>());
  fmt::print("  tokens       {} (every {} decode steps), logits {}\n", j["token_policy"].get<std::string>(),
             j["every"].get<std::int64_t>(), j["logits"].get<std::string>());
  fmt::print("  status       {}{}\n", j["status"].get<std::string>(),
             f.status() == "running" ? fmt::format(" (being written by pid {})", j.value("writer", json::object()).value("pid", 0))
             : f.status() == "killed" && f.text_attr("status") == "running"
                 ? " (its writer died before closing it; 'recover' closes it for every HDF5 reader)"
                 : "");
  if (j.contains("threads"))
    fmt::print("  run          batch size {}, {} threads, format {}{}\n", j.value("batch_size", std::int64_t{0}),
               j["threads"].get<std::int64_t>(), f.format_version(),
               j["fingerprinted"].get<bool>() ? ", model fingerprinted (replayable)" : "");
  if (j.contains("replay_of"))
    fmt::print("  replay of    {} ({}, fingerprint {})\n", j["replay_of"].value("source", std::string("?")),
               j["replay_of"].value("mode", std::string("?")),
               j["replay_of"].value("fingerprint_matched", false) ? "matched" : "differed");
  if (j.contains("interventions"))
    for (const auto& e : j["interventions"]) fmt::print("  intervention {}\n", e.get<std::string>());
  if (j.contains("shard"))
    fmt::print("  shard        {} of {}: prompts {}..{} of {} (the others are 'skipped'; dmi-inspect merge joins "
               "the shards)\n", j["shard"].value("index", -1), j["shard"].value("count", -1),
               j["shard"].value("begin", 0), j["shard"].value("end", 0), j["shard"].value("sequences", 0));
  if (j.contains("merged")) {
    const json& m = j["merged"];
    std::vector<std::string> files;
    for (const auto& s : m.value("shards", json::array())) files.push_back(s.value("file", std::string("?")));
    fmt::print("  merged       {} of {} shards, {}: {}{}\n", files.size(), m.value("count", 0),
               m.value("mode", std::string()) == "virtual" ? "virtual datasets over the shard files" : "rows copied",
               fmt::join(files, " "),
               m.value("missing", json::array()).empty() ? ""
                   : fmt::format(" (partial: shards {} missing)", m["missing"].dump()));
  }
  if (f.int_attr("records_written"))
    fmt::print("  records      {} written, {} dropped\n", j["records_written"].get<std::int64_t>(),
               j["records_dropped"].get<std::int64_t>());
  else
    fmt::print("  records      (counted when the file is closed)\n");
  fmt::print("  sequences    {}\n", f.n_sequences());
  const bool virtual_rows = !f.sites().empty() && f.sites()[0].virtual_rows;
  if (virtual_rows)
    fmt::print("  sites        {} ({} uncompressed, stored in the shard files)\n", f.sites().size(), fmt_bytes(raw));
  else
    fmt::print("  sites        {} ({} stored, {} uncompressed)\n", f.sites().size(), fmt_bytes(stored), fmt_bytes(raw));
  int last_layer = -2;
  for (const auto& s : f.sites()) {
    if (s.layer != last_layer && s.layer >= 0) fmt::print("    blocks.{}\n", s.layer);
    last_layer = s.layer;
    std::string shape = fmt::format("[{}]", fmt::join(s.row_shape, ", "));
    fmt::print("    {}{:<34} {:>8} rows  {:<14} {:<8} {:>10} / {:>10}{}\n", s.layer >= 0 ? "  " : "",
               s.layer >= 0 ? s.name.substr(s.name.find('.', 7) + 1) : s.name, s.rows, shape, s.dtype,
               s.virtual_rows ? std::string("in shards") : fmt_bytes(s.stored_bytes), fmt_bytes(s.raw_bytes),
               s.records_dropped ? fmt::format("  ({} records dropped)", s.records_dropped) : "");
  }
  return 0;
}

int cmd_sites(const CaptureFile& f, const Options& o) {
  auto names = dmi::analysis::match_sites(f, o.match);
  if (o.json) {
    std::cout << json(names).dump(2) << "\n";
    return 0;
  }
  for (const auto& n : names) fmt::print("{}\n", n);
  return 0;
}

int cmd_text(const CaptureFile& f, const Options& o) {
  auto tok = load_tokenizer(f, o);
  json out = json::array();
  for (std::size_t s = 0; s < f.n_sequences(); ++s) {
    if (o.seq >= 0 && static_cast<std::size_t>(o.seq) != s) continue;
    auto ids = f.tokens(s);
    json toks = json::array();
    for (std::size_t p = 0; p < ids.size(); ++p)
      toks.push_back({{"pos", p}, {"id", ids[p]}, {"text", token_text(tok.get(), ids[p])},
                      {"prompt", static_cast<std::int32_t>(p) < f.prompt_length(s)}});
    out.push_back({{"seq", s}, {"prompt", f.prompt_text(s)}, {"generated", f.generated_text(s)},
                   {"finish_reason", f.finish_reason(s)}, {"tokens", toks}});
  }
  if (o.seq >= 0 && out.empty())
    DMI_FAIL("{}: sequence {} does not exist (the file has {})", f.path(), o.seq, f.n_sequences());
  if (o.json) {
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  for (const auto& s : out) {
    fmt::print("[{}] ({}) {}|{}\n", s["seq"].get<std::size_t>(), s["finish_reason"].get<std::string>(),
               s["prompt"].get<std::string>(), s["generated"].get<std::string>());
    std::string line;
    for (const auto& t : s["tokens"]) {
      std::string piece = json(t["text"].get<std::string>()).dump();
      line += fmt::format("{}{}:{} ", t["prompt"].get<bool>() ? "" : "+", t["pos"].get<std::size_t>(), piece);
    }
    fmt::print("    {}\n", line);
  }
  return 0;
}

int cmd_show(const CaptureFile& f, const Options& o) {
  const auto& e = f.site(o.site);
  auto [lo, hi] = parse_range(o.pos);
  std::optional<std::int32_t> seq;
  if (o.seq >= 0) seq = o.seq;
  auto rows = f.find_rows(o.site, seq, lo, hi);
  DMI_CHECK(!rows.empty(), "{}: no rows of {} for{}{}", f.path(), o.site,
            seq ? fmt::format(" sequence {}", *seq) : std::string(" any sequence"),
            o.pos.empty() ? std::string() : fmt::format(" positions {}", o.pos));
  at::Tensor x = apply_index(f.read_rows(o.site, rows), o.index);
  const auto& sq = f.seq_of(o.site);
  const auto& ps = f.pos_of(o.site);
  if (!o.npy.empty()) {
    write_npy(o.npy, x);
    std::fprintf(stderr, "dmi-inspect: wrote %s: float32 [%s], rows ordered by (seq, pos)\n", o.npy.c_str(),
                 fmt::format("{}", fmt::join(x.sizes(), ", ")).c_str());
    return 0;
  }
  const std::string format = o.json ? "json" : o.format;
  if (format == "json") {
    json out = {{"site", o.site}, {"layout", e.layout}, {"row_shape", std::vector<std::int64_t>(x.sizes().begin() + 1, x.sizes().end())}, {"rows", json::array()}};
    for (std::size_t r = 0; r < rows.size(); ++r)
      out["rows"].push_back({{"seq", sq[rows[r]]}, {"pos", ps[rows[r]]}, {"values", nested(x[r])}});
    std::cout << out.dump() << "\n";
    return 0;
  }
  at::Tensor flat = x.reshape({x.size(0), -1});
  const std::int64_t n = flat.size(1);
  if (format == "csv") {
    std::string header = "seq,pos";
    for (std::int64_t i = 0; i < n; ++i) header += fmt::format(",v{}", i);
    fmt::print("{}\n", header);
    for (std::size_t r = 0; r < rows.size(); ++r) {
      std::string line = fmt::format("{},{}", sq[rows[r]], ps[rows[r]]);
      const float* p = flat[r].data_ptr<float>();
      for (std::int64_t i = 0; i < n; ++i) line += fmt::format(",{:.9g}", p[i]);
      fmt::print("{}\n", line);
    }
    return 0;
  }
  DMI_CHECK(format == "table", "--format '{}' is not table, json or csv", format);
  fmt::print("{}  row shape [{}]{}\n", o.site, fmt::join(x.sizes().begin() + 1, x.sizes().end(), ", "),
             n > 12 ? fmt::format("  (first 8 and last 4 of {} values; --format csv or --npy for all)", n) : "");
  for (std::size_t r = 0; r < rows.size(); ++r) {
    at::Tensor v = flat[r].contiguous();
    const float* p = v.data_ptr<float>();
    std::string vals;
    for (std::int64_t i = 0; i < n; ++i) {
      if (n > 12 && i == 8) {
        vals += " ...";
        i = n - 4;
      }
      vals += fmt::format(" {:>11.5g}", p[i]);
    }
    fmt::print("seq {:>3} pos {:>4} |{}\n", sq[rows[r]], ps[rows[r]], vals);
  }
  return 0;
}

int cmd_stats(const CaptureFile& f, const Options& o) {
  auto sites = dmi::analysis::match_sites(f, o.site);
  auto lines = dmi::analysis::site_stats(f, sites, dmi::analysis::parse_group_by(o.by));
  if (o.json) {
    json out = json::array();
    for (const auto& [label, s] : lines) out.push_back({{"group", label}, {"stats", stats_json(s)}});
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::size_t w = 8;
  for (const auto& [label, s] : lines) w = std::max(w, label.size());
  fmt::print("{:<{}} {:>10} {:>11} {:>11} {:>11} {:>11} {:>11} {:>5} {:>5}\n", o.by.empty() ? "site" : o.by, w,
             "count", "mean", "std", "rms", "min", "max", "nan", "inf");
  for (const auto& [label, s] : lines)
    fmt::print("{:<{}} {:>10} {:>11.5g} {:>11.5g} {:>11.5g} {:>11.5g} {:>11.5g} {:>5} {:>5}\n", label, w, s.count,
               s.mean, s.std, s.rms, s.min, s.max, s.nan, s.inf);
  return 0;
}

int cmd_attention(const CaptureFile& f, const Options& o) {
  const std::string site = fmt::format("blocks.{}.attn.hook_pattern", o.layer);
  DMI_CHECK(f.has_site(site), "{}: no site {} (capture it with dmi-run --hooks pattern)", f.path(), site);
  const auto& e = f.site(site);
  DMI_CHECK(o.seq >= 0, "attention needs --seq");
  auto rows = f.find_rows(site, o.seq);
  DMI_CHECK(!rows.empty(), "{}: no {} rows for sequence {}", f.path(), site, o.seq);
  const auto& ps = f.pos_of(site);
  const std::int64_t H = e.row_shape[0];
  DMI_CHECK(o.head < H, "--head {} is out of range ({} heads)", o.head, H);
  auto tok = load_tokenizer(f, o);
  auto ids = f.tokens(static_cast<std::size_t>(o.seq));
  if (!o.png.empty() || !o.svg.empty()) {
    // A labelled [query, key] heatmap of one head: tokens on both axes.
    const int h = o.head < 0 ? 0 : o.head;
    dmi::analysis::Heatmap hm;
    hm.values = f.read_rows(site, rows).select(1, h);  // [q, W]
    const std::int64_t maxpos = ps[rows.back()];
    hm.values = hm.values.narrow(1, 0, maxpos + 1);
    auto label = [&](std::int64_t p) {
      return fmt::format("{} {}", p, dmi::analysis::axis_label(token_text(tok.get(), ids.at(static_cast<std::size_t>(p)))));
    };
    for (auto r : rows) hm.row_labels.push_back(label(ps[r]));
    for (std::int64_t k = 0; k <= maxpos; ++k) hm.col_labels.push_back(label(k));
    const std::string base = std::filesystem::path(f.path()).filename().string();
    hm.title = fmt::format("{}: {}, head {}, sequence {}", base, site, h, o.seq);
    hm.subtitle = fmt::format("layer {}, {} queries x {} keys; prompt: positions 0-{}", o.layer, rows.size(),
                              maxpos + 1, f.prompt_length(static_cast<std::size_t>(o.seq)) - 1);
    hm.row_axis = "query (position, token)";
    hm.col_axis = "key (position, token)";
    hm.value_name = "attention weight";
    json out = json::array();
    for (const std::string& path : {o.png, o.svg}) {
      if (path.empty()) continue;
      const auto g = dmi::analysis::write_heatmap(path, hm);
      out.push_back({{"file", path}, {"width", g.width}, {"height", g.height}, {"grid_x", g.grid_x},
                     {"grid_y", g.grid_y}, {"cell", g.cell}, {"label_stride", g.label_stride},
                     {"queries", hm.values.size(0)}, {"keys", hm.values.size(1)}, {"layer", o.layer}, {"head", h},
                     {"seq", o.seq}});
      if (!o.json)
        std::fprintf(stderr, "dmi-inspect: wrote %s: layer %d head %d, %lld queries x %lld keys, %dx%d px\n",
                     path.c_str(), o.layer, h, static_cast<long long>(hm.values.size(0)),
                     static_cast<long long>(hm.values.size(1)), g.width, g.height);
    }
    if (o.json) std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::int64_t row = rows.back();
  if (o.qpos >= 0) {
    auto r = f.find_rows(site, o.seq, o.qpos, o.qpos + 1);
    DMI_CHECK(!r.empty(), "{}: no query row at position {} of sequence {}", f.path(), o.qpos, o.seq);
    row = r[0];
  }
  const std::int32_t qp = ps[row];
  at::Tensor x = f.read_rows(site, {row})[0].narrow(1, 0, qp + 1);  // [H, qp+1]
  json out = {{"layer", o.layer}, {"seq", o.seq}, {"pos", qp}, {"query", token_text(tok.get(), ids[qp])},
              {"heads", json::array()}};
  for (std::int64_t h = 0; h < H; ++h) {
    if (o.head >= 0 && h != o.head) continue;
    auto top = at::topk(x[h], std::min<std::int64_t>(o.top, qp + 1));
    json keys = json::array();
    for (std::int64_t k = 0; k < std::get<0>(top).size(0); ++k) {
      const std::int64_t kp = std::get<1>(top)[k].item<std::int64_t>();
      keys.push_back({{"pos", kp}, {"token", token_text(tok.get(), ids[kp])}, {"weight", std::get<0>(top)[k].item<double>()}});
    }
    out["heads"].push_back({{"head", h}, {"top", keys}});
  }
  if (o.json) {
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  fmt::print("layer {} seq {} query pos {} {}\n", o.layer, o.seq, qp, json(out["query"]).dump());
  for (const auto& h : out["heads"]) {
    std::string line;
    for (const auto& k : h["top"])
      line += fmt::format("  {}:{} {:.3f}", k["pos"].get<std::int64_t>(), json(k["token"]).dump(), k["weight"].get<double>());
    fmt::print("  head {:>2}:{}\n", h["head"].get<std::int64_t>(), line);
  }
  return 0;
}

int cmd_logits(const CaptureFile& f, const Options& o) {
  const std::string site = "unembed.hook_out";
  DMI_CHECK(f.has_site(site), "{}: no logits in this capture (capture them with dmi-run --hooks logits)", f.path());
  DMI_CHECK(o.seq >= 0 && o.qpos >= 0, "logits needs --seq and --pos");
  auto rows = f.find_rows(site, o.seq, o.qpos, o.qpos + 1);
  DMI_CHECK(!rows.empty(), "{}: no logits row for sequence {} position {}", f.path(), o.seq, o.qpos);
  const auto& e = f.site(site);
  auto tok = load_tokenizer(f, o);
  at::Tensor logits = f.read_rows(site, rows)[0].to(at::kDouble);
  at::Tensor values, ids;
  bool renormalised = false;
  if (e.layout == "topk") {
    values = logits;
    ids = f.read_ids(site, rows)[0].to(at::kLong);
    renormalised = true;
  } else {
    auto top = at::topk(logits, std::min<std::int64_t>(o.top, logits.size(0)));
    values = std::get<0>(top);
    ids = std::get<1>(top);
  }
  // Probabilities: softmax over the full vocabulary, or over the stored top-K.
  at::Tensor lse = at::logsumexp(e.layout == "topk" ? values : logits, 0);
  const std::int64_t k = std::min<std::int64_t>(o.top, values.size(0));
  auto seq_tokens = f.tokens(static_cast<std::size_t>(o.seq));
  json out = {{"seq", o.seq}, {"pos", o.qpos}, {"token", token_text(tok.get(), seq_tokens[o.qpos])},
              {"probabilities", renormalised ? "renormalised over the stored top-K" : "softmax over the vocabulary"},
              {"top", json::array()}};
  if (static_cast<std::size_t>(o.qpos + 1) < seq_tokens.size())
    out["next_token"] = {{"id", seq_tokens[o.qpos + 1]}, {"text", token_text(tok.get(), seq_tokens[o.qpos + 1])}};
  for (std::int64_t i = 0; i < k; ++i) {
    const std::int32_t id = static_cast<std::int32_t>(ids[i].item<std::int64_t>());
    out["top"].push_back({{"rank", i + 1}, {"id", id}, {"text", token_text(tok.get(), id)},
                          {"logit", values[i].item<double>()},
                          {"prob", std::exp(values[i].item<double>() - lse.item<double>())}});
  }
  if (o.json) {
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  fmt::print("seq {} pos {} {} -> next {} (probabilities {})\n", o.seq, o.qpos, json(out["token"]).dump(),
             out.contains("next_token") ? json(out["next_token"]["text"]).dump() : "(end)",
             out["probabilities"].get<std::string>());
  for (const auto& t : out["top"])
    fmt::print("  {:>3}. {:>8} {:<20} logit {:>9.4f}  p {:.4f}\n", t["rank"].get<std::int64_t>(),
               t["id"].get<std::int32_t>(), json(t["text"]).dump(), t["logit"].get<double>(), t["prob"].get<double>());
  return 0;
}

struct TrackerArgs {
  std::string heads, inst, data, seqs, benign, attack, output;
  double threshold = 0.5, k = 1.0;
};

// "0,2,5" -> sequence indexes.
std::vector<std::size_t> parse_seq_list(const std::string& s) {
  std::vector<std::size_t> out;
  std::size_t a = 0;
  while (a < s.size()) {
    std::size_t b = s.find(',', a);
    if (b == std::string::npos) b = s.size();
    const std::string item = s.substr(a, b - a);
    DMI_CHECK(!item.empty() && item.size() < 10 && item.find_first_not_of("0123456789") == std::string::npos,
              "--seq {}: '{}' is not a sequence index", s, item);
    out.push_back(std::stoul(item));
    a = b + 1;
  }
  return out;
}

int cmd_attn_tracker(const CaptureFile& f, const Options& o, const TrackerArgs& t) {
  dmi::analysis::TrackerOptions to;
  to.heads = dmi::analysis::read_tracker_heads(t.heads);
  to.inst = dmi::analysis::TokenSpan::parse(t.inst, "--inst");
  to.data = dmi::analysis::TokenSpan::parse(t.data, "--data");
  to.threshold = t.threshold;
  auto tok = load_tokenizer(f, o);
  const auto r = dmi::analysis::attention_tracker(f, tok.get(), to, parse_seq_list(t.seqs));
  std::size_t flagged = 0;
  for (const auto& s : r) flagged += s.flagged;
  if (o.json) {
    json heads = json::array();
    for (const auto& h : to.heads) heads.push_back({h.layer, h.head});
    json seqs = json::array();
    for (const auto& s : r)
      seqs.push_back({{"seq", s.seq}, {"query_pos", s.query_pos}, {"inst", {s.inst.first, s.inst.second}},
                      {"data", {s.data.first, s.data.second}}, {"a", s.a}, {"score", s.score},
                      {"flagged", s.flagged}});
    std::cout << json{{"file", f.path()}, {"heads", heads}, {"threshold", to.threshold}, {"flagged", flagged},
                      {"sequences", seqs}}.dump(2)
              << "\n";
    return 0;
  }
  fmt::print("{}: {} heads, threshold {}; {} of {} sequences flagged\n", f.path(), to.heads.size(), to.threshold,
             flagged, r.size());
  for (const auto& s : r)
    fmt::print("seq {:>4}  inst {}:{}  data {}:{}  focus {:.6f}  {}\n", s.seq, s.inst.first, s.inst.second,
               s.data.first, s.data.second, s.score, s.flagged ? "FLAGGED (instruction displaced)" : "ok");
  return 0;
}

int cmd_attn_tracker_select(const Options& o, const TrackerArgs& t) {
  auto benign = CaptureFile::open(t.benign);
  auto attack = CaptureFile::open(t.attack);
  auto tok = load_tokenizer(*benign, o);
  const auto inst = dmi::analysis::TokenSpan::parse(t.inst, "--inst");
  const auto data = dmi::analysis::TokenSpan::parse(t.data, "--data");
  const auto sep = dmi::analysis::separate_heads(*benign, *attack, tok.get(), inst, data);
  const auto chosen = dmi::analysis::select_heads(sep, t.k);
  if (!t.output.empty()) dmi::analysis::write_tracker_heads(t.output, chosen);
  auto list = [](const std::vector<dmi::analysis::TrackerHead>& hs) {
    json j = json::array();
    for (const auto& h : hs) j.push_back({h.layer, h.head});
    return j;
  };
  if (o.json) {
    json per_k = json::array();
    for (int k = 0; k <= 5; ++k) per_k.push_back({{"k", k}, {"heads", list(dmi::analysis::select_heads(sep, k))}});
    json heads = json::array();
    for (const auto& h : sep)
      heads.push_back({{"layer", h.head.layer}, {"head", h.head.head}, {"mean_benign", h.mean_benign},
                       {"std_benign", h.std_benign}, {"mean_attack", h.mean_attack}, {"std_attack", h.std_attack},
                       {"diff", h.diff}});
    std::cout << json{{"benign", t.benign}, {"attack", t.attack}, {"k", t.k}, {"selected", list(chosen)},
                      {"output", t.output}, {"by_k", per_k}, {"heads", heads}}.dump(2)
              << "\n";
    return 0;
  }
  fmt::print("{} benign and {} attack sequences; heads with mean_benign - mean_attack > k (std_benign + std_attack):\n",
             benign->n_sequences(), attack->n_sequences());
  for (int k = 0; k <= 5; ++k) {
    const auto hs = dmi::analysis::select_heads(sep, k);
    std::string names;
    for (std::size_t i = 0; i < hs.size() && i < 12; ++i) names += fmt::format(" L{}H{}", hs[i].layer, hs[i].head);
    fmt::print("  k={}: {:>4} heads{}{}\n", k, hs.size(), names, hs.size() > 12 ? " ..." : "");
  }
  if (!t.output.empty()) fmt::print("wrote {} heads (k={}) to {}\n", chosen.size(), t.k, t.output);
  return 0;
}

struct VectorOptions {
  dmi::analysis::MakeVectorOptions make;
  std::string output, vector_file, capture, gguf, model_hint, site;
  double scale = 1.0;
  bool drop_layer0 = false;
};

int cmd_vector_make(const VectorOptions& v, bool as_json) {
  DMI_CHECK(!v.output.empty(), "steer-vector make needs -o FILE.safetensors");
  auto vec = dmi::analysis::make_steering_vector(v.make);
  dmi::io::save_steering_vectors(v.output, vec);
  json j{{"output", v.output}, {"method", v.make.method}, {"site", v.make.site}, {"select", v.make.select},
         {"pairs", std::stoll(vec.metadata.at("pairs"))}, {"layers", json::array()}};
  for (const auto& [layer, t] : vec.direction) j["layers"].push_back({{"layer", layer}, {"norm", t.norm().item<double>()}});
  if (as_json) {
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  fmt::print("{}: {} direction(s) at {} from {} pairs ({}, select {}{})\n", v.output, vec.direction.size(), v.make.site,
             vec.metadata.at("pairs"), v.make.method, v.make.select, v.make.normalize ? ", unit norm" : "");
  for (const auto& [layer, t] : vec.direction) fmt::print("  layer {:>3}  |v| {:.6g}\n", layer, t.norm().item<double>());
  return 0;
}

int cmd_vector_show(const VectorOptions& v, bool as_json) {
  auto vec = dmi::io::load_steering_vectors(v.vector_file);
  std::string site = v.site;
  if (site.empty()) site = vec.metadata.count("site") ? vec.metadata.at("site") : "resid_post";
  auto rows = dmi::analysis::describe_steering_vector(vec, v.capture, site, v.scale);
  json j{{"file", v.vector_file}, {"format", vec.format}, {"site", site}, {"scale", v.scale}, {"metadata", vec.metadata},
         {"layers", json::array()}};
  for (const auto& r : rows) {
    json e{{"layer", r.layer}, {"norm", r.norm}};
    if (r.cos_prev) e["cos_prev"] = *r.cos_prev;
    if (r.mean_h_norm) e["mean_h_norm"] = *r.mean_h_norm;
    if (r.ratio) e["scale_v_over_h"] = *r.ratio;
    if (vec.target.count(r.layer)) e["target"] = vec.target.at(r.layer);
    j["layers"].push_back(e);
  }
  if (as_json) {
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  fmt::print("{} ({} format, site {}{})\n", v.vector_file, vec.format, site,
             vec.metadata.count("method") ? ", method " + vec.metadata.at("method") : std::string());
  fmt::print("  {:>5} {:>12} {:>10}{}\n", "layer", "|v|", "cos(L-1)",
             v.capture.empty() ? "" : fmt::format(" {:>12} {:>14}", "mean |h|", fmt::format("{}*|v|/|h|", v.scale)));
  for (const auto& r : rows) {
    fmt::print("  {:>5} {:>12.6g} {:>10}", r.layer, r.norm, r.cos_prev ? fmt::format("{:.4f}", *r.cos_prev) : "-");
    if (!v.capture.empty())
      fmt::print(" {:>12} {:>14}", r.mean_h_norm ? fmt::format("{:.6g}", *r.mean_h_norm) : "-",
                 r.ratio ? fmt::format("{:.4f}", *r.ratio) : "-");
    fmt::print("\n");
  }
  return 0;
}

int cmd_vector_export(const VectorOptions& v, bool as_json) {
  DMI_CHECK(!v.gguf.empty(), "steer-vector export needs --gguf OUT.gguf");
  auto vec = dmi::io::load_steering_vectors(v.vector_file);
  std::string hint = v.model_hint;
  if (hint.empty()) hint = vec.metadata.count("model_hint") ? vec.metadata.at("model_hint") : "";
  dmi::io::save_gguf_control_vector(v.gguf, vec, hint, v.drop_layer0);
  std::size_t n = 0;
  for (const auto& [layer, t] : vec.direction) n += layer > 0;
  if (as_json) std::cout << json{{"output", v.gguf}, {"tensors", n}, {"model_hint", hint}}.dump(2) << "\n";
  else fmt::print("{}: {} direction tensor(s) for llama.cpp (--control-vector){}\n", v.gguf, n,
                  vec.direction.count(0) ? "; direction.0 left out (llama.cpp never steers block 0)" : "");
  return 0;
}

int cmd_report(const CaptureFile& f, const Options& o, dmi::analysis::ReportOptions r, const std::string& seqs,
               const std::string& layers, const std::string& output) {
  if (!seqs.empty())
    for (auto s : dmi::hooks::parse_index_set(seqs, static_cast<std::int64_t>(f.n_sequences()), "--seq"))
      r.seqs.push_back(s);
  if (!layers.empty())
    for (auto l : dmi::hooks::parse_index_set(layers, f.int_attr("n_layers").value_or(1 << 20), "--layers"))
      r.layers.push_back(l);
  auto tok = load_tokenizer(f, o);
  const auto res = dmi::analysis::write_report(f, [&](std::int32_t id) { return token_text(tok.get(), id); }, r,
                                               output);
  if (o.json) {
    std::cout << json{{"output", output}, {"bytes", res.bytes}, {"sequences", res.sequences},
                      {"attention_maps", res.attention_maps}, {"left_out", res.left_out}}
                     .dump(2)
              << "\n";
    return 0;
  }
  fmt::print("{}: {} sequences, {} attention maps, {}\n", output, res.sequences, res.attention_maps,
             fmt_bytes(res.bytes));
  for (const auto& n : res.left_out) fmt::print("  left out: {}\n", n);
  return 0;
}

int cmd_merge(const dmi::sink::MergeOptions& m, bool as_json) {
  const auto r = dmi::sink::merge_captures(m);
  if (as_json) {
    std::cout << json{{"output", r.output}, {"mode", r.mode}, {"status", r.status}, {"shards", r.shards},
                      {"count", r.count}, {"missing", r.missing}, {"sequences", r.sequences}, {"sites", r.sites},
                      {"rows", r.rows}, {"file_bytes", r.file_bytes}}
                     .dump(2)
              << "\n";
    return 0;
  }
  fmt::print("{}: {} of {} shards merged ({}{}), {} sequences, {} rows in {} sites, status {}, {}\n", r.output,
             r.shards, r.count, r.mode == "virtual" ? "virtual datasets over the shard files" : "rows copied",
             r.missing.empty() ? "" : fmt::format("; missing shards {}", fmt::join(r.missing, ", ")), r.sequences,
             r.rows, r.sites, r.status, fmt_bytes(r.file_bytes));
  return 0;
}

int cmd_recover(const Options& o) {
  std::unique_ptr<dmi::io::Tokenizer> tok;
  {
    auto f = CaptureFile::open(o.file);
    tok = load_tokenizer(*f, o);
  }
  std::function<std::string(const std::vector<std::int32_t>&)> decode;
  if (tok) decode = [&](const std::vector<std::int32_t>& ids) { return tok->decode(ids, true); };
  const auto r = dmi::sink::recover_capture(o.file, decode);
  if (o.json) {
    std::cout << json{{"file", o.file}, {"status", "killed"}, {"sequences", r.sequences}, {"tokens", r.tokens},
                      {"sites", r.sites}, {"rows", r.rows}}
                     .dump(2)
              << "\n";
    return 0;
  }
  fmt::print("{}: recovered: {} sequences ({} tokens), {} rows in {} sites; status killed. Every HDF5 reader opens "
             "it now.\n", o.file, r.sequences, r.tokens, r.rows, r.sites);
  return 0;
}

// --follow: the command again whenever the capture changed (summary, show,
// stats), or what is new since the last look (text, logits), until the run
// closes the file. Exit 0 when it did, 1 when its writer died first.
int follow(const Options& o, const std::string& command, const std::function<int(const CaptureFile&)>& once) {
  dmi::analysis::FollowOptions fo;
  fo.interval = o.interval;
  fo.note = [&](const std::string& why) {
    std::fprintf(stderr, "dmi-inspect: waiting: %s\n", why.c_str());
  };
  std::unique_ptr<dmi::io::Tokenizer> tok;
  bool tok_loaded = false;
  std::vector<std::size_t> shown;  // text: tokens shown per sequence; logits: next position per sequence
  auto on_change = [&](const CaptureFile& f, bool last) {
    if (!tok_loaded && (command == "text" || command == "logits")) {
      tok = load_tokenizer(f, o);
      tok_loaded = true;
    }
    if (command == "text") {
      shown.resize(f.n_sequences(), 0);
      for (std::size_t s = 0; s < f.n_sequences(); ++s) {
        if (o.seq >= 0 && static_cast<std::size_t>(o.seq) != s) continue;
        const auto ids = f.tokens(s);
        const std::size_t plen = static_cast<std::size_t>(f.prompt_length(s));
        for (std::size_t p = shown[s]; p < ids.size() && o.json; ++p)
          std::cout << json{{"seq", s}, {"pos", p}, {"id", ids[p]}, {"text", token_text(tok.get(), ids[p])},
                            {"prompt", p < plen}}.dump() << "\n";
        if (!o.json && ids.size() > shown[s]) {
          std::string prompt, gen;
          for (std::size_t p = shown[s]; p < ids.size(); ++p) (p < plen ? prompt : gen) += token_text(tok.get(), ids[p]);
          fmt::print("[{}] {}{}{}\n", s, prompt.empty() ? "" : json(prompt).dump(), prompt.empty() ? "" : " ",
                     gen.empty() ? "" : "+" + json(gen).dump());
        }
        shown[s] = ids.size();
        if (last) {
          if (o.json)
            std::cout << json{{"seq", s}, {"finish_reason", f.finish_reason(s)}, {"generated", f.generated_text(s)}}
                             .dump() << "\n";
          else
            fmt::print("[{}] ({})\n", s, f.finish_reason(s));
        }
      }
    } else if (command == "logits") {
      const std::string site = "unembed.hook_out";
      DMI_CHECK(f.has_site(site), "{}: no logits in this capture (capture them with dmi-run --hooks logits)", f.path());
      DMI_CHECK(o.seq >= 0, "logits --follow needs --seq");
      shown.resize(1, static_cast<std::size_t>(std::max(o.qpos, 0)));
      const auto tokens = f.tokens(static_cast<std::size_t>(o.seq));
      const auto& ps = f.pos_of(site);
      for (std::int64_t row : f.find_rows(site, o.seq, static_cast<std::int32_t>(shown[0]))) {
        const std::int32_t p = ps[row];
        if (static_cast<std::size_t>(p) >= tokens.size()) break;  // its token is not in the log yet
        Options at = o;
        at.qpos = p;
        cmd_logits(f, at);
        shown[0] = static_cast<std::size_t>(p) + 1;
      }
    } else {
      if (!o.json) {
        const auto pr = dmi::analysis::progress_of(f);
        fmt::print("== {}: status {}, {} rows, {} tokens ==\n", f.path(), pr.status, pr.rows, pr.tokens);
      }
      once(f);
    }
    std::fflush(stdout);
  };
  const std::string status = dmi::analysis::follow_capture(o.file, fo, on_change);
  if (status == "killed") {
    std::fprintf(stderr, "dmi-inspect: %s: its writer died before closing it (status killed); "
                 "'dmi-inspect %s recover' closes it for every HDF5 reader\n", o.file.c_str(), o.file.c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dmi-inspect: query a dmi capture file (written by dmi-run --hooks ... -o FILE)."};
  app.footer(
      "Examples:\n"
      "  dmi-inspect run.h5 summary\n"
      "  dmi-inspect run.h5 sites --match 'blocks.*.hook_resid_post'\n"
      "  dmi-inspect run.h5 text --seq 0\n"
      "  dmi-inspect run.h5 show blocks.1.hook_resid_post --seq 0 --pos 2:5\n"
      "  dmi-inspect run.h5 show blocks.0.attn.hook_z --seq 0 --index 3,0:8 --format csv\n"
      "  dmi-inspect run.h5 show blocks.0.hook_resid_post --npy resid.npy\n"
      "  dmi-inspect run.h5 stats 'blocks.*.hook_resid_post' --by layer\n"
      "  dmi-inspect run.h5 attention --layer 3 --seq 0 --top 5\n"
      "  dmi-inspect run.h5 attention --layer 3 --head 1 --seq 0 --png head.png --svg head.svg\n"
      "  dmi-inspect run.h5 logits --seq 0 --pos 7 --top 10\n"
      "  dmi-inspect run.h5 text --follow                (while dmi-run writes run.h5: new tokens as they come)\n"
      "  dmi-inspect run.h5 recover                      (close the file of a killed run for every HDF5 reader)\n"
      "  dmi-inspect merge run.h5 part-0.h5 part-1.h5    (one capture over the files of dmi-run --shard K/N)\n"
      "  dmi-inspect run.h5 report -o run.html           (a self-contained HTML page: text, hover, attention)\n"
      "  dmi-inspect run.h5 attn-tracker --heads heads.json --inst 1:12 --data 12:40 --json\n"
      "  dmi-inspect attn-tracker-select --benign benign.h5 --attack attack.h5 --inst 1:12 --data 12:40 -o heads.json\n"
      "  dmi-inspect steer-vector make --pos happy.h5 --neg sad.h5 --site resid_post --select last-prompt -o v.safetensors\n"
      "  dmi-inspect steer-vector show v.safetensors --capture run.h5 --scale 4\n"
      "  dmi-inspect steer-vector export v.safetensors --gguf v.gguf\n"
      "\nEvery command takes --json. A capture being written reads like any other (status running); --follow\n"
      "keeps reading it until the run closes it. Exit status: 0 ok, 1 --follow saw the writer die (status killed),\n"
      "2 bad input or unreadable file.");
  app.require_subcommand(1);
  Options o;
  app.add_option("file", o.file, "capture file (.h5); not for steer-vector and attn-tracker-select");
  app.add_option("--tokenizer", o.tokenizer, "tokenizer.json for token text (default: the one the file names)");
  app.add_flag("--json", o.json, "machine-readable output");
  auto* follow_flag = app.add_flag("--follow", o.follow,
                                   "keep reading a capture that is being written (summary, text, show, stats, logits) "
                                   "until its run closes it");
  app.add_option("--interval", o.interval, "seconds between looks with --follow")
      ->capture_default_str()
      ->check(dmi::apps::kPositive);
  auto* summary = app.add_subcommand("summary", "model, settings, status, records and the tree of sites");
  auto* sites = app.add_subcommand("sites", "list site names");
  sites->add_option("--match", o.match, "glob over site names")->capture_default_str();
  auto* text = app.add_subcommand("text", "each sequence's text with token boundaries and positions");
  text->add_option("--seq", o.seq, "only this sequence");
  auto* show = app.add_subcommand("show", "print rows of a site");
  show->add_option("site", o.site, "site name")->required();
  show->add_option("--seq", o.seq, "sequence index");
  show->add_option("--pos", o.pos, "position or range A:B (end exclusive)");
  show->add_option("--index", o.index, "per row dimension an index or range, e.g. 3,0:8");
  show->add_option("--format", o.format, "table, json or csv")->capture_default_str()
      ->check(CLI::IsMember({"table", "json", "csv"}));
  show->add_option("--npy", o.npy, "write the rows as a NumPy .npy file instead");
  auto* stats = app.add_subcommand("stats", "count, mean, std, RMS, min, max, NaN/Inf counts");
  stats->add_option("site", o.site, "site name or glob")->required();
  stats->add_option("--by", o.by, "one line per layer, seq or pos")->check(CLI::IsMember({"layer", "seq", "pos"}));
  auto* attention = app.add_subcommand("attention", "top attended tokens of a query, or a heatmap (needs pattern)");
  attention->add_option("--layer", o.layer, "layer")->required()->check(dmi::apps::kNonNegative);
  attention->add_option("--head", o.head, "head (default: all; the PNG uses head 0)");
  attention->add_option("--seq", o.seq, "sequence index")->required();
  attention->add_option("--pos", o.qpos, "query position (default: the last captured)");
  attention->add_option("--top", o.top, "keys per head")->capture_default_str()->check(dmi::apps::kAtLeastOne);
  attention->add_option("--png", o.png, "write the [query, key] pattern of one head (--head, default 0) as a PNG "
                        "heatmap: tokens on both axes, colour bar, title");
  attention->add_option("--svg", o.svg, "the same heatmap as SVG (text stays text)");
  auto* logits = app.add_subcommand("logits", "top next tokens with probabilities (needs logits)");
  logits->add_option("--seq", o.seq, "sequence index")->required();
  logits->add_option("--pos", o.qpos, "position (with --follow: the first to show)");
  logits->add_option("--top", o.top, "how many")->capture_default_str()->check(dmi::apps::kAtLeastOne);
  auto* recover = app.add_subcommand("recover", "close the file of a run that was killed (status running, writer "
                                                "gone): sequences from its token log, status killed");
  dmi::analysis::ReportOptions ro;
  std::string report_seqs, report_layers, report_out;
  auto* report = app.add_subcommand("report", "one self-contained HTML page of the capture: text with token "
                                    "boundaries, hover for top next tokens and residual norms, attention heatmaps "
                                    "per layer and head, settings (no network)");
  report->add_option("-o,--output", report_out, "the HTML file to write")->required();
  report->add_option("--seq", report_seqs, "only these sequences: 0,3 or 0-9 (default: all, within --max-mb)");
  report->add_option("--layers", report_layers, "attention of these layers only: 0-3,10 (default: all captured)");
  report->add_option("--max-mb", ro.max_mb, "data in the page at most (MB); what does not fit is listed as left out")
      ->capture_default_str()
      ->check(dmi::apps::kPositive);
  report->add_option("--top", ro.top, "next-token candidates per token")->capture_default_str()
      ->check(dmi::apps::kAtLeastOne);
  dmi::sink::MergeOptions mo;
  auto* merge = app.add_subcommand("merge", "one capture over the shard files of dmi-run --shard K/N (HDF5 virtual "
                                   "datasets; no capture file before it; docs/scale-out.md)");
  merge->add_option("output", mo.output, "the merged capture to write")->required();
  merge->add_option("shards", mo.shards, "the shard files, in any order")->required();
  merge->add_flag("--copy", mo.copy, "copy the rows into OUTPUT (self-contained) instead of mapping the shard files");
  merge->add_flag("--allow-partial", mo.allow_partial,
                  "merge even if shards are missing; their sequences are marked missing (recorded in the file)");
  merge->add_flag("--overwrite", mo.overwrite, "replace OUTPUT if it exists");
  TrackerArgs ta;
  auto* tracker = app.add_subcommand("attn-tracker", "the Attention Tracker's focus score per sequence: the last "
                                     "prompt token's attention on the instruction vs the data (docs/monitors.md)");
  tracker->add_option("--heads", ta.heads, "JSON [[layer, head], ...]")->required();
  tracker->add_option("--inst", ta.inst, "instruction span: A:B token positions, or marker text")->required();
  tracker->add_option("--data", ta.data, "data span: A:B token positions, or marker text")->required();
  tracker->add_option("--threshold", ta.threshold, "flag a sequence whose score is at most this")
      ->capture_default_str();
  tracker->add_option("--seq", ta.seqs, "only these sequences (0,3,5)");
  auto* select = app.add_subcommand("attn-tracker-select", "choose the Attention Tracker's heads from a benign and "
                                    "an attack capture (no capture file before it)");
  select->add_option("--benign", ta.benign, "capture of benign prompts (--hooks pattern --tokens last-prompt)")
      ->required();
  select->add_option("--attack", ta.attack, "capture of prompt-injection attacks")->required();
  select->add_option("--inst", ta.inst, "instruction span: A:B token positions, or marker text")->required();
  select->add_option("--data", ta.data, "data span: A:B token positions, or marker text")->required();
  select->add_option("--k", ta.k, "select heads with mean difference > k (std_benign + std_attack)")
      ->capture_default_str()->check(dmi::apps::kNonNegative);
  select->add_option("-o,--output", ta.output, "write the selected heads as JSON [[layer, head], ...]");
  VectorOptions vo;
  auto* vec = app.add_subcommand("steer-vector", "make, show and export steering vectors (docs/steering.md)");
  vec->require_subcommand(1);
  auto* vmake = vec->add_subcommand("make", "a steering vector from two captures, paired by sequence index");
  vmake->add_option("--pos", vo.make.pos_file, "capture of the positive prompts")->required();
  vmake->add_option("--neg", vo.make.neg_file, "capture of the negative prompts")->required();
  vmake->add_option("--site", vo.make.site, "resid_post, resid_pre, resid_mid, attn_out or mlp_out")->capture_default_str();
  vmake->add_option("--layers", vo.make.layers, "layers, e.g. 0-3,10")->capture_default_str();
  vmake->add_option("--select", vo.make.select, "rows per sequence: last-prompt, last, all or pos:K")
      ->capture_default_str();
  vmake->add_option("--method", vo.make.method, "mean-diff (CAA), pca-diff (repeng), pca-center (llama.cpp)")
      ->capture_default_str();
  vmake->add_flag("--normalize", vo.make.normalize, "unit-norm direction per layer");
  vmake->add_option("-o,--output", vo.output, "output .safetensors (dmi's vector format)")->required();
  auto* vshow = vec->add_subcommand("show", "per layer |v|, cosine with the previous layer, and |v|/|h| against a capture");
  vshow->add_option("vector", vo.vector_file, "vector file (safetensors, GGUF or HDF5)")->required();
  vshow->add_option("--capture", vo.capture, "capture with the vector's site: adds mean |h| and scale*|v|/|h|");
  vshow->add_option("--site", vo.site, "site (default: the file's metadata, else resid_post)");
  vshow->add_option("--scale", vo.scale, "the scale you steer with")->capture_default_str();
  auto* vexport = vec->add_subcommand("export", "write a llama.cpp control vector (GGUF)");
  vexport->add_option("vector", vo.vector_file, "vector file")->required();
  vexport->add_option("--gguf", vo.gguf, "output .gguf")->required();
  vexport->add_option("--model-hint", vo.model_hint, "controlvector.model_hint (default: the file's model_hint)");
  vexport->add_flag("--drop-layer0", vo.drop_layer0, "leave out direction.0 (llama.cpp cannot apply it)");
  for (auto* sub : {summary, sites, text, show, stats, attention, logits, recover, report, merge, tracker, select, vmake,
                    vshow, vexport})
    sub->add_flag("--json", o.json, "machine-readable output");
  for (auto* sub : {summary, text, show, stats, logits}) {
    sub->add_flag("--follow", o.follow, follow_flag->get_description());
    sub->add_option("--interval", o.interval, "seconds between looks with --follow")->check(dmi::apps::kPositive);
  }
  if (int rc = dmi::apps::parse_args("dmi-inspect", app, argc, argv); rc >= 0) return rc;
  if (vec->parsed())
    return dmi::apps::guarded("dmi-inspect", [&] {
      DMI_CHECK(o.file.empty(), "steer-vector takes no capture file before it (got '{}')", o.file);
      if (vmake->parsed()) return cmd_vector_make(vo, o.json);
      if (vshow->parsed()) return cmd_vector_show(vo, o.json);
      return cmd_vector_export(vo, o.json);
    });
  if (merge->parsed())
    return dmi::apps::guarded("dmi-inspect", [&] {
      DMI_CHECK(o.file.empty(), "merge takes no capture file before it (dmi-inspect merge OUT.h5 SHARD.h5...)");
      for (int i = 0; i < argc; ++i) mo.command_line += (i ? " " : "") + std::string(argv[i]);
      return cmd_merge(mo, o.json);
    });
  if (select->parsed())
    return dmi::apps::guarded("dmi-inspect", [&] {
      DMI_CHECK(o.file.empty(), "attn-tracker-select takes no capture file before it (got '{}')", o.file);
      return cmd_attn_tracker_select(o, ta);
    });
  if (o.file.empty()) {
    std::fprintf(stderr, "dmi-inspect: error: a capture file is required before the command (see --help)\n");
    return 2;
  }
  return dmi::apps::guarded("dmi-inspect", [&] {
    if (recover->parsed()) return cmd_recover(o);
    if (o.follow) {
      DMI_CHECK(!sites->parsed() && !attention->parsed() && !tracker->parsed(),
                "--follow works with summary, text, show, stats and logits");
      DMI_CHECK(!logits->parsed() || o.seq >= 0, "logits --follow needs --seq");
      const std::string command = summary->parsed() ? "summary" : text->parsed() ? "text" : show->parsed() ? "show"
                                  : stats->parsed() ? "stats" : "logits";
      return follow(o, command, [&](const CaptureFile& f) {
        if (summary->parsed()) return cmd_summary(f, o);
        if (show->parsed()) return cmd_show(f, o);
        return cmd_stats(f, o);
      });
    }
    DMI_CHECK(!logits->parsed() || o.qpos >= 0, "logits needs --pos (or --follow)");
    auto f = CaptureFile::open(o.file);
    const std::string status = f->status();
    if (status == "running")
      std::fprintf(stderr, "dmi-inspect: note: %s is being written (status running); showing what it holds now "
                   "(--follow keeps reading)\n", o.file.c_str());
    else if (status == "killed" && f->text_attr("status") == "running")
      std::fprintf(stderr, "dmi-inspect: warning: %s was not closed: its writer died (status killed); showing what "
                   "it holds ('dmi-inspect %s recover' closes it for every HDF5 reader)\n", o.file.c_str(),
                   o.file.c_str());
    else if (status != "complete")
      std::fprintf(stderr, "dmi-inspect: warning: %s has status '%s': the run did not finish; showing the data there is\n",
                   o.file.c_str(), status.c_str());
    if (summary->parsed()) return cmd_summary(*f, o);
    if (sites->parsed()) return cmd_sites(*f, o);
    if (text->parsed()) return cmd_text(*f, o);
    if (show->parsed()) return cmd_show(*f, o);
    if (stats->parsed()) return cmd_stats(*f, o);
    if (attention->parsed()) return cmd_attention(*f, o);
    if (report->parsed()) return cmd_report(*f, o, ro, report_seqs, report_layers, report_out);
    if (tracker->parsed()) return cmd_attn_tracker(*f, o, ta);
    return cmd_logits(*f, o);
  });
}
