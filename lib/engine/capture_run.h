// One capture: the HookPoint (CapturePoint), the Ring² transport and the sink,
// assembled from dmi-run's flags and torn down with the right file status.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "hooks/capture.h"
#include "io/tokenizer.h"
#include "ring/baselines.h"
#include "ring/ring.h"
#include "sink/sink.h"

namespace dmi::engine {

struct Progress;

struct CaptureConfig {
  std::string output;               // HDF5 path (sink hdf5)
  std::string hooks;                // --hooks spec
  std::string tokens = "all";       // all | prompt | generated | last-prompt
  int every = 1;
  std::string logits = "full";      // full | topk:K
  std::string capture_dtype = "model";  // model | float32 | float16 | bfloat16
  double ring_mb = 256;
  std::size_t ring_records = 1 << 16;
  std::string on_full = "block";    // block | drop
  std::string sink = "hdf5";        // hdf5 | null
  std::string compression = "none";
  // ring (Ring², the real path), or the baselines dmi-bench compares with:
  // sync (each hook writes inline) and materialize (keep all, write at end).
  std::string transport = "ring";
  bool overwrite = false;           // replace an existing output file
  // Seconds between flushes of the HDF5 file: what a kill leaves, and how
  // often live (SWMR) readers see new rows.
  double flush_every = 1.0;
  // Online monitors over the captured rows (analysis/monitors.h): --monitor
  // specs and where their JSON lines go (empty: stderr).
  std::vector<std::string> monitors;
  std::string monitor_log;
};

// Checks flag values that need no model; throws dmi::Error naming the flag.
void validate_capture_config(const CaptureConfig& c);

// Checks, before anything is loaded, that the HDF5 output can be created:
// its directory exists and is writable (not a read-only file system), and
// the file does not exist unless c.overwrite. Errors name the path.
void check_output_path(const CaptureConfig& c);

// The HookPoint's options for a capture config (checked; errors name the
// flag): selection, token policy, --every, logits, capture dtype.
hooks::CaptureOptions capture_options(const CaptureConfig& c, const hooks::SiteSpace& space, std::int64_t max_len);

// At most how many rows each site gets (sink::StreamInfo::expected_rows);
// with token_log, the token log's rows. Sequence i has its prompt's p_i
// tokens and at most min(max_new, width - p_i) generated ones; the last is
// never fed back (no rows), and of the others every `every`-th is captured.
// 0 when the prompts are not known; max_new 0 when unknown (width alone
// bounds it).
std::int64_t expected_rows(hooks::TokenPolicy policy, std::int64_t every, bool token_log,
                           const std::vector<std::vector<std::int32_t>>& prompts, std::int64_t width,
                           std::int64_t max_new);

struct CaptureResult {
  ring::RingStats stats;
  std::string status;
};

class CaptureRun {
 public:
  // Creates the file (hdf5 sink) and starts the writer thread. tokenizer:
  // for monitors' marker spans (may be null). running: the prompts that
  // will run (a shard's, a replay's; empty: all), which bound the rows and
  // so the chunks of a small capture.
  CaptureRun(const CaptureConfig& c, const io::ModelConfig& cfg, const hooks::SiteSpace& space,
             at::ScalarType model_dtype, std::int64_t max_len, const sink::RunInfo& info,
             const io::Tokenizer* tokenizer = nullptr, const std::vector<std::size_t>& running = {});
  ~CaptureRun();
  hooks::Observer* observer() { return point_.get(); }
  // Adds tokens chosen at a decode step to the file's token log (through the
  // same transport as the sites, so the log never runs ahead of them).
  void log_tokens(std::int32_t step, const std::vector<std::int32_t>& seq, const std::vector<std::int32_t>& pos,
                  const std::vector<std::int32_t>& ids);
  const std::vector<sink::StreamInfo>& streams() const { return point_->streams(); }
  // The writer's state for a progress line: bytes that reached the sink,
  // ring fill, records dropped. Any thread; also after finish().
  void report(Progress& p) const;
  // Monitors with action=stop: whether one has asked to end sequence seq.
  bool stops_sequences() const { return stops_on_; }
  bool monitor_stopped(std::size_t seq) const { return seq < n_stops_ && stops_[seq].load(std::memory_order_relaxed); }
  // Drains the ring and closes the sink with `status` (complete, interrupted
  // or failed). If draining fails, the file is closed as failed and the
  // error rethrown.
  // timings_json: the run's speed, stored as the root attribute "timings".
  CaptureResult finish(const std::string& status, const std::vector<sink::SequenceInfo>& sequences,
                       const std::string& timings_json = "");

 private:
  std::unique_ptr<hooks::CapturePoint> point_;
  std::unique_ptr<sink::Sink> sink_;
  std::unique_ptr<ring::CpuRing> ring_;
  std::unique_ptr<ring::SyncProducer> sync_;
  std::unique_ptr<ring::MaterializeProducer> materialize_;
  ring::Producer* producer_ = nullptr;
  std::uint16_t token_stream_ = 0;     // after the sites' streams
  std::uint64_t token_records_ = 0;    // not counted as records written
  bool finished_ = false;
  std::unique_ptr<std::atomic<bool>[]> stops_;  // per sequence, set by monitors on the writer thread
  std::size_t n_stops_ = 0;
  bool stops_on_ = false;
};

}  // namespace dmi::engine
