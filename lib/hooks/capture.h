// The capturing HookPoint: an Observer that takes the selected sites' rows
// (one row per captured token: sequence, position) out of each batch tensor,
// converts them to the capture dtype and pushes them into the ring. It never
// touches storage.
#pragma once

#include <optional>
#include <vector>

#include "hooks/selection.h"
#include "io/config.h"
#include "ring/ring.h"
#include "sink/sink.h"

namespace dmi::hooks {

enum class TokenPolicy { all, prompt, generated, last_prompt };
TokenPolicy parse_token_policy(const std::string& s);
const char* token_policy_name(TokenPolicy p);

// The shape of one captured row of `site` (one token): [d_model], [heads,
// head_dim], [heads, attention_width] for attention rows, ...
std::vector<std::int64_t> site_row_shape(Site site, const io::ModelConfig& cfg, std::int64_t attention_width);

struct CaptureOptions {
  Selection selection;
  TokenPolicy tokens = TokenPolicy::all;
  int every = 1;        // capture decode step s when s % every == 0
  int logits_topk = 0;  // 0: full logits; K: top-K values and ids
  std::optional<at::ScalarType> capture_dtype;  // default: the model's dtype
  std::int64_t max_len = 0;  // longest sequence (prompt + generated): attention row width
};

class CapturePoint final : public Observer {
 public:
  CapturePoint(CaptureOptions opts, const io::ModelConfig& cfg, at::ScalarType model_dtype);
  // The streams a sink must open, in the order stream ids refer to them.
  const std::vector<sink::StreamInfo>& streams() const { return streams_; }
  void attach(ring::Producer* producer) { producer_ = producer; }

  void begin_forward(const ForwardInfo& info) override;
  bool wants(Site site, int layer) const override {
    return active_ && opts_.selection.wants(site, layer);
  }
  void observe(Site site, int layer, const at::Tensor& t, const ForwardInfo& info) override;

 private:
  CaptureOptions opts_;
  std::vector<sink::StreamInfo> streams_;
  std::vector<std::vector<int>> stream_of_;  // [site][layer] -> stream id
  ring::Producer* producer_ = nullptr;
  // Rows of the current forward pass to capture.
  bool active_ = false;
  bool all_rows_ = false;
  at::Tensor row_index_;             // flat b * T + t
  std::vector<std::int32_t> seq_, pos_;
  std::vector<std::int64_t> row_b_, row_t_;
};

}  // namespace dmi::hooks
