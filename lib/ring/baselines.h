// The obvious ways of capturing, as Producers, for benchmarks against Ring²:
//  * SyncProducer: each HookPoint writes its rows to the sink inline, before
//    the forward pass continues (what a hook that calls save() does);
//  * MaterializeProducer: every record is kept in memory and written after
//    generation (what output_hidden_states does).
#pragma once

#include <memory>
#include <vector>

#include "ring/ring.h"

namespace dmi::ring {

class SyncProducer final : public Producer {
 public:
  SyncProducer(std::size_t n_streams, sink::Sink& sink) : sink_(sink) { stats_.dropped_per_stream.assign(n_streams, 0); }
  bool push(const RecordMeta& meta, const std::vector<std::int64_t>& row_shape, at::ScalarType dtype,
            const std::function<void(at::Tensor&)>& fill) override;
  RingStats stats() const { return stats_; }

 private:
  sink::Sink& sink_;
  std::vector<std::uint8_t> buf_;
  RingStats stats_;
};

class MaterializeProducer final : public Producer {
 public:
  MaterializeProducer(std::size_t n_streams, sink::Sink& sink) : sink_(sink) {
    stats_.dropped_per_stream.assign(n_streams, 0);
  }
  bool push(const RecordMeta& meta, const std::vector<std::int64_t>& row_shape, at::ScalarType dtype,
            const std::function<void(at::Tensor&)>& fill) override;
  // Writes everything kept, in order, and frees it.
  void flush();
  RingStats stats() const { return stats_; }

 private:
  struct Kept {
    std::uint16_t stream;
    std::int32_t step;
    std::vector<std::int32_t> seq, pos;
    at::Tensor data;
  };
  sink::Sink& sink_;
  std::vector<Kept> kept_;
  RingStats stats_;
};

}  // namespace dmi::ring
