#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "common/error.h"

namespace dmi::io {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
  }
  return "?";
}

std::size_t dtype_size(DType d) { return d == DType::F32 ? 4 : 2; }

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DMI_CHECK(fd >= 0, "{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    DMI_FAIL("{}: not a regular file", path);
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    // Private writable mapping: pages stay shared with the page cache until
    // written, and an accidental write cannot reach the file.
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    int err = errno;
    ::close(fd);
    DMI_CHECK(p != MAP_FAILED, "{}: mmap failed: {}", path, std::strerror(err));
    data_ = static_cast<std::uint8_t*>(p);
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(data_, size_);
}

namespace {

DType parse_dtype(const std::string& s, const std::string& file, const std::string& tensor) {
  if (s == "F32") return DType::F32;
  if (s == "F16") return DType::F16;
  if (s == "BF16") return DType::BF16;
  DMI_FAIL("{}: tensor '{}' has dtype '{}'; supported: F32, F16, BF16", file, tensor, s);
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : map_(std::make_shared<MappedFile>(path)) {
  const std::size_t size = map_->size();
  DMI_CHECK(size >= 8, "{}: not a safetensors file ({} bytes, too short for a header)", path, size);
  std::uint64_t hlen = 0;
  std::memcpy(&hlen, map_->data(), 8);  // little-endian hosts only
  DMI_CHECK(hlen <= kMaxHeaderBytes, "{}: safetensors header claims {} bytes (limit {}): corrupt or not safetensors",
            path, hlen, kMaxHeaderBytes);
  DMI_CHECK(hlen <= size - 8, "{}: safetensors header claims {} bytes but the file has only {} after the length",
            path, hlen, size - 8);
  const char* hbeg = reinterpret_cast<const char*>(map_->data() + 8);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(hbeg, hbeg + hlen);
  } catch (const nlohmann::json::exception& e) {
    DMI_FAIL("{}: safetensors header is not valid JSON: {}", path, e.what());
  }
  DMI_CHECK(header.is_object(), "{}: safetensors header is not a JSON object", path);

  const std::uint8_t* data = map_->data() + 8 + hlen;
  const std::size_t data_size = size - 8 - hlen;
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  std::map<std::pair<std::size_t, std::size_t>, std::string> owner;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const auto& v = it.value();
    if (name == "__metadata__") {
      DMI_CHECK(v.is_object(), "{}: __metadata__ is not an object", path);
      for (auto m = v.begin(); m != v.end(); ++m)
        if (m.value().is_string()) metadata_[m.key()] = m.value().get<std::string>();
      continue;
    }
    DMI_CHECK(v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
              "{}: tensor '{}' lacks dtype, shape or data_offsets", path, name);
    DMI_CHECK(v["dtype"].is_string(), "{}: tensor '{}' dtype is not a string", path, name);
    TensorView t;
    t.name = name;
    t.dtype = parse_dtype(v["dtype"].get<std::string>(), path, name);
    const auto& shp = v["shape"];
    const auto& off = v["data_offsets"];
    DMI_CHECK(shp.is_array(), "{}: tensor '{}' shape is not an array", path, name);
    DMI_CHECK(off.is_array() && off.size() == 2 && off[0].is_number_unsigned() && off[1].is_number_unsigned(),
              "{}: tensor '{}' data_offsets is not [begin, end]", path, name);
    std::size_t numel = 1;
    for (const auto& d : shp) {
      DMI_CHECK(d.is_number_unsigned(), "{}: tensor '{}' has a negative or non-integer dimension", path, name);
      auto n = d.get<std::uint64_t>();
      DMI_CHECK(n == 0 || numel <= std::numeric_limits<std::size_t>::max() / 16 / n,
                "{}: tensor '{}' shape overflows", path, name);
      numel *= n;
      t.shape.push_back(static_cast<std::int64_t>(n));
    }
    auto b = off[0].get<std::uint64_t>(), e = off[1].get<std::uint64_t>();
    DMI_CHECK(b <= e && e <= data_size,
              "{}: tensor '{}' bytes [{}, {}) lie outside the data area ({} bytes): file truncated or header lies",
              path, name, b, e, data_size);
    DMI_CHECK(e - b == numel * dtype_size(t.dtype),
              "{}: tensor '{}' has {} bytes but {} x {} needs {}", path, name, e - b, dtype_name(t.dtype),
              numel, numel * dtype_size(t.dtype));
    t.data = data + b;
    t.nbytes = e - b;
    if (e > b) {
      ranges.emplace_back(b, e);
      owner[{b, e}] = name;
    }
    tensors_.emplace(name, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t i = 1; i < ranges.size(); ++i)
    DMI_CHECK(ranges[i].first >= ranges[i - 1].second, "{}: tensors '{}' and '{}' overlap", path,
              owner[ranges[i - 1]], owner[ranges[i]]);
}

}  // namespace dmi::io
