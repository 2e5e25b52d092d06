// The app boundary shared by dmi's tools: library exceptions become one line
// on stderr and an exit status; nothing else in dmi exits.
#pragma once

#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "common/error.h"

namespace dmi::apps {

// Parses argv; on --help prints and returns 0, on a bad flag prints one line
// and returns 2; returns -1 when the tool should go on.
inline int parse_args(const char* tool, CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return -1;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "%s: error: %s (see --help)\n", tool, e.what());
    return 2;
  }
}

// Runs body(); dmi::Error (bad input) -> status 2, anything else ->
// internal_status (1, or 2 for tools whose 1 means something else).
template <typename F>
int guarded(const char* tool, F&& body, int internal_status = 1) {
  try {
    return body();
  } catch (const dmi::Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", tool, e.what());
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", tool, e.what_without_backtrace());
    return internal_status;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", tool, e.what());
    return internal_status;
  }
}

}  // namespace dmi::apps
