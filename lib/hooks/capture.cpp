#include "hooks/capture.h"

#include <ATen/ATen.h>

#include <limits>

#include "common/error.h"

namespace dmi::hooks {

TokenPolicy parse_token_policy(const std::string& s) {
  if (s == "all") return TokenPolicy::all;
  if (s == "prompt") return TokenPolicy::prompt;
  if (s == "generated") return TokenPolicy::generated;
  if (s == "last-prompt") return TokenPolicy::last_prompt;
  DMI_FAIL("--tokens '{}' is not one of all, prompt, generated, last-prompt", s);
}

const char* token_policy_name(TokenPolicy p) {
  switch (p) {
    case TokenPolicy::all: return "all";
    case TokenPolicy::prompt: return "prompt";
    case TokenPolicy::generated: return "generated";
    case TokenPolicy::last_prompt: return "last-prompt";
  }
  return "?";
}

std::vector<std::int64_t> site_row_shape(Site site, const io::ModelConfig& cfg, std::int64_t attention_width) {
  switch (site) {
    case Site::q:
    case Site::q_normalized:
    case Site::rot_q:
    case Site::z: return {cfg.num_heads, cfg.head_dim};
    case Site::k:
    case Site::v:
    case Site::k_normalized:
    case Site::rot_k: return {cfg.num_kv_heads, cfg.head_dim};
    case Site::mlp_pre:
    case Site::mlp_pre_linear:
    case Site::mlp_post: return {cfg.intermediate_size};
    case Site::attn_scores:
    case Site::pattern: return {cfg.num_heads, attention_width};
    case Site::logits: return {cfg.vocab_size};
    default: return {cfg.hidden_size};
  }
}

CapturePoint::CapturePoint(CaptureOptions opts, const io::ModelConfig& cfg, at::ScalarType model_dtype)
    : opts_(std::move(opts)) {
  DMI_CHECK(opts_.every >= 1, "--every must be at least 1");
  const at::ScalarType dtype = opts_.capture_dtype.value_or(model_dtype);
  DMI_CHECK(opts_.logits_topk >= 0 && opts_.logits_topk <= cfg.vocab_size,
            "--logits topk:{} must be between 1 and vocab_size {}", opts_.logits_topk, cfg.vocab_size);
  stream_of_.assign(static_cast<int>(Site::kCount), std::vector<int>(std::max<std::int64_t>(cfg.num_layers, 1), -1));
  for (auto [site, layer] : opts_.selection.sites()) {
    sink::StreamInfo si;
    si.name = site_name(site, layer);
    si.layer = layer;
    si.dtype = dtype;
    si.row_shape = site_row_shape(site, cfg, opts_.max_len);
    if (site == Site::attn_scores || site == Site::pattern) si.layout = sink::Layout::attention;
    if (site == Site::logits && opts_.logits_topk > 0) {
      si.row_shape = {2, opts_.logits_topk};
      si.layout = sink::Layout::topk;
      si.dtype = at::kFloat;
    }
    stream_of_[static_cast<int>(site)][layer < 0 ? 0 : layer] = static_cast<int>(streams_.size());
    streams_.push_back(std::move(si));
  }
}

void CapturePoint::begin_forward(const ForwardInfo& info) {
  seq_.clear();
  pos_.clear();
  row_b_.clear();
  row_t_.clear();
  active_ = false;
  if (streams_.empty()) return;
  // Whether a token is captured: step is the decode step that fed it (-1: a
  // prompt token), last_prompt whether it is its prompt's last token.
  auto wanted = [&](std::int64_t step, bool last_prompt) {
    const bool prompt = step < 0;
    switch (opts_.tokens) {
      case TokenPolicy::all: return prompt || step % opts_.every == 0;
      case TokenPolicy::prompt: return prompt;
      case TokenPolicy::last_prompt: return last_prompt;
      case TokenPolicy::generated: return !prompt && step % opts_.every == 0;
    }
    return false;
  };
  const bool forced = !info.prompt_len.empty();
  const std::int64_t B = info.positions.size(0), T = info.positions.size(1);
  auto valid = info.valid.accessor<bool, 2>();
  auto pos = info.positions.accessor<std::int64_t, 2>();
  std::vector<std::int64_t> flat;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t) {
      if (!valid[b][t]) continue;
      const std::int64_t p = pos[b][t];
      bool take;
      if (forced) {
        const std::int64_t plen = info.prompt_len[b];
        take = wanted(p < plen ? -1 : p - plen, p == plen - 1);
      } else {
        // Prefill: prompts are left-padded, so each one ends in the last
        // column. Decode step: one generated token per row.
        take = wanted(info.step, info.step < 0 && t == T - 1);
      }
      if (!take) continue;
      flat.push_back(b * T + t);
      row_b_.push_back(b);
      row_t_.push_back(t);
      seq_.push_back(info.seq[b]);
      pos_.push_back(static_cast<std::int32_t>(p));
    }
  active_ = !flat.empty();
  all_rows_ = static_cast<std::int64_t>(flat.size()) == B * T;
  row_index_ = at::tensor(flat, at::kLong);
}

void CapturePoint::observe(Site site, int layer, const at::Tensor& t, const ForwardInfo& info) {
  const int stream = stream_of_[static_cast<int>(site)][layer < 0 ? 0 : layer];
  if (stream < 0 || !producer_) return;
  const sink::StreamInfo& si = streams_[stream];
  ring::RecordMeta meta{static_cast<std::uint16_t>(stream), info.step, static_cast<std::uint32_t>(seq_.size()),
                        seq_.data(), pos_.data()};
  std::function<void(at::Tensor&)> fill;
  if (si.layout == sink::Layout::attention) {
    // t: [B, H, T, L] over cache columns. Row (b, t) keeps key positions
    // 0..pos of its own sequence (cache columns col - pos .. col), so its
    // values do not depend on padding or batch.
    const bool scores = site == Site::attn_scores;
    // scores by value: fill runs inside push(), after this block's scope.
    fill = [&, scores](at::Tensor& dst) {
      dst.fill_(scores ? -std::numeric_limits<double>::infinity() : 0.0);
      for (std::size_t r = 0; r < seq_.size(); ++r) {
        const std::int64_t p = pos_[r], col = info.start + row_t_[r];
        dst[r].narrow(1, 0, p + 1).copy_(t[row_b_[r]].select(1, row_t_[r]).narrow(1, col - p, p + 1));
      }
    };
  } else if (si.layout == sink::Layout::topk) {
    fill = [&](at::Tensor& dst) {
      at::Tensor flat = t.reshape({-1, t.size(-1)}).index_select(0, row_index_).to(at::kFloat);
      auto top = at::topk(flat, si.row_shape[1], -1);
      dst.select(1, 0).copy_(std::get<0>(top));
      dst.select(1, 1).copy_(std::get<1>(top));
    };
  } else {
    fill = [&](at::Tensor& dst) {
      std::vector<std::int64_t> shape{-1};
      shape.insert(shape.end(), si.row_shape.begin(), si.row_shape.end());
      at::Tensor flat = t.reshape(shape);
      if (all_rows_) dst.copy_(flat);
      else if (flat.scalar_type() == dst.scalar_type()) at::index_select_out(dst, flat, 0, row_index_);
      else dst.copy_(flat.index_select(0, row_index_));
    };
  }
  producer_->push(meta, si.row_shape, si.dtype, fill);
}

}  // namespace dmi::hooks
