#include "analysis/follow.h"

#include <chrono>
#include <memory>
#include <thread>

#include "common/error.h"

namespace dmi::analysis {

CaptureProgress progress_of(const sink::CaptureFile& f) {
  CaptureProgress p;
  for (const auto& s : f.sites()) p.rows += s.rows;
  for (std::size_t s = 0; s < f.n_sequences(); ++s) p.tokens += static_cast<std::int64_t>(f.tokens(s).size());
  p.status = f.status();
  return p;
}

std::string follow_capture(const std::string& path, const FollowOptions& o,
                           const std::function<void(const sink::CaptureFile&, bool last)>& on_change) {
  const auto pause = std::chrono::duration<double>(o.interval);
  CaptureProgress seen;
  std::string last_note;
  bool first = true;
  double unopenable = 0;
  while (true) {
    std::unique_ptr<sink::CaptureFile> f;
    try {
      f = sink::CaptureFile::open(path);
      unopenable = 0;
    } catch (const Error&) {
      // Its writer holds it exclusively while finishing it; a file that
      // never opens is an error like any other.
      if (first || unopenable >= o.open_retry) throw;
      unopenable += o.interval;
      std::this_thread::sleep_for(pause);
      continue;
    }
    const CaptureProgress now = progress_of(*f);
    const bool last = now.status != "running";
    if (first || now != seen) {
      try {
        on_change(*f, last);
        seen = now;
        first = false;
      } catch (const Error& e) {
        if (last) throw;
        if (o.note && e.what() != last_note) o.note(e.what());
        last_note = e.what();
      }
    }
    if (last) return now.status;
    f.reset();
    std::this_thread::sleep_for(pause);
  }
}

}  // namespace dmi::analysis
