// Shared by the libFuzzer targets (tests/fuzz/README.md).
//
// A target feeds one input to one parser. dmi::Error is the parser saying
// "bad input" (the apps' exit 2): expected. Anything else escaping -- another
// exception, a crash, a sanitizer report, a leak, a hang -- is a finding.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/error.h"

namespace dmi::fuzz {

// The input as a file (parsers that take a path), in memory-backed /dev/shm.
class TempFile {
 public:
  TempFile(const std::uint8_t* data, std::size_t size, const char* suffix = "") {
    static const std::string dir = [] {
      std::string d = (::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
      return d + "/dmi-fuzz-" + std::to_string(::getpid());
    }();
    static const bool made = (::mkdir(dir.c_str(), 0700), true);
    (void)made;
    path_ = dir + "/input" + suffix;
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) std::abort();
    for (std::size_t off = 0; off < size;) {
      const ssize_t n = ::write(fd, data + off, size - off);
      if (n <= 0) std::abort();
      off += static_cast<std::size_t>(n);
    }
    ::close(fd);
  }
  ~TempFile() { ::unlink(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Runs f; dmi::Error is an expected rejection.
template <typename F>
void expect_ok_or_error(F&& f) {
  try {
    f();
  } catch (const dmi::Error&) {
  }
}

}  // namespace dmi::fuzz
