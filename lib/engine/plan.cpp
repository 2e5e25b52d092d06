#include "engine/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include <sys/stat.h>

#include "common/error.h"
#include "engine/shard.h"
#include "hooks/capture.h"

namespace dmi::engine {

namespace {

// HDF5 objects and attributes of a capture apart from its rows, fitted to
// files dmi-run wrote (docs/scale-out.md, "How --plan estimates"): a base
// (root attributes, /sequences, /token_log, free-space and B-tree
// overhead), per site (group, attributes, 3-4 chunked datasets), and the
// text attributes that grow with the model and the command line.
constexpr std::uint64_t kBaseMetadataBytes = 24 * 1024;
constexpr std::uint64_t kSiteMetadataBytes = 2560;

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kInt: return "int32";
    default: return "?";
  }
}

std::string bytes_text(double b) {
  if (b >= 1e12) return fmt::format("{:.2f} TB", b / 1e12);
  if (b >= 1e9) return fmt::format("{:.2f} GB", b / 1e9);
  if (b >= 1e6) return fmt::format("{:.2f} MB", b / 1e6);
  if (b >= 1e3) return fmt::format("{:.1f} KB", b / 1e3);
  return fmt::format("{:.0f} B", b);
}

// blocks.12.attn.hook_z -> blocks.*.attn.hook_z (one line per kind of site).
std::string site_kind(const std::string& name) {
  if (name.rfind("blocks.", 0) != 0) return name;
  const auto dot = name.find('.', 7);
  return dot == std::string::npos ? name : "blocks.*" + name.substr(dot);
}

}  // namespace

std::size_t estimate_weight_bytes(const io::ModelConfig& c, at::ScalarType dtype) {
  const std::uint64_t d = c.hidden_size, H = c.num_heads, KV = c.num_kv_heads, D = c.head_dim,
                      F = c.intermediate_size, V = c.vocab_size;
  std::uint64_t per_layer = d * H * D + 2 * d * KV * D + H * D * d + 3 * d * F + 2 * d;
  if (c.qkv_bias) per_layer += (H + 2 * KV) * D;
  if (c.o_bias) per_layer += d;
  if (c.qk_norm) per_layer += 2 * D;
  const std::uint64_t params = per_layer * static_cast<std::uint64_t>(c.num_layers) + d + V * d;
  return static_cast<std::size_t>(params * c10::elementSize(dtype));
}

PlanModel load_plan_model(const RunSettings& s) {
  PlanModel pm;
  struct stat st {};
  if (::stat(s.model_path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
    LoadedModel m = load_for_run(s, false);
    pm.cfg = m.model->config();
    pm.space = m.model->site_space();
    pm.weight_bytes = m.model->weight_bytes();
    pm.tokenizer = std::move(m.tokenizer);
    return pm;
  }
  pm.cfg = io::load_config(s.model_path + "/config.json");
  pm.space = {static_cast<int>(pm.cfg.num_layers), pm.cfg.qk_norm, {}};
  pm.tokenizer = std::make_unique<io::Tokenizer>(
      io::Tokenizer::load(s.tokenizer_path.empty() ? model::default_tokenizer_path(s.model_path) : s.tokenizer_path));
  return pm;
}

Plan make_plan(const PlanInput& in) {
  const io::ModelConfig& cfg = in.cfg;
  Plan p;
  p.prompts = in.prompts.size();
  const std::int64_t ctx = cfg.max_position_embeddings;
  p.attention_width = attention_width(in.prompts, in.max_new_tokens, ctx);  // as run_job
  const hooks::CaptureOptions o = capture_options(in.capture, in.space, p.attention_width);
  const hooks::CapturePoint point(o, cfg, in.model_dtype);

  // The generator's default: consecutive groups of batch_size.
  const std::vector<std::vector<std::size_t>> batches =
      in.batches.empty() ? shard_batches({0, in.prompts.size(), 0}, in.batch_size) : in.batches;
  std::vector<std::vector<std::int32_t>> running;
  const bool prompt_rows = o.tokens != hooks::TokenPolicy::generated;
  const bool generated_rows = o.tokens == hooks::TokenPolicy::all || o.tokens == hooks::TokenPolicy::generated;
  std::int64_t captured_passes = 0;
  for (const auto& b : batches) {
    std::int64_t longest = 0;
    for (std::size_t i : b) {
      running.push_back(in.prompts.at(i));
      longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(in.prompts[i].size()));
      p.prompt_tokens += static_cast<std::int64_t>(in.prompts[i].size());
      p.max_tokens += std::min<std::int64_t>(static_cast<std::int64_t>(in.prompts[i].size()) + in.max_new_tokens,
                                             std::max<std::int64_t>(ctx, static_cast<std::int64_t>(in.prompts[i].size())));
    }
    // A batch makes at most gen tokens: a prefill, then gen - 1 decode
    // passes (the last token is never fed back); decode pass s captures
    // when s % every == 0.
    const std::int64_t gen = std::max<std::int64_t>(std::min(in.max_new_tokens, ctx - longest), 0);
    const std::int64_t decode = std::max<std::int64_t>(gen - 1, 0);
    p.forward_passes += 1 + decode;
    p.decode_steps += decode;
    captured_passes += (prompt_rows ? 1 : 0) + (generated_rows ? (decode + o.every - 1) / o.every : 0);
  }
  p.batches = static_cast<std::int64_t>(batches.size());
  p.running = running.size();

  const std::int64_t rows = expected_rows(o.tokens, o.every, false, running, p.attention_width, in.max_new_tokens);
  for (const auto& st : point.streams()) {
    PlanSite s{st.name, st.row_shape, dtype_name(st.dtype), rows, 0};
    std::int64_t elements = 1;
    for (auto x : st.row_shape) elements *= x;
    // topk rows carry K values (float32) and K ids (int32): 2K elements of 4 bytes.
    s.row_bytes = elements * static_cast<std::int64_t>(c10::elementSize(st.dtype)) + 8;
    p.rows += s.rows;
    p.data_bytes += static_cast<std::uint64_t>(s.rows) * static_cast<std::uint64_t>(s.row_bytes);
    if (generated_rows)
      p.decode_step_bytes += static_cast<std::uint64_t>(s.row_bytes) * static_cast<std::uint64_t>(in.batch_size);
    p.sites.push_back(std::move(s));
  }
  p.records = captured_passes * static_cast<std::int64_t>(p.sites.size());
  p.decode_step_records = generated_rows ? static_cast<std::int64_t>(p.sites.size()) : 0;

  // /token_log (seq, pos, token: 12 bytes) holds every prompt's tokens from
  // creation and the generated ones; /sequences repeats them (4 bytes) with
  // per-sequence entries. Strings: prompt text written at creation and
  // again at close, generated text (~4 bytes a token), HDF5's variable-length
  // overhead (~32 bytes a string).
  std::int64_t all_prompt_tokens = 0;
  for (const auto& pr : in.prompts) all_prompt_tokens += static_cast<std::int64_t>(pr.size());
  const std::int64_t generated = p.max_tokens - p.prompt_tokens;
  const std::uint64_t tokens = static_cast<std::uint64_t>(all_prompt_tokens + generated);
  std::uint64_t text = 0;
  for (std::size_t b : in.prompt_text_bytes) text += 2 * b;
  text += 4 * static_cast<std::uint64_t>(generated) + 4 * 32 * in.prompts.size();
  p.sequence_bytes = 16 * tokens + 24 * in.prompts.size() + text;
  p.metadata_bytes = kBaseMetadataBytes + kSiteMetadataBytes * p.sites.size() + cfg.json_text.size();
  p.file_bytes = p.data_bytes + p.sequence_bytes + p.metadata_bytes;

  p.weight_bytes = in.weight_bytes ? in.weight_bytes : estimate_weight_bytes(cfg, in.model_dtype);
  p.read_bandwidth_gbs = in.read_bandwidth_gbs;
  if (in.read_bandwidth_gbs > 0) {
    p.floor_ms = static_cast<double>(p.weight_bytes) / (in.read_bandwidth_gbs * 1e9) * 1e3;
    // A decode step cannot beat the floor: at most this many records and
    // bytes per second reach the writer while decoding (every step captured
    // when every = 1, one in `every` otherwise).
    const double steps_per_s = 1e3 / p.floor_ms / o.every;
    p.records_per_second = static_cast<double>(p.decode_step_records) * steps_per_s;
    p.bytes_per_second = static_cast<double>(p.decode_step_bytes) * steps_per_s;
  }
  return p;
}

nlohmann::json plan_json(const Plan& p) {
  nlohmann::json sites = nlohmann::json::array();
  for (const auto& s : p.sites)
    sites.push_back({{"site", s.name}, {"row_shape", s.row_shape}, {"dtype", s.dtype}, {"rows", s.rows},
                     {"row_bytes", s.row_bytes}, {"bytes", s.rows * s.row_bytes}});
  return {{"prompts", p.prompts},
          {"running", p.running},
          {"prompt_tokens", p.prompt_tokens},
          {"max_tokens", p.max_tokens},
          {"batches", p.batches},
          {"forward_passes", p.forward_passes},
          {"decode_steps", p.decode_steps},
          {"attention_width", p.attention_width},
          {"rows", p.rows},
          {"records", p.records},
          {"data_bytes", p.data_bytes},
          {"sequence_bytes", p.sequence_bytes},
          {"metadata_bytes", p.metadata_bytes},
          {"file_bytes", p.file_bytes},
          {"bytes_per_token", p.max_tokens ? static_cast<double>(p.data_bytes) / static_cast<double>(p.max_tokens) : 0.0},
          {"weight_bytes", p.weight_bytes},
          {"read_bandwidth_gbs", p.read_bandwidth_gbs},
          {"decode_floor_ms", p.floor_ms},
          {"decode_step_records", p.decode_step_records},
          {"decode_step_bytes", p.decode_step_bytes},
          {"records_per_second", p.records_per_second},
          {"bytes_per_second", p.bytes_per_second},
          {"sites", sites}};
}

std::string plan_text(const Plan& p) {
  std::string out = fmt::format(
      "{} of {} prompts run in {} batch(es): {} prompt tokens, at most {} tokens with the generated ones\n", p.running,
      p.prompts, p.batches, p.prompt_tokens, p.max_tokens);
  // One line per kind of site: blocks.*.hook_resid_post x 28.
  struct Kind {
    std::int64_t count = 0, rows = 0, row_bytes = 0;
    std::uint64_t bytes = 0;
    std::string dtype;
    std::vector<std::int64_t> shape;
  };
  std::vector<std::string> order;
  std::map<std::string, Kind> kinds;
  for (const auto& s : p.sites) {
    const std::string k = site_kind(s.name);
    if (!kinds.count(k)) order.push_back(k);
    Kind& x = kinds[k];
    x.count += 1;
    x.rows = s.rows;
    x.row_bytes = s.row_bytes;
    x.bytes += static_cast<std::uint64_t>(s.rows) * static_cast<std::uint64_t>(s.row_bytes);
    x.dtype = s.dtype;
    x.shape = s.row_shape;
  }
  std::size_t w = 4;
  for (const auto& k : order) w = std::max(w, k.size() + 6);
  out += fmt::format("{:<{}} {:>10} {:>16} {:>11} {:>12}\n", "site", w, "rows each", "row shape", "bytes/row", "bytes");
  for (const auto& k : order) {
    const Kind& x = kinds[k];
    std::string shape = "[";
    for (std::size_t i = 0; i < x.shape.size(); ++i) shape += (i ? "," : "") + std::to_string(x.shape[i]);
    shape += "]";
    out += fmt::format("{:<{}} {:>10} {:>16} {:>11} {:>12}\n",
                       x.count > 1 ? fmt::format("{} x{}", k, x.count) : k, w, x.rows, shape + " " + x.dtype,
                       x.row_bytes, bytes_text(static_cast<double>(x.bytes)));
  }
  out += fmt::format("{} sites, {} rows, {} records (one per site per forward pass that captures)\n", p.sites.size(),
                     p.rows, p.records);
  out += fmt::format("file: at most about {} (site rows {}, sequences and token log {}, HDF5 metadata ~{}); "
                     "{:.0f} bytes per token\n",
                     bytes_text(static_cast<double>(p.file_bytes)), bytes_text(static_cast<double>(p.data_bytes)),
                     bytes_text(static_cast<double>(p.sequence_bytes)), bytes_text(static_cast<double>(p.metadata_bytes)),
                     p.max_tokens ? static_cast<double>(p.data_bytes) / static_cast<double>(p.max_tokens) : 0.0);
  if (p.read_bandwidth_gbs > 0)
    out += fmt::format("decode floor {:.3g} ms/step (weights {} at {:.1f} GB/s): at most {:.0f} records/s and {}/s "
                       "of site rows while decoding\n",
                       p.floor_ms, bytes_text(static_cast<double>(p.weight_bytes)), p.read_bandwidth_gbs,
                       p.records_per_second, bytes_text(p.bytes_per_second));
  return out;
}

}  // namespace dmi::engine
