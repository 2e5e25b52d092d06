#include "engine/generator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>

#include "common/error.h"

namespace dmi::engine {

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

Generator::Generator(model::CausalLM& model, GenerateOptions opts) : model_(model), opts_(std::move(opts)) {
  DMI_CHECK(opts_.batch_size >= 1, "batch size must be at least 1");
  DMI_CHECK(opts_.max_new_tokens >= 0, "max new tokens must be non-negative");
}

std::vector<SequenceResult> Generator::generate(const std::vector<std::vector<std::int32_t>>& prompts) {
  const auto& cfg = model_.config();
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    DMI_CHECK(!prompts[i].empty(), "prompt {} has no tokens", i);
    DMI_CHECK(static_cast<std::int64_t>(prompts[i].size()) < cfg.max_position_embeddings,
              "prompt {} has {} tokens; the model's context is {} (max_position_embeddings)", i, prompts[i].size(),
              cfg.max_position_embeddings);
    for (auto id : prompts[i])
      DMI_CHECK(id >= 0 && id < cfg.vocab_size, "prompt {}: token id {} is out of range (vocab_size {})", i, id,
                cfg.vocab_size);
  }
  std::vector<std::vector<std::size_t>> batches = opts_.batches;
  if (batches.empty())
    for (std::size_t first = 0; first < prompts.size(); first += opts_.batch_size) {
      batches.emplace_back();
      for (std::size_t i = first; i < std::min(prompts.size(), first + opts_.batch_size); ++i) batches.back().push_back(i);
    }
  std::vector<bool> seen(prompts.size(), false);
  for (const auto& batch : batches) {
    DMI_CHECK(!batch.empty() && static_cast<std::int64_t>(batch.size()) <= opts_.batch_size,
              "a batch must hold 1 to {} prompts, not {}", opts_.batch_size, batch.size());
    for (auto i : batch) {
      DMI_CHECK(i < prompts.size() && !seen[i], "batch composition names prompt {} twice or out of range", i);
      seen[i] = true;
    }
  }
  DMI_CHECK(opts_.interrupt_after.empty() || opts_.interrupt_after.size() == prompts.size(),
            "interrupt_after must have one entry per prompt");
  partial_.assign(prompts.size(), SequenceResult{});
  std::vector<SequenceResult>& out = partial_;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    out[i].prompt_ids = prompts[i];
    out[i].finish_reason = seen[i] ? "interrupted" : "skipped";  // until its batch runs
  }
  std::size_t done = 0;
  for (std::size_t bi = 0; bi < batches.size(); ++bi) {
    if (opts_.stop && opts_.stop->load()) break;
    run_batch(prompts, batches[bi], static_cast<std::int32_t>(bi), out);
    done += batches[bi].size();
    if (opts_.on_progress) opts_.on_progress(done, prompts.size());
  }
  return out;
}

void Generator::run_batch(const std::vector<std::vector<std::int32_t>>& prompts,
                          const std::vector<std::size_t>& members, std::int32_t batch_index,
                          std::vector<SequenceResult>& out) {
  const std::size_t n = members.size();
  const std::int64_t B = static_cast<std::int64_t>(n);
  const std::int64_t ctx = model_.config().max_position_embeddings;
  std::int64_t T = 0;
  for (std::size_t b = 0; b < n; ++b) T = std::max<std::int64_t>(T, prompts[members[b]].size());
  // Each sequence may generate until max_new_tokens or the model's context.
  std::vector<std::int64_t> budget(n);
  std::int64_t steps = 0;
  for (std::size_t b = 0; b < n; ++b) {
    budget[b] = std::min<std::int64_t>(opts_.max_new_tokens, ctx - prompts[members[b]].size());
    steps = std::max(steps, budget[b]);
  }
  const std::int64_t capacity = T + std::max<std::int64_t>(steps, 1);

  // Left padding: sequence b's prompt occupies cache columns [pad_b, T).
  at::Tensor ids = at::zeros({B, T}, at::kLong);
  at::Tensor positions = at::zeros({B, T}, at::kLong);
  at::Tensor key_valid = at::zeros({B, capacity}, at::kBool);
  std::vector<std::int64_t> len(n);
  {
    auto ids_a = ids.accessor<std::int64_t, 2>();
    auto pos_a = positions.accessor<std::int64_t, 2>();
    auto kv_a = key_valid.accessor<bool, 2>();
    for (std::size_t b = 0; b < n; ++b) {
      const auto& p = prompts[members[b]];
      len[b] = static_cast<std::int64_t>(p.size());
      const std::int64_t pad = T - len[b];
      for (std::int64_t t = 0; t < len[b]; ++t) {
        ids_a[b][pad + t] = p[t];
        pos_a[b][pad + t] = t;
        kv_a[b][pad + t] = true;
      }
      auto& r = out[members[b]];
      r.batch = batch_index;
      r.row = static_cast<std::int32_t>(b);
      r.left_pad = static_cast<std::int32_t>(pad);
      timings_.prefill_tokens += len[b];
    }
  }
  model::KVCache cache = model_.new_cache(B, capacity);
  std::vector<Sampler> samplers;
  for (std::size_t b = 0; b < n; ++b) samplers.emplace_back(opts_.sampling, members[b]);
  std::vector<bool> done(n, false);
  auto is_eos = [&](std::int32_t id) {
    return std::find(opts_.eos_ids.begin(), opts_.eos_ids.end(), id) != opts_.eos_ids.end();
  };

  std::vector<std::int32_t> seq_ids(n);
  for (std::size_t b = 0; b < n; ++b) seq_ids[b] = static_cast<std::int32_t>(members[b]);
  hooks::ForwardInfo info{positions, key_valid.narrow(1, 0, T), 0, seq_ids, -1, {}};

  double t0 = now();
  model::ForwardInput in{ids, positions, key_valid.narrow(1, 0, T), 0, false, &info};
  at::Tensor logits = model_.forward(in, cache, opts_.observer);  // [B, 1, V]
  double t1 = now();
  timings_.prefill_seconds += t1 - t0;

  std::size_t remaining = n;
  for (std::size_t b = 0; b < n; ++b)
    if (budget[b] <= 0) {
      done[b] = true;
      out[members[b]].finish_reason = "context";
      --remaining;
    }
  at::Tensor next_ids = at::zeros({B, 1}, at::kLong);
  at::Tensor next_pos = at::zeros({B, 1}, at::kLong);
  std::vector<std::int32_t> chosen_seq, chosen_pos, chosen_ids;
  for (std::int64_t step = 0; remaining > 0; ++step) {
    const double step_start = now();
    chosen_seq.clear();
    chosen_pos.clear();
    chosen_ids.clear();
    at::Tensor rows = logits.select(1, 0).contiguous();  // [B, V]
    auto nid = next_ids.accessor<std::int64_t, 2>();
    auto npos = next_pos.accessor<std::int64_t, 2>();
    for (std::size_t b = 0; b < n; ++b) {
      if (done[b]) continue;
      at::Tensor row = rows[b];
      if (opts_.on_logits) opts_.on_logits(members[b], step, row);
      std::int32_t tok = samplers[b].next(row);
      auto& r = out[members[b]];
      r.output_ids.push_back(tok);
      ++timings_.decode_tokens;
      nid[b][0] = tok;
      npos[b][0] = len[b] + step;
      if (opts_.on_tokens) {
        chosen_seq.push_back(static_cast<std::int32_t>(members[b]));
        chosen_pos.push_back(static_cast<std::int32_t>(len[b] + step));
        chosen_ids.push_back(tok);
      }
      const std::int64_t made = static_cast<std::int64_t>(r.output_ids.size());
      const char* why = nullptr;
      if (is_eos(tok)) why = "eos";
      else if (made >= opts_.max_new_tokens) why = "length";
      else if (made >= budget[b]) why = "context";
      else if (!opts_.interrupt_after.empty() && opts_.interrupt_after[members[b]] >= 0 &&
               made >= opts_.interrupt_after[members[b]])
        why = opts_.interrupt_reason.empty() ? "interrupted" : opts_.interrupt_reason[members[b]].c_str();
      else if (opts_.stop_sequence && opts_.stop_sequence(members[b]))
        why = "monitor";
      if (why) {
        r.finish_reason = why;
        done[b] = true;
        --remaining;
      }
    }
    if (opts_.on_tokens && !chosen_ids.empty())
      opts_.on_tokens(static_cast<std::int32_t>(step), chosen_seq, chosen_pos, chosen_ids);
    if (remaining == 0) break;
    if (opts_.stop && opts_.stop->load()) {
      for (std::size_t b = 0; b < n; ++b)
        if (!done[b]) out[members[b]].finish_reason = "interrupted";
      break;
    }
    // Finished sequences keep riding along (their rows are ignored) so the
    // batch shape stays fixed; only live sequences' new columns become valid.
    const std::int64_t col = T + step;
    {
      auto kv_a = key_valid.accessor<bool, 2>();
      for (std::size_t b = 0; b < n; ++b) kv_a[b][col] = !done[b];
    }
    hooks::ForwardInfo dinfo{next_pos, key_valid.narrow(1, col, 1), col, seq_ids, static_cast<std::int32_t>(step), {}};
    model::ForwardInput dec{next_ids, next_pos, key_valid.narrow(1, 0, col + 1), col, false, &dinfo};
    logits = model_.forward(dec, cache, opts_.observer);
    timings_.step_seconds.push_back(now() - step_start);
  }
  timings_.decode_seconds += now() - t1;
}

}  // namespace dmi::engine
