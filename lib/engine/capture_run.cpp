#include "engine/capture_run.h"

#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "analysis/monitors.h"
#include "common/error.h"
#include "engine/progress.h"
#include "sink/hdf5_sink.h"

namespace dmi::engine {

namespace {

int parse_topk(const std::string& s) {
  if (s == "full") return 0;
  if (s.rfind("topk:", 0) == 0 && s.size() > 5 && s.find_first_not_of("0123456789", 5) == std::string::npos &&
      s.size() < 14) {
    int k = std::stoi(s.substr(5));
    if (k > 0) return k;
  }
  DMI_FAIL("--logits '{}' is not 'full' or 'topk:K' (K > 0)", s);
}

std::optional<at::ScalarType> parse_capture_dtype(const std::string& s) {
  if (s == "model") return std::nullopt;
  if (s == "float32") return at::kFloat;
  if (s == "float16") return at::kHalf;
  if (s == "bfloat16") return at::kBFloat16;
  DMI_FAIL("--capture-dtype '{}' is not one of model, float32, float16, bfloat16", s);
}

}  // namespace

void validate_capture_config(const CaptureConfig& c) {
  hooks::parse_token_policy(c.tokens);
  parse_topk(c.logits);
  parse_capture_dtype(c.capture_dtype);
  sink::validate_compression(c.compression);
  DMI_CHECK(c.every >= 1, "--every must be at least 1");
  DMI_CHECK(c.ring_mb > 0, "--ring-mb must be positive");
  DMI_CHECK(c.on_full == "block" || c.on_full == "drop", "--on-full '{}' is not block or drop", c.on_full);
  DMI_CHECK(c.sink == "hdf5" || c.sink == "null", "--sink '{}' is not hdf5 or null", c.sink);
  DMI_CHECK(c.transport == "ring" || c.transport == "sync" || c.transport == "materialize",
            "--transport '{}' is not ring, sync or materialize", c.transport);
  DMI_CHECK(c.sink != "hdf5" || !c.output.empty(), "--hooks with --sink hdf5 needs --output FILE.h5");
  DMI_CHECK(c.flush_every > 0, "--flush-every must be positive (got {})", c.flush_every);
  for (const auto& m : c.monitors) analysis::check_monitor_syntax(m);
  DMI_CHECK(c.monitor_log.empty() || !c.monitors.empty(), "--monitor-log needs --monitor");
}

void check_output_path(const CaptureConfig& c) {
  if (c.sink != "hdf5" || c.output.empty()) return;
  const std::string& path = c.output;
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  struct stat st {};
  DMI_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "--output {}: directory {} does not exist", path,
            dir);
  struct statvfs vfs {};
  DMI_CHECK(::statvfs(dir.c_str(), &vfs) != 0 || !(vfs.f_flag & ST_RDONLY), "--output {}: {} is on a read-only file "
            "system", path, dir);
  DMI_CHECK(::access(dir.c_str(), W_OK) == 0, "--output {}: cannot write to {}: {}", path, dir, std::strerror(errno));
  if (::stat(path.c_str(), &st) == 0) {
    DMI_CHECK(!S_ISDIR(st.st_mode), "--output {} is a directory", path);
    DMI_CHECK(S_ISREG(st.st_mode), "--output {} is not a regular file (a device or pipe); for no file use --sink null",
              path);
    DMI_CHECK(c.overwrite, "--output {} exists; pass --overwrite to replace it", path);
    DMI_CHECK(::access(path.c_str(), W_OK) == 0, "--output {}: cannot replace it: {}", path, std::strerror(errno));
  }
}

std::int64_t expected_rows(hooks::TokenPolicy policy, std::int64_t every, bool token_log,
                           const std::vector<std::vector<std::int32_t>>& prompts, std::int64_t width,
                           std::int64_t max_new) {
  std::int64_t rows = 0;
  for (const auto& p : prompts) {
    const std::int64_t n = static_cast<std::int64_t>(p.size());
    std::int64_t gen = std::max<std::int64_t>(width - n, 0);
    if (max_new > 0) gen = std::min(gen, max_new);
    if (token_log) {
      rows += n + gen;
      continue;
    }
    const std::int64_t e = std::max<std::int64_t>(every, 1);
    const std::int64_t fed = (std::max<std::int64_t>(gen - 1, 0) + e - 1) / e;
    switch (policy) {
      case hooks::TokenPolicy::all: rows += n + fed; break;
      case hooks::TokenPolicy::prompt: rows += n; break;
      case hooks::TokenPolicy::generated: rows += fed; break;
      case hooks::TokenPolicy::last_prompt: rows += 1; break;
    }
  }
  return rows;
}

hooks::CaptureOptions capture_options(const CaptureConfig& c, const hooks::SiteSpace& space, std::int64_t max_len) {
  validate_capture_config(c);
  hooks::CaptureOptions o;
  o.selection = hooks::Selection::parse(c.hooks, space);
  DMI_CHECK(!o.selection.empty(), "--hooks '{}' selects no site", c.hooks);
  o.tokens = hooks::parse_token_policy(c.tokens);
  o.every = c.every;
  o.logits_topk = parse_topk(c.logits);
  o.capture_dtype = parse_capture_dtype(c.capture_dtype);
  o.max_len = max_len;
  return o;
}

namespace {
std::int64_t int_info(const sink::RunInfo& info, const std::string& name) {
  for (const auto& [k, v] : info.ints)
    if (k == name) return v;
  return 0;
}
}  // namespace

CaptureRun::CaptureRun(const CaptureConfig& c, const io::ModelConfig& cfg, const hooks::SiteSpace& space,
                       at::ScalarType model_dtype, std::int64_t max_len, const sink::RunInfo& info,
                       const io::Tokenizer* tokenizer, const std::vector<std::size_t>& running) {
  hooks::CaptureOptions o = capture_options(c, space, max_len);
  const hooks::TokenPolicy policy = o.tokens;
  const bool prompt_rows = o.tokens != hooks::TokenPolicy::generated;
  const bool generated_rows = o.tokens == hooks::TokenPolicy::all || o.tokens == hooks::TokenPolicy::generated;
  point_ = std::make_unique<hooks::CapturePoint>(std::move(o), cfg, model_dtype);
  // Monitors are checked before the file is created.
  analysis::MonitorSetup monitors;
  monitors.specs = c.monitors;
  monitors.log_path = c.monitor_log;
  monitors.prompts = info.prompt_ids;
  monitors.tokenizer = tokenizer;
  monitors.streams = point_->streams();
  monitors.prompt_rows = prompt_rows;
  monitors.generated_rows = generated_rows;
  n_stops_ = info.prompt_ids.size();
  stops_ = std::make_unique<std::atomic<bool>[]>(n_stops_);
  for (std::size_t i = 0; i < n_stops_; ++i) stops_[i].store(false);
  monitors.stop_flags = stops_.get();
  sink_ = analysis::make_monitor_sink(
      [&] {
        return c.sink == "null" ? sink::make_null_sink()
                                : sink::make_hdf5_sink(c.output, info, sink::Hdf5Options{c.compression, c.flush_every});
      },
      monitors);
  for (const auto& m : c.monitors) stops_on_ = stops_on_ || analysis::monitor_stops(m);
  // The sites' streams, then the token log's.
  std::vector<sink::StreamInfo> streams = point_->streams();
  const std::int64_t max_new = int_info(info, "max_new_tokens");
  std::vector<std::vector<std::int32_t>> sized;  // the prompts that run
  for (std::size_t i : running) sized.push_back(info.prompt_ids.at(i));
  const auto& rows_of = running.empty() ? info.prompt_ids : sized;
  const std::int64_t site_rows = expected_rows(policy, c.every, false, rows_of, max_len, max_new);
  for (auto& st : streams) st.expected_rows = site_rows;
  token_stream_ = static_cast<std::uint16_t>(streams.size());
  sink::StreamInfo log;
  log.name = "token_log";
  log.dtype = at::kInt;
  log.layout = sink::Layout::token_log;
  log.expected_rows = expected_rows(policy, c.every, true, info.prompt_ids, max_len, max_new);  // all prompts are logged
  streams.push_back(log);
  sink_->open(streams);
  const std::size_t n = streams.size();
  if (c.transport == "sync") {
    sync_ = std::make_unique<ring::SyncProducer>(n, *sink_);
    producer_ = sync_.get();
  } else if (c.transport == "materialize") {
    materialize_ = std::make_unique<ring::MaterializeProducer>(n, *sink_);
    producer_ = materialize_.get();
  } else {
    ring_ = std::make_unique<ring::CpuRing>(static_cast<std::size_t>(c.ring_mb * (1 << 20)), c.ring_records,
                                            c.on_full == "drop" ? ring::OnFull::drop : ring::OnFull::block, n, *sink_);
    producer_ = ring_.get();
  }
  point_->attach(producer_);
}

void CaptureRun::log_tokens(std::int32_t step, const std::vector<std::int32_t>& seq,
                            const std::vector<std::int32_t>& pos, const std::vector<std::int32_t>& ids) {
  if (finished_ || ids.empty()) return;
  ring::RecordMeta meta;
  meta.stream = token_stream_;
  meta.step = step;
  meta.rows = static_cast<std::uint32_t>(ids.size());
  meta.seq = seq.data();
  meta.pos = pos.data();
  meta.lossless = true;
  producer_->push(meta, {}, at::kInt, [&](at::Tensor& dst) {
    std::memcpy(dst.data_ptr(), ids.data(), ids.size() * sizeof(std::int32_t));
  });
  ++token_records_;
}

CaptureRun::~CaptureRun() {
  if (!finished_) {
    try {
      finish("failed", {});
    } catch (...) {
    }
  }
}

void CaptureRun::report(Progress& p) const {
  const ring::RingStats st = ring_ ? ring_->stats() : sync_ ? sync_->stats() : materialize_->stats();
  p.bytes_written = static_cast<std::int64_t>(st.bytes_written);
  p.dropped = static_cast<std::int64_t>(st.records_dropped);
  p.ring_fill = ring_ && st.arena_bytes ? static_cast<double>(st.used_bytes) / static_cast<double>(st.arena_bytes) : -1.0;
}

CaptureResult CaptureRun::finish(const std::string& status, const std::vector<sink::SequenceInfo>& sequences,
                                 const std::string& timings_json) {
  finished_ = true;
  point_->attach(nullptr);
  sink::Finish f;
  f.sequences = sequences;
  f.timings_json = timings_json;
  std::exception_ptr error;
  ring::RingStats stats;
  try {
    if (ring_) ring_->drain();
    if (materialize_) materialize_->flush();
    f.status = status;
  } catch (...) {
    error = std::current_exception();
    f.status = "failed";
  }
  stats = ring_ ? ring_->stats() : sync_ ? sync_->stats() : materialize_->stats();
  // The token log's records are not captures: the counts are the sites'.
  stats.records_written -= std::min(stats.records_written, token_records_);
  if (stats.dropped_per_stream.size() > token_stream_) stats.dropped_per_stream.resize(token_stream_);
  CaptureResult r{stats, f.status};
  f.records_written = r.stats.records_written;
  f.records_dropped = r.stats.records_dropped;
  f.dropped_per_stream = r.stats.dropped_per_stream;
  sink_->close(f);
  if (error) std::rethrow_exception(error);
  return r;
}

}  // namespace dmi::engine
