// Write-capable HookPoints: interventions that change a site's tensor before
// the forward pass continues with it (steering, ablation, patching), and the
// chain that puts them in front of a capture.
//
// An Intervention is resolved: its vectors, reference rows and positions are
// known (engine/interventions.h reads the files and flags). Rows are
// selected per token by (sequence, position), never by batch row, so a
// sequence's output does not depend on its neighbours or their
// interventions.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "hooks/site.h"

namespace dmi::hooks {

// Which positions of a sequence an intervention touches.
struct PositionSpec {
  enum class Kind { all, prompt, generated, last_prompt, ranges, after } kind = Kind::all;
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;  // [a, b): "3:7", "1,4,9"
  std::string text;                                           // after:TEXT
  // all, prompt, generated, last-prompt, a:b, a list "1,4,9" (ranges too),
  // after:TEXT. Throws dmi::Error naming the value.
  static PositionSpec parse(const std::string& s);
  // Whether position p of a sequence with a prompt of plen tokens is
  // selected; after_start: the first position after TEXT (after:TEXT only).
  bool selects(std::int64_t p, std::int64_t plen, std::int64_t after_start = -1) const;
};

enum class SteerMode { add, normadd, set, ablate };
SteerMode parse_steer_mode(const std::string& s);
const char* steer_mode_name(SteerMode m);

struct Intervention {
  enum class Kind {
    steer,    // add / normadd / set / ablate a direction (residual-shaped sites)
    zero,     // zero-ablation (optionally of some heads)
    replace,  // the rows come from value(): mean / resample ablation, patching
  } kind = Kind::steer;
  std::string label;                         // the flag as given, for messages
  std::vector<std::pair<Site, int>> sites;   // where it applies
  // steer
  SteerMode mode = SteerMode::add;
  double scale = 1.0;
  std::map<int, at::Tensor> direction;       // layer -> float32 [d_model]
  std::map<int, double> target;              // layer -> c (set)
  // zero / replace: heads (query heads, or KV heads for k, v, rot_k); empty: all
  std::vector<std::int64_t> heads;
  // replace: the row for (site, layer, seq, pos), float32 of the site's row
  // shape; throws dmi::Error when there is none.
  std::function<at::Tensor(Site, int, std::int32_t, std::int64_t)> value;
  // where
  PositionSpec positions;
  std::map<std::int32_t, std::int64_t> after_start;  // after:TEXT: first position touched, per sequence
  std::optional<std::set<std::int32_t>> only_seqs;   // per-row interventions
};

// Applies interventions, in order, at their sites.
class Intervener final : public Observer {
 public:
  // prompt_len: per sequence id, its prompt length (for prompt / generated /
  // last-prompt positions).
  Intervener(std::vector<Intervention> interventions, std::vector<std::int64_t> prompt_len);
  const std::vector<Intervention>& interventions() const { return list_; }

  void begin_forward(const ForwardInfo& info) override;
  bool wants(Site, int) const override { return false; }
  void observe(Site, int, const at::Tensor&, const ForwardInfo&) override {}
  bool writes(Site site, int layer) const override {
    return writes_[static_cast<int>(site)].count(layer < 0 ? -1 : layer) != 0;
  }
  at::Tensor intervene(Site site, int layer, const at::Tensor& t, const ForwardInfo& info) override;
  // Wall seconds spent inside intervene() (what steering costs the forward pass).
  double seconds() const { return seconds_; }

 private:
  // [B, T] bool of the tokens intervention i touches in this forward pass;
  // undefined when it touches every token.
  const at::Tensor& mask(std::size_t i, const ForwardInfo& info);
  at::Tensor apply(const Intervention& iv, std::size_t i, Site site, int layer, const at::Tensor& t,
                   const ForwardInfo& info);
  std::vector<Intervention> list_;
  std::vector<std::int64_t> prompt_len_;
  std::vector<std::set<int>> writes_;  // [site] -> layers (-1 for global sites)
  std::vector<bool> mask_ready_;
  std::vector<at::Tensor> masks_;
  double seconds_ = 0;
};

// Interventions in front of a capture: the model sees one Observer. The
// capture records a site's value after the interventions at that site, or
// before them with capture_before.
class HookChain final : public Observer {
 public:
  HookChain(Observer* intervener, Observer* capture, bool capture_before)
      : iv_(intervener), cap_(capture), before_(capture_before) {}
  void begin_forward(const ForwardInfo& info) override;
  bool wants(Site site, int layer) const override {
    return cap_ && cap_->wants(site, layer) && !(before_ && iv_ && iv_->writes(site, layer));
  }
  void observe(Site site, int layer, const at::Tensor& t, const ForwardInfo& info) override {
    cap_->observe(site, layer, t, info);
  }
  bool writes(Site site, int layer) const override { return iv_ && iv_->writes(site, layer); }
  at::Tensor intervene(Site site, int layer, const at::Tensor& t, const ForwardInfo& info) override;

 private:
  Observer* iv_;
  Observer* cap_;
  bool before_;
};

}  // namespace dmi::hooks
