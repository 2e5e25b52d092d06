#include "model/torchscript.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/library.h>
#include <torch/script.h>

#include <fmt/ranges.h>

#include <fstream>
#include <map>
#include <sstream>
#include <unordered_map>

#include "common/error.h"
#include "hooks/capture.h"
#include "io/hook_map.h"

namespace dmi::model {

using hooks::Site;

namespace {

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

std::string shape_str(at::IntArrayRef s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

bool attention_site(Site s) { return s == Site::attn_scores || s == Site::pattern; }

// ---------------------------------------------------------------------------
// The dmi::hook operator. Its state is per thread: the forward pass that is
// running on this thread (TorchScript runs a module's ops on the caller's
// thread), so modules stay plain identities anywhere else.

struct SiteInfo {
  Site site;
  int layer;
  std::vector<std::int64_t> row;  // trailing shape of one token's row, as seen at load
};

struct Probe {
  std::map<std::string, std::vector<at::Tensor>> seen;  // site -> tensors, in call order
};

struct HookContext {
  Probe* probe = nullptr;
  const std::unordered_map<std::string, SiteInfo>* sites = nullptr;
  hooks::Observer* observer = nullptr;
  const hooks::ForwardInfo* info = nullptr;
  // Hook tensors are [B, Lq, ...] (attention: [B, H, Lq, Lk]); the rows of
  // this call's T new tokens start at query row q_start.
  std::int64_t B = 0, Lq = 0, Lk = 0, q_start = 0, T = 0;
  std::exception_ptr error;  // a dmi::Error raised inside the graph
};

thread_local HookContext* t_context = nullptr;

void check_rows(const std::string& name, const SiteInfo& s, const at::Tensor& x, const HookContext& c) {
  std::vector<std::int64_t> want{c.B};
  if (attention_site(s.site)) want.insert(want.end(), {s.row[0], c.Lq, c.Lk});
  else want.push_back(c.Lq), want.insert(want.end(), s.row.begin(), s.row.end());
  DMI_CHECK(x.sizes().vec() == want, "dmi::hook '{}': got a tensor of shape {}, expected {}", name,
            shape_str(x.sizes()), shape_str(want));
}

at::Tensor hook_op(at::Tensor x, std::string name) {
  HookContext* c = t_context;
  if (!c) return x;
  try {
    if (c->probe) {
      c->probe->seen[name].push_back(x);
      return x;
    }
    if (!c->observer) return x;
    auto it = c->sites->find(name);
    DMI_CHECK(it != c->sites->end(), "dmi::hook '{}' was not called when the module was checked at load", name);
    const SiteInfo& s = it->second;
    // unembed.hook_out is forward's return value, observed by the caller.
    if (s.site == Site::logits || !c->observer->wants(s.site, s.layer)) return x;
    check_rows(name, s, x, *c);
    // The observer wants the rows of this call's new tokens.
    c->observer->observe(s.site, s.layer, x.narrow(attention_site(s.site) ? 2 : 1, c->q_start, c->T), *c->info);
  } catch (...) {
    if (!c->error) c->error = std::current_exception();
    throw std::runtime_error("dmi::hook failed");
  }
  return x;
}

}  // namespace

// CONSERVATIVE: the JIT treats every call as having side effects, so no
// pass removes or reorders a hook.
TORCH_LIBRARY(dmi, m) {
  m.def(torch::schema("dmi::hook(Tensor x, str site) -> Tensor", c10::AliasAnalysisKind::CONSERVATIVE), &hook_op);
}

namespace {

// ---------------------------------------------------------------------------
// Automatic instrumentation: inline every submodule call of forward into one
// graph, inserting dmi::hook at the outputs (or inputs) the hook map names.
// Inlining first makes each call site belong to one module instance (the
// types of a ModuleList's layers are shared, their call sites are not).

namespace jit = torch::jit;

// "model.layers.3" for a value reached from forward's self by GetAttrs.
std::optional<std::string> module_path(jit::Value* v, jit::Value* self) {
  if (v == self) return std::string();
  if (v->node()->kind() != c10::prim::GetAttr) return std::nullopt;
  auto base = module_path(v->node()->input(0), self);
  if (!base) return std::nullopt;
  const std::string& attr = v->node()->s(c10::attr::name);
  return base->empty() ? attr : *base + "." + attr;
}

jit::Value* insert_hook(jit::Graph& g, jit::Value* x, const std::string& site) {
  return g.insert(c10::Symbol::fromQualString("dmi::hook"), {x, site});
}

bool is_tensor(const c10::TypePtr& t) { return t->isSubtypeOf(*c10::TensorType::get()); }

// Instruments one root method; used[e] counts the call sites of entry e.
void instrument_method(jit::Module& module, const std::string& root, const io::HookMap& map,
                       std::vector<std::size_t>& used) {
  auto& fn = jit::toGraphFunction(module.get_method(root).function());
  std::shared_ptr<jit::Graph> g = fn.graph();
  jit::Value* self = g->inputs().at(0);
  for (;;) {
    auto calls = jit::findAllNodes(*g, c10::prim::CallMethod, /*recurse=*/true);
    if (calls.empty()) break;
    jit::Node* n = calls.front();
    auto cls = n->input(0)->type()->cast<c10::ClassType>();
    DMI_CHECK(cls, "{}: cannot inline a method call on a non-module value in {}", map.path, root);
    const std::string method = n->s(c10::attr::name);
    auto& callee = jit::toGraphFunction(cls->getMethod(method));
    const std::optional<std::string> path_of_module = module_path(n->input(0), self);
    const std::string mod = path_of_module.value_or("?");
    std::vector<io::HookMatch> matches;
    if (path_of_module && method == "forward") matches = map.match(*path_of_module);
    for (const auto& m : matches) {
      used[m.entry - map.entries.data()]++;
      if (!m.entry->input) continue;
      const std::size_t arg = static_cast<std::size_t>(m.entry->index) + 1;
      DMI_CHECK(arg < n->inputs().size(), "{}: input {} of module '{}' does not exist (its forward takes {} arguments)",
                map.path, m.entry->index, mod, n->inputs().size() - 1);
      DMI_CHECK(is_tensor(n->input(arg)->type()), "{}: input {} of module '{}' is a {}, not a Tensor", map.path,
                m.entry->index, mod, n->input(arg)->type()->str());
      jit::WithInsertPoint guard(n);
      n->replaceInput(arg, insert_hook(*g, n->input(arg), m.site));
    }
    // The graph as written (optimized_graph() would have its calls inlined already).
    std::vector<jit::Value*> outs = jit::inlineCallTo(n, &callee, callee.graph().get());
    for (const auto& m : matches) {
      if (m.entry->input) continue;
      DMI_CHECK(outs.size() == 1, "{}: module '{}' returns {} values", map.path, mod, outs.size());
      jit::Value* out = outs[0];
      if (is_tensor(out->type())) {
        DMI_CHECK(m.entry->index == 0, "{}: module '{}' returns one Tensor, there is no output {}", map.path, mod,
                  m.entry->index);
        jit::WithInsertPoint guard(out->node()->next());
        jit::Value* h = insert_hook(*g, out, m.site);
        out->replaceAllUsesAfterNodeWith(h->node(), h);
      } else {
        jit::Node* tuple = out->node();
        DMI_CHECK(tuple->kind() == c10::prim::TupleConstruct,
                  "{}: module '{}' returns a {}; only a Tensor or a tuple built in its forward can be hooked", map.path,
                  mod, out->type()->str());
        const std::size_t k = static_cast<std::size_t>(m.entry->index);
        DMI_CHECK(k < tuple->inputs().size() && is_tensor(tuple->input(k)->type()),
                  "{}: output {} of module '{}' is not a Tensor (it returns {})", map.path, k, mod, out->type()->str());
        jit::WithInsertPoint guard(tuple);
        tuple->replaceInput(k, insert_hook(*g, tuple->input(k), m.site));
      }
    }
  }
}

// Instruments forward and, when present, forward_step.
void instrument(jit::Module& module, const io::HookMap& map, const std::string& path) {
  std::vector<std::size_t> used(map.entries.size(), 0);
  for (const char* root : {"forward", "forward_step"})
    if (module.find_method(root)) instrument_method(module, root, map, used);
  for (std::size_t e = 0; e < map.entries.size(); ++e) {
    if (used[e] > 0) continue;
    std::vector<std::string> names;
    for (const auto& sub : module.named_modules())
      if (!sub.name.empty() && names.size() < 8) names.push_back(sub.name);
    DMI_FAIL("{}: module '{}' (hooks[{}]) is not called by {}'s forward; its submodules include {}", map.path,
             map.entries[e].module, e, path, fmt::join(names, ", "));
  }
}

// ---------------------------------------------------------------------------

class TorchScriptLM final : public CausalLM {
 public:
  TorchScriptLM(const std::string& path, at::ScalarType dtype, const std::string& hook_map) : path_(path), dtype_(dtype) {
    DMI_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "compute dtype must be float32 or bfloat16");
    {
      char magic[4] = {};
      std::ifstream f(path, std::ios::binary);
      DMI_CHECK(f.read(magic, 4) && std::string(magic, 4) == std::string("PK\x03\x04", 4),
                "{}: neither an HF model directory nor a TorchScript archive (the zip file torch.jit.save writes)",
                path);
    }
    std::unordered_map<std::string, std::string> extra{{"config.json", ""}};
    try {
      module_ = torch::jit::load(path, at::kCPU, extra);
    } catch (const c10::Error& e) {
      DMI_FAIL("{}: not a loadable TorchScript archive (a file written by torch.jit.save): {}", path,
               first_line(e.what_without_backtrace()));
    } catch (const std::exception& e) {
      DMI_FAIL("{}: not a loadable TorchScript archive (a file written by torch.jit.save): {}", path, first_line(e.what()));
    }
    check_signature();
    cfg_ = read_config(extra["config.json"]);
    module_.eval();
    module_.to(dtype);
    for (const auto& p : module_.parameters()) {
      p.set_requires_grad(false);
      weight_bytes_ += p.numel() * p.element_size();
    }
    if (!hook_map.empty()) instrument(module_, io::load_hook_map(hook_map), path);
    probe();
  }

  const io::ModelConfig& config() const override { return cfg_; }
  at::ScalarType dtype() const override { return dtype_; }
  std::size_t weight_bytes() const override { return weight_bytes_; }
  hooks::SiteSpace site_space() const override { return space_; }

  KVCache new_cache(std::int64_t batch, std::int64_t capacity) const override {
    KVCache c;
    c.capacity = capacity;
    if (!cached_) c.tokens = at::zeros({batch, capacity}, at::kLong);  // forward_step keeps its own cache in state
    return c;
  }

  // dmi::hook's result is not guaranteed to feed the rest of a module's
  // graph (hook maps, full recomputation), so TorchScript models only read.
  bool supports_interventions() const override { return false; }
  at::Tensor forward(const ForwardInput& in, KVCache& cache, hooks::Observer* obs) override {
    c10::InferenceMode inference;
    const std::int64_t B = in.ids.size(0), T = in.ids.size(1), L = in.start + T;
    DMI_CHECK(L <= cache.capacity && (cached_ || (cache.tokens.defined() && cache.tokens.size(0) == B)),
              "forward: cache of {} columns cannot hold {} tokens", cache.capacity, L);
    DMI_CHECK(in.key_valid.size(0) == B && in.key_valid.size(1) == L, "key_valid must be [B, start + T]");
#ifdef DMI_NO_HOOKS
    DMI_CHECK(!obs, "this build has hooks compiled out (DMI_HOOKS=OFF)");
#endif
    DMI_CHECK(!obs || in.info, "forward: an observer needs ForwardInput::info");
    at::Tensor mask = in.key_valid.to(at::kLong);
    if (obs) obs->begin_forward(*in.info);
    HookContext ctx;
    ctx.sites = &sites_;
    ctx.observer = obs;
    ctx.info = in.info;
    ctx.B = B, ctx.Lk = L, ctx.T = T;
    at::Tensor rows;
    if (cached_) {
      // forward_step: the T new tokens, with the module's own cache.
      ctx.Lq = T, ctx.q_start = 0;
      rows = run_step(ctx, in.ids, mask, cache.state);
    } else {
      // forward: the whole sequence again; the new tokens are its last T.
      ctx.Lq = L, ctx.q_start = in.start;
      cache.tokens.narrow(1, in.start, T).copy_(in.ids);
      rows = run(ctx, cache.tokens.narrow(1, 0, L).contiguous(), mask).narrow(1, in.start, T);
    }
    if (obs && obs->wants(Site::logits, -1)) obs->observe(Site::logits, -1, rows, *in.info);
    return (in.all_logits ? rows : rows.narrow(1, T - 1, 1)).to(at::kFloat).contiguous();
  }

 private:
  void check_signature() {
    auto method = module_.find_method("forward");
    DMI_CHECK(method, "{}: the module has no forward method", path_);
    const c10::FunctionSchema& s = method->function().getSchema();
    const auto& args = s.arguments();
    const bool ok = args.size() == 3 && is_tensor(args[1].type()) && is_tensor(args[2].type()) &&
                    s.returns().size() == 1 && is_tensor(s.returns()[0].type());
    std::ostringstream found;
    found << s;
    DMI_CHECK(ok,
              "{}: forward must be forward(input_ids: Tensor, attention_mask: Tensor) -> Tensor (see "
              "docs/torchscript.md); this module has {}",
              path_, found.str());
    // The optional KV-cache method.
    auto step = module_.find_method("forward_step");
    if (!step) return;
    const c10::FunctionSchema& st = step->function().getSchema();
    const auto& sa = st.arguments();
    const auto tensor_list = c10::ListType::ofTensors();
    bool step_ok = sa.size() == 4 && is_tensor(sa[1].type()) && is_tensor(sa[2].type()) &&
                   sa[3].type()->isSubtypeOf(*tensor_list) && st.returns().size() == 1;
    if (step_ok) {
      auto tuple = st.returns()[0].type()->cast<c10::TupleType>();
      step_ok = tuple && tuple->elements().size() == 2 && is_tensor(tuple->elements()[0]) &&
                tuple->elements()[1]->isSubtypeOf(*tensor_list);
    }
    std::ostringstream step_found;
    step_found << st;
    DMI_CHECK(step_ok,
              "{}: forward_step must be forward_step(input_ids: Tensor, attention_mask: Tensor, cache: List[Tensor]) "
              "-> Tuple[Tensor, List[Tensor]] (see docs/torchscript.md); this module has {}",
              path_, step_found.str());
    cached_ = true;
  }

  io::ModelConfig read_config(const std::string& inside) {
    if (!inside.empty()) return io::parse_generic_config(inside, path_ + ":config.json");
    const auto slash = path_.rfind('/');
    const std::string next = (slash == std::string::npos ? std::string(".") : path_.substr(0, slash)) + "/config.json";
    std::ifstream f(next);
    DMI_CHECK(f,
              "{}: no config.json inside the archive (torch.jit.save _extra_files) or next to it; dmi needs at least "
              "max_position_embeddings (and eos_token_id to stop at end of text)",
              path_);
    std::stringstream ss;
    ss << f.rdbuf();
    return io::parse_generic_config(ss.str(), next);
  }

  // Calls `method` with ctx installed; errors become dmi::Error naming the file.
  c10::IValue call(const char* method, HookContext& ctx, std::vector<c10::IValue> args) {
    c10::IValue out;
    t_context = &ctx;
    try {
      out = module_.get_method(method)(std::move(args));
    } catch (const std::exception& e) {
      t_context = nullptr;
      if (ctx.error) std::rethrow_exception(ctx.error);
      const auto* c10e = dynamic_cast<const c10::Error*>(&e);
      DMI_FAIL("{}: {} failed: {}", path_, method, first_line(c10e ? c10e->what_without_backtrace() : e.what()));
    }
    t_context = nullptr;
    return out;
  }

  // forward(ids, mask): logits of every position, checked.
  at::Tensor run(HookContext& ctx, const at::Tensor& ids, const at::Tensor& mask) {
    c10::IValue out = call("forward", ctx, {ids, mask});
    DMI_CHECK(out.isTensor(), "{}: forward returned a {}, not a Tensor of logits", path_, out.tagKind());
    return check_logits(out.toTensor(), ids, "forward");
  }

  // forward_step(ids, mask, cache): logits of the new tokens; replaces cache.
  at::Tensor run_step(HookContext& ctx, const at::Tensor& ids, const at::Tensor& mask,
                      std::vector<at::Tensor>& cache) {
    c10::List<at::Tensor> past;
    for (const auto& t : cache) past.push_back(t);
    c10::IValue out = call("forward_step", ctx, {ids, mask, past});
    auto tuple = out.toTuple();
    cache.clear();
    for (const at::Tensor& t : tuple->elements()[1].toTensorList()) cache.push_back(t);
    return check_logits(tuple->elements()[0].toTensor(), ids, "forward_step");
  }

  at::Tensor check_logits(at::Tensor logits, const at::Tensor& ids, const char* method) {
    const std::int64_t V = cfg_.vocab_size;
    DMI_CHECK(logits.dim() == 3 && logits.size(0) == ids.size(0) && logits.size(1) == ids.size(1) &&
                  (V == 0 || logits.size(2) == V) && at::isFloatingType(logits.scalar_type()),
              "{}: {} returned {} logits of shape {}; expected floating-point [batch {}, length {}, vocab{}]",
              path_, method, c10::toString(logits.scalar_type()), shape_str(logits.sizes()), ids.size(0), ids.size(1),
              V ? fmt::format(" {}", V) : std::string());
    return logits;
  }

  // A two-token forward: checks the convention, finds the vocabulary and
  // every site the module's hook calls produce, with their row shapes.
  void probe() {
    c10::InferenceMode inference;
    const std::int64_t L = 2;
    Probe probe;
    HookContext ctx;
    ctx.probe = &probe;
    const at::Tensor ids = at::zeros({1, L}, at::kLong), mask = at::ones({1, L}, at::kLong);
    at::Tensor logits;
    if (cached_) {
      std::vector<at::Tensor> cache;
      logits = run_step(ctx, ids, mask, cache);
      // One more token through the returned cache: the round trip works.
      Probe again;
      HookContext next;
      next.probe = &again;
      run_step(next, at::zeros({1, 1}, at::kLong), at::ones({1, L + 1}, at::kLong), cache);
    } else {
      logits = run(ctx, ids, mask);
    }
    if (cfg_.vocab_size == 0) cfg_.vocab_size = logits.size(2);
    std::int64_t max_layer = -1;
    for (const auto& [name, calls] : probe.seen) {
      SiteInfo s{};
      DMI_CHECK(hooks::parse_site_name(name, s.site, s.layer),
                "{}: dmi::hook site '{}' is not a TransformerLens site name dmi knows (e.g. blocks.0.hook_resid_post; "
                "see docs/torchscript.md)",
                path_, name);
      DMI_CHECK(calls.size() == 1, "{}: dmi::hook '{}' is called {} times per forward; a site must be produced once",
                path_, name, calls.size());
      const at::Tensor& x = calls[0];
      if (attention_site(s.site)) {
        DMI_CHECK(x.dim() == 4 && x.size(0) == 1 && x.size(2) == L && x.size(3) == L,
                  "{}: dmi::hook '{}' got shape {} for 1 sequence of {} tokens; attention sites are [batch, heads, "
                  "query, key]",
                  path_, name, shape_str(x.sizes()), L);
        s.row = {x.size(1)};
      } else {
        DMI_CHECK(x.dim() >= 3 && x.size(0) == 1 && x.size(1) == L,
                  "{}: dmi::hook '{}' got shape {} for 1 sequence of {} tokens; expected [batch, sequence, ...]",
                  path_, name, shape_str(x.sizes()), L);
        s.row = x.sizes().slice(2).vec();
      }
      max_layer = std::max<std::int64_t>(max_layer, s.layer);
      sites_[name] = s;
    }
    if (cfg_.num_layers == 0) cfg_.num_layers = max_layer + 1;
    // Fill the dimensions config.json does not give from the rows seen, then
    // check every site against them.
    for (const auto& [name, s] : sites_) {
      const auto& r = s.row;
      auto fill = [](std::int64_t& field, std::int64_t v) {
        if (field == 0) field = v;
      };
      switch (s.site) {
        case Site::q: case Site::q_normalized: case Site::rot_q: case Site::z:
          if (r.size() == 2) fill(cfg_.num_heads, r[0]), fill(cfg_.head_dim, r[1]);
          break;
        case Site::k: case Site::v: case Site::k_normalized: case Site::rot_k:
          if (r.size() == 2) fill(cfg_.num_kv_heads, r[0]), fill(cfg_.head_dim, r[1]);
          break;
        case Site::mlp_pre: case Site::mlp_pre_linear: case Site::mlp_post:
          if (r.size() == 1) fill(cfg_.intermediate_size, r[0]);
          break;
        case Site::attn_scores: case Site::pattern: fill(cfg_.num_heads, r[0]); break;
        case Site::logits: break;
        default:
          if (r.size() == 1) fill(cfg_.hidden_size, r[0]);
      }
    }
    hooks::SiteSpace space{static_cast<int>(cfg_.num_layers), false, {}};
    space.available.assign(static_cast<int>(Site::kCount), std::vector<bool>(std::max<std::int64_t>(cfg_.num_layers, 1)));
    space.available[static_cast<int>(Site::logits)][0] = true;
    for (auto& [name, s] : sites_) {
      DMI_CHECK(s.layer < cfg_.num_layers, "{}: dmi::hook '{}' names layer {}, but config.json has num_hidden_layers {}",
                path_, name, s.layer, cfg_.num_layers);
      if (s.site == Site::logits) continue;
      const auto want = hooks::site_row_shape(s.site, cfg_, L);
      std::int64_t want_n = 1, got_n = 1;
      for (auto v : want) want_n *= v;
      for (auto v : s.row) got_n *= v;
      if (attention_site(s.site)) got_n *= L;
      DMI_CHECK(want_n > 0 && want_n == got_n,
                "{}: dmi::hook '{}' has rows of shape {}, which do not fit the model's dimensions (heads {}, kv heads "
                "{}, head_dim {}, intermediate {}, hidden {}); give them in config.json",
                path_, name, shape_str(s.row), cfg_.num_heads, cfg_.num_kv_heads, cfg_.head_dim,
                cfg_.intermediate_size, cfg_.hidden_size);
      space.available[static_cast<int>(s.site)][s.layer < 0 ? 0 : s.layer] = true;
      if (s.site == Site::q_normalized || s.site == Site::k_normalized) space.qk_norm = cfg_.qk_norm = true;
    }
    space_ = std::move(space);
    cfg_.architecture = cfg_.architecture.empty() ? "TorchScript" : "TorchScript/" + cfg_.architecture;
  }

  std::string path_;
  at::ScalarType dtype_;
  torch::jit::Module module_;
  io::ModelConfig cfg_;
  std::size_t weight_bytes_ = 0;
  std::unordered_map<std::string, SiteInfo> sites_;
  hooks::SiteSpace space_;
  bool cached_ = false;  // the module has forward_step (KV-cache convention)
};

}  // namespace

std::unique_ptr<CausalLM> load_torchscript(const std::string& path, at::ScalarType dtype, const std::string& hook_map) {
  return std::make_unique<TorchScriptLM>(path, dtype, hook_map);
}

}  // namespace dmi::model
