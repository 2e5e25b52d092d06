// engine/progress: the progress line's text.
#include <doctest/doctest.h>

#include "engine/progress.h"

using dmi::engine::format_progress;
using dmi::engine::Progress;

TEST_CASE("progress line: units, rate, ETA from tokens, writer fields") {
  Progress p;
  p.total = 8;
  p.done = 2;
  CHECK(format_progress(p, "runs", 10.0) == "2/8 runs, ETA 0:30");  // 1/4 done in 10 s
  p.tokens = 300;
  p.expected_tokens = 600;  // half the tokens: the ETA follows them, not the units
  CHECK(format_progress(p, "sequences", 10.0) == "2/8 sequences, 30.0 tok/s, ETA 0:10");
  p.bytes_written = 12'345'678;
  p.ring_fill = 0.04;
  p.dropped = 3;
  CHECK(format_progress(p, "sequences", 10.0) ==
        "2/8 sequences, 30.0 tok/s, ETA 0:10, 12.3 MB written, ring 4%, 3 dropped");
  p.done = 8;
  CHECK(format_progress(p, "sequences", 3725.0) ==
        "8/8 sequences, 0.1 tok/s, 1:02:05 elapsed, 12.3 MB written, ring 4%, 3 dropped");
  Progress fresh;
  fresh.total = 4;
  CHECK(format_progress(fresh, "sequences", 0.0) == "0/4 sequences, ETA -");
}
