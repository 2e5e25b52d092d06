#include "io/vectors.h"

#include <ATen/ATen.h>
#include <hdf5.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "io/safetensors.h"

namespace dmi::io {

namespace {

// A direction has d_model elements: far below this (4 MiB of float32). A
// file claiming more is refused before anything is allocated or read.
constexpr std::int64_t kMaxVectorElements = 1 << 20;

// "direction.12" -> ("direction", 12); false for other names.
bool parse_vector_name(const std::string& name, std::string& kind, int& layer) {
  const auto dot = name.find('.');
  if (dot == std::string::npos) return false;
  kind = name.substr(0, dot);
  const std::string num = name.substr(dot + 1);
  if ((kind != "direction" && kind != "target") || num.empty() || num.size() > 6 ||
      num.find_first_not_of("0123456789") != std::string::npos)
    return false;
  layer = std::stoi(num);
  return true;
}

void add_tensor(SteeringVectors& v, const std::string& path, const std::string& name, const float* data,
                const std::vector<std::int64_t>& shape) {
  std::string kind;
  int layer = -1;
  DMI_CHECK(parse_vector_name(name, kind, layer),
            "{}: tensor '{}' is not direction.L or target.L (L = 0-based layer)", path, name);
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  for (std::int64_t i = 0; i < n; ++i)
    DMI_CHECK(std::isfinite(data[i]), "{}: tensor '{}' holds NaN or Inf (element {})", path, name, i);
  if (kind == "target") {
    DMI_CHECK(n == 1 && shape.size() <= 1, "{}: tensor '{}' must be a scalar (shape [] or [1])", path, name);
    v.target[layer] = data[0];
    return;
  }
  DMI_CHECK(shape.size() == 1 && n > 0, "{}: tensor '{}' must be 1-D [d_model], not rank {}", path, name,
            shape.size());
  at::Tensor t = at::from_blob(const_cast<float*>(data), {n}, at::kFloat).clone();
  auto it = v.direction.find(layer);
  if (it == v.direction.end()) v.direction[layer] = t;
  else it->second = it->second + t;  // duplicates add up, as in llama.cpp
}

void read_safetensors(SteeringVectors& v, const std::string& path) {
  SafetensorsFile f(path);
  v.metadata = f.metadata();
  v.format = "dmi";
  for (const auto& [name, t] : f.tensors()) {
    DMI_CHECK(t.dtype == DType::F32, "{}: tensor '{}' is {}, steering vectors must be F32", path, name,
              dtype_name(t.dtype));
    std::vector<float> buf(t.nbytes / 4);
    std::memcpy(buf.data(), t.data, t.nbytes);
    add_tensor(v, path, name, buf.data(), t.shape);
  }
}

// GGUF (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): a
// little-endian header, key/value metadata, tensor infos, aligned data.
class GgufReader {
 public:
  GgufReader(const MappedFile& m, const std::string& path) : p_(m.data()), n_(m.size()), path_(path) {}
  template <typename T>
  T get() {
    need(sizeof(T));
    T x;
    std::memcpy(&x, p_ + off_, sizeof(T));
    off_ += sizeof(T);
    return x;
  }
  std::string str() {
    const auto len = get<std::uint64_t>();
    need(len);
    std::string s(reinterpret_cast<const char*>(p_ + off_), len);
    off_ += len;
    return s;
  }
  void skip_value(std::uint32_t type, int depth = 0) {
    static const std::size_t sizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    DMI_CHECK(type <= 12, "{}: GGUF metadata value type {} is unknown: corrupt file", path_, type);
    if (type == 8) {
      str();
    } else if (type == 9) {
      DMI_CHECK(depth < 4, "{}: GGUF arrays nested too deeply", path_);
      const auto elem = get<std::uint32_t>();
      const auto count = get<std::uint64_t>();
      DMI_CHECK(count <= n_, "{}: GGUF array of {} elements cannot fit in the file", path_, count);
      for (std::uint64_t i = 0; i < count; ++i) skip_value(elem, depth + 1);
    } else {
      need(sizes[type]);
      off_ += sizes[type];
    }
  }
  std::size_t offset() const { return off_; }
  void need(std::uint64_t bytes) const {
    DMI_CHECK(bytes <= n_ && off_ <= n_ - bytes, "{}: GGUF file truncated (needs {} bytes at offset {})", path_,
              bytes, off_);
  }
  const std::uint8_t* data() const { return p_; }
  std::size_t size() const { return n_; }

 private:
  const std::uint8_t* p_;
  std::size_t n_, off_ = 0;
  std::string path_;
};

void read_gguf(SteeringVectors& v, const std::string& path) {
  MappedFile m(path);
  GgufReader r(m, path);
  DMI_CHECK(r.get<std::uint32_t>() == 0x46554747u, "{}: not a GGUF file", path);
  const auto version = r.get<std::uint32_t>();
  DMI_CHECK(version == 2 || version == 3, "{}: GGUF version {} is not supported (2 or 3)", path, version);
  const auto n_tensors = r.get<std::uint64_t>();
  const auto n_kv = r.get<std::uint64_t>();
  DMI_CHECK(n_tensors <= 1u << 20 && n_kv <= 1u << 20, "{}: GGUF header counts are implausible: corrupt file", path);
  std::uint64_t alignment = 32;
  for (std::uint64_t i = 0; i < n_kv; ++i) {
    const std::string key = r.str();
    const auto type = r.get<std::uint32_t>();
    if (key == "general.alignment" && type == 4) {
      alignment = r.get<std::uint32_t>();
      DMI_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0, "{}: general.alignment {} is not a power of 2",
                path, alignment);
    } else if (type == 8 && (key == "general.architecture" || key == "controlvector.model_hint")) {
      v.metadata[key] = r.str();
    } else {
      r.skip_value(type);
    }
  }
  struct Info {
    std::string name;
    std::vector<std::int64_t> shape;
    std::uint64_t offset;
  };
  std::vector<Info> infos;
  for (std::uint64_t i = 0; i < n_tensors; ++i) {
    Info t;
    t.name = r.str();
    const auto n_dims = r.get<std::uint32_t>();
    DMI_CHECK(n_dims >= 1 && n_dims <= 4, "{}: tensor '{}' has {} dimensions", path, t.name, n_dims);
    for (std::uint32_t d = 0; d < n_dims; ++d) t.shape.push_back(static_cast<std::int64_t>(r.get<std::uint64_t>()));
    const auto type = r.get<std::uint32_t>();
    DMI_CHECK(type == 0, "{}: tensor '{}' has GGML type {}; control vectors must be F32 (type 0)", path, t.name, type);
    t.offset = r.get<std::uint64_t>();
    // llama.cpp's reading: ne[0] is the length; higher dims must be 1.
    for (std::size_t d = 1; d < t.shape.size(); ++d)
      DMI_CHECK(t.shape[d] == 1, "{}: tensor '{}' is not 1-D", path, t.name);
    t.shape.resize(1);
    infos.push_back(std::move(t));
  }
  const std::uint64_t data_start = (r.offset() + alignment - 1) / alignment * alignment;
  for (const auto& t : infos) {
    std::string kind;
    int layer = -1;
    DMI_CHECK(parse_vector_name(t.name, kind, layer) && kind == "direction",
              "{}: tensor '{}' is not direction.N (a llama.cpp control vector holds only those)", path, t.name);
    DMI_CHECK(layer != 0, "{}: tensor 'direction.0' is invalid in a GGUF control vector (llama.cpp refuses it: block "
              "0's output is never steered)", path);
    DMI_CHECK(t.shape[0] > 0 && t.shape[0] <= kMaxVectorElements, "{}: tensor '{}' has {} elements (a direction "
              "has d_model, at most {})", path, t.name, static_cast<std::uint64_t>(t.shape[0]), kMaxVectorElements);
    const std::uint64_t bytes = static_cast<std::uint64_t>(t.shape[0]) * 4;
    DMI_CHECK(data_start <= m.size() && t.offset <= m.size() - data_start &&
                  bytes <= m.size() - data_start - t.offset,
              "{}: tensor '{}' lies outside the file: truncated or corrupt", path, t.name);
    std::vector<float> buf(static_cast<std::size_t>(t.shape[0]));
    std::memcpy(buf.data(), m.data() + data_start + t.offset, bytes);
    add_tensor(v, path, t.name, buf.data(), t.shape);
  }
  v.format = "gguf";
}

void read_hdf5(SteeringVectors& v, const std::string& path) {
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  DMI_CHECK(f >= 0, "{}: cannot open as HDF5", path);
  hsize_t n = 0;
  H5Gget_num_objs(f, &n);
  std::string error;
  for (hsize_t i = 0; i < n && error.empty(); ++i) {
    char buf[256];
    H5Gget_objname_by_idx(f, i, buf, sizeof buf);
    const std::string name = buf;
    if (H5Gget_objtype_by_idx(f, i) != H5G_DATASET) continue;
    hid_t d = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
    hid_t s = H5Dget_space(d);
    const int rank = H5Sget_simple_extent_ndims(s);
    std::vector<hsize_t> dims(std::max(rank, 0));
    H5Sget_simple_extent_dims(s, dims.data(), nullptr);
    hid_t t = H5Dget_type(d);
    // A float of 2 to 8 bytes (a corrupt type may claim any size, and the
    // conversion buffer would be sized by it).
    const bool is_float = H5Tget_class(t) == H5T_FLOAT && H5Tget_size(t) >= 2 && H5Tget_size(t) <= 8;
    H5Tclose(t);
    std::int64_t count = 1;
    std::vector<std::int64_t> shape;
    for (auto x : dims) {
      count = x > static_cast<hsize_t>(kMaxVectorElements) ? kMaxVectorElements + 1
                                                           : std::min(count * static_cast<std::int64_t>(x),
                                                                      kMaxVectorElements + 1);
      shape.push_back(static_cast<std::int64_t>(std::min<hsize_t>(x, kMaxVectorElements + 1)));
    }
    if (rank < 0 || rank > 1 || count > kMaxVectorElements) {
      H5Sclose(s);
      H5Dclose(d);
      error = fmt::format("{}: dataset '{}' is not a vector of at most {} elements (rank {}, {}{} elements)", path,
                          name, kMaxVectorElements, rank, count > kMaxVectorElements ? "more than " : "",
                          std::min(count, kMaxVectorElements));
      break;
    }
    std::vector<float> data(static_cast<std::size_t>(count));
    const bool ok = is_float &&
                    (count == 0 || H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()) >= 0);
    H5Sclose(s);
    H5Dclose(d);
    if (!ok) {
      error = fmt::format("{}: dataset '{}' is not a readable float array", path, name);
      break;
    }
    try {
      add_tensor(v, path, name, data.data(), shape);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  H5Fclose(f);
  DMI_CHECK(error.empty(), "{}", error);
  v.format = "hdf5";
}

}  // namespace

SteeringVectors load_steering_vectors(const std::string& path, std::int64_t d_model, std::int64_t n_layers) {
  std::ifstream probe(path, std::ios::binary);
  DMI_CHECK(probe, "{}: cannot read steering-vector file", path);
  char magic[8] = {};
  probe.read(magic, 8);
  SteeringVectors v;
  if (std::memcmp(magic, "GGUF", 4) == 0) read_gguf(v, path);
  else if (std::memcmp(magic, "\x89HDF\r\n\x1a\n", 8) == 0) read_hdf5(v, path);
  else read_safetensors(v, path);
  DMI_CHECK(!v.direction.empty(), "{}: no direction.L tensors: not a steering-vector file", path);
  std::int64_t d = -1;
  for (const auto& [layer, t] : v.direction) {
    if (d < 0) d = t.size(0);
    DMI_CHECK(t.size(0) == d, "{}: tensor 'direction.{}' has {} elements, others have {}", path, layer, t.size(0), d);
    DMI_CHECK(d_model <= 0 || t.size(0) == d_model, "{}: tensor 'direction.{}' has {} elements; the model's d_model is {}",
              path, layer, t.size(0), d_model);
    DMI_CHECK(n_layers <= 0 || layer < n_layers, "{}: tensor 'direction.{}': layer {} is out of range (the model has {} "
              "layers, 0 to {})", path, layer, layer, n_layers, n_layers - 1);
  }
  for (const auto& [layer, c] : v.target)
    DMI_CHECK(v.direction.count(layer), "{}: tensor 'target.{}' has no direction.{}", path, layer, layer);
  return v;
}

void save_steering_vectors(const std::string& path, const SteeringVectors& v) {
  nlohmann::json header;
  nlohmann::json meta = nlohmann::json::object();
  for (const auto& [k, val] : v.metadata) meta[k] = val;
  meta["format"] = "dmi-steering-vector";
  meta["version"] = "1";
  header["__metadata__"] = meta;
  std::vector<std::uint8_t> data;
  auto put = [&](const std::string& name, const std::vector<float>& values, const std::vector<std::int64_t>& shape) {
    const std::size_t b = data.size();
    data.resize(b + values.size() * 4);
    std::memcpy(data.data() + b, values.data(), values.size() * 4);
    header[name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {b, data.size()}}};
  };
  for (const auto& [layer, t] : v.direction) {
    at::Tensor c = t.to(at::kFloat).contiguous();
    put("direction." + std::to_string(layer), std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel()),
        {c.numel()});
  }
  for (const auto& [layer, c] : v.target) put("target." + std::to_string(layer), {static_cast<float>(c)}, {});
  std::string h = header.dump();
  while ((8 + h.size()) % 8) h += ' ';
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  DMI_CHECK(f, "{}: cannot write", path);
  const std::uint64_t hlen = h.size();
  f.write(reinterpret_cast<const char*>(&hlen), 8);
  f.write(h.data(), static_cast<std::streamsize>(h.size()));
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  DMI_CHECK(f.good(), "{}: write failed (disk full?)", path);
}

void save_gguf_control_vector(const std::string& path, const SteeringVectors& v, const std::string& model_hint,
                              bool drop_layer0) {
  DMI_CHECK(drop_layer0 || !v.direction.count(0),
            "{}: direction.0 cannot be written to GGUF: llama.cpp never steers block 0's output and refuses the "
            "tensor", path);
  std::string out;
  auto u32 = [&](std::uint32_t x) { out.append(reinterpret_cast<const char*>(&x), 4); };
  auto u64 = [&](std::uint64_t x) { out.append(reinterpret_cast<const char*>(&x), 8); };
  auto str = [&](const std::string& s) {
    u64(s.size());
    out += s;
  };
  std::vector<std::pair<int, at::Tensor>> tensors;
  for (const auto& [layer, t] : v.direction)
    if (layer > 0) tensors.emplace_back(layer, t.to(at::kFloat).contiguous());
  DMI_CHECK(!tensors.empty(), "{}: nothing to write (no direction.L with L >= 1)", path);
  int max_layer = 0;
  for (const auto& [layer, t] : tensors) max_layer = std::max(max_layer, layer);
  u32(0x46554747u);  // "GGUF"
  u32(3);
  u64(tensors.size());
  u64(3);
  str("general.architecture");
  u32(8);
  str("controlvector");
  str("controlvector.model_hint");
  u32(8);
  str(model_hint);
  str("controlvector.layer_count");
  u32(5);  // INT32, as llama.cpp's cvector-generator writes it
  const std::int32_t count = max_layer;
  out.append(reinterpret_cast<const char*>(&count), 4);
  const std::uint64_t align = 32;
  std::uint64_t offset = 0;
  for (const auto& [layer, t] : tensors) {
    str("direction." + std::to_string(layer));
    u32(1);
    u64(static_cast<std::uint64_t>(t.numel()));
    u32(0);  // GGML_TYPE_F32
    u64(offset);
    offset += (static_cast<std::uint64_t>(t.numel()) * 4 + align - 1) / align * align;
  }
  out.resize((out.size() + align - 1) / align * align, '\0');
  for (const auto& [layer, t] : tensors) {
    const std::size_t b = out.size();
    out.append(reinterpret_cast<const char*>(t.data_ptr<float>()), static_cast<std::size_t>(t.numel()) * 4);
    out.resize(b + (static_cast<std::uint64_t>(t.numel()) * 4 + align - 1) / align * align, '\0');
  }
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  DMI_CHECK(f, "{}: cannot write", path);
  f.write(out.data(), static_cast<std::streamsize>(out.size()));
  DMI_CHECK(f.good(), "{}: write failed (disk full?)", path);
}

}  // namespace dmi::io
