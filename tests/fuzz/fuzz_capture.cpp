// The capture-file reader: open a (mutated) capture and query it as
// dmi-inspect does: attributes, sequences, each site's index and rows.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "sink/capture_file.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  dmi::fuzz::TempFile f(data, size, ".h5");
  dmi::fuzz::expect_ok_or_error([&] {
    auto c = dmi::sink::CaptureFile::open(f.path());
    (void)c->status();
    (void)c->text_attr("model_config");
    (void)c->int_attr("attention_width");
    for (std::size_t s = 0; s < c->n_sequences() && s < 8; ++s) {
      (void)c->tokens(s);
      (void)c->prompt_text(s);
      (void)c->finish_reason(s);
    }
    for (const auto& site : c->sites()) {
      const auto rows = c->find_rows(site.name, std::nullopt);
      std::vector<std::int64_t> some(rows.begin(), rows.begin() + std::min<std::size_t>(rows.size(), 4));
      (void)c->read_rows(site.name, some);
      if (site.layout == "topk") (void)c->read_ids(site.name, some);
    }
  });
  return 0;
}
