#include "sink/liveness.h"

#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace dmi::sink {

namespace {

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "";
  return buf;
}

std::string boot_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(f, id);
  return id;
}

// Field 22 of /proc/PID/stat: the process's start time in clock ticks after
// boot; "" when there is no such process, or it has exited (a zombie).
std::string start_ticks(long pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return "";
  const auto paren = line.rfind(')');  // the command name may hold spaces
  if (paren == std::string::npos) return "";
  std::istringstream rest(line.substr(paren + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i == 3 && (field == "Z" || field == "X")) return "";
    if (i == 22) return field;
  }
  return "";
}

}  // namespace

std::string writer_record() {
  const long pid = static_cast<long>(::getpid());
  return nlohmann::json{{"host", host_name()}, {"boot_id", boot_id()}, {"pid", pid}, {"start_ticks", start_ticks(pid)}}
      .dump();
}

std::optional<bool> writer_alive(const std::string& record) {
  const auto j = nlohmann::json::parse(record, nullptr, false);
  if (!j.is_object() || !j.contains("pid") || !j["pid"].is_number_integer()) return std::nullopt;
  if (j.value("host", std::string()) != host_name()) return std::nullopt;
  if (j.value("boot_id", std::string()) != boot_id()) return false;  // rebooted since
  const std::string ticks = start_ticks(j["pid"].get<long>());
  return !ticks.empty() && ticks == j.value("start_ticks", std::string());
}

}  // namespace dmi::sink
