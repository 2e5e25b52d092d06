#include "ring/ring.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cstring>
#include <ctime>

#include "common/error.h"
#include "sink/sink.h"

namespace dmi::ring {

namespace {
constexpr std::size_t kAlign = 64;
constexpr std::uint64_t kWakeRecords = 64;
constexpr auto kWriterPeriod = std::chrono::milliseconds(20);
std::size_t round_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
}  // namespace

CpuRing::CpuRing(std::size_t arena_bytes, std::size_t max_records, OnFull on_full, std::size_t n_streams,
                 sink::Sink& sink)
    : arena_(new std::uint8_t[round_up(arena_bytes)]), arena_size_(round_up(arena_bytes)), records_(max_records), on_full_(on_full), sink_(sink) {
  DMI_CHECK(arena_bytes >= kAlign && max_records > 0, "ring needs a non-empty arena and record ring");
  stats_.dropped_per_stream.assign(n_streams, 0);
  writer_ = std::thread([this] { writer_loop(); });
}

CpuRing::~CpuRing() {
  try {
    drain();
  } catch (...) {
  }
}

bool CpuRing::push(const RecordMeta& meta, const std::vector<std::int64_t>& row_shape, at::ScalarType dtype,
                   const std::function<void(at::Tensor&)>& fill) {
  std::int64_t per_row = 1;
  for (auto d : row_shape) per_row *= d;
  const std::size_t data_bytes = static_cast<std::size_t>(per_row) * meta.rows * c10::elementSize(dtype);
  const std::size_t header = round_up(2 * sizeof(std::int32_t) * meta.rows);
  const std::size_t need = round_up(header + data_bytes);
  const std::size_t cap = arena_size_;

  std::uint64_t offset = 0;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (writer_error_) std::rethrow_exception(writer_error_);
    auto fits = [&](std::uint64_t& start) {
      start = head_;
      const std::size_t pos = head_ % cap;
      if (pos + need > cap) start += cap - pos;  // wrap: skip the arena's tail end
      if (rec_head_ == rec_tail_) tail_ = start;  // empty: the skipped bytes are free too
      return start + need - tail_ <= cap && rec_head_ - rec_tail_ < records_.size();
    };
    if (need > cap) {
      if (on_full_ == OnFull::drop && !meta.lossless) {
        ++stats_.records_dropped;
        ++stats_.dropped_per_stream[meta.stream];
        return false;
      }
      DMI_FAIL("a capture record of {} bytes does not fit the ring arena ({} bytes): raise --ring-mb", need, cap);
    }
    if (!fits(offset)) {
      if (on_full_ == OnFull::drop && !meta.lossless) {
        ++stats_.records_dropped;
        ++stats_.dropped_per_stream[meta.stream];
        return false;
      }
      auto t0 = std::chrono::steady_clock::now();
      producer_waiting_ = true;
      data_cv_.notify_one();
      space_cv_.wait(lock, [&] { return fits(offset) || writer_error_; });
      producer_waiting_ = false;
      if (writer_error_) std::rethrow_exception(writer_error_);
      stats_.producer_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    head_ = offset + need;
    stats_.high_water_bytes = std::max<std::uint64_t>(stats_.high_water_bytes, head_ - tail_);
  }
  // Fill outside the lock: the writer only reads published spans.
  std::uint8_t* span = arena_.get() + offset % cap;
  std::memcpy(span, meta.seq, sizeof(std::int32_t) * meta.rows);
  std::memcpy(span + sizeof(std::int32_t) * meta.rows, meta.pos, sizeof(std::int32_t) * meta.rows);
  std::vector<std::int64_t> shape{static_cast<std::int64_t>(meta.rows)};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  at::Tensor dst = at::from_blob(span + header, shape, at::TensorOptions().dtype(dtype));
  fill(dst);
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    records_[rec_head_ % records_.size()] = Record{meta.stream, meta.step, meta.rows, offset, need, data_bytes};
    ++rec_head_;
    wake = writer_waiting_ && writer_needed();
  }
  if (wake) data_cv_.notify_one();
  return true;
}

bool CpuRing::writer_needed() const {
  const std::uint64_t pending = rec_head_ - rec_tail_;
  return stopping_ ||
         (pending > 0 && (producer_waiting_ || pending >= kWakeRecords || (head_ - tail_) * 4 >= arena_size_));
}

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

void CpuRing::writer_loop() {
  const std::size_t cap = arena_size_;
  double sink_cpu = 0;
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    writer_waiting_ = true;
    data_cv_.wait_for(lock, kWriterPeriod, [&] { return writer_needed(); });
    writer_waiting_ = false;
    if (rec_tail_ == rec_head_) {
      if (stopping_) return;
      continue;
    }
    // Write everything pending, without the lock while the sink works.
    while (rec_tail_ < rec_head_) {
      const Record r = records_[rec_tail_ % records_.size()];
      lock.unlock();
      try {
        const std::uint8_t* span = arena_.get() + r.offset % cap;
        const auto* seq = reinterpret_cast<const std::int32_t*>(span);
        const auto* pos = seq + r.rows;
        const std::size_t header = round_up(2 * sizeof(std::int32_t) * r.rows);
        const double c0 = thread_cpu_seconds();
        sink_.write(r.stream, r.step, r.rows, seq, pos, span + header, r.data_bytes);
        sink_cpu += thread_cpu_seconds() - c0;
      } catch (...) {
        lock.lock();
        writer_error_ = std::current_exception();
        space_cv_.notify_all();
        return;
      }
      lock.lock();
      ++rec_tail_;
      tail_ = r.offset + r.bytes;
      ++stats_.records_written;
      stats_.bytes_written += r.data_bytes;
      stats_.sink_cpu_seconds = sink_cpu;
      if (producer_waiting_) space_cv_.notify_one();
    }
  }
}

void CpuRing::drain() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  data_cv_.notify_all();
  if (writer_.joinable()) writer_.join();
  std::lock_guard<std::mutex> lock(mu_);
  if (writer_error_) {
    auto e = writer_error_;
    writer_error_ = nullptr;
    std::rethrow_exception(e);
  }
}

RingStats CpuRing::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  RingStats s = stats_;
  s.used_bytes = head_ - tail_;
  s.arena_bytes = arena_size_;
  return s;
}

}  // namespace dmi::ring
