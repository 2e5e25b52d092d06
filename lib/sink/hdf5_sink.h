// The dmi-capture HDF5 file (format "dmi-capture", version 2); the layout is
// documented in docs/capture-format.md and schemas/dmi-capture.schema.json.
#pragma once

#include <memory>
#include <string>

#include "sink/sink.h"

namespace dmi::sink {

// Version 2 added the run record (model fingerprint, settings, environment,
// batch composition) that replay needs; readers accept 1 and 2.
constexpr int kCaptureFormatVersion = 2;
constexpr int kOldestReadableFormatVersion = 1;

// compression: "none", "gzip:N" (N = 1..9) or "shuffle+gzip:N": filters
// every HDF5 reader (h5py included) has without plugins.
// Creates the file at once (truncating), with status "failed" until close().
std::unique_ptr<Sink> make_hdf5_sink(const std::string& path, const RunInfo& info, const std::string& compression);

// Checks a --compression value; throws dmi::Error naming it.
void validate_compression(const std::string& compression);

}  // namespace dmi::sink
