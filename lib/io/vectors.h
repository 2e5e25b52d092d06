// Steering-vector files: per layer L a direction (float32 [d_model], added
// at the output of block L unless the steer names another site) and an
// optional scalar target (the `set` mode's c_L).
//
// dmi's own format is safetensors: tensors `direction.L` (F32 [d_model]) and
// `target.L` (F32 [] or [1]), `__metadata__` with format "dmi-steering-vector",
// version "1", model_hint, site, method, pairs, normalization. Also read:
// llama.cpp GGUF control vectors (F32 1-D `direction.N`; llama.cpp adds
// direction.N to the output of layer N, the same as dmi, and never applies
// direction.0, so dmi ignores it too) and HDF5 files with root datasets of
// the same names. docs/steering.md has the details.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>

namespace dmi::io {

struct SteeringVectors {
  std::map<int, at::Tensor> direction;  // layer -> float32 [d_model]
  std::map<int, double> target;         // layer -> c_L (optional)
  std::map<std::string, std::string> metadata;
  std::string format;                   // "dmi" (safetensors), "gguf", "hdf5"
};

// Reads any of the three formats (by content, not by extension). Checks
// names (direction.L / target.L), dtype F32, rank, a common d_model,
// finiteness; with d_model / n_layers > 0 also checks them against the
// model. Errors name the file and the tensor.
SteeringVectors load_steering_vectors(const std::string& path, std::int64_t d_model = 0, std::int64_t n_layers = 0);

// Writes dmi's safetensors format.
void save_steering_vectors(const std::string& path, const SteeringVectors& v);

// Writes a GGUF (version 3) control vector llama.cpp loads: general.architecture
// "controlvector", controlvector.model_hint, controlvector.layer_count, and
// F32 tensors direction.N. Layer 0 cannot be expressed (llama.cpp ignores
// direction.0): throws if v has it, unless drop_layer0.
void save_gguf_control_vector(const std::string& path, const SteeringVectors& v, const std::string& model_hint,
                              bool drop_layer0 = false);

}  // namespace dmi::io
