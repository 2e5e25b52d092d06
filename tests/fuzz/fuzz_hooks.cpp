// --hooks selection strings (against a 4-layer Qwen3-like site space) and
// TorchScript hook-map JSON. The first byte chooses.
#include <string>

#include "fuzz_util.h"
#include "hooks/selection.h"
#include "io/hook_map.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) {
    dmi::hooks::SiteSpace space;
    space.n_layers = 4;
    space.qk_norm = data[0] & 2;
    dmi::fuzz::expect_ok_or_error([&] {
      auto s = dmi::hooks::Selection::parse(text, space);
      (void)s.sites();
    });
    dmi::fuzz::expect_ok_or_error([&] { dmi::hooks::parse_index_set(text, 64, "layers"); });
  } else {
    dmi::fuzz::expect_ok_or_error([&] {
      auto m = dmi::io::parse_hook_map(text, "hooks.json");
      (void)m.match("model.layers.3");
      (void)m.match("model.norm");
    });
  }
  return 0;
}
