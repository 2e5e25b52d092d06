// TorchScript models: a module saved with torch.jit.save whose
//   forward(input_ids: Tensor[B, L] int64, attention_mask: Tensor[B, L] int64) -> Tensor[B, L, vocab]
// recomputes the whole (left-padded) sequence on every call; when it also has
//   forward_step(input_ids: Tensor[B, T], attention_mask: Tensor[B, S + T], cache: List[Tensor])
//       -> (Tensor[B, T, vocab], List[Tensor])
// dmi uses that instead (the module keeps its own KV cache). HookPoints are
// calls to the dmi::hook(Tensor x, str site) -> Tensor operator that libdmi
// registers: identity, and a capture when the site is selected. A hook map
// (io/hook_map.h) inserts such calls into a module exported without them.
// See docs/torchscript.md.
#pragma once

#include <memory>
#include <string>

#include "model/causal_lm.h"

namespace dmi::model {

// Loads `path` (the archive), its config.json (inside the archive, as
// torch.jit.save's extra file "config.json", or next to it), instruments it
// from `hook_map` when given, and checks the calling convention with a
// two-token forward (and one more token through forward_step's cache). Errors name the file and what is wrong.
std::unique_ptr<CausalLM> load_torchscript(const std::string& path, at::ScalarType dtype, const std::string& hook_map);

}  // namespace dmi::model
