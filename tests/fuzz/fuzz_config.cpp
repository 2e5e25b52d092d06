// config.json: the HF architectures dmi runs, and the generic reader
// TorchScript models use.
#include <string>

#include "fuzz_util.h"
#include "io/config.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  dmi::fuzz::expect_ok_or_error([&] { dmi::io::parse_config(text, "config.json"); });
  dmi::fuzz::expect_ok_or_error([&] { dmi::io::parse_generic_config(text, "config.json"); });
  return 0;
}
