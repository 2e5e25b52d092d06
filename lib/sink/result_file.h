// Small HDF5 files of analysis results (dmi-patch's sweeps), and the result
// tables monitors add to a capture: float64
// datasets, string datasets and attributes, written under PATH.partial and
// renamed into place by close(), so a killed or failed run never leaves a
// half-written result where a finished one is expected.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "sink/sink.h"

namespace dmi::sink {

// Writes /GROUP (parents created), its text attributes and its columns into
// an open HDF5 file (hid_t): a capture's /monitors tables at close. Errors
// name path.
void write_result_table(std::int64_t file, const ResultTable& t, const std::string& path);

class ResultFile {
 public:
  // Refuses an existing path unless overwrite; errors name the path.
  ResultFile(const std::string& path, bool overwrite);
  ~ResultFile();  // without close(): the partial file is removed
  ResultFile(const ResultFile&) = delete;
  ResultFile& operator=(const ResultFile&) = delete;

  // Attributes on an object ("/" or a group or dataset written before).
  void attr(const std::string& object, const std::string& name, const std::string& text);
  void attr(const std::string& object, const std::string& name, double value);
  void attr(const std::string& object, const std::string& name, std::int64_t value);
  // A float64 dataset of t's shape ("/patch/z/raw"); parent groups are created.
  void dataset(const std::string& path, const at::Tensor& t);
  void strings(const std::string& path, const std::vector<std::string>& values);
  // Flushes, closes and renames PATH.partial to PATH.
  void close();

 private:
  std::string path_, partial_;
  std::int64_t file_ = -1;  // hid_t
};

}  // namespace dmi::sink
