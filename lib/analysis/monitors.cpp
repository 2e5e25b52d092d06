#include "analysis/monitors.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "analysis/attn_tracker.h"
#include "common/error.h"
#include "hooks/selection.h"

namespace dmi::analysis {

namespace {

struct Spec {
  std::string kind;
  std::map<std::string, std::string> args;
};

// KIND:key=value,key=value; an item without '=' continues the previous value
// (marker text with commas).
Spec parse_spec(const std::string& s) {
  Spec out;
  const auto colon = s.find(':');
  out.kind = s.substr(0, colon);
  DMI_CHECK(out.kind == "attn-tracker" || out.kind == "attn-entropy" || out.kind == "resid-norm",
            "--monitor {}: unknown monitor '{}' (known: attn-tracker, attn-entropy, resid-norm)", s, out.kind);
  std::string last;
  if (colon != std::string::npos) {
    std::size_t a = colon + 1;
    while (a <= s.size()) {
      std::size_t b = s.find(',', a);
      if (b == std::string::npos) b = s.size();
      const std::string item = s.substr(a, b - a);
      a = b + 1;
      const auto eq = item.find('=');
      if (eq == std::string::npos) {
        DMI_CHECK(!last.empty(), "--monitor {}: '{}' is not key=value", s, item);
        out.args[last] += "," + item;
        continue;
      }
      last = item.substr(0, eq);
      DMI_CHECK(!out.args.count(last), "--monitor {}: {} given twice", s, last);
      out.args[last] = item.substr(eq + 1);
    }
  }
  const bool tracker = out.kind == "attn-tracker";
  const std::set<std::string> allowed =
      tracker                       ? std::set<std::string>{"heads", "inst", "data", "threshold", "name", "action"}
      : out.kind == "attn-entropy" ? std::set<std::string>{"layers", "window", "threshold", "name", "action"}
                                   : std::set<std::string>{"layers", "site", "z", "warmup", "name", "action"};
  for (const auto& [k, v] : out.args)
    DMI_CHECK(allowed.count(k), "--monitor {}: unknown key '{}' (allowed: {})", s, k, fmt::join(allowed, ", "));
  DMI_CHECK(!out.args.count("action") || out.args["action"] == "log" || out.args["action"] == "stop",
            "--monitor {}: action={} is not log or stop", s, out.args["action"]);
  if (tracker)
    for (const char* k : {"heads", "inst", "data"})
      DMI_CHECK(out.args.count(k) && !out.args[k].empty(), "--monitor {}: attn-tracker needs {}=", s, k);
  return out;
}

double parse_threshold(const std::string& spec, const std::string& v) {
  double t = 0;
  try {
    std::size_t used = 0;
    t = std::stod(v, &used);
    DMI_CHECK(used == v.size(), "");
  } catch (const std::exception&) {
    DMI_FAIL("--monitor {}: threshold={} is not a number", spec, v);
  }
  DMI_CHECK(std::isfinite(t), "--monitor {}: threshold={} is not a finite number", spec, v);
  return t;
}

std::string monitor_name(const std::string& spec, Spec& p);

class Monitor {
 public:
  Monitor(const std::string& spec, const MonitorSetup& setup)
      : stop_(parse_spec(spec).args["action"] == "stop"), flags_(setup.stop_flags), n_(setup.prompts.size()) {}
  virtual ~Monitor() = default;
  virtual void rows(std::uint16_t stream, std::uint32_t n, const std::int32_t* seq, const std::int32_t* pos,
                    const void* data) = 0;
  virtual sink::ResultTable table() const = 0;

 protected:
  // A sequence was flagged: with action=stop, ask the generator to end it.
  // Returns the action, for the JSON line.
  const char* act(std::int32_t seq) {
    if (!stop_) return "log";
    if (flags_ && seq >= 0 && static_cast<std::size_t>(seq) < n_) flags_[seq].store(true, std::memory_order_relaxed);
    return "stop";
  }

 private:
  bool stop_;
  std::atomic<bool>* flags_;
  std::size_t n_;
};

// The Attention Tracker online: the same focus() over the same stored
// values as `dmi-inspect attn-tracker`.
class AttnTracker final : public Monitor {
 public:
  // log: where the JSON lines go (set once every monitor is checked).
  AttnTracker(const std::string& spec, const MonitorSetup& setup, std::FILE* const* log)
      : Monitor(spec, setup), spec_(spec), log_(log) {
    Spec p = parse_spec(spec);
    name_ = monitor_name(spec, p);
    heads_ = read_tracker_heads(p.args["heads"]);
    inst_text_ = p.args["inst"];
    data_text_ = p.args["data"];
    const TokenSpan inst = TokenSpan::parse(inst_text_, "--monitor " + spec + ": inst");
    const TokenSpan data = TokenSpan::parse(data_text_, "--monitor " + spec + ": data");
    if (p.args.count("threshold")) threshold_ = parse_threshold(spec, p.args["threshold"]);
    DMI_CHECK(setup.prompt_rows, "--monitor {}: attn-tracker reads the last prompt token's pattern; capture prompt "
              "positions (--tokens last-prompt, prompt or all)", spec);
    for (std::size_t i = 0; i < heads_.size(); ++i) {
      const std::string site = "blocks." + std::to_string(heads_[i].layer) + ".attn.hook_pattern";
      bool found = false;
      for (std::size_t s = 0; s < setup.streams.size(); ++s) {
        const auto& st = setup.streams[s];
        if (st.name != site || st.layout != sink::Layout::attention) continue;
        DMI_CHECK(heads_[i].head < st.row_shape[0], "--monitor {}: head {} of layer {} is out of range ({} heads)",
                  spec, heads_[i].head, heads_[i].layer, st.row_shape[0]);
        by_stream_[static_cast<std::uint16_t>(s)].push_back(i);
        shape_[static_cast<std::uint16_t>(s)] = {st.row_shape[0], st.row_shape[1]};
        dtype_[static_cast<std::uint16_t>(s)] = st.dtype;
        found = true;
      }
      DMI_CHECK(found, "--monitor {}: the capture has no {} (add it: --hooks pattern --tokens last-prompt)", spec,
                site);
    }
    for (std::size_t s = 0; s < setup.prompts.size(); ++s) {
      const auto& prompt = setup.prompts[s];
      last_.push_back(static_cast<std::int64_t>(prompt.size()) - 1);
      inst_.push_back(inst.resolve(prompt, setup.tokenizer, s, "--monitor " + spec + ": inst"));
      data_.push_back(data.resolve(prompt, setup.tokenizer, s, "--monitor " + spec + ": data"));
    }
    a_.assign(setup.prompts.size(), std::vector<double>(heads_.size(), std::numeric_limits<double>::quiet_NaN()));
    left_.assign(setup.prompts.size(), heads_.size());
    score_.assign(setup.prompts.size(), std::numeric_limits<double>::quiet_NaN());
  }

  void rows(std::uint16_t stream, std::uint32_t n, const std::int32_t* seq, const std::int32_t* pos,
            const void* data) override {
    auto it = by_stream_.find(stream);
    if (it == by_stream_.end()) return;
    const auto [H, W] = shape_.at(stream);
    at::Tensor rows;  // [n, H, W] float32, made only when a row is wanted
    for (std::uint32_t r = 0; r < n; ++r) {
      const std::int32_t s = seq[r];
      if (s < 0 || static_cast<std::size_t>(s) >= last_.size() || pos[r] != last_[s]) continue;
      if (!rows.defined())
        rows = at::from_blob(const_cast<void*>(data), {static_cast<std::int64_t>(n), H, W}, dtype_.at(stream))
                   .to(at::kFloat)
                   .contiguous();
      const float* row = rows.data_ptr<float>() + static_cast<std::int64_t>(r) * H * W;
      for (std::size_t i : it->second) {
        if (!std::isnan(a_[s][i])) continue;
        a_[s][i] = tracker_focus(row + heads_[i].head * W, W, inst_[s], data_[s]);
        if (--left_[s] == 0) finish(s);
      }
    }
  }

  sink::ResultTable table() const override {
    sink::ResultTable t;
    t.group = "monitors/" + name_;
    nlohmann::json heads = nlohmann::json::array();
    for (const auto& h : heads_) heads.push_back({h.layer, h.head});
    t.attrs = {{"monitor", "attn-tracker"}, {"spec", spec_}, {"heads", heads.dump()}, {"inst", inst_text_},
               {"data", data_text_}, {"threshold", nlohmann::json(threshold_).dump()}};
    const auto n = static_cast<std::int64_t>(score_.size()), k = static_cast<std::int64_t>(heads_.size());
    sink::ResultTable::Column score{"score", {n}, score_, false};
    sink::ResultTable::Column flagged{"flagged", {n}, {}, true};
    sink::ResultTable::Column a{"a", {n, k}, {}, false};
    for (std::size_t s = 0; s < score_.size(); ++s) {
      flagged.values.push_back(std::isnan(score_[s]) ? -1 : score_[s] <= threshold_ ? 1 : 0);
      a.values.insert(a.values.end(), a_[s].begin(), a_[s].end());
    }
    t.columns = {score, flagged, a};
    return t;
  }

 private:
  void finish(std::int32_t s) {
    double sum = 0;
    for (double v : a_[s]) sum += v;
    score_[s] = sum / static_cast<double>(a_[s].size());
    const bool flagged = score_[s] <= threshold_;
    nlohmann::json line = {{"monitor", "attn-tracker"}, {"name", name_}, {"seq", s}, {"pos", last_[s]},
                           {"score", score_[s]}, {"flagged", flagged}, {"a", a_[s]}};
    if (flagged) line["action"] = act(s);
    std::fprintf(*log_, "%s\n", line.dump().c_str());
    std::fflush(*log_);
  }

  std::string spec_, name_, inst_text_, data_text_;
  std::FILE* const* log_;
  std::vector<TrackerHead> heads_;
  double threshold_ = 0.5;
  std::map<std::uint16_t, std::vector<std::size_t>> by_stream_;  // stream -> indexes into heads_
  std::map<std::uint16_t, std::pair<std::int64_t, std::int64_t>> shape_;
  std::map<std::uint16_t, at::ScalarType> dtype_;
  std::vector<std::int64_t> last_;
  std::vector<std::pair<std::int64_t, std::int64_t>> inst_, data_;
  std::vector<std::vector<double>> a_;
  std::vector<std::size_t> left_;
  std::vector<double> score_;
};

std::string monitor_name(const std::string& spec, Spec& p) {
  const std::string name = p.args.count("name") ? p.args["name"] : p.kind;
  DMI_CHECK(!name.empty() && name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-_") == std::string::npos,
            "--monitor {}: name={} must be lowercase letters, digits, - and _", spec, name);
  return name;
}

// Mean attention entropy (nats, over heads) per layer per generated token;
// flags a sequence once the mean over the monitored layers stays below the
// threshold for `window` generated tokens in a row (attention collapse).
class AttnEntropy final : public Monitor {
 public:
  AttnEntropy(const std::string& spec, const MonitorSetup& setup, std::FILE* const* log)
      : Monitor(spec, setup), spec_(spec), log_(log) {
    Spec p = parse_spec(spec);
    name_ = monitor_name(spec, p);
    if (p.args.count("threshold")) threshold_ = parse_threshold(spec, p.args["threshold"]);
    if (p.args.count("window")) {
      const std::string& w = p.args["window"];
      DMI_CHECK(!w.empty() && w.size() < 7 && w.find_first_not_of("0123456789") == std::string::npos && std::stoi(w) >= 1,
                "--monitor {}: window={} is not a count of tokens (1 or more)", spec, w);
      window_ = std::stoi(w);
    }
    std::set<int> wanted;
    int most = 0;
    for (const auto& st : setup.streams) most = std::max(most, st.layer + 1);
    if (p.args.count("layers"))
      for (auto l : hooks::parse_index_set(p.args["layers"], most, "layers")) wanted.insert(static_cast<int>(l));
    for (std::size_t s = 0; s < setup.streams.size(); ++s) {
      const auto& st = setup.streams[s];
      if (st.layout != sink::Layout::attention || st.name.find("attn.hook_pattern") == std::string::npos) continue;
      if (!wanted.empty() && !wanted.count(st.layer)) continue;
      layer_of_[static_cast<std::uint16_t>(s)] = static_cast<int>(layers_.size());
      layers_.push_back(st.layer);
      shape_[static_cast<std::uint16_t>(s)] = {st.row_shape[0], st.row_shape[1]};
      dtype_[static_cast<std::uint16_t>(s)] = st.dtype;
    }
    DMI_CHECK(!layers_.empty(), "--monitor {}: the capture has no attention pattern{} (add --hooks pattern)", spec,
              wanted.empty() ? "" : " of the layers asked for");
    DMI_CHECK(layers_.size() == wanted.size() || wanted.empty(), "--monitor {}: the capture lacks the pattern of "
              "some of layers={} (capture them: --hooks pattern)", spec, p.args["layers"]);
    DMI_CHECK(setup.generated_rows, "--monitor {}: attn-entropy reads generated tokens' patterns; capture them "
              "(--tokens all or generated)", spec);
    for (const auto& prompt : setup.prompts) plen_.push_back(static_cast<std::int64_t>(prompt.size()));
    run_.assign(plen_.size(), 0);
    flag_pos_.assign(plen_.size(), -1);
  }

  void rows(std::uint16_t stream, std::uint32_t n, const std::int32_t* seq, const std::int32_t* pos,
            const void* data) override {
    auto it = layer_of_.find(stream);
    if (it == layer_of_.end()) return;
    const auto [H, W] = shape_.at(stream);
    at::Tensor rows;
    for (std::uint32_t r = 0; r < n; ++r) {
      const std::int32_t s = seq[r];
      if (s < 0 || static_cast<std::size_t>(s) >= plen_.size() || pos[r] < plen_[s]) continue;
      if (!rows.defined())
        rows = at::from_blob(const_cast<void*>(data), {static_cast<std::int64_t>(n), H, W}, dtype_.at(stream))
                   .to(at::kFloat)
                   .contiguous();
      const float* row = rows.data_ptr<float>() + static_cast<std::int64_t>(r) * H * W;
      double mean = 0;
      for (std::int64_t h = 0; h < H; ++h) mean += attention_entropy(row + h * W, std::min<std::int64_t>(pos[r] + 1, W));
      mean /= static_cast<double>(H);
      auto key = std::make_pair(s, pos[r]);
      auto& e = pending_[key];
      if (e.empty()) e.assign(layers_.size(), std::numeric_limits<double>::quiet_NaN());
      e[it->second] = mean;
      if (std::none_of(e.begin(), e.end(), [](double v) { return std::isnan(v); })) token_done(s, pos[r], e);
    }
  }

  sink::ResultTable table() const override {
    sink::ResultTable t;
    t.group = "monitors/" + name_;
    t.attrs = {{"monitor", "attn-entropy"}, {"spec", spec_}, {"layers", nlohmann::json(layers_).dump()},
               {"window", std::to_string(window_)}, {"threshold", nlohmann::json(threshold_).dump()}};
    const auto n = static_cast<std::int64_t>(seq_.size()), L = static_cast<std::int64_t>(layers_.size());
    sink::ResultTable::Column seq{"seq", {n}, seq_, true}, pos{"pos", {n}, pos_, true};
    sink::ResultTable::Column entropy{"entropy", {n, L}, entropy_, false};
    sink::ResultTable::Column flag_pos{"flag_pos", {static_cast<std::int64_t>(flag_pos_.size())}, {}, true};
    for (auto p : flag_pos_) flag_pos.values.push_back(static_cast<double>(p));
    t.columns = {seq, pos, entropy, flag_pos};
    return t;
  }

 private:
  void token_done(std::int32_t s, std::int32_t p, const std::vector<double>& e) {
    double mean = 0;
    for (double v : e) mean += v;
    mean /= static_cast<double>(e.size());
    seq_.push_back(s);
    pos_.push_back(p);
    entropy_.insert(entropy_.end(), e.begin(), e.end());
    pending_.erase({s, p});
    run_[s] = mean < threshold_ ? run_[s] + 1 : 0;
    if (run_[s] >= window_ && flag_pos_[s] < 0) {
      flag_pos_[s] = p;
      nlohmann::json line = {{"monitor", "attn-entropy"}, {"name", name_}, {"seq", s}, {"pos", p},
                             {"flagged", true}, {"entropy", mean}, {"window", window_}, {"action", act(s)}};
      std::fprintf(*log_, "%s\n", line.dump().c_str());
      std::fflush(*log_);
    }
  }

  std::string spec_, name_;
  std::FILE* const* log_;
  double threshold_ = 0.5;
  int window_ = 16;
  std::vector<int> layers_;
  std::map<std::uint16_t, int> layer_of_;  // stream -> index into layers_
  std::map<std::uint16_t, std::pair<std::int64_t, std::int64_t>> shape_;
  std::map<std::uint16_t, at::ScalarType> dtype_;
  std::vector<std::int64_t> plen_, flag_pos_;
  std::vector<int> run_;
  std::map<std::pair<std::int32_t, std::int32_t>, std::vector<double>> pending_;
  std::vector<double> seq_, pos_, entropy_;
};

// Per layer, the L2 norm of each captured residual row and its z-score
// against the running mean and standard deviation of the rows before it
// (Welford, float64, in the order rows reach the writer: per layer, the
// order of the site's rows in the file). Flags |z| > z once warmup rows are
// in.
class ResidNorm final : public Monitor {
 public:
  ResidNorm(const std::string& spec, const MonitorSetup& setup, std::FILE* const* log)
      : Monitor(spec, setup), spec_(spec), log_(log) {
    Spec p = parse_spec(spec);
    name_ = monitor_name(spec, p);
    if (p.args.count("z")) z_ = parse_threshold(spec, p.args["z"]);
    DMI_CHECK(z_ > 0, "--monitor {}: z={} must be greater than 0", spec, z_);
    if (p.args.count("warmup")) {
      const std::string& w = p.args["warmup"];
      DMI_CHECK(!w.empty() && w.size() < 9 && w.find_first_not_of("0123456789") == std::string::npos && std::stol(w) >= 2,
                "--monitor {}: warmup={} is not a count of rows (2 or more)", spec, w);
      warmup_ = std::stol(w);
    }
    const std::string site = p.args.count("site") ? p.args["site"] : "resid_post";
    const std::set<std::string> sites{"resid_pre", "resid_mid", "resid_post"};
    DMI_CHECK(sites.count(site), "--monitor {}: site={} is not resid_pre, resid_mid or resid_post", spec, site);
    suffix_ = ".hook_" + site;
    std::set<int> wanted;
    int most = 0;
    for (const auto& st : setup.streams) most = std::max(most, st.layer + 1);
    if (p.args.count("layers"))
      for (auto l : hooks::parse_index_set(p.args["layers"], most, "layers")) wanted.insert(static_cast<int>(l));
    for (std::size_t s = 0; s < setup.streams.size(); ++s) {
      const auto& st = setup.streams[s];
      if (st.name.size() < suffix_.size() || st.name.compare(st.name.size() - suffix_.size(), suffix_.size(), suffix_))
        continue;
      if (!wanted.empty() && !wanted.count(st.layer)) continue;
      const auto k = static_cast<std::uint16_t>(s);
      layer_of_[k] = static_cast<int>(layers_.size());
      layers_.push_back(st.layer);
      width_[k] = st.row_shape[0];
      dtype_[k] = st.dtype;
    }
    DMI_CHECK(!layers_.empty() && (wanted.empty() || layers_.size() == wanted.size()), "--monitor {}: the capture "
              "lacks {} of {} (add --hooks {})", spec, site, wanted.empty() ? "every layer" : "layers=" + p.args["layers"],
              site);
    stats_.resize(layers_.size());
  }

  void rows(std::uint16_t stream, std::uint32_t n, const std::int32_t* seq, const std::int32_t* pos,
            const void* data) override {
    auto it = layer_of_.find(stream);
    if (it == layer_of_.end()) return;
    const std::int64_t d = width_.at(stream);
    const at::Tensor x = at::from_blob(const_cast<void*>(data), {static_cast<std::int64_t>(n), d}, dtype_.at(stream))
                             .to(at::kFloat)
                             .contiguous();
    Stats& st = stats_[it->second];
    for (std::uint32_t r = 0; r < n; ++r) {
      const float* row = x.data_ptr<float>() + static_cast<std::int64_t>(r) * d;
      double ss = 0;
      for (std::int64_t i = 0; i < d; ++i) ss += static_cast<double>(row[i]) * row[i];
      const double norm = std::sqrt(ss);
      double z = std::numeric_limits<double>::quiet_NaN();
      if (st.n >= warmup_ && st.m2 > 0) z = (norm - st.mean) / std::sqrt(st.m2 / static_cast<double>(st.n));
      // Welford
      st.n += 1;
      const double delta = norm - st.mean;
      st.mean += delta / static_cast<double>(st.n);
      st.m2 += delta * (norm - st.mean);
      seq_.push_back(seq[r]);
      pos_.push_back(pos[r]);
      layer_.push_back(layers_[it->second]);
      norm_.push_back(norm);
      zs_.push_back(z);
      if (std::abs(z) > z_) {
        ++outliers_;
        nlohmann::json line = {{"monitor", "resid-norm"}, {"name", name_}, {"seq", seq[r]}, {"pos", pos[r]},
                               {"layer", layers_[it->second]}, {"norm", norm}, {"z", z}, {"flagged", true},
                               {"action", act(seq[r])}};
        std::fprintf(*log_, "%s\n", line.dump().c_str());
        std::fflush(*log_);
      }
    }
  }

  sink::ResultTable table() const override {
    sink::ResultTable t;
    t.group = "monitors/" + name_;
    t.attrs = {{"monitor", "resid-norm"}, {"spec", spec_}, {"site", suffix_.substr(1)},
               {"layers", nlohmann::json(layers_).dump()}, {"z", nlohmann::json(z_).dump()},
               {"warmup", std::to_string(warmup_)}, {"outliers", std::to_string(outliers_)}};
    const auto n = static_cast<std::int64_t>(seq_.size());
    t.columns = {{"seq", {n}, seq_, true},     {"pos", {n}, pos_, true}, {"layer", {n}, layer_, true},
                 {"norm", {n}, norm_, false}, {"z", {n}, zs_, false}};
    return t;
  }

 private:
  struct Stats {
    std::int64_t n = 0;
    double mean = 0, m2 = 0;
  };
  std::string spec_, name_, suffix_;
  std::FILE* const* log_;
  double z_ = 4.0;
  std::int64_t warmup_ = 32, outliers_ = 0;
  std::vector<int> layers_;
  std::map<std::uint16_t, int> layer_of_;
  std::map<std::uint16_t, std::int64_t> width_;
  std::map<std::uint16_t, at::ScalarType> dtype_;
  std::vector<Stats> stats_;
  std::vector<double> seq_, pos_, layer_, norm_, zs_;
};

class MonitorSink final : public sink::Sink {
 public:
  // Checks every monitor, then opens the log, then makes the inner sink (so
  // a bad spec creates no file).
  MonitorSink(const std::function<std::unique_ptr<sink::Sink>()>& make_inner, const MonitorSetup& setup) {
    std::set<std::string> names;
    for (const auto& spec : setup.specs) {
      if (spec.rfind("attn-entropy", 0) == 0) monitors_.push_back(std::make_unique<AttnEntropy>(spec, setup, &log_));
      else if (spec.rfind("resid-norm", 0) == 0) monitors_.push_back(std::make_unique<ResidNorm>(spec, setup, &log_));
      else monitors_.push_back(std::make_unique<AttnTracker>(spec, setup, &log_));
      const std::string name = monitors_.back()->table().group;
      DMI_CHECK(names.insert(name).second, "--monitor {}: two monitors store /{}; give one a name=", spec, name);
    }
    if (setup.log_path.empty()) {
      log_ = stderr;
    } else {
      log_ = std::fopen(setup.log_path.c_str(), "w");
      DMI_CHECK(log_, "--monitor-log {}: cannot write: {}", setup.log_path, std::strerror(errno));
      own_log_ = true;
    }
    inner_ = make_inner();
  }
  ~MonitorSink() override {
    if (own_log_) std::fclose(log_);
  }
  void open(const std::vector<sink::StreamInfo>& streams) override { inner_->open(streams); }
  void write(std::uint16_t stream, std::int32_t step, std::uint32_t rows, const std::int32_t* seq,
             const std::int32_t* pos, const void* data, std::size_t bytes) override {
    for (auto& m : monitors_) m->rows(stream, rows, seq, pos, data);
    inner_->write(stream, step, rows, seq, pos, data, bytes);
  }
  void close(const sink::Finish& f) override {
    sink::Finish g = f;
    for (const auto& m : monitors_) g.results.push_back(m->table());
    inner_->close(g);
  }

 private:
  std::unique_ptr<sink::Sink> inner_;
  std::vector<std::unique_ptr<Monitor>> monitors_;
  std::FILE* log_ = nullptr;
  bool own_log_ = false;
};

}  // namespace

void check_monitor_syntax(const std::string& spec) { parse_spec(spec); }

bool monitor_stops(const std::string& spec) { return parse_spec(spec).args["action"] == "stop"; }

std::unique_ptr<sink::Sink> make_monitor_sink(const std::function<std::unique_ptr<sink::Sink>()>& make_inner,
                                              const MonitorSetup& setup) {
  if (setup.specs.empty()) return make_inner();
  return std::make_unique<MonitorSink>(make_inner, setup);
}

}  // namespace dmi::analysis
