// dmi-bench: what capturing costs, against honest baselines. A thin front
// end over engine::run_bench.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "app_main.h"
#include "common/error.h"
#include "engine/bench.h"
#include "engine/runtime.h"
#include "model/causal_lm.h"

using nlohmann::json;

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<std::int64_t> parse_ints(const std::string& s, const char* flag) {
  std::vector<std::int64_t> out;
  std::size_t i = 0;
  while (i <= s.size()) {
    auto j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    try {
      std::size_t used = 0;
      long long v = std::stoll(s.substr(i, j - i), &used);
      DMI_CHECK(used == j - i && v > 0, "{} '{}': '{}' is not a positive integer", flag, s, s.substr(i, j - i));
      out.push_back(v);
    } catch (const std::logic_error&) {
      DMI_FAIL("{} '{}': '{}' is not a positive integer", flag, s, s.substr(i, j - i));
    }
    i = j + 1;
  }
  return out;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::size_t i = 0;
  while (i <= s.size()) {
    auto j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    if (j > i) out.push_back(s.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dmi-bench: capture overhead sweeps against baselines (off, null, async, sync, materialize)."};
  app.footer(
      "Modes: off (no site selected), null (HookPoints + Ring², data discarded), async (Ring² + writer\n"
      "thread + HDF5, the real path), sync (each hook writes HDF5 inline), materialize (everything kept\n"
      "in memory, written after generation); off2 (a second 'off' per repeat: the noise floor).\n"
      "Modes are interleaved within each repeat, starting at a different mode each repeat; overhead\n"
      "is time / time of 'off' in the same repeat, end to end and for the median decode step; the table\n"
      "shows medians and, from 6 repeats on, distribution-free 95% confidence intervals of them.\n"
      "TPOT/floor: the decode step against the machine's floor for its batch, measured here: the\n"
      "weights and the batch's KV cache read once at the probed read bandwidth, or its projections\n"
      "and attention at the kernels' peak multiply-add rate, whichever is longer, at the mean\n"
      "context of the decode steps (--json also has the prefill ceiling).\n"
      "\nExamples:\n"
      "  dmi-bench                                             # the default model, bf16, batch 1 and 8\n"
      "  dmi-bench --model build/bench-models/qwen3-0.6b-shape --batch-sizes 1,8 --hooks residual --json r.json\n"
      "  dmi-bench --hooks residual --hooks full --modes off,null,async --repeats 5\n"
      "  dmi-bench --modes off,off2,async,sync --repeats 15       # with the noise floor\n"
      "  dmi-bench --modes off,off2,steer --batch-sizes 8 --repeats 15   # what --steer costs\n"
      "  dmi-bench --hooks resid_post,pattern --modes off,async,monitor --monitor resid-norm --monitor attn-entropy\n"
      "  /usr/bin/python3 scripts/plot_bench.py r.json r.png   # overhead vs batch size per mode\n"
      "\nExit status: 0 ok, 2 bad input.");
  std::string model_dir, hook_map, dtype = "bfloat16", batches = "1,8", modes = "off,null,async,sync,materialize", json_out,
                         tmp_dir = "/tmp";
  std::vector<std::string> hooks;
  dmi::engine::BenchConfig cfg;
  int threads = 0;
  bool quiet = false;
  double progress_every = -1;
  app.add_option("-m,--model", model_dir, "HF model directory or TorchScript .pt file (default: the embedded model)");
  app.add_option("--hook-map", hook_map, "TorchScript only: hook map JSON (as for dmi-run)");
  app.add_option("--dtype", dtype, "compute dtype")->capture_default_str()->check(CLI::IsMember({"float32", "bfloat16"}));
  app.add_option("--batch-sizes", batches, "comma-separated batch sizes")->capture_default_str();
  app.add_option("--prompt-len", cfg.prompt_len, "prompt tokens per sequence (random ids)")->capture_default_str()
      ->check(dmi::apps::kAtLeastOne);
  app.add_option("--new-tokens", cfg.new_tokens, "tokens generated per sequence")->capture_default_str()
      ->check(dmi::apps::kAtLeastOne);
  app.add_option("--hooks", hooks, "a --hooks selection (repeatable; default: residual)");
  app.add_option("--modes", modes, "comma-separated modes")->capture_default_str();
  app.add_option("--repeats", cfg.repeats, "measured repeats")->capture_default_str()->check(dmi::apps::kAtLeastOne);
  app.add_option("--warmup", cfg.warmup, "warm-up repeats (not reported)")->capture_default_str()
      ->check(dmi::apps::kNonNegative);
  app.add_option("--seed", cfg.seed, "seed of the random prompts")->capture_default_str();
  app.add_option("-t,--threads", threads, "CPU threads (0 = all cores)")->capture_default_str();
  app.add_option("--json", json_out, "write every run and the summary as JSON to this file");
  app.add_option("--tmp-dir", tmp_dir, "where HDF5 files of the async/sync/materialize runs go (deleted after)")
      ->capture_default_str();
  app.add_option("--monitor", cfg.monitors, "monitor specs for the monitor mode, as dmi-run --monitor (repeatable; "
                 "default resid-norm; token-range spans only)")->allow_extra_args(false);
  app.add_flag("-q,--quiet", quiet, "no progress on stderr");
  dmi::apps::add_progress_every(
      app, progress_every, "seconds between updates of the live line on a terminal (default 0.25); elsewhere a line per run");
  if (int rc = dmi::apps::parse_args("dmi-bench", app, argc, argv); rc >= 0) return rc;
  dmi::engine::prepare_process_env(argc, argv, dmi::engine::math_owner_for(dtype, model_dir));
  return dmi::apps::guarded("dmi-bench", [&] {
    threads = dmi::engine::configure_threads(threads);
    cfg.batch_sizes = parse_ints(batches, "--batch-sizes");
    cfg.modes = split(modes);
    cfg.hooks = hooks.empty() ? std::vector<std::string>{"residual"} : hooks;
    cfg.tmp_dir = tmp_dir;
    dmi::engine::validate_bench_config(cfg);  // before the (slow) model load
    if (model_dir.empty()) model_dir = dmi::apps::default_model_dir();
    auto model = dmi::model::load_model(model_dir, dtype == "bfloat16" ? at::kBFloat16 : at::kFloat, {hook_map});
    double bw = dmi::engine::measure_read_bandwidth_gbs();
    double floor_ms = model->weight_bytes() / (bw * 1e9) * 1000.0;
    auto peak = dmi::kernels::measure_peak_macs_per_second(model->kernel_isa(), model->dtype());
    if (!quiet)
      std::fprintf(stderr, "dmi-bench: %s (%s, %s), %d threads; weights %.1f MB, read bandwidth %.1f GB/s -> decode floor %.1f ms/step\n",
                   model_dir.c_str(), model->config().architecture.c_str(), dtype.c_str(), threads,
                   model->weight_bytes() / 1e6, bw, floor_ms);
    // On a terminal one live line (runs done, ETA); otherwise a line per run.
    dmi::engine::Progress progress;
    dmi::engine::ProgressOptions po = dmi::apps::progress_options(quiet, progress_every);
    po.enabled = po.enabled && ::isatty(::fileno(stderr));
    dmi::engine::ProgressLine line("dmi-bench", "runs", progress, po);
    auto runs = dmi::engine::run_bench(*model, cfg, [&](std::size_t done, std::size_t total, const auto& r) {
      progress.total = total;
      progress.done = done;
      if (!quiet && !po.enabled)
        std::fprintf(stderr, "dmi-bench: [%zu/%zu] batch %lld %s %s repeat %d: %.3f s\n", done, total,
                     static_cast<long long>(r.batch), r.hooks.c_str(), r.mode.c_str(), r.repeat, r.seconds);
    });
    line.stop();
    // The floor is what memory can deliver: probed again after the runs and
    // the faster probe kept, so that one stall of a shared machine during
    // the first probe does not make the floor several times too slow.
    bw = std::max(bw, dmi::engine::measure_read_bandwidth_gbs());
    floor_ms = model->weight_bytes() / (bw * 1e9) * 1000.0;
    // The same for the compute peak: the faster of the two probes.
    const auto peak2 = dmi::kernels::measure_peak_macs_per_second(model->kernel_isa(), model->dtype());
    peak.macs_per_second = std::max(peak.macs_per_second, peak2.macs_per_second);
    const dmi::engine::MachineFloor machine{static_cast<double>(model->weight_bytes()), bw, peak.macs_per_second,
                                            model->forward_work()};
    // A decode step attends prompt_len + s positions at step s = 1 .. new_tokens - 1:
    // the median step's context, and TPOT's mean, is prompt_len + new_tokens / 2.
    const double decode_context = static_cast<double>(cfg.prompt_len) + static_cast<double>(cfg.new_tokens) / 2;
    // Summary per configuration: medians, overhead spread.
    struct Key {
      std::int64_t batch;
      std::string hooks, mode;
      bool operator<(const Key& o) const {
        return std::tie(batch, hooks, mode) < std::tie(o.batch, o.hooks, o.mode);
      }
    };
    std::map<Key, std::vector<const dmi::engine::BenchRun*>> groups;
    std::vector<Key> order;
    for (const auto& r : runs) {
      Key k{r.batch, r.hooks, r.mode};
      if (!groups.count(k)) order.push_back(k);
      groups[k].push_back(&r);
    }
    json summary = json::array();
    fmt::print("model {} ({}, {}), {} threads, prompt {} + {} new tokens, {} repeats (+{} warm-up)\n", model_dir,
               model->config().architecture, dtype, threads, cfg.prompt_len, cfg.new_tokens, cfg.repeats, cfg.warmup);
    fmt::print("weights {:.1f} MB at {:.1f} GB/s read bandwidth: decode floor {:.1f} ms/step\n",
               model->weight_bytes() / 1e6, bw, floor_ms);
    if (machine.compute_ms_per_token() > 0)
      fmt::print("projections {:.3f} G multiply-adds per token at {:.1f} G/s peak ({}, {} threads): compute floor "
                 "{:.2f} ms per token of a batch\n",
                 (machine.work.per_token + machine.work.per_logits_row) / 1e9, peak.macs_per_second / 1e9,
                 peak.instruction, threads, machine.compute_ms_per_token());
    else
      fmt::print("no compute floor: the {} kernels' peak rate is not measured\n", dmi::kernels::isa_name(model->kernel_isa()));
    const json env = json::parse(dmi::engine::environment_json(threads));
    fmt::print("kernels {}; CPU {} [{}]\n\n", model->kernels(), env["cpu_model"].get<std::string>(),
               fmt::join(env["cpu_flags"].get<std::vector<std::string>>(), " "));
    fmt::print("{:>5} {:<12} {:<12} {:>9} {:>9} {:>8} {:>6} {:>9} {:>9} {:>15} {:>9} {:>15} {:>9} {:>9} {:>8} {:>8} {:>7} {:>7}\n",
               "batch", "hooks", "mode", "prefill", "decode", "TPOT", "TPOT/", "e2e", "overhead", "[95% CI]", "step",
               "[95% CI]", "MB", "MB/s", "RSS MB", "ring MB", "wait s", "sink s");
    fmt::print("{:>5} {:<12} {:<12} {:>9} {:>9} {:>8} {:>6} {:>9} {:>9} {:>15} {:>9}\n", "", "", "", "tok/s", "tok/s",
               "ms", "floor", "tok/s", "(e2e)", "", "overhead");
    for (const auto& k : order) {
      const auto& g = groups[k];
      auto med = [&](auto f) {
        std::vector<double> v;
        for (auto* r : g) v.push_back(f(*r));
        return median(v);
      };
      std::vector<double> ov, sov;
      for (auto* r : g) ov.push_back(r->overhead), sov.push_back(r->step_overhead);
      const double mb = med([](const auto& r) { return r.bytes / 1e6; });
      const double secs = med([](const auto& r) { return r.seconds; });
      json s = {{"batch", k.batch},
                {"hooks", k.hooks},
                {"mode", k.mode},
                {"prefill_tokens_per_second", med([](const auto& r) { return r.prefill_tps; })},
                {"decode_tokens_per_second", med([](const auto& r) { return r.decode_tps; })},
                {"time_per_output_token_ms", med([](const auto& r) { return r.tpot_ms; })},
                {"end_to_end_tokens_per_second", med([](const auto& r) { return r.e2e_tps; })},
                {"seconds", secs},
                {"overhead", median(ov)},
                {"overhead_min", *std::min_element(ov.begin(), ov.end())},
                {"overhead_max", *std::max_element(ov.begin(), ov.end())},
                {"overhead_ci95", nullptr},
                {"step_ms", med([](const auto& r) { return r.step_ms; })},
                {"step_overhead", median(sov)},
                {"step_overhead_ci95", nullptr},
                {"bytes_captured", med([](const auto& r) { return static_cast<double>(r.bytes); })},
                {"bytes_per_second", mb * 1e6 / secs},
                {"peak_rss_mb", med([](const auto& r) { return r.peak_rss_mb; })},
                {"ring_high_water_bytes", med([](const auto& r) { return static_cast<double>(r.ring_high_water); })},
                {"producer_wait_seconds", med([](const auto& r) { return r.producer_wait; })},
                {"sink_cpu_seconds", med([](const auto& r) { return r.sink_cpu; })},
                {"intervene_seconds", med([](const auto& r) { return r.intervene_seconds; })},
                {"intervene_share", med([](const auto& r) { return r.seconds > 0 ? r.intervene_seconds / r.seconds : 0.0; })},
                {"capture_finish_seconds", med([](const auto& r) { return r.capture_finish_seconds; })}};
      // Against what the machine allows this batch (MachineFloor).
      const double step_floor = machine.decode_step_ms(k.batch, decode_context);
      const double prefill_ceiling = machine.prefill_tokens_per_second(k.batch, cfg.prompt_len);
      s["step_floor_ms"] = step_floor;
      s["tpot_over_floor"] = s["time_per_output_token_ms"].get<double>() / step_floor;
      s["prefill_ceiling_tokens_per_second"] = prefill_ceiling;
      s["prefill_share_of_ceiling"] = prefill_ceiling > 0 ? s["prefill_tokens_per_second"].get<double>() / prefill_ceiling : 0.0;
      const auto ci = dmi::engine::median_ci95(ov), sci = dmi::engine::median_ci95(sov);
      if (ci) s["overhead_ci95"] = {ci->first, ci->second};
      if (sci) s["step_overhead_ci95"] = {sci->first, sci->second};
      auto ci_str = [](const auto& c) { return c ? fmt::format("[{:.3f}-{:.3f}]", c->first, c->second) : std::string("-"); };
      summary.push_back(s);
      fmt::print("{:>5} {:<12} {:<12} {:>9.1f} {:>9.1f} {:>8.1f} {:>5.2f}x {:>9.1f} {:>8.3f}x {:>15} {:>8.3f}x {:>15} {:>9.1f} {:>9.1f} {:>8.0f} {:>8.1f} {:>7.3f} {:>7.3f}\n",
                 k.batch, k.hooks.size() > 12 ? k.hooks.substr(0, 11) + "~" : k.hooks, k.mode,
                 s["prefill_tokens_per_second"].get<double>(), s["decode_tokens_per_second"].get<double>(),
                 s["time_per_output_token_ms"].get<double>(), s["tpot_over_floor"].get<double>(),
                 s["end_to_end_tokens_per_second"].get<double>(),
                 s["overhead"].get<double>(), ci_str(ci), s["step_overhead"].get<double>(), ci_str(sci), mb,
                 s["bytes_per_second"].get<double>() / 1e6, s["peak_rss_mb"].get<double>(),
                 s["ring_high_water_bytes"].get<double>() / 1e6, s["producer_wait_seconds"].get<double>(),
                 s["sink_cpu_seconds"].get<double>());
      if (k.mode == "steer")
        fmt::print("      steer: {:.4f} s per run inside the interventions ({:.3f} % of the run, median)\n",
                   s["intervene_seconds"].get<double>(), 100 * s["intervene_share"].get<double>());
    }
    if (!json_out.empty()) {
      json j = {{"model", model_dir}, {"architecture", model->config().architecture}, {"dtype", dtype},
                {"threads", threads}, {"prompt_len", cfg.prompt_len}, {"new_tokens", cfg.new_tokens},
                {"repeats", cfg.repeats}, {"warmup", cfg.warmup}, {"batch_sizes", cfg.batch_sizes},
                {"hooks", cfg.hooks}, {"modes", cfg.modes}, {"weight_bytes", model->weight_bytes()},
                {"read_bandwidth_gbs", bw}, {"decode_floor_ms", floor_ms}, {"kernels", model->kernels()},
                {"peak_macs_per_second", peak.macs_per_second}, {"peak_instruction", peak.instruction},
                {"projection_macs_per_token", machine.work.per_token},
                {"lm_head_macs_per_row", machine.work.per_logits_row},
                {"attention_macs_per_position", machine.work.attention_per_position},
                {"kv_bytes_per_position", machine.work.kv_bytes_per_position},
                {"decode_context", decode_context},
                {"compute_floor_ms_per_token", machine.compute_ms_per_token()},
                {"environment", env}, {"summary", summary},
                {"runs", json::array()}};
      for (const auto& r : runs)
        j["runs"].push_back({{"batch", r.batch}, {"hooks", r.hooks}, {"mode", r.mode}, {"repeat", r.repeat},
                             {"seconds", r.seconds}, {"prefill_tokens_per_second", r.prefill_tps},
                             {"decode_tokens_per_second", r.decode_tps}, {"time_per_output_token_ms", r.tpot_ms},
                             {"end_to_end_tokens_per_second", r.e2e_tps}, {"overhead", r.overhead},
                             {"step_ms", r.step_ms}, {"step_overhead", r.step_overhead},
                             {"bytes_captured", r.bytes}, {"records", r.records}, {"peak_rss_mb", r.peak_rss_mb},
                             {"ring_high_water_bytes", r.ring_high_water}, {"producer_wait_seconds", r.producer_wait}, {"sink_cpu_seconds", r.sink_cpu},
                             {"intervene_seconds", r.intervene_seconds},
                             {"capture_finish_seconds", r.capture_finish_seconds}});
      std::ofstream f(json_out);
      DMI_CHECK(f, "{}: cannot write", json_out);
      f << j.dump(2) << "\n";
      DMI_CHECK(f.good(), "{}: write failed", json_out);
    }
    return 0;
  });
}
