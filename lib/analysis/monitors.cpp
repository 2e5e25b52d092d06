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

// What every monitor shares: its spec, name and action, the JSON lines,
// number arguments, the layers= set, and a record's rows as float32.
class Monitor {
 public:
  // log: where the JSON lines go (set once every monitor is checked).
  Monitor(const std::string& spec, const MonitorSetup& setup, std::FILE* const* log)
      : spec_(spec), p_(parse_spec(spec)), log_(log), flags_(setup.stop_flags), n_(setup.prompts.size()) {
    name_ = p_.args.count("name") ? p_.args["name"] : p_.kind;
    DMI_CHECK(!name_.empty() && name_.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-_") == std::string::npos,
              "--monitor {}: name={} must be lowercase letters, digits, - and _", spec, name_);
    stop_ = p_.args["action"] == "stop";
  }
  virtual ~Monitor() = default;
  virtual void rows(std::uint16_t stream, std::uint32_t n, const std::int32_t* seq, const std::int32_t* pos,
                    const void* data) = 0;
  virtual sink::ResultTable table() const = 0;
  const std::string& name() const { return name_; }

 protected:
  // key= as a finite number, or fallback when absent.
  double number(const std::string& key, double fallback) {
    if (!p_.args.count(key)) return fallback;
    const std::string& v = p_.args[key];
    double t = 0;
    std::size_t used = 0;
    try {
      t = std::stod(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    DMI_CHECK(used == v.size() && used > 0 && std::isfinite(t), "--monitor {}: {}={} is not a finite number", spec_,
              key, v);
    return t;
  }
  // key= as a whole number of at least lo, or fallback when absent.
  std::int64_t count(const std::string& key, std::int64_t fallback, std::int64_t lo, const char* what) {
    if (!p_.args.count(key)) return fallback;
    const std::string& v = p_.args[key];
    DMI_CHECK(!v.empty() && v.size() < 9 && v.find_first_not_of("0123456789") == std::string::npos &&
                  std::stoll(v) >= lo,
              "--monitor {}: {}={} is not a count of {} ({} or more)", spec_, key, v, what, lo);
    return std::stoll(v);
  }
  // layers= as a set (empty: every layer).
  std::set<int> layers(const MonitorSetup& setup) {
    std::set<int> out;
    if (!p_.args.count("layers")) return out;
    int most = 0;
    for (const auto& st : setup.streams) most = std::max(most, st.layer + 1);
    for (auto l : hooks::parse_index_set(p_.args["layers"], most, "layers")) out.insert(static_cast<int>(l));
    return out;
  }
  // A record's n rows of shape `shape` in the stored dtype, as float32.
  static at::Tensor float_rows(const void* data, std::uint32_t n, std::vector<std::int64_t> shape,
                               at::ScalarType dtype) {
    shape.insert(shape.begin(), static_cast<std::int64_t>(n));
    return at::from_blob(const_cast<void*>(data), shape, dtype).to(at::kFloat).contiguous();
  }
  // A sequence was flagged: with action=stop, ask the generator to end it.
  // Returns the action, for the JSON line.
  const char* act(std::int32_t seq) {
    if (!stop_) return "log";
    if (flags_ && seq >= 0 && static_cast<std::size_t>(seq) < n_) flags_[seq].store(true, std::memory_order_relaxed);
    return "stop";
  }
  void emit(nlohmann::json line) const {
    line["monitor"] = p_.kind;
    line["name"] = name_;
    std::fprintf(*log_, "%s\n", line.dump().c_str());
    std::fflush(*log_);
  }
  sink::ResultTable table_head(std::vector<std::pair<std::string, std::string>> attrs) const {
    sink::ResultTable t;
    t.group = "monitors/" + name_;
    t.attrs = {{"monitor", p_.kind}, {"spec", spec_}};
    t.attrs.insert(t.attrs.end(), attrs.begin(), attrs.end());
    return t;
  }

  std::string spec_, name_;
  Spec p_;

 private:
  std::FILE* const* log_;
  std::atomic<bool>* flags_;
  std::size_t n_;
  bool stop_ = false;
};

// The Attention Tracker online: the same tracker_focus() over the same
// stored values as `dmi-inspect attn-tracker`.
class AttnTracker final : public Monitor {
 public:
  AttnTracker(const std::string& spec, const MonitorSetup& setup, std::FILE* const* log) : Monitor(spec, setup, log) {
    heads_ = read_tracker_heads(p_.args["heads"]);
    const TokenSpan inst = TokenSpan::parse(p_.args["inst"], "--monitor " + spec + ": inst");
    const TokenSpan data = TokenSpan::parse(p_.args["data"], "--monitor " + spec + ": data");
    threshold_ = number("threshold", 0.5);
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
        streams_[static_cast<std::uint16_t>(s)] = st;
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
    const sink::StreamInfo& st = streams_.at(stream);
    const std::int64_t W = st.row_shape[1];
    at::Tensor rows;  // [n, H, W] float32, made only when a row is wanted
    for (std::uint32_t r = 0; r < n; ++r) {
      const std::int32_t s = seq[r];
      if (s < 0 || static_cast<std::size_t>(s) >= last_.size() || pos[r] != last_[s]) continue;
      if (!rows.defined()) rows = float_rows(data, n, st.row_shape, st.dtype);
      const float* row = rows[r].data_ptr<float>();
      for (std::size_t i : it->second) {
        if (!std::isnan(a_[s][i])) continue;
        a_[s][i] = tracker_focus(row + heads_[i].head * W, W, inst_[s], data_[s]);
        if (--left_[s] == 0) finish(s);
      }
    }
  }

  sink::ResultTable table() const override {
    nlohmann::json heads = nlohmann::json::array();
    for (const auto& h : heads_) heads.push_back({h.layer, h.head});
    sink::ResultTable t = table_head({{"heads", heads.dump()}, {"inst", p_.args.at("inst")}, {"data", p_.args.at("data")},
                                      {"threshold", nlohmann::json(threshold_).dump()}});
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
    nlohmann::json line = {{"seq", s}, {"pos", last_[s]}, {"score", score_[s]}, {"flagged", flagged}, {"a", a_[s]}};
    if (flagged) line["action"] = act(s);
    emit(line);
  }

  std::vector<TrackerHead> heads_;
  double threshold_ = 0.5;
  std::map<std::uint16_t, std::vector<std::size_t>> by_stream_;  // stream -> indexes into heads_
  std::map<std::uint16_t, sink::StreamInfo> streams_;
  std::vector<std::int64_t> last_;
  std::vector<std::pair<std::int64_t, std::int64_t>> inst_, data_;
  std::vector<std::vector<double>> a_;
  std::vector<std::size_t> left_;
  std::vector<double> score_;
};

// Mean attention entropy (nats, over heads) per layer per generated token;
// flags a sequence once the mean over the monitored layers stays below the
// threshold for `window` generated tokens in a row (attention collapse).
class AttnEntropy final : public Monitor {
 public:
  AttnEntropy(const std::string& spec, const MonitorSetup& setup, std::FILE* const* log) : Monitor(spec, setup, log) {
    threshold_ = number("threshold", 0.5);
    window_ = count("window", 16, 1, "tokens");
    const std::set<int> wanted = layers(setup);
    for (std::size_t s = 0; s < setup.streams.size(); ++s) {
      const auto& st = setup.streams[s];
      if (st.layout != sink::Layout::attention || st.name.find("attn.hook_pattern") == std::string::npos) continue;
      if (!wanted.empty() && !wanted.count(st.layer)) continue;
      layer_of_[static_cast<std::uint16_t>(s)] = static_cast<int>(layers_.size());
      streams_[static_cast<std::uint16_t>(s)] = st;
      layers_.push_back(st.layer);
    }
    DMI_CHECK(!layers_.empty() && (wanted.empty() || layers_.size() == wanted.size()), "--monitor {}: the capture "
              "lacks the attention pattern of {} (add --hooks pattern)", spec,
              wanted.empty() ? "every layer" : "some of layers=" + p_.args["layers"]);
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
    const sink::StreamInfo& st = streams_.at(stream);
    const std::int64_t H = st.row_shape[0], W = st.row_shape[1];
    at::Tensor rows;
    for (std::uint32_t r = 0; r < n; ++r) {
      const std::int32_t s = seq[r];
      if (s < 0 || static_cast<std::size_t>(s) >= plen_.size() || pos[r] < plen_[s]) continue;
      if (!rows.defined()) rows = float_rows(data, n, st.row_shape, st.dtype);
      const float* row = rows[r].data_ptr<float>();
      double mean = 0;
      for (std::int64_t h = 0; h < H; ++h) mean += attention_entropy(row + h * W, std::min<std::int64_t>(pos[r] + 1, W));
      mean /= static_cast<double>(H);
      auto& e = pending_[{s, pos[r]}];
      if (e.empty()) e.assign(layers_.size(), std::numeric_limits<double>::quiet_NaN());
      e[it->second] = mean;
      if (std::none_of(e.begin(), e.end(), [](double v) { return std::isnan(v); })) token_done(s, pos[r], e);
    }
  }

  sink::ResultTable table() const override {
    sink::ResultTable t = table_head({{"layers", nlohmann::json(layers_).dump()}, {"window", std::to_string(window_)},
                                      {"threshold", nlohmann::json(threshold_).dump()}});
    const auto n = static_cast<std::int64_t>(seq_.size()), L = static_cast<std::int64_t>(layers_.size());
    sink::ResultTable::Column flag_pos{"flag_pos", {static_cast<std::int64_t>(flag_pos_.size())}, {}, true};
    for (auto p : flag_pos_) flag_pos.values.push_back(static_cast<double>(p));
    t.columns = {{"seq", {n}, seq_, true}, {"pos", {n}, pos_, true}, {"entropy", {n, L}, entropy_, false}, flag_pos};
    return t;
  }

 private:
  void token_done(std::int32_t s, std::int32_t p, std::vector<double> e) {
    pending_.erase({s, p});
    double mean = 0;
    for (double v : e) mean += v;
    mean /= static_cast<double>(e.size());
    seq_.push_back(s);
    pos_.push_back(p);
    entropy_.insert(entropy_.end(), e.begin(), e.end());
    run_[s] = mean < threshold_ ? run_[s] + 1 : 0;
    if (run_[s] >= window_ && flag_pos_[s] < 0) {
      flag_pos_[s] = p;
      emit({{"seq", s}, {"pos", p}, {"flagged", true}, {"entropy", mean}, {"window", window_}, {"action", act(s)}});
    }
  }

  double threshold_ = 0.5;
  std::int64_t window_ = 16;
  std::vector<int> layers_;
  std::map<std::uint16_t, int> layer_of_;  // stream -> index into layers_
  std::map<std::uint16_t, sink::StreamInfo> streams_;
  std::vector<std::int64_t> plen_, flag_pos_, run_;
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
  ResidNorm(const std::string& spec, const MonitorSetup& setup, std::FILE* const* log) : Monitor(spec, setup, log) {
    z_ = number("z", 4.0);
    DMI_CHECK(z_ > 0, "--monitor {}: z={} must be greater than 0", spec, z_);
    warmup_ = count("warmup", 32, 2, "rows");
    const std::string site = p_.args.count("site") ? p_.args["site"] : "resid_post";
    DMI_CHECK(site == "resid_pre" || site == "resid_mid" || site == "resid_post",
              "--monitor {}: site={} is not resid_pre, resid_mid or resid_post", spec, site);
    suffix_ = ".hook_" + site;
    const std::set<int> wanted = layers(setup);
    for (std::size_t s = 0; s < setup.streams.size(); ++s) {
      const auto& st = setup.streams[s];
      if (st.name.size() < suffix_.size() || st.name.compare(st.name.size() - suffix_.size(), suffix_.size(), suffix_))
        continue;
      if (!wanted.empty() && !wanted.count(st.layer)) continue;
      layer_of_[static_cast<std::uint16_t>(s)] = static_cast<int>(layers_.size());
      streams_[static_cast<std::uint16_t>(s)] = st;
      layers_.push_back(st.layer);
    }
    DMI_CHECK(!layers_.empty() && (wanted.empty() || layers_.size() == wanted.size()), "--monitor {}: the capture "
              "lacks {} of {} (add --hooks {})", spec, site, wanted.empty() ? "every layer" : "layers=" + p_.args["layers"],
              site);
    stats_.resize(layers_.size());
  }

  void rows(std::uint16_t stream, std::uint32_t n, const std::int32_t* seq, const std::int32_t* pos,
            const void* data) override {
    auto it = layer_of_.find(stream);
    if (it == layer_of_.end()) return;
    const sink::StreamInfo& info = streams_.at(stream);
    const at::Tensor x = float_rows(data, n, info.row_shape, info.dtype);
    const std::int64_t d = info.row_shape[0];
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
        emit({{"seq", seq[r]}, {"pos", pos[r]}, {"layer", layers_[it->second]}, {"norm", norm}, {"z", z},
              {"flagged", true}, {"action", act(seq[r])}});
      }
    }
  }

  sink::ResultTable table() const override {
    sink::ResultTable t = table_head({{"site", suffix_.substr(1)}, {"layers", nlohmann::json(layers_).dump()},
                                      {"z", nlohmann::json(z_).dump()}, {"warmup", std::to_string(warmup_)},
                                      {"outliers", std::to_string(outliers_)}});
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
  std::string suffix_;
  double z_ = 4.0;
  std::int64_t warmup_ = 32, outliers_ = 0;
  std::vector<int> layers_;
  std::map<std::uint16_t, int> layer_of_;
  std::map<std::uint16_t, sink::StreamInfo> streams_;
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
      const std::string& name = monitors_.back()->name();
      DMI_CHECK(names.insert(name).second, "--monitor {}: two monitors store /monitors/{}; give one a name=", spec,
                name);
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
