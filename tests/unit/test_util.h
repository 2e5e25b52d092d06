// Shared helpers for dmi's unit tests.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace dmi::test {

// Source tree root (for committed fixtures and npm-fetched tokenizers).
inline std::string source_dir() {
  const char* s = std::getenv("DMI_SOURCE_DIR");
  return s ? s : DMI_SOURCE_DIR_DEFAULT;
}

// Directory written by scripts/make_test_models.py (CTest fixture).
inline std::string test_models_dir() {
  const char* s = std::getenv("DMI_TEST_MODELS");
  return s ? s : DMI_TEST_MODELS_DEFAULT;
}

inline const std::vector<std::string>& test_model_names() {
  static const std::vector<std::string> names = {"llama-gqa-f32",       "llama-mha-tied-bf16-sharded",
                                                 "mistral-window-bf16-sharded", "qwen2-bias-tied-f16",
                                                 "qwen3-qknorm-bf16-misaligned", "qwen3-untied-f32"};
  return names;
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot read " + path);
  return nlohmann::json::parse(f);
}

// A fresh directory under /tmp, removed with everything in it when the
// object goes (repeated test runs leave nothing behind).
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    std::string tmpl = "/tmp/dmi-test-" + tag + "-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (!mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed");
    path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace dmi::test
