// Online monitors (dmi-run --monitor SPEC): they read captured rows on the
// ring's writer thread, never the forward thread, as a Sink in front of the
// capture's sink. Each result is a JSON line (stderr or --monitor-log) as
// soon as it is known, and a table under /monitors/<name> in the capture
// when it closes (docs/monitors.md).
//
//   attn-tracker:heads=FILE,inst=SPAN,data=SPAN[,threshold=0.5][,name=N]
//   attn-entropy[:layers=L][,window=16][,threshold=0.5][,name=N]
//   resid-norm[:site=resid_post][,layers=L][,z=4][,warmup=32][,name=N]
//
// The Attention Tracker's offline twin is in dmi-inspect
// (analysis/attn_tracker.h): both compute with the same function over the
// same stored values, so they agree bit for bit.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "io/tokenizer.h"
#include "sink/sink.h"

namespace dmi::analysis {

struct MonitorSetup {
  std::vector<std::string> specs;  // --monitor values, in order
  std::string log_path;            // --monitor-log; empty: stderr
  // Each sequence's prompt (the last prompt position; marker spans).
  std::vector<std::vector<std::int32_t>> prompts;
  const io::Tokenizer* tokenizer = nullptr;  // for marker spans
  // What the capture stores: its streams and whether prompt positions
  // (--tokens all, prompt or last-prompt) and generated ones (all,
  // generated) are captured.
  std::vector<sink::StreamInfo> streams;
  bool prompt_rows = true, generated_rows = true;
};

// Checks every spec (its grammar, files, spans, and that the capture holds
// the sites it reads), then makes the capture's sink with make_inner and
// wraps it (returns it unwrapped without specs). Throws dmi::Error naming
// the spec before make_inner is called: a bad spec creates no file.
std::unique_ptr<sink::Sink> make_monitor_sink(const std::function<std::unique_ptr<sink::Sink>()>& make_inner,
                                              const MonitorSetup& setup);

// The grammar alone, for errors before the model loads.
void check_monitor_syntax(const std::string& spec);

}  // namespace dmi::analysis
