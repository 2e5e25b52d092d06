// A real tokenizer (the embedded default model's byte-level BPE, or
// $DMI_FUZZ_TOKENIZER) encoding fuzzed text and decoding fuzzed ids.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "io/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const auto tok = [] {
    const char* p = std::getenv("DMI_FUZZ_TOKENIZER");
    return std::make_unique<dmi::io::Tokenizer>(
        dmi::io::Tokenizer::load(p ? p : DMI_SOURCE_DIR "/data/default-model/tokenizer.json"));
  }();
  const std::string text(reinterpret_cast<const char*>(data), size);
  dmi::fuzz::expect_ok_or_error([&] {
    const auto ids = tok->encode(text, size % 2 == 0);
    const std::string back = tok->decode(ids, false);
    (void)back;
  });
  // The same bytes as token ids (in and out of the vocabulary).
  std::vector<std::int32_t> ids;
  for (std::size_t i = 0; i + 4 <= size; i += 4) {
    std::int32_t v;
    std::memcpy(&v, data + i, 4);
    ids.push_back(v);
  }
  dmi::fuzz::expect_ok_or_error([&] { (void)tok->decode(ids, true); });
  return 0;
}
