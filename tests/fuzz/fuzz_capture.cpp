// The capture-file reader: a capture whose every attribute, dataset, shape,
// type and value the input chooses (written with HDF5's API; h5_builder.h),
// opened and queried as dmi-inspect does: attributes, sequences (from
// /sequences or the token log), each site's index and rows.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "h5_builder.h"
#include "sink/capture_file.h"

namespace {

const std::vector<std::string> kSites = {"blocks.0.hook_resid_post", "unembed.hook_out", "blocks.1.attn.hook_pattern",
                                         "ln_final.hook_normalized"};

void build(FuzzedDataProvider& in, const std::string& path) {
  dmi::fuzz::H5Builder b(in, path);
  const hid_t f = b.file();
  if (f < 0) return;
  b.text_attr(f, "format", b.pick_text({"dmi-capture"}));
  b.int_attr(f, "format_version", b.pick_int(in.ConsumeIntegralInRange(1, 2)));
  b.text_attr(f, "status", b.pick_text({"complete", "running", "killed", "failed", "interrupted"}));
  if (in.ConsumeBool())
    b.text_attr(f, "writer", b.pick_text({R"({"host":"x","boot_id":"y","pid":1,"start_ticks":"1"})", "{}", "[]"}));
  b.int_attr(f, "attention_width", b.pick_int(4));
  const std::size_t n_seq = in.ConsumeIntegralInRange<std::size_t>(0, 4);
  const std::size_t n_tok = in.ConsumeIntegralInRange<std::size_t>(0, 16);
  if (in.ConsumeIntegralInRange(0, 3)) {
    hid_t g = b.group(f, "sequences");
    for (const char* name : {"tokens", "offsets", "prompt_lengths", "batch", "row", "left_pad"})
      if (in.ConsumeIntegralInRange(0, 7))
        b.dataset(g, name, 1, std::string(name) == "tokens" ? n_tok : std::string(name) == "offsets" ? n_seq + 1 : n_seq);
    for (const char* name : {"prompt_text", "generated_text", "finish_reason"})
      if (in.ConsumeIntegralInRange(0, 7)) b.strings(g, name, in.ConsumeIntegralInRange(0, 3) ? n_seq : in.ConsumeIntegralInRange<std::size_t>(0, 5));
    H5Gclose(g);
  }
  if (in.ConsumeBool()) {
    hid_t g = b.group(f, "token_log");
    for (const char* name : {"seq", "pos", "token"})
      if (in.ConsumeIntegralInRange(0, 7)) b.dataset(g, name, 1, n_tok);
    H5Gclose(g);
  }
  if (in.ConsumeIntegralInRange(0, 7)) {
    hid_t sites = b.group(f, "sites");
    const int n = in.ConsumeIntegralInRange(0, 3);
    for (int i = 0; i < n; ++i) {
      const std::string name = b.pick_text(kSites);
      if (name.empty() || name.find('/') != std::string::npos || name == ".") continue;
      hid_t g = b.group(sites, name);
      if (g < 0) continue;
      const std::size_t rows = in.ConsumeIntegralInRange<std::size_t>(0, 8);
      b.text_attr(g, "layout", b.pick_text({"dense", "attention", "topk"}));
      b.int_attr(g, "layer", b.pick_int(i));
      b.int_attr(g, "index", b.pick_int(i));
      if (in.ConsumeBool()) b.int_attr(g, "records_dropped", b.pick_int(0));
      for (const char* ds : {"data", "seq", "pos", "ids"})
        if (in.ConsumeIntegralInRange(0, 7)) b.dataset(g, ds, std::string(ds) == "seq" || std::string(ds) == "pos" ? 1 : 2, rows);
      H5Gclose(g);
    }
    H5Gclose(sites);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // HDF5 allocates (and zeroes) its per-file structures anew on every open
  // unless its free lists keep them: unlimited lists made this target ~8x
  // faster under ASan (53 -> 455 executions/s).
  static const bool limits = (H5set_free_list_limits(-1, -1, -1, -1, -1, -1), true);
  (void)limits;
  FuzzedDataProvider in(data, size);
  static const std::string path = [] {
    std::string d = (::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp");
    return d + "/dmi-fuzz-capture-" + std::to_string(::getpid()) + ".h5";
  }();
  build(in, path);
  dmi::fuzz::expect_ok_or_error([&] {
    auto c = dmi::sink::CaptureFile::open(path);
    (void)c->status();
    (void)c->text_attr("model_config");
    (void)c->int_attr("attention_width");
    for (std::size_t s = 0; s < c->n_sequences() && s < 8; ++s) {
      (void)c->tokens(s);
      (void)c->prompt_length(s);
      (void)c->prompt_text(s);
      (void)c->generated_text(s);
      (void)c->finish_reason(s);
    }
    for (const auto& site : c->sites()) {
      const auto rows = c->find_rows(site.name, std::nullopt);
      std::vector<std::int64_t> some(rows.begin(), rows.begin() + std::min<std::size_t>(rows.size(), 4));
      (void)c->read_rows(site.name, some);
      if (site.rows > 0) (void)c->read_block(site.name, 0, std::min<std::int64_t>(site.rows, 3));
      (void)c->find_rows(site.name, 0, 1, 3);
      if (site.layout == "topk") (void)c->read_ids(site.name, some);
    }
  });
  ::unlink(path.c_str());
  return 0;
}
