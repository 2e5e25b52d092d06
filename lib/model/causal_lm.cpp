#include "model/causal_lm.h"

#include <sys/stat.h>

#include "common/error.h"
#include "io/weights.h"
#include "model/llama.h"

namespace dmi::model {

std::unique_ptr<CausalLM> load_model(const std::string& dir, at::ScalarType dtype) {
  struct stat st {};
  DMI_CHECK(::stat(dir.c_str(), &st) == 0, "{}: model directory does not exist", dir);
  DMI_CHECK(S_ISDIR(st.st_mode), "{}: not a directory (expected an HF model directory with config.json)", dir);
  io::ModelConfig cfg = io::load_config(dir + "/config.json");
  io::WeightStore weights(dir);
  // Every supported architecture is a member of the Llama family; the
  // variants (q/k/v biases, per-head q/k norms, sliding window) follow from
  // config.json and the weights present.
  return std::make_unique<LlamaFamily>(std::move(cfg), weights, dtype);
}

}  // namespace dmi::model
