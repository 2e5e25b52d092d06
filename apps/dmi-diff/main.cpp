// dmi-diff: compare two dmi capture files. Exit status 0: equal within
// tolerance, 1: different, 2: usage or file error.
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "analysis/diff.h"
#include "app_main.h"
#include "common/error.h"
#include "sink/capture_file.h"

using nlohmann::json;

namespace {

json finite(double v) { return std::isfinite(v) ? json(v) : json(std::isnan(v) ? "nan" : "inf"); }

int run(const std::string& a_path, const std::string& b_path, const dmi::analysis::DiffOptions& o, bool as_json,
        bool quiet) {
  auto a = dmi::sink::CaptureFile::open(a_path);
  auto b = dmi::sink::CaptureFile::open(b_path);
  for (const auto* f : {a.get(), b.get()})
    if (f->status() != "complete")
      std::fprintf(stderr, "dmi-diff: warning: %s has status '%s'\n", f->path().c_str(), f->status().c_str());
  if (a->text_attr("capture_dtype") != b->text_attr("capture_dtype") && !as_json && !quiet)
    fmt::print("capture dtypes differ ({} vs {}): comparing in float32\n", a->text_attr("capture_dtype"),
               b->text_attr("capture_dtype"));
  auto r = dmi::analysis::diff_captures(*a, *b, o);
  const bool equal = r.equal();
  if (as_json) {
    json j = {{"a", a_path}, {"b", b_path}, {"atol", o.atol}, {"rtol", o.rtol}, {"sites_glob", o.sites_glob},
              {"equal", equal}, {"sequences_only_a", r.sequences_only_a}, {"sequences_only_b", r.sequences_only_b},
              {"sites_only_a", r.sites_only_a}, {"sites_only_b", r.sites_only_b}, {"skipped_sequences", r.skipped}};
    j["sequences"] = json::array();
    for (const auto& s : r.sequences) {
      json e = {{"seq", s.seq}, {"equal", s.equal}, {"prompt_differs", s.prompt_differs}};
      if (s.first_generated_diff)
        e["first_diverging_generated_token"] = {{"index", *s.first_generated_diff}, {"a", s.token_a}, {"b", s.token_b}};
      j["sequences"].push_back(e);
    }
    j["sites"] = json::array();
    for (const auto& s : r.sites) {
      json e = {{"site", s.site}, {"equal", s.equal()}, {"rows", s.rows}, {"rows_only_a", s.rows_only_a},
                {"rows_only_b", s.rows_only_b}, {"shape_mismatch", s.shape_mismatch}, {"max_abs", finite(s.max_abs)},
                {"mean_abs", finite(s.mean_abs)}, {"nmse", finite(s.nmse)}, {"cosine", finite(s.cosine)},
                {"mismatches", s.mismatches}};
      if (s.first_mismatch) e["first_mismatch"] = {{"seq", s.first_mismatch->first}, {"pos", s.first_mismatch->second}};
      j["sites"].push_back(e);
    }
    std::cout << j.dump(2) << "\n";
    return equal ? 0 : 1;
  }
  for (const auto& s : r.sequences) {
    if (s.prompt_differs) fmt::print("sequence {}: prompts differ\n", s.seq);
    else if (s.first_generated_diff)
      fmt::print("sequence {}: generated tokens diverge at generated token {} ({} vs {})\n", s.seq,
                 *s.first_generated_diff, s.token_a, s.token_b);
  }
  if (r.sequences_only_a || r.sequences_only_b)
    fmt::print("sequences only in {}: {}\n", r.sequences_only_a ? a_path : b_path,
               r.sequences_only_a ? r.sequences_only_a : r.sequences_only_b);
  if (!r.skipped.empty())
    fmt::print("{} sequence(s) skipped by a replay, not compared: {}\n", r.skipped.size(), fmt::join(r.skipped, ", "));
  for (const auto& n : r.sites_only_a) fmt::print("site only in A: {}\n", n);
  for (const auto& n : r.sites_only_b) fmt::print("site only in B: {}\n", n);
  {
    std::size_t w = 4;
    for (const auto& s : r.sites) w = std::max(w, s.site.size());
    if (!quiet) fmt::print("{:<{}} {:>7} {:>11} {:>11} {:>11} {:>12}  {}\n", "site", w, "rows", "max_abs", "mean_abs", "nmse",
               "cosine", "result");
    for (const auto& s : r.sites) {
      if (quiet && s.equal()) continue;
      std::string verdict = s.equal() ? "ok" : "DIFF";
      if (s.shape_mismatch) verdict = "DIFF (shapes differ)";
      else if (s.first_mismatch)
        verdict += fmt::format(" (first at seq {} pos {}; {} elements beyond tolerance)", s.first_mismatch->first,
                               s.first_mismatch->second, s.mismatches);
      if (s.rows_only_a || s.rows_only_b)
        verdict += fmt::format(" [{} rows only in A, {} only in B]", s.rows_only_a, s.rows_only_b);
      fmt::print("{:<{}} {:>7} {:>11.4g} {:>11.4g} {:>11.4g} {:>12.9f}  {}\n", s.site, w, s.rows, s.max_abs,
                 s.mean_abs, s.nmse, s.cosine, verdict);
    }
  }
  fmt::print("{} (atol {}, rtol {})\n", equal ? "equal" : "different", o.atol, o.rtol);
  return equal ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dmi-diff: compare two dmi capture files site by site, rows matched by (sequence, position)."};
  app.footer(
      "Examples:\n"
      "  dmi-diff before.h5 after.h5\n"
      "  dmi-diff fp32.h5 bf16.h5 --atol 0.05 --rtol 0.02 --sites 'blocks.*.hook_resid_post'\n"
      "  dmi-diff a.h5 b.h5 --json > report.json\n"
      "\nTokens are compared first; then for every site in both files: max and mean absolute difference,\n"
      "normalised MSE (mse(a,b)/mse(a,0)), cosine similarity, and the first (seq, pos) where\n"
      "|a - b| > atol + rtol * |b|. Files of different capture dtypes compare in float32.\n"
      "Exit status: 0 equal within tolerance, 1 different, 2 usage or file error.");
  std::string a, b;
  dmi::analysis::DiffOptions o;
  bool as_json = false, quiet = false;
  app.add_option("a", a, "first capture (A)")->required();
  app.add_option("b", b, "second capture (B, the reference for rtol)")->required();
  app.add_option("--sites", o.sites_glob, "compare only sites matching this glob")->capture_default_str();
  app.add_option("--atol", o.atol, "absolute tolerance")->capture_default_str()->check(dmi::apps::kNonNegative);
  app.add_option("--rtol", o.rtol, "relative tolerance")->capture_default_str()->check(dmi::apps::kNonNegative);
  app.add_flag("--json", as_json, "machine-readable report on stdout");
  app.add_flag("-q,--quiet", quiet, "print only sites that differ, and the verdict");
  if (int rc = dmi::apps::parse_args("dmi-diff", app, argc, argv); rc >= 0) return rc;
  // Exit status 1 means "different", so internal errors are 2 as well.
  return dmi::apps::guarded("dmi-diff", [&] { return run(a, b, o, as_json, quiet); }, 2);
}
