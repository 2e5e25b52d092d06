#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <cstring>

#include "common/error.h"
#include "io/safetensors.h"
#include "io/weights.h"
#include "test_util.h"

using dmi::io::SafetensorsFile;

namespace {

// A safetensors file from a header (JSON text) and a data area of n bytes.
std::string make_file(const std::string& header, std::size_t data_bytes, std::size_t pad = 0) {
  std::string h = header + std::string(pad, ' ');
  std::uint64_t n = h.size();
  std::string out(reinterpret_cast<const char*>(&n), 8);
  out += h;
  out += std::string(data_bytes, '\0');
  return out;
}

std::string error_of(const std::string& bytes) {
  static const dmi::test::TempDir dir("st");
  const std::string path = dir.path() + "/t.safetensors";
  dmi::test::write_file(path, bytes);
  try {
    SafetensorsFile f(path);
  } catch (const dmi::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("safetensors: a valid file maps its tensors") {
  const dmi::test::TempDir tmp("st-ok");
  const std::string& dir = tmp.path();
  auto bytes = make_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"__metadata__":{"format":"pt"}})", 16);
  float vals[4] = {1, 2, 3, 4};
  std::memcpy(&bytes[bytes.size() - 16], vals, 16);
  dmi::test::write_file(dir + "/model.safetensors", bytes);
  SafetensorsFile f(dir + "/model.safetensors");
  REQUIRE(f.tensors().size() == 1);
  CHECK(f.metadata().at("format") == "pt");
  dmi::io::WeightStore w(dir);
  at::Tensor t = w.get("a", at::kFloat, {2, 2});
  CHECK(t[1][0].item<float>() == 3.0f);
  CHECK(w.views() == 1);  // served from the mapping, no copy
  at::Tensor b = w.get("a", at::kBFloat16, {2, 2});
  CHECK((b.scalar_type() == at::kBFloat16));
  CHECK(w.copies() == 1);
  CHECK_THROWS_WITH_AS(w.get("a", at::kFloat, {4}), doctest::Contains("tensor 'a' has shape [2, 2], config.json implies [4]"),
                       dmi::Error);
  CHECK_THROWS_WITH_AS(w.get("b", at::kFloat, {4}), doctest::Contains("missing tensor 'b'"), dmi::Error);
}

TEST_CASE("safetensors: misaligned 2-byte data is copied, values intact") {
  const dmi::test::TempDir tmp("st-mis");
  const std::string& dir = tmp.path();
  // Header padded so that the data area starts at an odd offset.
  std::string header = R"({"h":{"dtype":"F16","shape":[3],"data_offsets":[0,6]}})";
  if ((8 + header.size()) % 2 == 0) header += " ";
  auto bytes = make_file(header, 6);
  const std::uint16_t halves[3] = {0x3C00, 0x4000, 0xC200};  // 1, 2, -3
  std::memcpy(&bytes[bytes.size() - 6], halves, 6);
  dmi::test::write_file(dir + "/model.safetensors", bytes);
  dmi::io::WeightStore w(dir);
  at::Tensor t = w.get("h", at::kFloat, {3});
  CHECK(t[0].item<float>() == 1.0f);
  CHECK(t[2].item<float>() == -3.0f);
  CHECK(w.copies() == 1);
}

TEST_CASE("safetensors: lying or corrupt headers are rejected with the tensor named") {
  CHECK(error_of("abc").find("too short") != std::string::npos);
  std::string huge(8, '\0');
  std::uint64_t n = 1ull << 40;
  std::memcpy(&huge[0], &n, 8);
  CHECK(error_of(huge + "{}").find("header claims") != std::string::npos);
  std::string beyond(8, '\0');
  n = 1000;
  std::memcpy(&beyond[0], &n, 8);
  CHECK(error_of(beyond + "{}").find("file has only") != std::string::npos);
  CHECK(error_of(make_file("{not json", 0)).find("not valid JSON") != std::string::npos);
  CHECK(error_of(make_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8))
            .find("tensor 'w' bytes [0, 16) lie outside the data area") != std::string::npos);
  CHECK(error_of(make_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,12]}})", 16))
            .find("tensor 'w' has 12 bytes but F32 x 4 needs 16") != std::string::npos);
  CHECK(error_of(make_file(R"({"w":{"dtype":"I4","shape":[4],"data_offsets":[0,2]}})", 2))
            .find("tensor 'w' has dtype 'I4'") != std::string::npos);
  CHECK(error_of(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12))
            .find("tensors 'a' and 'b' overlap") != std::string::npos);
  CHECK(error_of(make_file(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4))
            .find("negative") != std::string::npos);
  CHECK(error_of(make_file(R"({"w":{"dtype":"F32","shape":[1]}})", 4)).find("lacks") != std::string::npos);
}
