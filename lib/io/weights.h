// The weights of a Hugging Face model directory: model.safetensors, or the
// shards listed in model.safetensors.index.json. Tensors are served as views
// of the memory mapping when their dtype and alignment allow it, and copied
// (converted) otherwise.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/fingerprint.h"
#include "io/safetensors.h"

namespace dmi::io {

class WeightStore {
 public:
  explicit WeightStore(const std::string& model_dir);

  bool has(const std::string& name) const { return where_.count(name) != 0; }
  // The tensor `name` as `dtype`, checked against `shape`; errors name the
  // file and the tensor.
  at::Tensor get(const std::string& name, at::ScalarType dtype, const std::vector<std::int64_t>& shape) const;
  // How many tensors were served as zero-copy views / as copies.
  std::size_t views() const { return views_; }
  std::size_t copies() const { return copies_; }
  // XXH3-128 of every weight file (over the mapping the tensors are served
  // from) and SHA-256 of the shard index, keyed by file name.
  Fingerprint content_hashes() const;
  std::size_t file_bytes() const;

 private:
  std::string index_path_;  // empty for a single model.safetensors
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> where_;
  std::map<const TensorView*, const SafetensorsFile*> file_of_;
  mutable std::size_t views_ = 0, copies_ = 0;
};

}  // namespace dmi::io
