// The dmi-capture HDF5 file (format "dmi-capture", version 2); the layout is
// documented in docs/capture-format.md and schemas/dmi-capture.schema.json.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "sink/sink.h"

namespace dmi::sink {

// Version 2 added the run record (model fingerprint, settings, environment,
// batch composition) that replay needs; readers accept 1 and 2.
constexpr int kCaptureFormatVersion = 2;
constexpr int kOldestReadableFormatVersion = 1;

struct Hdf5Options {
  // "none", "gzip:N" (N = 1..9) or "shuffle+gzip:N": filters every HDF5
  // reader (h5py included) has without plugins.
  std::string compression = "none";
  // Seconds between flushes: every row written before a flush survives a
  // SIGKILL and is visible to live (SWMR) readers.
  double flush_every = 1.0;
};

// Creates the file at once (truncating) with status "running", as an HDF5
// SWMR writer (single writer, multiple readers): readers may open it while
// it grows. close() gives it its final status.
std::unique_ptr<Sink> make_hdf5_sink(const std::string& path, const RunInfo& info, const Hdf5Options& options);

// Checks a --compression value; throws dmi::Error naming it.
void validate_compression(const std::string& compression);

// Closes a capture whose writer died before closing it (status "running",
// writer gone): clears HDF5's open-for-writing flag, so any HDF5 reader
// opens it, gives every site the rows all its tables hold, writes
// /sequences from the token log (finish_reason "killed"; generated text via
// `decode` when given) and sets status "killed". Throws dmi::Error naming the
// file when it is not such a capture (complete, or its writer still runs).
struct RecoverResult {
  std::size_t sequences = 0, tokens = 0, sites = 0;
  std::int64_t rows = 0;
};
RecoverResult recover_capture(const std::string& path,
                              const std::function<std::string(const std::vector<std::int32_t>&)>& decode = {});

}  // namespace dmi::sink
