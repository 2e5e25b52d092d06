// tokenizer.json: loaded, then a fixed text encoded and decoded with it.
#include <string>

#include "fuzz_util.h"
#include "io/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  dmi::fuzz::expect_ok_or_error([&] {
    auto tok = dmi::io::Tokenizer::parse(text, "tokenizer.json");
    const auto ids = tok.encode("Hello, wörld! 12345  tabs\tand\nnewlines 你好 <|endoftext|>", true);
    (void)tok.decode(ids, false);
    (void)tok.decode(ids, true);
  });
  return 0;
}
