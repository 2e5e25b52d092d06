// The app boundary shared by dmi's tools: library exceptions become one line
// on stderr and an exit status; nothing else in dmi exits.
#pragma once

#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "common/error.h"
#include "completion.h"
#include "engine/progress.h"

namespace dmi::apps {

// Numeric flag checks whose errors say what is allowed in words
// ("--batch-size: must be at least 1 (got 0)"), unlike CLI11's range
// validators, which print the limits of a double.
inline CLI::Validator number_check(double lo, double hi, bool lo_open, const std::string& words) {
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        double v = 0;
        try {
          std::size_t used = 0;
          v = std::stod(s, &used);
          if (used != s.size()) return "'" + s + "' is not a number";
        } catch (const std::exception&) {
          return "'" + s + "' is not a number";
        }
        if ((lo_open ? !(v > lo) : !(v >= lo)) || !(v <= hi)) return "must be " + words + " (got " + s + ")";
        return std::string();
      },
      words);
}
inline const CLI::Validator kAtLeastOne = number_check(1, 1e300, false, "at least 1");
inline const CLI::Validator kPositive = number_check(0, 1e300, true, "greater than 0");
inline const CLI::Validator kNonNegative = number_check(0, 1e300, false, "0 or more");

// SIGINT and SIGTERM set g_stop (the tools stop after the current step and
// keep what they have); stopped_status() is the exit status a shell reports
// for that signal: 130 for Ctrl-C, 143 for SIGTERM.
inline std::atomic<bool> g_stop{false};
inline std::atomic<int> g_signal{0};
inline void on_stop_signal(int sig) {
  g_signal.store(sig);
  g_stop.store(true);
}
inline void install_stop_signals() {
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
}
inline int stopped_status() { return 128 + (g_signal.load() ? g_signal.load() : SIGINT); }

#ifdef DMI_SOURCE_DIR
// The embedded default model (data/default-model), or $DMI_DEFAULT_MODEL.
inline std::string default_model_dir() {
  if (const char* env = std::getenv("DMI_DEFAULT_MODEL")) return env;
  return std::string(DMI_SOURCE_DIR) + "/data/default-model";
}
#endif

// Parses argv; on --help or --version ("dmi-run 0.1.0") prints and returns 0,
// on a bad flag prints one line and returns 2; returns -1 when the tool
// should go on.
inline int parse_args(const char* tool, CLI::App& app, int argc, char** argv) {
  app.set_version_flag("--version", std::string(tool) + " " + DMI_VERSION, "print the tool's name and version, and exit");
  std::string shell;
  app.add_option("--completion", shell,
                 std::string("print a completion script for the shell, and exit: source <(") + tool +
                     " --completion bash)")
      ->check(CLI::IsMember({"bash"}));
  // Before parsing: a completion script needs none of the required flags.
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg != "--completion" && arg.rfind("--completion=", 0) != 0) continue;
    shell = arg == "--completion" ? (i + 1 < argc ? argv[i + 1] : "") : arg.substr(13);
    if (shell != "bash") {
      std::fprintf(stderr, "%s: error: --completion: '%s' is not a supported shell (bash) (see --help)\n", tool,
                   shell.c_str());
      return 2;
    }
    std::fputs(bash_completion(app, tool).c_str(), stdout);
    return 0;
  }
  try {
    app.parse(argc, argv);
    return -1;
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "%s: error: %s (see --help)\n", tool, e.what());
    return 2;
  }
}

// -q and --progress-every: progress on stderr, a live line on a terminal
// (updated every 0.25 s), else a plain line every 10 s; --progress-every
// sets either interval (engine/progress.h).
inline void add_progress_every(CLI::App& app, double& every,
                               const std::string& help = "seconds between progress lines when stderr is not a "
                                                         "terminal (default 10), or between updates of the live "
                                                         "line on a terminal (default 0.25)") {
  app.add_option("--progress-every", every, help)->check(kPositive);
}
inline engine::ProgressOptions progress_options(bool quiet, double every) {
  engine::ProgressOptions o;
  o.enabled = !quiet;
  if (every > 0) o.interval = every;
  return o;
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
