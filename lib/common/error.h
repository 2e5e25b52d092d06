// Errors thrown inside libdmi. Apps turn them into one line on stderr and an
// exit status; the library never exits or prints.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace dmi {

// Bad input from the user (a file, a flag, a prompt): apps exit with status 2.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace dmi

// DMI_CHECK(cond, "tensor {} has shape {}, config says {}", ...): throws
// dmi::Error with the formatted message when cond is false.
#define DMI_CHECK(cond, ...)                                  \
  do {                                                        \
    if (!(cond)) throw ::dmi::Error(::fmt::format(__VA_ARGS__)); \
  } while (0)

#define DMI_FAIL(...) throw ::dmi::Error(::fmt::format(__VA_ARGS__))
