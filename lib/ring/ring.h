// Ring²: a bounded payload ring plus a metadata ring, drained by a
// background writer, so the forward pass never waits on storage.
//
// Producers (HookPoints, on the forward thread) reserve a span of the payload
// arena, fill it (copy + convert) and publish a fixed-size record. The writer
// thread pops records in order, hands each record's bytes to the sink, and
// releases the span. When the arena or the record ring is full the producer
// either waits (OnFull::block, lossless) or drops the record and counts it
// (OnFull::drop, never stalls).
//
// On a machine with few cores every wake-up of the writer takes a core from
// the forward pass, so the writer is woken in batches: when a quarter of the
// arena or 64 records are pending, when the producer must wait, or every
// 20 ms.
//
// Producer is the seam a CUDA ring implements (device arena, pinned staging,
// copy stream + events, write cursors in device memory) without touching
// hooks or sinks.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dmi::sink {
class Sink;
}

namespace dmi::ring {

enum class OnFull { block, drop };

// What a record carries besides its rows' data.
struct RecordMeta {
  std::uint16_t stream = 0;  // index into the streams opened on the sink
  std::int32_t step = -1;    // -1: prefill; else the decode step
  std::uint32_t rows = 0;
  const std::int32_t* seq = nullptr;  // [rows] sequence index of each row
  const std::int32_t* pos = nullptr;  // [rows] position within its sequence
  // Never dropped, even with OnFull::drop (the token log: a few bytes a step).
  bool lossless = false;
};

// Fixed-size entry of the metadata ring.
struct Record {
  std::uint16_t stream;
  std::int32_t step;
  std::uint32_t rows;
  std::uint64_t offset;  // span start (monotonic byte cursor)
  std::uint64_t bytes;   // span length, header included
  std::uint64_t data_bytes;
};

struct RingStats {
  std::uint64_t records_written = 0, records_dropped = 0, bytes_written = 0;
  std::uint64_t high_water_bytes = 0;
  std::uint64_t used_bytes = 0, arena_bytes = 0;  // the ring's payload now, and its size (CpuRing)
  double producer_wait_seconds = 0;
  // CPU time spent inside Sink::write: on the writer thread (Ring²), on the
  // forward thread (sync), or after generation (materialize).
  double sink_cpu_seconds = 0;
  std::vector<std::uint64_t> dropped_per_stream;
};

// CPU time of the calling thread, in seconds.
double thread_cpu_seconds();

// The producer side seen by HookPoints.
class Producer {
 public:
  virtual ~Producer() = default;
  // Reserves room for `meta.rows` rows of `row_shape` in `dtype`, calls
  // fill(dst) with dst a [rows, row_shape...] tensor over that room, and
  // publishes it. Returns false when the record was dropped (fill not called).
  virtual bool push(const RecordMeta& meta, const std::vector<std::int64_t>& row_shape, at::ScalarType dtype,
                    const std::function<void(at::Tensor&)>& fill) = 0;
};

// CPU implementation: arena in host memory, one writer thread.
class CpuRing final : public Producer {
 public:
  CpuRing(std::size_t arena_bytes, std::size_t max_records, OnFull on_full, std::size_t n_streams,
          sink::Sink& sink);
  ~CpuRing() override;
  bool push(const RecordMeta& meta, const std::vector<std::int64_t>& row_shape, at::ScalarType dtype,
            const std::function<void(at::Tensor&)>& fill) override;
  // Waits until every published record reached the sink, then stops the
  // writer. Rethrows the writer's error, if any. Idempotent.
  void drain();
  RingStats stats() const;

 private:
  void writer_loop();
  // Whether the writer should run now rather than at its next timeout.
  bool writer_needed() const;
  // Not zero-filled: pages are touched (and count in RSS) only as the ring
  // reaches them.
  std::unique_ptr<std::uint8_t[]> arena_;
  std::size_t arena_size_;
  std::vector<Record> records_;
  const OnFull on_full_;
  sink::Sink& sink_;

  mutable std::mutex mu_;
  std::condition_variable space_cv_, data_cv_;
  std::uint64_t head_ = 0, tail_ = 0;          // payload cursors (bytes)
  std::uint64_t rec_head_ = 0, rec_tail_ = 0;  // record cursors
  bool stopping_ = false;
  bool writer_waiting_ = false, producer_waiting_ = false;
  std::exception_ptr writer_error_;
  RingStats stats_;
  std::thread writer_;
};

}  // namespace dmi::ring
