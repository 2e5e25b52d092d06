// model.safetensors.index.json next to one valid shard: the weight map.
#include <fstream>
#include <string>

#include "fuzz_util.h"
#include "io/weights.h"

namespace {
// A shard with one F32 tensor "w" [2].
const std::string& shard() {
  static const std::string s = [] {
    const std::string header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
    std::string out(8, '\0');
    const std::uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return out + header + std::string(8, '\0');
  }();
  return s;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string dir = [] {
    std::string d = "/dev/shm/dmi-fuzz-index-" + std::to_string(::getpid());
    ::mkdir(d.c_str(), 0700);
    std::ofstream(d + "/model-00001-of-00001.safetensors", std::ios::binary) << shard();
    return d;
  }();
  {
    std::ofstream idx(dir + "/model.safetensors.index.json", std::ios::binary);
    idx.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  dmi::fuzz::expect_ok_or_error([&] {
    dmi::io::WeightStore w(dir);
    (void)w.has("w");
  });
  return 0;
}
