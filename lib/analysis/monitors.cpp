#include "analysis/monitors.h"

#include <ATen/ATen.h>

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
  DMI_CHECK(out.kind == "attn-tracker", "--monitor {}: unknown monitor '{}' (known: attn-tracker)", s, out.kind);
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
  const std::set<std::string> allowed{"heads", "inst", "data", "threshold", "name"};
  for (const auto& [k, v] : out.args)
    DMI_CHECK(allowed.count(k), "--monitor {}: unknown key '{}' (allowed: data, heads, inst, name, threshold)", s, k);
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

class Monitor {
 public:
  virtual ~Monitor() = default;
  virtual void rows(std::uint16_t stream, std::uint32_t n, const std::int32_t* seq, const std::int32_t* pos,
                    const void* data) = 0;
  virtual sink::ResultTable table() const = 0;
};

// The Attention Tracker online: the same focus() over the same stored
// values as `dmi-inspect attn-tracker`.
class AttnTracker final : public Monitor {
 public:
  // log: where the JSON lines go (set once every monitor is checked).
  AttnTracker(const std::string& spec, const MonitorSetup& setup, std::FILE* const* log) : spec_(spec), log_(log) {
    Spec p = parse_spec(spec);
    name_ = p.args.count("name") ? p.args["name"] : "attn-tracker";
    DMI_CHECK(!name_.empty() && name_.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-_") == std::string::npos,
              "--monitor {}: name={} must be lowercase letters, digits, - and _", spec, name_);
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
    nlohmann::json line = {{"monitor", "attn-tracker"}, {"name", name_}, {"seq", s}, {"pos", last_[s]},
                           {"score", score_[s]}, {"flagged", score_[s] <= threshold_}, {"a", a_[s]}};
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

class MonitorSink final : public sink::Sink {
 public:
  // Checks every monitor, then opens the log, then makes the inner sink (so
  // a bad spec creates no file).
  MonitorSink(const std::function<std::unique_ptr<sink::Sink>()>& make_inner, const MonitorSetup& setup) {
    std::set<std::string> names;
    for (const auto& spec : setup.specs) {
      monitors_.push_back(std::make_unique<AttnTracker>(spec, setup, &log_));
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

std::unique_ptr<sink::Sink> make_monitor_sink(const std::function<std::unique_ptr<sink::Sink>()>& make_inner,
                                              const MonitorSetup& setup) {
  if (setup.specs.empty()) return make_inner();
  return std::make_unique<MonitorSink>(make_inner, setup);
}

}  // namespace dmi::analysis
