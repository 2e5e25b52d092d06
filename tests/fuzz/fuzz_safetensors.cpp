// A safetensors file: header length, JSON header, dtypes, shapes, offsets.
#include "fuzz_util.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dmi::fuzz::TempFile f(data, size, ".safetensors");
  dmi::fuzz::expect_ok_or_error([&] {
    dmi::io::SafetensorsFile st(f.path());
    std::size_t bytes = 0;
    for (const auto& [name, view] : st.tensors()) {
      // Every byte a view claims must be inside the mapping (ASan checks).
      volatile std::uint8_t sink = 0;
      if (view.nbytes) sink ^= view.data[0] ^ view.data[view.nbytes - 1];
      bytes += view.nbytes + name.size();
    }
    (void)bytes;
  });
  return 0;
}
