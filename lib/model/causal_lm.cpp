#include "model/causal_lm.h"

#include <sys/stat.h>

#include <chrono>

#include "common/error.h"
#include "io/weights.h"
#include "kernels/memory.h"
#include "model/llama.h"
#include "model/torchscript.h"

namespace dmi::model {

bool is_torchscript_archive(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::unique_ptr<CausalLM> load_model(const std::string& dir, at::ScalarType dtype, const LoadOptions& opts) {
  struct stat st {};
  DMI_CHECK(::stat(dir.c_str(), &st) == 0, "{}: model directory does not exist", dir);
  auto seconds_since = [](std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (is_torchscript_archive(dir)) {
    auto m = load_torchscript(dir, dtype, opts.hook_map);
    if (opts.fingerprint) {
      const auto t0 = std::chrono::steady_clock::now();
      io::Fingerprint fp{{dir.substr(dir.rfind('/') + 1), io::xxh3_128_file(dir)}};
      m->set_weights_fingerprint(std::move(fp), seconds_since(t0), static_cast<std::size_t>(st.st_size));
    }
    return m;
  }
  DMI_CHECK(S_ISDIR(st.st_mode),
            "{}: not a directory (expected an HF model directory with config.json, or a TorchScript .pt archive)", dir);
  DMI_CHECK(opts.hook_map.empty(), "--hook-map applies to TorchScript models only ({} is an HF directory)", dir);
  io::ModelConfig cfg = io::load_config(dir + "/config.json");
  io::WeightStore weights(dir);
  // Every supported architecture is a member of the Llama family; the
  // variants (q/k/v biases, per-head q/k norms, sliding window) follow from
  // config.json and the weights present.
  auto m = std::make_unique<LlamaFamily>(std::move(cfg), weights, dtype);
  // Loading frees large temporaries (for the Qwen3-0.6B shape one the size
  // of the embedding, 311 MB); they are not a forward pass's working set.
  kernels::release_kept_large_blocks();
  if (opts.fingerprint) {
    // After construction: the tensors served as views share these pages, so
    // hashing is the read the first forward pass would do anyway.
    const auto t0 = std::chrono::steady_clock::now();
    io::Fingerprint fp = weights.content_hashes();
    m->set_weights_fingerprint(std::move(fp), seconds_since(t0), weights.file_bytes());
  }
  return m;
}

std::string default_tokenizer_path(const std::string& model_path) {
  if (is_torchscript_archive(model_path)) {
    const auto slash = model_path.rfind('/');
    return (slash == std::string::npos ? std::string(".") : model_path.substr(0, slash)) + "/tokenizer.json";
  }
  return model_path + "/tokenizer.json";
}

}  // namespace dmi::model
