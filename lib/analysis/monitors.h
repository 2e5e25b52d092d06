// Online monitors (dmi-run --monitor SPEC): they read captured rows on the
// ring's writer thread, never the forward thread, as a Sink in front of the
// capture's sink. Each result is a JSON line (stderr or --monitor-log) as
// soon as it is known, and a table under /monitors/<name> in the capture
// when it closes (docs/monitors.md).
//
//   attn-tracker:heads=FILE,inst=SPAN,data=SPAN[,threshold=0.5][,name=N][,action=log|stop]
//   attn-entropy[:layers=L][,window=16][,threshold=0.5][,name=N][,action=log|stop]
//   resid-norm[:site=resid_post][,layers=L][,z=4][,warmup=32][,name=N][,action=log|stop]
//
// action=stop ends a flagged sequence (finish_reason "monitor"): the
// generator reads the flag between tokens, so the stop lands a few tokens
// after the flagged one, as soon as the writer has seen its rows.
//
// The Attention Tracker's offline twin is in dmi-inspect
// (analysis/attn_tracker.h): both compute with the same function over the
// same stored values, so they agree bit for bit.
#pragma once

#include <atomic>
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
  // One flag per sequence; monitors with action=stop set a flagged
  // sequence's (the generator ends it, finish_reason "monitor").
  std::atomic<bool>* stop_flags = nullptr;
};

// Checks every spec (its grammar, files, spans, and that the capture holds
// the sites it reads), then makes the capture's sink with make_inner and
// wraps it (returns it unwrapped without specs). Throws dmi::Error naming
// the spec before make_inner is called: a bad spec creates no file.
std::unique_ptr<sink::Sink> make_monitor_sink(const std::function<std::unique_ptr<sink::Sink>()>& make_inner,
                                              const MonitorSetup& setup);

// The grammar alone, for errors before the model loads.
void check_monitor_syntax(const std::string& spec);
// Whether the spec has action=stop.
bool monitor_stops(const std::string& spec);

}  // namespace dmi::analysis
