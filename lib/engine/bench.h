// dmi-bench's sweep: capture modes against honest baselines, interleaved and
// repeated so that noise on a shared machine hits every mode alike.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "model/causal_lm.h"

namespace dmi::engine {

// off: no site selected; null: HookPoints + Ring², sink discards; async:
// Ring² + writer thread + HDF5; sync: hooks write HDF5 inline; materialize:
// everything kept in memory, written after generation. --modes also accepts
// off2: a second "off" run per repeat, whose overhead shows the noise floor,
// and steer: nothing captured, one steering vector added at every layer's
// output at every position (what --steer costs), and monitor: async with
// the online monitors of BenchConfig::monitors (what --monitor costs the
// forward pass: nothing, if they keep up on the writer thread).
const std::vector<std::string>& bench_modes();

// A distribution-free 95 % confidence interval for the median of v (order
// statistics of the sign test); none for fewer than 6 values.
std::optional<std::pair<double, double>> median_ci95(std::vector<double> v);

struct BenchConfig {
  std::vector<std::int64_t> batch_sizes{1, 8};
  std::int64_t prompt_len = 64;
  std::int64_t new_tokens = 32;
  std::vector<std::string> hooks{"residual"};
  std::vector<std::string> modes = bench_modes();
  int repeats = 3;
  int warmup = 1;
  std::uint64_t seed = 0;
  std::string tmp_dir = "/tmp";
  // --monitor specs for the monitor mode (default: resid-norm).
  std::vector<std::string> monitors;
};

struct BenchRun {
  std::int64_t batch = 0;
  std::string hooks, mode;
  int repeat = 0;
  double prefill_tps = 0, decode_tps = 0, tpot_ms = 0, e2e_tps = 0, seconds = 0, capture_finish_seconds = 0;
  std::uint64_t bytes = 0, records = 0, ring_high_water = 0;
  double producer_wait = 0;
  double intervene_seconds = 0;  // steer mode: wall seconds inside the interventions
  double sink_cpu = 0;  // CPU seconds inside the sink's writes (RingStats::sink_cpu_seconds)
  double peak_rss_mb = 0;
  double step_ms = 0;   // median decode step time of the run
  double overhead = 0;  // seconds / seconds of "off" in the same repeat and configuration
  double step_overhead = 0;  // step_ms / step_ms of "off" in the same repeat and configuration
};

// Checks what needs no model (modes, lengths); throws dmi::Error naming the flag.
void validate_bench_config(const BenchConfig& cfg);

// Runs the sweep; progress(done, total, run) after each measured run.
std::vector<BenchRun> run_bench(model::CausalLM& model, const BenchConfig& cfg,
                                const std::function<void(std::size_t, std::size_t, const BenchRun&)>& progress);

// Best of a few passes summing a buffer of `bytes` (far larger than any
// cache), in GB/s.
double measure_read_bandwidth_gbs(std::size_t bytes = std::size_t{1} << 30);

// What the machine allows a model, from measured rates: its weights and KV
// cache read at the read bandwidth, its projections and attention at the
// kernels' peak multiply-add rate (kernels::measure_peak_macs_per_second;
// attention runs unfused fp32 arithmetic, slower than that peak). Row
// operations and dispatch are left out, so real steps can only come close.
struct MachineFloor {
  double weight_bytes = 0, read_bandwidth_gbs = 0;
  double peak_macs_per_second = 0;  // 0: unknown, no compute floor
  model::ForwardWork work;
  // Projections of one token (with its row of logits) at the peak rate, ms.
  double compute_ms_per_token() const;
  // The shortest decode step of a batch whose sequences attend `context`
  // cache positions: the weights and the batch's K/V read once, or its
  // projections and attention at the peak rate, whichever takes longer.
  double decode_step_ms(std::int64_t batch, double context) const;
  // The most prefill tokens per second for `batch` prompts of `prompt`
  // tokens (causal attention), logits for each prompt's last position only.
  double prefill_tokens_per_second(std::int64_t batch, std::int64_t prompt) const;
};

}  // namespace dmi::engine
