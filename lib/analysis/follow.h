// Reading a capture while dmi-run writes it (dmi-inspect --follow): the file
// is reopened as an SWMR reader every interval, and the caller is shown it
// whenever its rows, tokens or status changed, until the status leaves
// "running".
#pragma once

#include <functional>
#include <string>

#include "sink/capture_file.h"

namespace dmi::analysis {

struct FollowOptions {
  double interval = 0.5;  // seconds between polls
  // How long a file that cannot be opened (its writer is between closing it
  // as an SWMR writer and reopening it to finish it) is retried.
  double open_retry = 30;
  // Told, once per distinct message, why a look showed nothing yet.
  std::function<void(const std::string&)> note;
};

// What changed between two looks at a capture.
struct CaptureProgress {
  std::int64_t rows = 0;    // all sites' rows
  std::int64_t tokens = 0;  // all sequences' tokens
  std::string status;
  bool operator==(const CaptureProgress& o) const {
    return rows == o.rows && tokens == o.tokens && status == o.status;
  }
  bool operator!=(const CaptureProgress& o) const { return !(*this == o); }
};
CaptureProgress progress_of(const sink::CaptureFile& f);

// Calls on_change(file, last) for the first look and for every later one
// that differs; returns the final status (anything but "running": complete,
// interrupted, failed, or killed when the writer died). Errors that the
// running capture may outgrow (rows not there yet) are retried while the
// capture runs; a final look's errors propagate.
std::string follow_capture(const std::string& path, const FollowOptions& o,
                           const std::function<void(const sink::CaptureFile&, bool last)>& on_change);

}  // namespace dmi::analysis
