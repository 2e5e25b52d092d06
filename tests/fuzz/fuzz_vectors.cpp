// Steering-vector files: dmi safetensors, llama.cpp GGUF, HDF5 (by content).
#include "fuzz_util.h"
#include "io/vectors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dmi::fuzz::TempFile f(data, size, ".vec");
  dmi::fuzz::expect_ok_or_error([&] { dmi::io::load_steering_vectors(f.path()); });
  dmi::fuzz::expect_ok_or_error([&] { dmi::io::load_steering_vectors(f.path(), 192, 4); });
  return 0;
}
