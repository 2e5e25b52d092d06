// Memory-mapped, validated safetensors files.
//
// A file is validated before anything is trusted: header length within the
// file and below kMaxHeaderBytes, well-formed JSON, known dtypes, every
// tensor's byte range inside the data area with end - begin equal to
// dtype size x product(shape), and no two tensors overlapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dmi::io {

enum class DType { F32, F16, BF16 };
const char* dtype_name(DType d);
std::size_t dtype_size(DType d);

// A read-only (copy-on-write) mapping of a whole file.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

struct TensorView {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  const std::uint8_t* data;  // inside the mapping; may be misaligned
  std::size_t nbytes;
};

class SafetensorsFile {
 public:
  static constexpr std::size_t kMaxHeaderBytes = 100u << 20;

  explicit SafetensorsFile(const std::string& path);
  const std::string& path() const { return map_->path(); }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Keeps the mapping alive for as long as a tensor wraps its memory.
  std::shared_ptr<const MappedFile> mapping() const { return map_; }

 private:
  std::shared_ptr<MappedFile> map_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace dmi::io
