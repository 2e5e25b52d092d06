#include "sink/sink.h"

namespace dmi::sink {

namespace {
class NullSink final : public Sink {
 public:
  void open(const std::vector<StreamInfo>&) override {}
  void write(std::uint16_t, std::int32_t, std::uint32_t, const std::int32_t*, const std::int32_t*, const void*,
             std::size_t) override {}
  void close(const Finish&) override {}
};
}  // namespace

std::unique_ptr<Sink> make_null_sink() { return std::make_unique<NullSink>(); }

}  // namespace dmi::sink
