// A prompts file (text lines or JSON Lines), and --prompt-ids lists.
#include <string>

#include "engine/prompts.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dmi::fuzz::TempFile f(data, size, ".txt");
  dmi::fuzz::expect_ok_or_error([&] { dmi::engine::read_prompts_file(f.path()); });
  const std::string text(reinterpret_cast<const char*>(data), size);
  dmi::fuzz::expect_ok_or_error([&] { dmi::engine::parse_id_list(text); });
  return 0;
}
