// Content hashes that identify a model and its tokenizer, recorded in every
// capture so that a replay can prove it runs the same model.
//
// Small files (config.json, tokenizer.json, tokenizer_config.json) get
// SHA-256; weight files and TorchScript archives get XXH3-128, which hashes
// at memory speed, over the same memory mapping the weights are served from
// (so the file is read once, not twice).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dmi::io {

// "sha256:<64 hex digits>" of a file's bytes; throws dmi::Error naming it.
std::string sha256_file(const std::string& path);
// "xxh3-128:<32 hex digits>" of a buffer, or of a file's bytes.
std::string xxh3_128(const void* data, std::size_t size);
std::string xxh3_128_file(const std::string& path);

// File name (relative to the model) -> "algorithm:hex". std::map keeps the
// JSON form stable.
using Fingerprint = std::map<std::string, std::string>;

// Differences between a recorded and a current fingerprint, one line per
// file ("model.safetensors: content differs (recorded xxh3-128:..., now
// xxh3-128:...)"); empty when equal.
std::vector<std::string> fingerprint_differences(const Fingerprint& recorded, const Fingerprint& now);

}  // namespace dmi::io
