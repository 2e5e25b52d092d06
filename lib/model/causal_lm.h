// The interface every model family implements, and the loader that picks the
// family from config.json.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "hooks/selection.h"
#include "hooks/site.h"
#include "io/config.h"
#include "io/fingerprint.h"
#include "kernels/linear.h"

namespace dmi::model {

// Preallocated key/value cache, written in place: per layer [B, kv_heads,
// capacity, head_dim]. Column c of every sequence holds the token the batch
// processed at cache column c (prompts are left-padded to a common column).
struct KVCache {
  std::vector<at::Tensor> k, v;
  // TorchScript models: the token ids of every column when each step
  // recomputes the whole sequence ([B, capacity] int64), or the module's own
  // cache list (forward_step) in state.
  at::Tensor tokens;
  std::vector<at::Tensor> state;
  std::int64_t capacity = 0;
};

// What a forward pass must compute and read besides its weights, for
// benchmarks' floors. Multiply-adds of the products with weight matrices
// (the projections): per token through the layers, and per row of logits
// the LM head computes. Attention: multiply-adds per query token and cached
// position it attends (scores and values, all layers), and the K and V
// bytes per sequence and cache position (all layers), read at each decode
// step. The row operations are not counted.
struct ForwardWork {
  std::int64_t per_token = 0, per_logits_row = 0;
  std::int64_t attention_per_position = 0, kv_bytes_per_position = 0;
};

struct ForwardInput {
  at::Tensor ids;        // [B, T] int64
  at::Tensor positions;  // [B, T] int64: rotary position of each token in its own sequence
  at::Tensor key_valid;  // [B, start + T] bool: cache columns holding real (non-padding) tokens
  std::int64_t start = 0;  // cache column of ids[:, 0]
  bool all_logits = false;  // logits for every position, or only the last
  const hooks::ForwardInfo* info = nullptr;  // required when an observer is passed
};

struct LoadOptions {
  // TorchScript only: a hook map (io/hook_map.h) whose sites are inserted
  // into the module's graph.
  std::string hook_map;
  // Hash the weight files (or the archive) for the capture's model
  // fingerprint (io/fingerprint.h).
  bool fingerprint = false;
};

class CausalLM {
 public:
  virtual ~CausalLM() = default;
  virtual const io::ModelConfig& config() const = 0;
  virtual at::ScalarType dtype() const = 0;
  virtual KVCache new_cache(std::int64_t batch, std::int64_t capacity) const = 0;
  // Logits as float32: [B, T, vocab] with all_logits, else [B, 1, vocab].
  virtual at::Tensor forward(const ForwardInput& in, KVCache& cache, hooks::Observer* observer = nullptr) = 0;
  // Bytes of weights read per forward (for bandwidth floors in benchmarks).
  virtual std::size_t weight_bytes() const = 0;
  // Which kernels compute the forward pass, in words (benchmarks, logs).
  virtual std::string kernels() const { return "aten"; }
  // The kernels' choice (kernels/linear.h); aten where ATen computes it.
  virtual kernels::Isa kernel_isa() const { return kernels::Isa::aten; }
  // What a forward pass costs (benchmarks' floors); zero when unknown.
  virtual ForwardWork forward_work() const { return {}; }
  // The sites this model's forward produces (for --hooks).
  virtual hooks::SiteSpace site_space() const {
    return {static_cast<int>(config().num_layers), config().qk_norm, {}};
  }
  // Whether environment.dmi_attention decides this model's bits: dmi's
  // attention kernels run its forward pass, in bf16, with heads of a shape
  // that runs on vdpbf16ps where the CPU has it (kernels/ops.h). False for
  // fp32 and fp16 models, other head shapes and TorchScript graphs.
  virtual bool attention_arithmetic_applies() const { return false; }
  // Whether HookPoints may replace tensors (--steer, --ablate, --patch).
  virtual bool supports_interventions() const { return true; }
  // Content hashes of the weight files (or the TorchScript archive), when
  // loaded with LoadOptions::fingerprint; and what computing them cost.
  const io::Fingerprint& weights_fingerprint() const { return weights_fp_; }
  double fingerprint_seconds() const { return fingerprint_seconds_; }
  std::size_t fingerprint_bytes() const { return fingerprint_bytes_; }
  void set_weights_fingerprint(io::Fingerprint fp, double seconds, std::size_t bytes) {
    weights_fp_ = std::move(fp);
    fingerprint_seconds_ = seconds;
    fingerprint_bytes_ = bytes;
  }

 private:
  io::Fingerprint weights_fp_;
  double fingerprint_seconds_ = 0;
  std::size_t fingerprint_bytes_ = 0;
};

// True when path is a regular file: load_model reads it as a TorchScript
// archive (a directory is an HF model).
bool is_torchscript_archive(const std::string& path);

// Loads an HF model directory (config.json + safetensors) or a TorchScript
// archive (a .pt file; model/torchscript.h). dtype: kFloat or kBFloat16.
// Errors name the file, field or tensor at fault.
std::unique_ptr<CausalLM> load_model(const std::string& path, at::ScalarType dtype, const LoadOptions& opts = {});

// tokenizer.json inside an HF directory, or next to a TorchScript file.
std::string default_tokenizer_path(const std::string& model_path);

}  // namespace dmi::model
