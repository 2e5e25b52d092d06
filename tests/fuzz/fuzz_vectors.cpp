// Steering-vector files, by content: dmi safetensors and llama.cpp GGUF as
// raw bytes (dmi's own parsers), HDF5 vector files built from the input
// through HDF5's API (h5_builder.h; byte-mutated HDF5 would fuzz HDF5's
// parser, not dmi's). The first byte chooses.
#include <string>

#include "fuzz_util.h"
#include "h5_builder.h"
#include "io/vectors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  static const bool limits = (H5set_free_list_limits(-1, -1, -1, -1, -1, -1), true);  // as in fuzz_capture.cpp
  (void)limits;
  if (data[0] & 1) {
    FuzzedDataProvider in(data + 1, size - 1);
    static const std::string path = "/dev/shm/dmi-fuzz-vectors-" + std::to_string(::getpid()) + ".h5";
    {
      dmi::fuzz::H5Builder b(in, path);
      if (b.file() < 0) return 0;
      const int n = in.ConsumeIntegralInRange(0, 4);
      for (int i = 0; i < n; ++i) {
        const std::string name = b.pick_text({"direction.1", "direction.2", "direction.0", "target.1", "target.3"});
        if (name.empty() || name.find('/') != std::string::npos || name == ".") continue;
        b.dataset(b.file(), name, 1, 192);
      }
    }
    dmi::fuzz::expect_ok_or_error([&] { dmi::io::load_steering_vectors(path); });
    dmi::fuzz::expect_ok_or_error([&] { dmi::io::load_steering_vectors(path, 192, 4); });
    ::unlink(path.c_str());
    return 0;
  }
  if (size >= 9 && std::string(reinterpret_cast<const char*>(data) + 1, 8) == "\x89HDF\r\n\x1a\n") return 0;
  dmi::fuzz::TempFile f(data + 1, size - 1, ".vec");
  dmi::fuzz::expect_ok_or_error([&] { dmi::io::load_steering_vectors(f.path()); });
  dmi::fuzz::expect_ok_or_error([&] { dmi::io::load_steering_vectors(f.path(), 192, 4); });
  return 0;
}
