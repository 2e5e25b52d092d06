#include "engine/bench.h"

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>

#include "analysis/monitors.h"
#include "common/error.h"
#include "hooks/intervene.h"
#include "engine/capture_run.h"
#include "engine/generator.h"

namespace dmi::engine {

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Peak RSS since the last reset (Linux: VmHWM; writing 5 to clear_refs resets it).
void reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  if (f) f << "5";
}
double peak_rss_mb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return 0;
}

}  // namespace

const std::vector<std::string>& bench_modes() {
  static const std::vector<std::string> m = {"off", "null", "async", "sync", "materialize"};
  return m;
}

std::optional<std::pair<double, double>> median_ci95(std::vector<double> v) {
  const std::size_t n = v.size();
  if (n < 6) return std::nullopt;
  std::sort(v.begin(), v.end());
  // The largest k with P(Binomial(n, 1/2) < k) <= 2.5 %: [x_(k), x_(n+1-k)]
  // (1-based order statistics) covers the median with probability >= 95 %.
  std::vector<double> cdf(n + 1);
  double p = std::pow(0.5, static_cast<double>(n)), acc = 0;  // P(X = 0)
  for (std::size_t i = 0; i <= n; ++i) {
    acc += p;
    cdf[i] = acc;  // P(X <= i)
    p = p * static_cast<double>(n - i) / static_cast<double>(i + 1);
  }
  std::size_t k = 0;
  while (k + 1 <= n && cdf[k] <= 0.025) ++k;  // P(X <= k-1) = P(X < k) <= 2.5 %
  if (k == 0) return std::nullopt;
  return std::make_pair(v[k - 1], v[n - k]);
}

double measure_read_bandwidth_gbs(std::size_t bytes) {
  // From malloc, not ATen's allocator: a probe of up to 512 MiB would be
  // kept by kernels::install_large_block_cache, in the process's RSS,
  // after it is freed. And on a Zen 5 VM the decode steps after a probe in
  // a huge-page mapping ran slower (b1 TPOT 29.4 against 25.5 ms, 3
  // rounds; cause not found: docs/benchmarks.md, 2026-12-06).
  float* raw = static_cast<float*>(std::malloc(bytes));
  DMI_CHECK(raw, "read-bandwidth probe: cannot allocate {} bytes", bytes);
  at::Tensor buf = at::from_blob(raw, {static_cast<std::int64_t>(bytes / 4)}, [](void* p) { std::free(p); }, at::kFloat);
  buf.fill_(1);
  double best = 0;
  for (int i = 0; i < 4; ++i) {
    double t0 = now();
    volatile double s = buf.sum().item<double>();
    (void)s;
    best = std::max(best, buf.numel() * 4.0 / (now() - t0) / 1e9);
  }
  return best;
}

double MachineFloor::compute_ms_per_token() const {
  if (peak_macs_per_second <= 0) return 0;
  return static_cast<double>(work.per_token + work.per_logits_row) / peak_macs_per_second * 1e3;
}

double MachineFloor::decode_step_ms(std::int64_t batch, double context) const {
  const double B = static_cast<double>(batch);
  const double bytes = weight_bytes + B * context * static_cast<double>(work.kv_bytes_per_position);
  const double read_ms = read_bandwidth_gbs > 0 ? bytes / (read_bandwidth_gbs * 1e9) * 1e3 : 0;
  const double attention_ms =
      peak_macs_per_second > 0
          ? B * context * static_cast<double>(work.attention_per_position) / peak_macs_per_second * 1e3
          : 0;
  return std::max(read_ms, B * compute_ms_per_token() + attention_ms);
}

double MachineFloor::prefill_tokens_per_second(std::int64_t batch, std::int64_t prompt) const {
  const double read_s = read_bandwidth_gbs > 0 ? weight_bytes / (read_bandwidth_gbs * 1e9) : 0;
  const double P = static_cast<double>(prompt);
  const double macs = P * static_cast<double>(work.per_token) + static_cast<double>(work.per_logits_row) +
                      P * (P + 1) / 2 * static_cast<double>(work.attention_per_position);  // causal: t + 1 keys
  const double compute_s = peak_macs_per_second > 0 ? static_cast<double>(batch) * macs / peak_macs_per_second : 0;
  const double s = std::max(read_s, compute_s);
  return s > 0 ? static_cast<double>(batch * prompt) / s : 0;
}

void validate_bench_config(const BenchConfig& cfg) {
  DMI_CHECK(!cfg.modes.empty(), "--modes selects no mode");
  for (const auto& m : cfg.modes)
    DMI_CHECK(m == "off2" || m == "steer" || m == "monitor" ||
                  std::find(bench_modes().begin(), bench_modes().end(), m) != bench_modes().end(),
              "--modes: '{}' is not one of off, null, async, sync, materialize, steer, monitor (or off2)", m);
  for (const auto& s : cfg.monitors) analysis::check_monitor_syntax(s);
  DMI_CHECK(cfg.prompt_len >= 1 && cfg.new_tokens >= 1, "--prompt-len and --new-tokens must be at least 1");
}

std::vector<BenchRun> run_bench(model::CausalLM& model, const BenchConfig& cfg,
                                const std::function<void(std::size_t, std::size_t, const BenchRun&)>& progress) {
  validate_bench_config(cfg);
  const auto& mc = model.config();
  DMI_CHECK(cfg.prompt_len + cfg.new_tokens <= mc.max_position_embeddings,
            "--prompt-len + --new-tokens = {} exceeds the model's context {}", cfg.prompt_len + cfg.new_tokens,
            mc.max_position_embeddings);
  std::vector<BenchRun> out;
  const std::size_t total = cfg.batch_sizes.size() * cfg.hooks.size() * cfg.modes.size() * cfg.repeats;
  std::size_t done = 0;
  const std::string file = fmt::format("{}/dmi-bench-{}.h5", cfg.tmp_dir, ::getpid());
  for (auto B : cfg.batch_sizes) {
    // The same random prompts for every mode of this batch size.
    std::mt19937_64 rng(cfg.seed + B);
    std::uniform_int_distribution<std::int32_t> tok(0, static_cast<std::int32_t>(mc.vocab_size - 1));
    std::vector<std::vector<std::int32_t>> prompts(B, std::vector<std::int32_t>(cfg.prompt_len));
    for (auto& p : prompts)
      for (auto& t : p) t = tok(rng);
    for (const auto& hooks : cfg.hooks) {
      std::map<int, double> off_seconds, off_step_ms;
      for (int rep = -cfg.warmup; rep < cfg.repeats; ++rep) {
        // Each repeat starts the modes at a different one (a rotation), so
        // that no mode always runs first or right after a capture's cleanup.
        const std::size_t M = cfg.modes.size();
        for (std::size_t k = 0; k < M; ++k) {
          const std::string& mode = cfg.modes[(k + static_cast<std::size_t>(rep + cfg.warmup)) % M];
          const bool off = mode == "off" || mode == "off2" || mode == "steer";
          GenerateOptions o;
          o.max_new_tokens = cfg.new_tokens;
          o.batch_size = B;
          std::unique_ptr<CaptureRun> cap;
          std::unique_ptr<hooks::Intervener> steer;
          if (mode == "steer") {
            // One vector at every layer's output, every position (--steer FILE,
            // mode=add): what steering costs, with nothing captured.
            hooks::Intervention iv;
            iv.label = "dmi-bench steer";
            std::mt19937_64 vr(cfg.seed + 7);
            std::normal_distribution<float> g(0.0f, 1.0f / std::sqrt(static_cast<float>(mc.hidden_size)));
            for (int l = 0; l < mc.num_layers; ++l) {
              std::vector<float> v(static_cast<std::size_t>(mc.hidden_size));
              for (auto& x : v) x = g(vr);
              iv.direction[l] = at::tensor(v, at::kFloat);
              iv.sites.emplace_back(hooks::Site::resid_post, l);
            }
            std::vector<std::int64_t> plen(prompts.size(), cfg.prompt_len);
            steer = std::make_unique<hooks::Intervener>(std::vector<hooks::Intervention>{iv}, plen);
            o.observer = steer.get();
          }
          if (!off) {
            CaptureConfig c;
            c.hooks = hooks;
            c.output = file;
            c.sink = mode == "null" ? "null" : "hdf5";
            c.transport = mode == "sync" ? "sync" : mode == "materialize" ? "materialize" : "ring";
            sink::RunInfo info;
            info.text = {{"tool", "dmi-bench"}};
            if (mode == "monitor") {
              c.monitors = cfg.monitors.empty() ? std::vector<std::string>{"resid-norm"} : cfg.monitors;
              c.monitor_log = file + ".monitors.jsonl";
              info.prompt_ids = prompts;
            }
            cap = std::make_unique<CaptureRun>(c, mc, model.site_space(), model.dtype(), cfg.prompt_len + cfg.new_tokens, info);
            o.observer = cap->observer();
          }
          reset_peak_rss();
          Generator gen(model, o);
          const double t0 = now();
          gen.generate(prompts);
          const double t1 = now();
          CaptureResult cr;
          if (cap) cr = cap->finish("complete", {});
          const double t2 = now();
          cap.reset();
          std::remove(file.c_str());
          std::remove((file + ".monitors.jsonl").c_str());
          if (rep < 0) continue;  // warm-up
          const auto& t = gen.timings();
          BenchRun r;
          r.batch = B;
          r.hooks = hooks;  // for "off": the configuration it is the baseline of
          r.mode = mode;
          r.repeat = rep;
          r.seconds = t2 - t0;
          r.capture_finish_seconds = t2 - t1;
          r.prefill_tps = t.prefill_tokens / t.prefill_seconds;
          // The first new token comes from the prefill's logits: decode is
          // the new_tokens - 1 steps after it (as scripts/hf_eager_bench.py).
          const std::int64_t steps = std::max<std::int64_t>(1, cfg.new_tokens - 1);
          r.decode_tps = static_cast<double>(B * steps) / t.decode_seconds;
          r.tpot_ms = 1000.0 * t.decode_seconds / static_cast<double>(steps);
          r.e2e_tps = (t.prefill_tokens + t.decode_tokens) / r.seconds;
          r.bytes = cr.stats.bytes_written;
          r.records = cr.stats.records_written;
          r.ring_high_water = cr.stats.high_water_bytes;
          r.producer_wait = cr.stats.producer_wait_seconds;
          r.sink_cpu = cr.stats.sink_cpu_seconds;
          if (steer) r.intervene_seconds = steer->seconds();
          r.peak_rss_mb = peak_rss_mb();
          {
            std::vector<double> st = t.step_seconds;
            std::sort(st.begin(), st.end());
            r.step_ms = st.empty() ? 0.0 : 1000.0 * st[st.size() / 2];
          }
          if (mode == "off") off_seconds[rep] = r.seconds, off_step_ms[rep] = r.step_ms;
          out.push_back(r);
          if (progress) progress(++done, total, r);
        }
      }
      // Overhead against "off" of the same repeat (when off was measured).
      for (auto& r : out)
        if (r.batch == B && r.hooks == hooks && off_seconds.count(r.repeat)) {
          r.overhead = r.seconds / off_seconds[r.repeat];
          if (off_step_ms[r.repeat] > 0) r.step_overhead = r.step_ms / off_step_ms[r.repeat];
        }
    }
  }
  return out;
}

}  // namespace dmi::engine
