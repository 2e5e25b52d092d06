// Progress of a long run on stderr: one live line on a terminal, plain
// periodic lines otherwise (dmi-run, dmi-bench, dmi-patch; -q turns it off).
// The run updates a Progress's counters (atomics, from any thread); the
// ProgressLine's own thread reads them and prints, so the forward pass never
// waits on the terminal.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>

namespace dmi::engine {

struct Progress {
  std::atomic<std::uint64_t> done{0}, total{0};  // units: sequences, patched runs, bench runs
  std::atomic<std::int64_t> tokens{0};           // tokens generated so far (tok/s); 0: not shown
  // Upper bound of the tokens of the whole job: with it, the ETA follows the
  // tokens rather than the (coarser) units.
  std::atomic<std::int64_t> expected_tokens{0};
  // A capture's writer: bytes that reached the sink, ring fill (0..1) and
  // records dropped; negative: no capture (not shown).
  std::atomic<std::int64_t> bytes_written{-1};
  std::atomic<double> ring_fill{-1.0};
  std::atomic<std::int64_t> dropped{-1};
};

// One progress line (no newline, no terminal codes): "3/8 sequences, 41.2
// tok/s, ETA 0:12, 12.3 MB written, ring 4%, 0 dropped".
std::string format_progress(const Progress& p, const std::string& unit, double elapsed_seconds);

struct ProgressOptions {
  bool enabled = true;       // false: -q
  int tty = -1;              // -1: isatty(out)
  double interval = -1;      // seconds between lines; -1: 0.25 on a terminal, 10 otherwise
  std::FILE* out = stderr;
};

class ProgressLine {
 public:
  // tool: the line's prefix ("dmi-run"); unit: what done/total count.
  ProgressLine(std::string tool, std::string unit, const Progress& p, ProgressOptions o = {});
  ~ProgressLine();
  // Stops the thread; on a terminal where a line was shown, prints the final
  // state and ends the line. Idempotent.
  void stop();

 private:
  void loop();
  std::string tool_, unit_;
  const Progress& p_;
  ProgressOptions o_;
  double start_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool shown_ = false;  // a line was printed
  std::thread thread_;
};

}  // namespace dmi::engine
