#include "model/causal_lm.h"

#include <sys/stat.h>

#include "common/error.h"
#include "io/weights.h"
#include "model/llama.h"
#include "model/torchscript.h"

namespace dmi::model {

std::unique_ptr<CausalLM> load_model(const std::string& dir, at::ScalarType dtype, const LoadOptions& opts) {
  struct stat st {};
  DMI_CHECK(::stat(dir.c_str(), &st) == 0, "{}: model directory does not exist", dir);
  if (S_ISREG(st.st_mode)) return load_torchscript(dir, dtype, opts.hook_map);
  DMI_CHECK(S_ISDIR(st.st_mode),
            "{}: not a directory (expected an HF model directory with config.json, or a TorchScript .pt archive)", dir);
  DMI_CHECK(opts.hook_map.empty(), "--hook-map applies to TorchScript models only ({} is an HF directory)", dir);
  io::ModelConfig cfg = io::load_config(dir + "/config.json");
  io::WeightStore weights(dir);
  // Every supported architecture is a member of the Llama family; the
  // variants (q/k/v biases, per-head q/k norms, sliding window) follow from
  // config.json and the weights present.
  return std::make_unique<LlamaFamily>(std::move(cfg), weights, dtype);
}

std::string default_tokenizer_path(const std::string& model_path) {
  struct stat st {};
  if (::stat(model_path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
    const auto slash = model_path.rfind('/');
    return (slash == std::string::npos ? std::string(".") : model_path.substr(0, slash)) + "/tokenizer.json";
  }
  return model_path + "/tokenizer.json";
}

}  // namespace dmi::model
