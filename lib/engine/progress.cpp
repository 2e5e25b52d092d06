#include "engine/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>

namespace dmi::engine {

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string clock_text(double seconds) {
  const long s = std::lround(seconds);
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}
}  // namespace

std::string format_progress(const Progress& p, const std::string& unit, double elapsed) {
  const std::uint64_t done = p.done.load(), total = p.total.load();
  const std::int64_t tokens = p.tokens.load(), expected = p.expected_tokens.load();
  std::string s = fmt::format("{}/{} {}", done, total, unit);
  if (tokens > 0 && elapsed > 0) s += fmt::format(", {:.1f} tok/s", tokens / elapsed);
  // Fraction of the work done: the units, or the tokens when they say more
  // (a batch's sequences finish together).
  double f = total ? static_cast<double>(done) / static_cast<double>(total) : 0.0;
  if (expected > 0) f = std::max(f, std::min(1.0, static_cast<double>(tokens) / static_cast<double>(expected)));
  if (done >= total && total) {
    s += fmt::format(", {} elapsed", clock_text(elapsed));
  } else if (f > 0 && elapsed > 0) {
    s += fmt::format(", ETA {}", clock_text(elapsed * (1 - f) / f));
  } else {
    s += ", ETA -";
  }
  if (const std::int64_t b = p.bytes_written.load(); b >= 0) s += fmt::format(", {:.1f} MB written", b / 1e6);
  if (const double r = p.ring_fill.load(); r >= 0) s += fmt::format(", ring {:.0f}%", 100 * r);
  if (const std::int64_t d = p.dropped.load(); d >= 0) s += fmt::format(", {} dropped", d);
  return s;
}

ProgressLine::ProgressLine(std::string tool, std::string unit, const Progress& p, ProgressOptions o)
    : tool_(std::move(tool)), unit_(std::move(unit)), p_(p), o_(o), start_(now()) {
  if (!o_.enabled) return;
  if (o_.tty < 0) o_.tty = ::isatty(::fileno(o_.out)) ? 1 : 0;
  if (o_.interval <= 0) o_.interval = o_.tty ? 0.25 : 10.0;
  thread_ = std::thread([this] { loop(); });
}

ProgressLine::~ProgressLine() { stop(); }

void ProgressLine::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, std::chrono::duration<double>(o_.interval), [&] { return stopping_; })) {
    const std::string line = format_progress(p_, unit_, now() - start_);
    if (o_.tty)
      std::fprintf(o_.out, "\r\033[K%s: %s", tool_.c_str(), line.c_str());  // rewrite the line in place
    else
      std::fprintf(o_.out, "%s: %s\n", tool_.c_str(), line.c_str());
    std::fflush(o_.out);
    shown_ = true;
  }
}

void ProgressLine::stop() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
  if (o_.tty && shown_) {  // the last state stays on screen
    std::fprintf(o_.out, "\r\033[K%s: %s\n", tool_.c_str(), format_progress(p_, unit_, now() - start_).c_str());
    std::fflush(o_.out);
  }
}

}  // namespace dmi::engine
