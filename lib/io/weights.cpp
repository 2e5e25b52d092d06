#include "io/weights.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>
#include <sys/stat.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "common/error.h"

namespace dmi::io {

namespace {

bool exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

at::ScalarType torch_dtype(DType d) {
  switch (d) {
    case DType::F32: return at::kFloat;
    case DType::F16: return at::kHalf;
    case DType::BF16: return at::kBFloat16;
  }
  return at::kFloat;
}

}  // namespace

WeightStore::WeightStore(const std::string& dir) {
  const std::string single = dir + "/model.safetensors";
  const std::string index = dir + "/model.safetensors.index.json";
  std::vector<std::string> shard_names;
  nlohmann::json weight_map;
  if (exists(index)) {
    index_path_ = index;
    std::ifstream f(index);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(f);
    } catch (const nlohmann::json::exception& e) {
      DMI_FAIL("{}: malformed JSON: {}", index, e.what());
    }
    DMI_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), "{}: missing 'weight_map'", index);
    weight_map = j["weight_map"];
    std::set<std::string> uniq;
    for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
      DMI_CHECK(it.value().is_string(), "{}: weight_map['{}'] is not a file name", index, it.key());
      uniq.insert(it.value().get<std::string>());
    }
    shard_names.assign(uniq.begin(), uniq.end());
  } else {
    DMI_CHECK(exists(single), "{}: no model.safetensors or model.safetensors.index.json", dir);
    shard_names.push_back("model.safetensors");
  }
  for (const auto& s : shard_names) {
    DMI_CHECK(s.find('/') == std::string::npos, "{}: shard name '{}' must be a plain file name", index, s);
    files_.push_back(std::make_unique<SafetensorsFile>(dir + "/" + s));
    for (const auto& [name, view] : files_.back()->tensors()) {
      DMI_CHECK(!where_.count(name), "{}: tensor '{}' appears in more than one shard", files_.back()->path(), name);
      where_[name] = &view;
      file_of_[&view] = files_.back().get();
    }
  }
  for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
    auto w = where_.find(it.key());
    DMI_CHECK(w != where_.end() && file_of_[w->second]->path() == dir + "/" + it.value().get<std::string>(),
              "{}: tensor '{}' is listed in {} but not found there", index, it.key(), it.value().get<std::string>());
  }
}

Fingerprint WeightStore::content_hashes() const {
  Fingerprint fp;
  auto base = [](const std::string& p) { return p.substr(p.rfind('/') + 1); };
  if (!index_path_.empty()) fp[base(index_path_)] = sha256_file(index_path_);
  for (const auto& f : files_) {
    const auto m = f->mapping();
    fp[base(f->path())] = xxh3_128(m->data(), m->size());
  }
  return fp;
}

std::size_t WeightStore::file_bytes() const {
  std::size_t n = 0;
  for (const auto& f : files_) n += f->mapping()->size();
  return n;
}

at::Tensor WeightStore::get(const std::string& name, at::ScalarType dtype,
                            const std::vector<std::int64_t>& shape) const {
  auto it = where_.find(name);
  DMI_CHECK(it != where_.end(), "missing tensor '{}' in {}", name,
            files_.size() == 1 ? files_[0]->path() : std::string("the model's shards"));
  const TensorView& v = *it->second;
  const SafetensorsFile& file = *file_of_.at(&v);
  DMI_CHECK(v.shape == shape, "{}: tensor '{}' has shape [{}], config.json implies [{}]", file.path(), name,
            fmt::join(v.shape, ", "), fmt::join(shape, ", "));
  const at::ScalarType src = torch_dtype(v.dtype);
  const bool aligned = reinterpret_cast<std::uintptr_t>(v.data) % dtype_size(v.dtype) == 0;
  auto opts = at::TensorOptions().dtype(src).device(at::kCPU);
  if (aligned) {
    auto keep = file.mapping();
    at::Tensor t = at::from_blob(const_cast<std::uint8_t*>(v.data), v.shape, [keep](void*) {}, opts);
    if (src == dtype) {
      ++views_;
      return t;
    }
    ++copies_;
    return t.to(dtype);
  }
  // Misaligned (real files can place 2-byte tensors at odd offsets): copy the
  // bytes into an aligned buffer first.
  ++copies_;
  at::Tensor t = at::empty(v.shape, opts);
  std::memcpy(t.data_ptr(), v.data, v.nbytes);
  return t.to(dtype);
}

}  // namespace dmi::io
