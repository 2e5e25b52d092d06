// Activation-patching sweeps (dmi-patch): run a clean and a corrupted prompt,
// then, for every (site, layer, position) or (site, layer, head), run the
// base prompt again with that one activation taken from the other run, and
// measure how much of the clean behaviour comes back.
//
// The patched runs go through the same write-capable HookPoints as
// `dmi-run --patch` (hooks::Intervener, Kind::replace), several cells per
// forward pass as batch rows. A patch at position p leaves positions < p as
// they were, so those rows start from the base run's KV cache at column p and
// compute only positions p..T-1 (reuse_prefix).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "analysis/heatmap.h"
#include "hooks/site.h"
#include "model/causal_lm.h"

namespace dmi::analysis {

enum class PatchDirection {
  denoise,  // clean activations into the corrupted run
  noise,    // corrupted activations into the clean run
};
enum class PatchMetric { logit_diff, logprob, prob, kl };

PatchDirection parse_patch_direction(const std::string& s);  // denoise | noise
PatchMetric parse_patch_metric(const std::string& s);        // logit-diff | logprob | prob | kl
const char* patch_direction_name(PatchDirection d);
const char* patch_metric_name(PatchMetric m);

// The sites a sweep patches, by short name: resid_pre, attn_out, mlp_out
// (one cell per layer and position) and z, pattern (one per layer and head,
// every position). Throws dmi::Error naming the item for anything else.
std::vector<hooks::Site> parse_patch_sites(const std::string& list);
// "resid_pre", "attn_out", "mlp_out", "z", "pattern": the name under /patch/ in the file.
std::string patch_site_short_name(hooks::Site s);
// Whether a site's cells are (layer, head) rather than (layer, position).
bool patch_site_per_head(hooks::Site s);

struct PatchPair {
  std::vector<std::int32_t> clean, corrupt;  // same length
};

struct PatchSweepOptions {
  std::vector<hooks::Site> sites;
  PatchDirection direction = PatchDirection::denoise;
  PatchMetric metric = PatchMetric::logit_diff;
  std::int32_t answer = -1, wrong = -1;  // token ids (logit-diff needs both, logprob and prob the answer)
  std::int64_t batch_size = 8;           // patched runs per forward pass
  bool reuse_prefix = true;              // start position-p patches from the base run's KV cache
  std::function<void(std::size_t done, std::size_t total)> on_progress;  // patched runs
  const std::atomic<bool>* stop = nullptr;  // set: throws dmi::Error("interrupted") between batches
};

// One site's cells: raw metric (the mean over pairs) and its normalised form
// (m - m_corrupt) / (m_clean - m_corrupt), both float64 [n_layers, n_cols].
struct PatchGrid {
  hooks::Site site;
  bool per_head = false;  // columns are heads, else positions
  at::Tensor raw, norm;
};

struct PatchSweepResult {
  double m_clean = 0, m_corrupt = 0;  // means over pairs
  std::vector<double> pair_clean, pair_corrupt;
  std::vector<PatchGrid> grids;
  std::int64_t patched_runs = 0;     // cells x pairs
  std::int64_t forward_passes = 0;
  std::int64_t tokens_computed = 0;  // token positions the patched runs computed
  std::int64_t tokens_naive = 0;     // ... had every patched run recomputed the whole prompt
  double seconds = 0;                // patched runs only
};

// The metric of one run's last-position logits ([vocab] float32); clean_logp:
// the clean run's log-probabilities (float64 [vocab]) for kl, else undefined.
double patch_metric(PatchMetric m, const at::Tensor& logits, std::int32_t answer, std::int32_t wrong,
                    const at::Tensor& clean_logp);

// Runs the sweep. Every pair must have the same length (the grids share
// their position axis); errors name the pair at fault.
PatchSweepResult patch_sweep(model::CausalLM& model, const std::vector<PatchPair>& pairs,
                             const PatchSweepOptions& opts);

// What a sweep's file records besides the grids (docs/patching.md).
struct PatchFileInfo {
  std::string model_path, dtype, command_line;
  std::string fingerprint_json;            // the model's fingerprint ({} when not hashed)
  std::vector<std::string> clean_texts, corrupt_texts;  // the prompts as given
  std::vector<std::string> tokens;         // pair 1's base prompt, one string per position
  std::string answer, wrong;               // as tokens ("" when not used)
};

// The labelled picture of one site's normalised effects (dmi-patch --png,
// --svg): layers down, positions (with pair 1's tokens) or heads across,
// blue -1 (as corrupted) .. red +1 (as clean).
Heatmap patch_heatmap(const PatchGrid& g, const PatchSweepOptions& o, const PatchFileInfo& info,
                      const std::string& output);

// Writes /patch/<short site name>/{raw,norm} and the root attributes, under
// PATH.partial renamed into place once complete. An existing path only with
// overwrite.
void write_patch_file(const std::string& path, bool overwrite, const PatchSweepResult& r,
                      const PatchSweepOptions& o, const PatchFileInfo& info);

// The cells whose normalised effect is largest in magnitude, largest first
// (NaN cells last), at most k over all sites.
struct PatchCell {
  hooks::Site site;
  int layer;
  std::int64_t col;  // position, or head for per-head sites
  double raw, norm;
};
std::vector<PatchCell> top_patch_cells(const PatchSweepResult& r, std::size_t k);

}  // namespace dmi::analysis
