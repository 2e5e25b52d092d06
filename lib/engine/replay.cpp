#include "engine/replay.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "common/error.h"
#include "engine/runtime.h"
#include "sink/capture_file.h"

namespace dmi::engine {

using nlohmann::json;

namespace {

bool exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

std::string real_path(const std::string& p) {
  char buf[PATH_MAX];
  return ::realpath(p.c_str(), buf) ? std::string(buf) : p;
}

json parse_json_attr(const sink::CaptureFile& f, const std::string& name) {
  const std::string text = f.text_attr(name);
  if (text.empty()) return json();
  try {
    return json::parse(text);
  } catch (const json::exception&) {
    DMI_FAIL("{}: root attribute '{}' is not valid JSON: corrupt capture", f.path(), name);
  }
}

std::int64_t int_attr_or(const sink::CaptureFile& f, const std::string& name, std::int64_t fallback) {
  return f.int_attr(name).value_or(fallback);
}

// "3,7", "10:20" (end exclusive), "1,4:6" -> sorted ids, each < n.
std::vector<std::int32_t> parse_seq_list(const std::string& spec, std::size_t n, const std::string& path) {
  std::set<std::int32_t> out;
  auto number = [&](const std::string& tok) -> std::int64_t {
    DMI_CHECK(!tok.empty() && tok.size() < 10 && tok.find_first_not_of("0123456789") == std::string::npos,
              "--seq '{}': '{}' is not a sequence number", spec, tok);
    return std::stoll(tok);
  };
  std::size_t i = 0;
  while (i <= spec.size()) {
    std::size_t j = spec.find(',', i);
    if (j == std::string::npos) j = spec.size();
    const std::string item = spec.substr(i, j - i);
    std::int64_t lo, hi;
    if (auto c = item.find(':'); c != std::string::npos) {
      lo = number(item.substr(0, c));
      hi = number(item.substr(c + 1));
      DMI_CHECK(lo < hi, "--seq '{}': range {} is empty (a:b means a <= seq < b)", spec, item);
    } else {
      lo = number(item);
      hi = lo + 1;
    }
    DMI_CHECK(hi <= static_cast<std::int64_t>(n), "--seq '{}': sequence {} does not exist ({} has {} sequences, 0 to {})",
              spec, hi - 1, path, n, static_cast<std::int64_t>(n) - 1);
    for (std::int64_t s = lo; s < hi; ++s) out.insert(static_cast<std::int32_t>(s));
    i = j + 1;
  }
  return {out.begin(), out.end()};
}

// The recorded batches: [batch] -> sequence ids in row order. Version 1
// files did not record them: consecutive groups of batch_size, leaving out
// sequences that never ran (interrupted before their batch, no tokens).
std::vector<std::vector<std::size_t>> recorded_batches(const sink::CaptureFile& f, std::int64_t batch_size) {
  const std::size_t n = f.n_sequences();
  std::vector<std::vector<std::size_t>> batches;
  if (!f.batch_of().empty()) {
    std::map<std::int32_t, std::map<std::int32_t, std::size_t>> by_batch;
    for (std::size_t i = 0; i < n; ++i)
      if (f.batch_of()[i] >= 0) by_batch[f.batch_of()[i]][f.row_of()[i]] = i;
    for (const auto& [b, rows] : by_batch) {
      batches.emplace_back();
      for (const auto& [r, i] : rows) batches.back().push_back(i);
    }
    return batches;
  }
  for (std::size_t first = 0; first < n; first += static_cast<std::size_t>(batch_size)) {
    std::vector<std::size_t> b;
    for (std::size_t i = first; i < std::min<std::size_t>(n, first + batch_size); ++i) {
      const bool ran = !((f.finish_reason(i) == "interrupted" || f.finish_reason(i) == "failed") &&
                         f.tokens(i).size() == static_cast<std::size_t>(f.prompt_length(i)));
      if (ran) b.push_back(i);
    }
    if (!b.empty()) batches.push_back(std::move(b));
  }
  return batches;
}

bool has_token(const std::string& command_line, const std::string& flag) {
  std::size_t p = 0;
  while ((p = command_line.find(flag, p)) != std::string::npos) {
    const bool start = p == 0 || command_line[p - 1] == ' ';
    const std::size_t e = p + flag.size();
    if (start && (e == command_line.size() || command_line[e] == ' ')) return true;
    p = e;
  }
  return false;
}

struct Source {
  std::unique_ptr<sink::CaptureFile> file;
  RunSettings settings;
  io::Fingerprint fingerprint;  // empty for version 1
  json environment;
  std::int64_t attention_width = 0;
};

Source read_source(const ReplayOptions& o) {
  Source src;
  src.file = sink::CaptureFile::open(o.source);
  const auto& f = *src.file;
  DMI_CHECK(f.has_sequences(),
            "{}: the capture has no /sequences (its run was killed before closing the file): nothing to replay",
            o.source);
  DMI_CHECK(f.text_attr("tool") == "dmi-run", "{}: written by '{}', not dmi-run: nothing to replay", o.source,
            f.text_attr("tool"));
  RunSettings& s = src.settings;
  s.model_path = f.text_attr("model_path");
  s.tokenizer_path = f.text_attr("tokenizer_path");
  s.hook_map = f.text_attr("hook_map");
  s.dtype = f.text_attr("compute_dtype");
  DMI_CHECK(s.dtype == "float32" || s.dtype == "bfloat16", "{}: compute_dtype '{}' is not float32 or bfloat16",
            o.source, s.dtype);
  s.max_new_tokens = int_attr_or(f, "max_new_tokens", 0);
  s.batch_size = int_attr_or(f, "batch_size", 1);
  DMI_CHECK(s.batch_size >= 1 && s.max_new_tokens >= 0, "{}: batch_size/max_new_tokens out of range: corrupt capture",
            o.source);
  const json sampling = parse_json_attr(f, "sampling");
  DMI_CHECK(sampling.is_object(), "{}: root attribute 'sampling' is missing: corrupt capture", o.source);
  s.sampling.temperature = sampling.value("temperature", 0.0);
  s.sampling.top_k = sampling.value("top_k", std::int64_t{0});
  s.sampling.top_p = sampling.value("top_p", 1.0);
  s.sampling.seed = static_cast<std::uint64_t>(int_attr_or(f, "seed", 0));
  const std::string cl = f.text_attr("command_line");
  // Version 1 did not record these two; its command line says.
  s.ignore_eos = int_attr_or(f, "ignore_eos", has_token(cl, "--ignore-eos")) != 0;
  s.add_special_tokens = int_attr_or(f, "add_special_tokens", !has_token(cl, "--no-special-tokens")) != 0;
  s.threads = static_cast<int>(int_attr_or(f, "threads", 0));
  s.interventions = recorded_interventions(f.text_attr("interventions"), o.source, o.allow_mismatch);
  s.capture_before_interventions = int_attr_or(f, "capture_before_interventions", 0) != 0;
  src.attention_width = int_attr_or(f, "attention_width", 0);
  const json fp = parse_json_attr(f, "model_fingerprint");
  if (fp.is_object())
    for (auto it = fp.begin(); it != fp.end(); ++it) src.fingerprint[it.key()] = it.value().get<std::string>();
  src.environment = parse_json_attr(f, "environment");
  return src;
}

// The environment variable that selects a recorded environment value, as
// "NAME=value", or "" where none does. dmi's kernels can change with its
// version (kernels::default_isa); the others with the CPU: a capture made on
// a CPU without AVX replays bit for bit on a newer one only with ATen's
// portable kernels too (the rotary tables are ATen's cos and sin).
std::string selecting_variable(const std::string& key, const std::string& recorded) {
  if (key == "dmi_kernels") return "DMI_KERNELS=" + recorded;
  if (key == "dmi_attention") return recorded == "portable" ? "DMI_ATTENTION=portable" : "";
  if (key == "aten_cpu_capability") {
    // at::show_config()'s names: "NO AVX" (1.13) or "DEFAULT" (2.x), "AVX2", "AVX512".
    if (recorded == "NO AVX" || recorded == "DEFAULT") return "ATEN_CPU_CAPABILITY=default";
    if (recorded == "AVX2") return "ATEN_CPU_CAPABILITY=avx2";
    if (recorded == "AVX512") return "ATEN_CPU_CAPABILITY=avx512";
    return "";
  }
  if (key == "openblas_core") return recorded == "unknown" ? "" : "OPENBLAS_CORETYPE=" + recorded;
  if (key == "onednn_isa") {
    // A cap oneDNN reads at start; "all" (no JIT ISA) and raw numbers have none.
    if (recorded == "all" || recorded == "unknown" || recorded.rfind("0x", 0) == 0) return "";
    std::string isa = recorded;
    for (char& c : isa) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return "ONEDNN_MAX_CPU_ISA=" + isa;
  }
  return "";
}

// Differences in what decides the numbers besides model and settings.
// A capture made before dmi recorded dmi_attention had the portable
// attention (vdpbf16ps attention came with it, 2026-12-07); dmi_attention
// names bf16 attention's arithmetic, which decides nothing for a model
// whose attention never runs on vdpbf16ps (attention_applies false: fp32,
// other head shapes, TorchScript).
std::vector<std::string> environment_differences(json recorded, const json& now, bool attention_applies) {
  std::vector<std::string> out;
  if (!recorded.is_object()) return out;
  if (recorded.contains("dmi_kernels") && !recorded.contains("dmi_attention")) recorded["dmi_attention"] = "portable";
  for (const std::string key : {"libtorch_version", "cpu_flags", "dmi_kernels", "dmi_attention", "aten_cpu_capability",
                                "onednn_isa", "openblas_core"})
    if (recorded.contains(key) && recorded[key] != now[key] && (key != "dmi_attention" || attention_applies)) {
      std::string d = fmt::format("{}: recorded {}, now {}", key, recorded[key].dump(), now[key].dump());
      if (recorded[key].is_string())
        if (const std::string v = selecting_variable(key, recorded[key].get<std::string>()); !v.empty())
          d += fmt::format("; {} selects the recorded one{} where the CPU has {}", v,
                           key == "dmi_kernels" ? "s" : "", key == "dmi_kernels" ? "them" : "it");
      out.push_back(d);
    }
  return out;
}

// Teacher forcing: one forward pass per batch over each sequence's prompt
// and generated tokens: all but the last, which the generation never fed,
// except after a kill, when the last token logged may have been fed already.
void teacher_force(model::CausalLM& model, const sink::CaptureFile& f, const std::vector<std::int32_t>& seqs,
                   std::int64_t batch_size, hooks::Observer* observer, const std::atomic<bool>* stop,
                   const std::function<void(std::size_t, std::size_t)>& on_progress,
                   std::vector<SequenceResult>& results, Timings& timings) {
  std::int32_t batch_index = 0;
  for (std::size_t first = 0; first < seqs.size(); first += static_cast<std::size_t>(batch_size), ++batch_index) {
    if (stop && stop->load()) break;
    const std::size_t n = std::min<std::size_t>(batch_size, seqs.size() - first);
    std::vector<std::vector<std::int32_t>> fed(n);
    std::vector<std::int64_t> prompt_len(n);
    std::int64_t T = 0;
    for (std::size_t b = 0; b < n; ++b) {
      const std::int32_t s = seqs[first + b];
      const auto tokens = f.tokens(s);
      prompt_len[b] = f.prompt_length(s);
      const std::size_t generated = tokens.size() - static_cast<std::size_t>(prompt_len[b]);
      const bool last_fed = f.status() == "killed";
      fed[b].assign(tokens.begin(), tokens.end() - (generated > 0 && !last_fed ? 1 : 0));
      T = std::max<std::int64_t>(T, fed[b].size());
    }
    const std::int64_t B = static_cast<std::int64_t>(n);
    at::Tensor ids = at::zeros({B, T}, at::kLong), positions = at::zeros({B, T}, at::kLong);
    at::Tensor valid = at::zeros({B, T}, at::kBool);
    std::vector<std::int32_t> seq_ids(n);
    {
      auto ia = ids.accessor<std::int64_t, 2>();
      auto pa = positions.accessor<std::int64_t, 2>();
      auto va = valid.accessor<bool, 2>();
      for (std::size_t b = 0; b < n; ++b) {
        const std::int64_t len = static_cast<std::int64_t>(fed[b].size()), pad = T - len;
        for (std::int64_t t = 0; t < len; ++t) {
          ia[b][pad + t] = fed[b][t];
          pa[b][pad + t] = t;
          va[b][pad + t] = true;
        }
        seq_ids[b] = seqs[first + b];
        auto& r = results[seqs[first + b]];
        r.batch = batch_index;
        r.row = static_cast<std::int32_t>(b);
        r.left_pad = static_cast<std::int32_t>(pad);
        timings.prefill_tokens += len;
      }
    }
    hooks::ForwardInfo info{positions, valid, 0, seq_ids, -1, prompt_len};
    model::ForwardInput in{ids, positions, valid, 0, false, &info};
    model::KVCache cache = model.new_cache(B, T);
    const auto t0 = std::chrono::steady_clock::now();
    model.forward(in, cache, observer);
    timings.prefill_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (std::size_t b = 0; b < n; ++b) {
      auto& r = results[seqs[first + b]];
      const auto tokens = f.tokens(seqs[first + b]);
      r.output_ids.assign(tokens.begin() + prompt_len[b], tokens.end());
      r.finish_reason = f.finish_reason(seqs[first + b]);
    }
    if (on_progress) on_progress(std::min(seqs.size(), first + n), seqs.size());
  }
}

}  // namespace

std::string recorded_compute_dtype(const std::string& path) {
  try {
    return sink::CaptureFile::open(path)->text_attr("compute_dtype");
  } catch (const std::exception&) {
    return "";
  }
}

CaptureConfig recorded_capture_config(const std::string& path) {
  auto f = sink::CaptureFile::open(path);
  CaptureConfig c;
  c.hooks = f->text_attr("selection");
  c.tokens = f->text_attr("token_policy");
  c.every = static_cast<int>(f->int_attr("every").value_or(1));
  c.logits = f->text_attr("logits");
  c.capture_dtype = f->text_attr("capture_dtype");
  c.compression = f->text_attr("compression");
  if (c.tokens.empty()) c.tokens = "all";
  if (c.logits.empty()) c.logits = "full";
  if (c.capture_dtype.empty()) c.capture_dtype = "model";
  if (c.compression.empty()) c.compression = "none";
  return c;
}

std::pair<double, double> replay_tolerances(const std::string& compute_dtype, const std::string& capture_dtype) {
  auto coarse = [](const std::string& d) { return d == "bfloat16" || d == "float16"; };
  if (coarse(compute_dtype) || coarse(capture_dtype)) return {5e-2, 2e-2};
  return {1e-5, 1e-4};
}

std::string record_hash(const std::string& path) {
  auto f = sink::CaptureFile::open(path);
  json j;
  for (const char* a : {"model_fingerprint", "model_config", "architecture", "hook_map", "selection", "token_policy",
                        "logits", "capture_dtype", "compute_dtype", "sampling", "eos_token_ids", "environment",
                        "interventions"})
    j["attributes"][a] = f->text_attr(a);
  for (const char* a : {"every", "seed", "max_new_tokens", "batch_size", "threads", "ignore_eos", "add_special_tokens",
                        "capture_before_interventions", "attention_width"})
    j["attributes"][a] = f->int_attr(a) ? json(*f->int_attr(a)) : json();
  for (std::size_t i = 0; i < f->n_sequences(); ++i)
    j["sequences"].push_back({f->tokens(i), f->prompt_length(i), f->finish_reason(i),
                              f->batch_of().empty() ? -1 : f->batch_of()[i], f->row_of().empty() ? -1 : f->row_of()[i],
                              f->left_pad_of().empty() ? -1 : f->left_pad_of()[i]});
  const std::string text = j.dump();
  return io::xxh3_128(text.data(), text.size());
}

ReplayResult replay(const ReplayOptions& o, const std::atomic<bool>* stop, Progress* progress) {
  DMI_CHECK(o.mode == "exact" || o.mode == "forced", "--replay-mode '{}' is not exact or forced", o.mode);
  DMI_CHECK(o.mode == "forced" || !o.batch_size, "--batch-size applies to --replay-mode forced only (exact replays "
            "keep the recorded batches)");
  Source src = read_source(o);
  const auto& f = *src.file;
  ReplayResult r;
  r.mode = o.mode;
  r.source_timings = f.text_attr("timings");
  if (f.status() != "complete")
    r.warnings.push_back(fmt::format("{} has status '{}': replaying the part it contains", o.source, f.status()));
  DMI_CHECK(f.status() != "running", "{}: still being written (status running): replay it once its run has finished",
            o.source);
  DMI_CHECK(o.mode == "forced" || f.status() != "killed",
            "{}: its run was killed before closing the file, so where each batch stopped was not recorded: replay it "
            "with --replay-mode forced (the tokens it logged, teacher-forced)", o.source);

  // Which sequences: whole recorded batches for exact (a sequence's numbers
  // depend on its batch), any subset for forced.
  const std::size_t n = f.n_sequences();
  std::vector<std::int32_t> wanted = o.seqs.empty() ? std::vector<std::int32_t>() : parse_seq_list(o.seqs, n, o.source);
  const auto batches_all = recorded_batches(f, src.settings.batch_size);
  std::set<std::int32_t> ran;
  for (const auto& b : batches_all)
    for (auto i : b) ran.insert(static_cast<std::int32_t>(i));
  if (o.seqs.empty()) wanted.assign(ran.begin(), ran.end());
  for (auto s : wanted)
    DMI_CHECK(ran.count(s), "--seq: sequence {} never ran in {} (status '{}'): nothing to replay", s, o.source,
              f.status());
  DMI_CHECK(!wanted.empty(), "{}: no sequence ran in this capture: nothing to replay", o.source);
  std::vector<std::vector<std::size_t>> batches;
  if (o.mode == "exact") {
    std::set<std::int32_t> want(wanted.begin(), wanted.end());
    for (const auto& b : batches_all)
      if (std::any_of(b.begin(), b.end(), [&](std::size_t i) { return want.count(static_cast<std::int32_t>(i)); }))
        batches.push_back(b);
    for (const auto& b : batches)
      for (auto i : b) r.replayed.push_back(static_cast<std::int32_t>(i));
    std::sort(r.replayed.begin(), r.replayed.end());
  } else {
    r.replayed = wanted;
  }

  // Settings: the record's, with the model moved if asked.
  RunSettings s = src.settings;
  s.command_line = o.command_line;
  if (!o.model.empty()) {
    s.model_path = o.model;
    s.tokenizer_path = o.tokenizer;  // empty: the new model's own tokenizer
  } else if (!o.tokenizer.empty()) {
    s.tokenizer_path = o.tokenizer;
  }
  DMI_CHECK(!s.model_path.empty(), "{}: the capture records no model_path; pass --model", o.source);
  DMI_CHECK(exists(s.model_path), "{}: the model recorded in {} does not exist (pass --model DIR if it moved)",
            s.model_path, o.source);
  s.threads = configure_threads(o.threads ? *o.threads : s.threads);
  s.capture = o.capture;
  s.capture.on_full = "block";
  DMI_CHECK(!s.capture.hooks.empty(), "{}: the capture records no selection; pass --hooks", o.source);
  std::string output = s.capture.output;
  const bool temp_output = output.empty();
  DMI_CHECK(!temp_output || o.verify, "--replay needs --output FILE.h5 (or --verify alone, to check and discard)");
  if (!temp_output)
    DMI_CHECK(real_path(output) != real_path(o.source), "--output {} is the capture being replayed: choose another file",
              output);
  {
    CaptureConfig check = s.capture;
    if (temp_output) check.output = "(temporary)";
    validate_capture_config(check);
    if (!temp_output) check_output_path(s.capture);
  }
  if (o.mode == "forced") {
    if (o.batch_size) {
      DMI_CHECK(*o.batch_size >= 1, "--batch-size must be at least 1");
      s.batch_size = *o.batch_size;
    }
  }

  // The model, checked against the record.
  LoadedModel m = load_for_run(s, /*fingerprint=*/true);
  r.fingerprint_seconds = m.model->fingerprint_seconds();
  r.fingerprint_bytes = m.model->fingerprint_bytes();
  if (src.fingerprint.empty()) {
    r.warnings.push_back(fmt::format(
        "{} is a format version {} capture without a model fingerprint: the model is not checked", o.source,
        f.format_version()));
  } else {
    r.fingerprint_differences = io::fingerprint_differences(src.fingerprint, m.fingerprint);
    r.fingerprint_matched = r.fingerprint_differences.empty();
    DMI_CHECK(r.fingerprint_matched || o.allow_mismatch,
              "{}: the model differs from the one recorded in {}: {}; pass --allow-mismatch to replay anyway",
              s.model_path, o.source, fmt::join(r.fingerprint_differences, "; "));
  }
  const json env_now = json::parse(environment_json(s.threads));
  for (const auto& d : environment_differences(src.environment, env_now, m.model->attention_arithmetic_applies()))
    r.warnings.push_back("environment differs (" + d + "): bit identity is not guaranteed");
  if (src.settings.threads > 0 && s.threads != src.settings.threads)
    r.warnings.push_back(fmt::format("{} threads instead of the recorded {}: bit identity is not guaranteed", s.threads,
                                     src.settings.threads));

  // All sequences of the source are in the job; those not replayed are
  // "skipped" (prompt only), so sequence ids stay the source's.
  Job job;
  for (std::size_t i = 0; i < n; ++i) {
    const auto t = f.tokens(i);
    job.prompts.emplace_back(t.begin(), t.begin() + f.prompt_length(i));
    job.prompt_texts.push_back(f.prompt_text(i));
  }
  job.attention_width = src.attention_width;
  json replay_of{{"source", real_path(o.source)}, {"record_hash", record_hash(o.source)}, {"mode", o.mode},
                 {"sequences", r.replayed}, {"fingerprint_matched", r.fingerprint_matched}};
  job.extra_attributes.push_back({"replay_of", replay_of.dump()});

  if (temp_output) {
    const char* tmpdir = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmpdir && *tmpdir ? tmpdir : "/tmp") + "/dmi-replay-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    const int fd = ::mkstemp(buf.data());
    DMI_CHECK(fd >= 0, "cannot create a temporary file in {} for --verify", tmpl);
    ::close(fd);
    output = buf.data();
    s.capture.output = output;
  }
  try {
    if (o.mode == "exact") {
      job.batches = batches;
      job.interrupt_after.assign(n, -1);
      job.interrupt_reason.assign(n, "interrupted");
      // A monitor's stop (action=stop) came from the writer thread at a step
      // timing decided; the replay stops there itself.
      for (auto i : r.replayed)
        if (f.finish_reason(i) == "interrupted" || f.finish_reason(i) == "failed" || f.finish_reason(i) == "monitor") {
          job.interrupt_after[i] = static_cast<std::int64_t>(f.tokens(i).size()) - f.prompt_length(i);
          if (f.finish_reason(i) == "monitor") job.interrupt_reason[i] = "monitor";
        }
      RunOutput out = run_job(s, m, job, stop, progress);
      r.results = std::move(out.results);
      r.timings = out.timings;
      r.capture = out.capture;
      r.capture_sites = out.capture_sites;
    } else {
      const auto& cfg = m.model->config();
      for (const auto& p : job.prompts)
        for (auto id : p)
          DMI_CHECK(id >= 0 && id < cfg.vocab_size, "{}: token id {} is out of range for the model (vocab_size {})",
                    o.source, id, cfg.vocab_size);
      for (auto i : r.replayed) {
        const auto t = f.tokens(i);
        for (auto id : t)
          DMI_CHECK(id >= 0 && id < cfg.vocab_size, "{}: token id {} is out of range for the model (vocab_size {})",
                    o.source, id, cfg.vocab_size);
        DMI_CHECK(static_cast<std::int64_t>(t.size()) <= cfg.max_position_embeddings,
                  "{}: sequence {} has {} tokens, more than the model's context {}", o.source, i, t.size(),
                  cfg.max_position_embeddings);
      }
      std::int64_t width = src.attention_width;
      for (auto i : r.replayed) width = std::max<std::int64_t>(width, f.tokens(i).size());
      auto hooks = make_hooks(s, m, job.prompts);
      sink::RunInfo info = make_run_info(s, m, width, hooks->resolved.record_json);
      for (const auto& a : job.extra_attributes) info.text.push_back(a);
      const at::ScalarType dtype = s.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
      CaptureRun capture(s.capture, cfg, m.model->site_space(), dtype, width, info);
      if (hooks->intervener)
        hooks->chain = std::make_unique<hooks::HookChain>(hooks->intervener.get(), capture.observer(),
                                                          s.capture_before_interventions);
      hooks::Observer* observer = hooks->observer(capture.observer());
      r.results.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        r.results[i].prompt_ids = job.prompts[i];
        r.results[i].finish_reason = "skipped";
      }
      try {
        std::function<void(std::size_t, std::size_t)> on_progress;
        if (progress) {
          progress->total = r.replayed.size();
          on_progress = [progress, &capture](std::size_t done, std::size_t) {
            progress->done = done;
            capture.report(*progress);
          };
        }
        teacher_force(*m.model, f, r.replayed, s.batch_size, observer, stop, on_progress, r.results, r.timings);
      } catch (...) {
        capture.finish("failed", {});
        throw;
      }
      const bool interrupted = stop && stop->load();
      if (interrupted)
        for (auto i : r.replayed)
          if (r.results[i].batch < 0) r.results[i].finish_reason = "interrupted";
      r.capture = capture.finish(interrupted ? "interrupted" : "complete",
                                 sequence_infos(job, r.results, *m.tokenizer), timings_json(r.timings));
      r.capture_sites = capture.streams().size();
    }
  } catch (...) {
    if (temp_output) std::remove(output.c_str());
    throw;
  }
  r.output = temp_output ? "" : output;
  r.tokenizer = std::move(m.tokenizer);

  if (o.verify) {
    r.verified = true;
    r.bitwise = o.mode == "exact" && r.fingerprint_matched && !o.atol && !o.rtol;
    const auto tol = replay_tolerances(s.dtype, f.text_attr("capture_dtype"));
    r.atol = r.bitwise ? 0 : o.atol.value_or(tol.first);
    r.rtol = r.bitwise ? 0 : o.rtol.value_or(tol.second);
    analysis::DiffOptions d;
    d.atol = r.atol;
    d.rtol = r.rtol;
    d.bitwise = r.bitwise;
    d.seqs.insert(r.replayed.begin(), r.replayed.end());
    if (stop && stop->load()) {
      d.seqs.clear();
      for (auto i : r.replayed)
        if (r.results[i].batch >= 0 && r.results[i].finish_reason != "interrupted") d.seqs.insert(i);
      if (d.seqs.empty()) d.seqs.insert(-1);  // nothing finished: compare nothing
    }
    auto replayed_file = sink::CaptureFile::open(output);
    r.report = analysis::diff_captures(*replayed_file, f, d);
    // Sites only one file has are expected (--hooks may differ). Rows only
    // in the replay are expected when the source dropped records or the
    // replay captures other tokens.
    const CaptureConfig rec = recorded_capture_config(o.source);
    const bool same_tokens = s.capture.tokens == rec.tokens && s.capture.every == rec.every;
    // A failed source may hold rows of the forward pass that failed, which a
    // replay stopping at its last recorded token does not run.
    const bool source_extra = f.int_attr("records_dropped").value_or(0) > 0 || f.status() == "failed";
    // A killed source lost the rows after its last flush.
    const bool source_short = f.int_attr("records_dropped").value_or(0) > 0 || f.status() == "killed";
    r.equal = true;
    for (const auto& sd : r.report.sequences) r.equal = r.equal && sd.equal;
    for (const auto& site : r.report.sites) {
      const bool rows_ok = (!same_tokens || source_extra || site.rows_only_b == 0) &&
                           (!same_tokens || source_short || site.rows_only_a == 0);
      r.equal = r.equal && !site.shape_mismatch && site.mismatches == 0 && rows_ok;
    }
    replayed_file.reset();
  }
  if (temp_output) std::remove(output.c_str());
  return r;
}

}  // namespace dmi::engine
