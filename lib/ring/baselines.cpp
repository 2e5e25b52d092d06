#include "ring/baselines.h"

#include <ATen/ATen.h>

#include "sink/sink.h"

namespace dmi::ring {

namespace {
std::vector<std::int64_t> full_shape(const RecordMeta& meta, const std::vector<std::int64_t>& row_shape) {
  std::vector<std::int64_t> shape{static_cast<std::int64_t>(meta.rows)};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  return shape;
}
}  // namespace

bool SyncProducer::push(const RecordMeta& meta, const std::vector<std::int64_t>& row_shape, at::ScalarType dtype,
                        const std::function<void(at::Tensor&)>& fill) {
  auto shape = full_shape(meta, row_shape);
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  const std::size_t bytes = static_cast<std::size_t>(n) * c10::elementSize(dtype);
  if (buf_.size() < bytes) buf_.resize(bytes);
  at::Tensor dst = at::from_blob(buf_.data(), shape, at::TensorOptions().dtype(dtype));
  fill(dst);
  const double c0 = thread_cpu_seconds();
  sink_.write(meta.stream, meta.step, meta.rows, meta.seq, meta.pos, buf_.data(), bytes);
  stats_.sink_cpu_seconds += thread_cpu_seconds() - c0;
  ++stats_.records_written;
  stats_.bytes_written += bytes;
  return true;
}

bool MaterializeProducer::push(const RecordMeta& meta, const std::vector<std::int64_t>& row_shape,
                               at::ScalarType dtype, const std::function<void(at::Tensor&)>& fill) {
  Kept k{meta.stream, meta.step, std::vector<std::int32_t>(meta.seq, meta.seq + meta.rows),
         std::vector<std::int32_t>(meta.pos, meta.pos + meta.rows),
         at::empty(full_shape(meta, row_shape), at::TensorOptions().dtype(dtype))};
  fill(k.data);
  stats_.high_water_bytes += k.data.numel() * k.data.element_size();
  kept_.push_back(std::move(k));
  return true;
}

void MaterializeProducer::flush() {
  for (const auto& k : kept_) {
    const std::size_t bytes = k.data.numel() * k.data.element_size();
    const double c0 = thread_cpu_seconds();
    sink_.write(k.stream, k.step, static_cast<std::uint32_t>(k.seq.size()), k.seq.data(), k.pos.data(),
                k.data.data_ptr(), bytes);
    stats_.sink_cpu_seconds += thread_cpu_seconds() - c0;
    ++stats_.records_written;
    stats_.bytes_written += bytes;
  }
  kept_.clear();
}

}  // namespace dmi::ring
