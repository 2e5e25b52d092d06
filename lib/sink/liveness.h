// Whether the process writing a capture is still running. A capture in
// progress has status "running" and a root attribute "writer" naming its
// process (host, boot, pid and the pid's start time, so a reused pid is not
// mistaken for the writer). A reader on the same host can then tell a live
// run from one that was killed before it closed its file.
#pragma once

#include <optional>
#include <string>

namespace dmi::sink {

// This process, as JSON text for the "writer" attribute.
std::string writer_record();

// true: the writer named by `record` is running; false: it is gone (killed,
// crashed, power lost); nullopt: it ran on another host (or the record is
// unreadable), so this host cannot tell.
std::optional<bool> writer_alive(const std::string& record);

}  // namespace dmi::sink
