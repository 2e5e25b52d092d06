#include "io/fingerprint.h"

#include <openssl/evp.h>
#include <xxhash.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <vector>

#include "common/error.h"
#include "io/safetensors.h"

namespace dmi::io {

namespace {

std::string hex(const unsigned char* p, std::size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (std::size_t i = 0; i < n; ++i) {
    s[2 * i] = digits[p[i] >> 4];
    s[2 * i + 1] = digits[p[i] & 15];
  }
  return s;
}

}  // namespace

std::string sha256_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DMI_CHECK(f, "{}: cannot read (for the model fingerprint)", path);
  std::unique_ptr<EVP_MD_CTX, void (*)(EVP_MD_CTX*)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  DMI_CHECK(ctx && EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) == 1, "SHA-256 is unavailable (OpenSSL)");
  std::vector<char> buf(1 << 16);
  while (f) {
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    if (f.gcount() > 0) EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<std::size_t>(f.gcount()));
  }
  DMI_CHECK(f.eof(), "{}: read error (for the model fingerprint)", path);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_DigestFinal_ex(ctx.get(), md, &n);
  return "sha256:" + hex(md, n);
}

std::string xxh3_128(const void* data, std::size_t size) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits(data, size));
  return "xxh3-128:" + hex(c.digest, sizeof c.digest);
}

std::string xxh3_128_file(const std::string& path) {
  MappedFile m(path);
  return xxh3_128(m.data(), m.size());
}

std::vector<std::string> fingerprint_differences(const Fingerprint& recorded, const Fingerprint& now) {
  std::vector<std::string> out;
  for (const auto& [file, hash] : recorded) {
    auto it = now.find(file);
    if (it == now.end()) out.push_back(fmt::format("{}: recorded in the capture, absent now", file));
    else if (it->second != hash)
      out.push_back(fmt::format("{}: content differs (recorded {}, now {})", file, hash, it->second));
  }
  for (const auto& [file, hash] : now)
    if (!recorded.count(file)) out.push_back(fmt::format("{}: present now, not in the capture's record", file));
  return out;
}

}  // namespace dmi::io
