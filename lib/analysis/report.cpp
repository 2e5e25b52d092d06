#include "analysis/report.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>
#include <nlohmann/json.hpp>

#include "common/error.h"

namespace dmi::analysis {

namespace {

using nlohmann::json;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// The page: styles and script inline; the data in a JSON script element.
// The Content-Security-Policy comes first: the page may run its own inline
// script and styles and load nothing, from anywhere.
constexpr const char* kHead = R"HTML(<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; connect-src 'none'; form-action 'none'; base-uri 'none'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>)HTML";

constexpr const char* kStyle = R"HTML(</title>
<style>
body { font: 14px/1.45 "DejaVu Sans", Verdana, sans-serif; margin: 0 24px 40px; color: #1e1e1e; background: #fff; }
h1 { font-size: 20px; margin: 18px 0 6px; } h2 { font-size: 16px; margin: 22px 0 8px; }
table.kv td { padding: 1px 12px 1px 0; vertical-align: top; } table.kv td:first-child { color: #666; }
#tokens { line-height: 2.1; max-width: 1100px; }
.tok { padding: 2px 1px; border-right: 1px solid #ccc; white-space: pre; cursor: default; font-family: "DejaVu Sans Mono", monospace; }
.tok.prompt { background: #e8eef8; } .tok.gen { background: #e9f6e4; } .tok:hover, .tok.sel { outline: 2px solid #c33; }
#tip { position: fixed; display: none; background: #fffff4; border: 1px solid #999; padding: 6px 9px; font-size: 12px; box-shadow: 2px 2px 6px #0003; pointer-events: none; max-width: 420px; }
#tip table td { padding: 0 6px 0 0; } .bar { display: inline-block; height: 9px; background: #5b8fd6; vertical-align: middle; }
select { font: inherit; margin-right: 12px; } #grid canvas { margin: 2px; border: 1px solid #ccc; cursor: pointer; image-rendering: pixelated; }
#grid div { display: inline-block; text-align: center; font-size: 11px; } #hover { font-family: monospace; min-height: 1.5em; }
.legend span { padding: 1px 6px; margin-right: 8px; } .note { color: #a44; }
</style></head><body>
<h1 id="title"></h1><table class="kv" id="settings"></table>
<ul id="notes"></ul>
<h2>Text</h2><div>sequence <select id="seq"></select><span class="legend"><span class="tok prompt">prompt</span><span class="tok gen">generated</span></span> hover a token: its top next tokens and residual norm per layer</div>
<p id="seqinfo"></p><div id="tokens"></div><div id="tip"></div>
<h2>Attention</h2><div id="attnctl">layer <select id="layer"></select> head <select id="head"></select></div>
<div id="hover"></div><div id="heatmap"></div>
<h3 id="gridtitle"></h3><div id="grid"></div>
<script type="application/json" id="dmi-data">)HTML";

constexpr const char* kScript = R"HTML(</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("dmi-data").textContent);
const $ = (id) => document.getElementById(id);
// The view, also from the address: #seq=1&layer=3&head=2&pos=7 (pos: a token's details shown).
const st = { seq: D.sequences.length ? D.sequences[0].seq : 0, layer: null, head: 0, pos: null };
for (const kv of location.hash.slice(1).split("&")) {
  const [k, v] = kv.split("=");
  if (k in st && v !== undefined && v !== "") st[k] = Number(v);
}
const VIR = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function colour(v) {
  if (!isFinite(v)) return [0, 0, 0];
  v = Math.min(1, Math.max(0, v)) * 4;
  const i = Math.min(3, Math.floor(v)), t = v - i;
  return VIR[i].map((a, c) => Math.round(a + t * (VIR[i + 1][c] - a)));
}
function esc(s) { return String(s).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c])); }
function label(s) { return s.replace(/\n/g, "\\n").replace(/\t/g, "\\t").replace(/ /g, "\u00b7"); }
function seqData() { return D.sequences.find((s) => s.seq === st.seq) || D.sequences[0]; }

function settings() {
  $("title").textContent = "dmi capture " + D.file;
  const rows = D.settings.map(([k, v]) => "<tr><td>" + esc(k) + "</td><td>" + esc(v) + "</td></tr>");
  $("settings").innerHTML = rows.join("");
  $("notes").innerHTML = D.left_out.map((n) => '<li class="note">' + esc(n) + "</li>").join("");
  $("seq").innerHTML = D.sequences.map((s) => '<option value="' + s.seq + '">' + s.seq + ": " +
    esc(s.prompt.slice(0, 60)) + "</option>").join("");
  $("seq").value = st.seq;
}

function text() {
  const s = seqData();
  if (!s) return;
  $("seqinfo").textContent = s.tokens.length + " tokens (" + s.prompt_length + " prompt), finish reason " + s.finish_reason;
  $("tokens").innerHTML = s.tokens.map((t, p) => '<span class="tok ' + (p < s.prompt_length ? "prompt" : "gen") +
    '" data-pos="' + p + '">' + esc(t[1]) + "</span>").join("");
}

function tip(ev) {
  const el = ev.target.closest(".tok");
  if (!el) { $("tip").style.display = "none"; return; }
  details(Number(el.dataset.pos), ev.clientX + 14, ev.clientY + 16);
}

function details(p, x, y) {
  const t = $("tip"), s = seqData(), tok = s.tokens[p];
  if (!tok) return;
  let h = "<b>" + p + "</b> " + esc(JSON.stringify(tok[1])) + " (id " + tok[0] + ")";
  const lg = s.logits && s.logits[p];
  if (lg) h += "<br>next token (" + D.logits_kind + "):<table>" + lg.map(([id, txt, v]) =>
    "<tr><td>" + esc(JSON.stringify(txt)) + "</td><td>#" + id + "</td><td>" + v.toFixed(4) + '</td><td><span class="bar" style="width:' +
    Math.round(60 * (D.logits_kind === "probability" ? v : 1)) + 'px"></span></td></tr>').join("") + "</table>";
  const nm = s.norms && s.norms[p];
  if (nm) {
    const mx = Math.max(...nm.filter((x) => x !== null), 1e-30);
    h += "residual norm (" + D.norm_site + ") per layer:<table>" + nm.map((v, l) => v === null ? "" :
      "<tr><td>" + l + "</td><td>" + v.toFixed(3) + '</td><td><span class="bar" style="width:' +
      Math.round(80 * v / mx) + 'px"></span></td></tr>').join("") + "</table>";
  }
  if (!lg && !nm) h += "<br>(no logits or residual stream captured for this token)";
  t.innerHTML = h;
  t.style.display = "block";
  t.style.left = Math.max(0, Math.min(x, window.innerWidth - 440)) + "px";
  t.style.top = y + "px";
}

function maps() { return D.attention.filter((a) => a.seq === st.seq); }

function attention() {
  const ms = maps();
  if (!ms.length) {
    $("attnctl").style.display = "none";
    $("heatmap").textContent = D.attention.length ? "no attention pattern of this sequence in the page" :
      "no attention patterns captured (dmi-run --hooks pattern)";
    $("grid").innerHTML = ""; $("gridtitle").textContent = "";
    return;
  }
  $("attnctl").style.display = "";
  if (st.layer === null || !ms.some((a) => a.layer === st.layer)) st.layer = ms[0].layer;
  const a = ms.find((m) => m.layer === st.layer);
  if (st.head >= a.heads) st.head = 0;
  $("layer").innerHTML = ms.map((m) => "<option>" + m.layer + "</option>").join("");
  $("layer").value = st.layer;
  $("head").innerHTML = Array.from({ length: a.heads }, (_, h) => "<option>" + h + "</option>").join("");
  $("head").value = st.head;
  const s = seqData(), nq = a.queries.length, nk = a.keys;
  const cell = Math.max(4, Math.min(22, Math.floor(560 / Math.max(nq, nk))));
  const stride = Math.ceil(12 / cell);
  const lw = 110, top = 8, W = lw + nk * cell + 10, H = top + nq * cell + lw;
  const vals = a.values[st.head];
  const out = ['<svg id="pattern" xmlns="http://www.w3.org/2000/svg" width="' + W + '" height="' + H +
    '" font-size="10" data-layer="' + a.layer + '" data-head="' + st.head + '" data-seq="' + a.seq + '">'];
  for (let i = 0; i < nq; ++i) for (let k = 0; k < nk; ++k) {
    const v = vals[i * nk + k] / a.scale, c = colour(v);
    out.push('<rect x="' + (lw + k * cell) + '" y="' + (top + i * cell) + '" width="' + cell + '" height="' + cell +
      '" fill="rgb(' + c + ')" data-q="' + a.queries[i] + '" data-k="' + k + '" data-v="' + v.toFixed(4) + '"></rect>');
  }
  const tk = (p) => esc(p + " " + label(s.tokens[p] ? s.tokens[p][1] : "?").slice(0, 12));
  for (let i = 0; i < nq; i += stride)
    out.push('<text x="' + (lw - 4) + '" y="' + (top + i * cell + cell / 2 + 3) + '" text-anchor="end">' + tk(a.queries[i]) + "</text>");
  for (let k = 0; k < nk; k += stride) {
    const x = lw + k * cell + cell / 2 + 3, y = top + nq * cell + 4;
    out.push('<text transform="translate(' + x + "," + y + ') rotate(-90)" text-anchor="end">' + tk(k) + "</text>");
  }
  out.push("</svg>");
  $("heatmap").innerHTML = out.join("");
  $("gridtitle").textContent = "layer " + a.layer + ": all " + a.heads + " heads (click one)";
  const px = Math.max(1, Math.floor(110 / Math.max(nq, nk)));
  $("grid").innerHTML = "";
  for (let h = 0; h < a.heads; ++h) {
    const box = document.createElement("div"), cv = document.createElement("canvas");
    cv.width = nk * px; cv.height = nq * px; cv.dataset.head = h; cv.title = "head " + h;
    const g = cv.getContext("2d"), img = g.createImageData(nk * px, nq * px);
    for (let i = 0; i < nq * px; ++i) for (let k = 0; k < nk * px; ++k) {
      const c = colour(a.values[h][Math.floor(i / px) * nk + Math.floor(k / px)] / a.scale), o = 4 * (i * nk * px + k);
      img.data[o] = c[0]; img.data[o + 1] = c[1]; img.data[o + 2] = c[2]; img.data[o + 3] = 255;
    }
    g.putImageData(img, 0, 0);
    if (h === st.head) cv.style.outline = "2px solid #c33";
    cv.onclick = () => { st.head = h; attention(); };
    box.appendChild(cv); box.appendChild(document.createElement("br")); box.append("head " + h);
    $("grid").appendChild(box);
  }
}

settings(); text(); attention();
if (st.pos !== null) {
  const el = document.querySelector('.tok[data-pos="' + st.pos + '"]');
  if (el) { el.classList.add("sel"); const r = el.getBoundingClientRect(); details(st.pos, r.left, r.bottom + 6); }
}
$("seq").onchange = () => { st.seq = Number($("seq").value); text(); attention(); };
$("layer").onchange = () => { st.layer = Number($("layer").value); attention(); };
$("head").onchange = () => { st.head = Number($("head").value); attention(); };
$("tokens").onmousemove = tip;
$("tokens").onmouseleave = () => { $("tip").style.display = "none"; };
$("heatmap").onmousemove = (ev) => {
  const r = ev.target.closest("rect");
  const s = seqData();
  $("hover").textContent = r ? "query " + r.dataset.q + " " + JSON.stringify(s.tokens[r.dataset.q][1]) + " -> key " +
    r.dataset.k + " " + JSON.stringify(s.tokens[r.dataset.k][1]) + ": " + r.dataset.v : "";
};
</script></body></html>
)HTML";

}  // namespace

ReportResult write_report(const sink::CaptureFile& f, const std::function<std::string(std::int32_t)>& token_text,
                          const ReportOptions& o, const std::string& output) {
  DMI_CHECK(o.max_mb > 0, "report --max-mb must be positive");
  const std::uint64_t budget = static_cast<std::uint64_t>(o.max_mb * 1e6);
  ReportResult res;
  std::vector<std::int64_t> seqs = o.seqs;
  for (auto s : seqs)
    DMI_CHECK(s >= 0 && static_cast<std::size_t>(s) < f.n_sequences(), "{}: sequence {} does not exist (the file "
              "has {})", f.path(), s, f.n_sequences());
  if (seqs.empty())
    for (std::size_t s = 0; s < f.n_sequences(); ++s)
      if (f.finish_reason(s) != "skipped" && f.finish_reason(s) != "missing") seqs.push_back(static_cast<std::int64_t>(s));
  // The attention layers captured, and the residual site for the norms.
  std::map<int, std::string> pattern_sites, resid_sites;
  for (const auto& e : f.sites()) {
    if (e.layout == "attention" && e.name.find("hook_pattern") != std::string::npos) pattern_sites[e.layer] = e.name;
    if (e.name.find(".hook_resid_post") != std::string::npos) resid_sites[e.layer] = e.name;
  }
  std::string norm_site = "hook_resid_post";
  if (resid_sites.empty()) {
    norm_site = "hook_resid_pre";
    for (const auto& e : f.sites())
      if (e.name.find(".hook_resid_pre") != std::string::npos) resid_sites[e.layer] = e.name;
  }
  std::vector<int> layers;
  for (const auto& [l, _] : pattern_sites)
    if (o.layers.empty() || std::find(o.layers.begin(), o.layers.end(), l) != o.layers.end()) layers.push_back(l);
  for (auto l : o.layers)
    DMI_CHECK(pattern_sites.count(static_cast<int>(l)), "{}: --layers {}: no attention pattern captured at layer {} "
              "(captured: {})", f.path(), l, l, fmt::join([&] {
                std::vector<int> v;
                for (const auto& [k, _] : pattern_sites) v.push_back(k);
                return v;
              }(), ","));
  const std::string logits_site = f.has_site("unembed.hook_out") ? "unembed.hook_out" : "";
  const bool topk = !logits_site.empty() && f.site(logits_site).layout == "topk";

  json data;
  const std::string file_name = std::filesystem::path(f.path()).filename().string();
  data["file"] = file_name;
  json settings = json::array();
  auto add = [&](const std::string& k, const std::string& v) { settings.push_back({k, v}); };
  add("model", f.text_attr("model_path") + " (" + f.text_attr("architecture") + ")");
  add("status", f.status());
  add("records", fmt::format("{} written, {} dropped", f.int_attr("records_written").value_or(0),
                             f.int_attr("records_dropped").value_or(0)));
  add("dtypes", "compute " + f.text_attr("compute_dtype") + ", capture " + f.text_attr("capture_dtype"));
  add("selection", f.text_attr("selection") + " (" + std::to_string(f.sites().size()) + " sites), tokens " +
                       f.text_attr("token_policy") + ", logits " + f.text_attr("logits"));
  add("sampling", f.text_attr("sampling") + ", seed " + std::to_string(f.int_attr("seed").value_or(0)) +
                      ", max new tokens " + std::to_string(f.int_attr("max_new_tokens").value_or(0)) + ", batch size " +
                      std::to_string(f.int_attr("batch_size").value_or(0)));
  add("sequences", std::to_string(f.n_sequences()));
  add("command line", f.text_attr("command_line"));
  add("written by", f.text_attr("tool") + " " + f.text_attr("tool_version"));
  data["settings"] = settings;
  data["logits_kind"] = topk ? "logit" : "probability";
  data["norm_site"] = norm_site;

  // Per sequence: tokens, top next tokens, residual norms (cheap); then
  // attention maps while the budget lasts.
  std::uint64_t used = dump(data).size();
  json sequences = json::array();
  std::vector<std::int64_t> shown;
  for (auto s : seqs) {
    const auto us = static_cast<std::size_t>(s);
    const auto ids = f.tokens(us);
    json seq{{"seq", s}, {"prompt", f.prompt_text(us)}, {"prompt_length", f.prompt_length(us)},
             {"finish_reason", f.finish_reason(us)}};
    json toks = json::array();
    for (auto id : ids) toks.push_back({id, token_text(id)});
    seq["tokens"] = toks;
    if (!logits_site.empty()) {
      json lg = json::object();
      const auto rows = f.find_rows(logits_site, static_cast<std::int32_t>(s));
      const auto& pos = f.pos_of(logits_site);
      if (!rows.empty()) {
        at::Tensor x = f.read_rows(logits_site, rows);  // [n, V] or [n, K]
        at::Tensor idt = topk ? f.read_ids(logits_site, rows) : at::Tensor();
        const int k = static_cast<int>(std::min<std::int64_t>(o.top, x.size(1)));
        at::Tensor val = topk ? x.narrow(1, 0, k) : at::softmax(x.to(at::kDouble), 1).to(at::kFloat);
        at::Tensor top_v, top_i;
        if (topk) {
          top_v = val;
          top_i = idt.narrow(1, 0, k);
        } else {
          std::tie(top_v, top_i) = at::topk(val, k, 1);
        }
        for (std::size_t r = 0; r < rows.size(); ++r) {
          json cand = json::array();
          for (int j = 0; j < k; ++j) {
            const auto id = static_cast<std::int32_t>(top_i[static_cast<std::int64_t>(r)][j].item<std::int64_t>());
            cand.push_back({id, token_text(id), top_v[static_cast<std::int64_t>(r)][j].item<float>()});
          }
          lg[std::to_string(pos[static_cast<std::size_t>(rows[r])])] = cand;
        }
      }
      seq["logits"] = lg;
    }
    if (!resid_sites.empty()) {
      const int n_layers = resid_sites.rbegin()->first + 1;
      std::vector<std::vector<json>> norms(ids.size(), std::vector<json>(static_cast<std::size_t>(n_layers)));
      bool any = false;
      for (const auto& [l, site] : resid_sites) {
        const auto rows = f.find_rows(site, static_cast<std::int32_t>(s));
        if (rows.empty() || l < 0) continue;
        const auto& pos = f.pos_of(site);
        at::Tensor nm = f.read_rows(site, rows).to(at::kDouble).norm(2, 1);
        for (std::size_t r = 0; r < rows.size(); ++r) {
          const auto p = static_cast<std::size_t>(pos[static_cast<std::size_t>(rows[r])]);
          if (p < norms.size()) norms[p][static_cast<std::size_t>(l)] = nm[static_cast<std::int64_t>(r)].item<double>();
          any = true;
        }
      }
      if (any) {
        json byp = json::object();
        for (std::size_t p = 0; p < norms.size(); ++p)
          if (std::any_of(norms[p].begin(), norms[p].end(), [](const json& v) { return !v.is_null(); }))
            byp[std::to_string(p)] = norms[p];
        seq["norms"] = byp;
      }
    }
    const std::uint64_t size = dump(seq).size();
    if (used + size > budget) {
      res.left_out.push_back(fmt::format("sequences from {} on: the page's size cap ({} MB; --max-mb, --seq)", s,
                                         o.max_mb));
      break;
    }
    used += size;
    sequences.push_back(std::move(seq));
    shown.push_back(s);
  }
  data["sequences"] = sequences;
  res.sequences = shown.size();

  // Attention: [heads][queries * keys] as integers (value * scale) for each
  // (sequence, layer), in order, until the cap.
  const double scale = 10000;
  json attention = json::array();
  std::vector<std::string> skipped;
  for (auto s : shown) {
    for (int l : layers) {
      const std::string& site = pattern_sites[l];
      const auto rows = f.find_rows(site, static_cast<std::int32_t>(s));
      if (rows.empty()) continue;
      const auto& pos = f.pos_of(site);
      const std::int64_t nk = pos[static_cast<std::size_t>(rows.back())] + 1;
      at::Tensor x = f.read_rows(site, rows).narrow(2, 0, nk).contiguous();  // [nq, H, nk]
      const std::int64_t H = x.size(1), nq = x.size(0);
      const std::uint64_t estimate = static_cast<std::uint64_t>(H * nq * nk) * 6;
      if (used + estimate > budget) {
        skipped.push_back(fmt::format("{}:{}", s, l));
        continue;
      }
      json heads = json::array();
      at::Tensor xi = (x.permute({1, 0, 2}) * scale).round().to(at::kInt).contiguous();
      const std::int32_t* p = xi.data_ptr<std::int32_t>();
      for (std::int64_t h = 0; h < H; ++h) heads.push_back(std::vector<std::int32_t>(p + h * nq * nk, p + (h + 1) * nq * nk));
      json q = json::array();
      for (auto r : rows) q.push_back(pos[static_cast<std::size_t>(r)]);
      json m{{"seq", s}, {"layer", l}, {"heads", H}, {"queries", q}, {"keys", nk}, {"scale", scale},
             {"values", heads}};
      used += dump(m).size();
      attention.push_back(std::move(m));
    }
  }
  if (!skipped.empty())
    res.left_out.push_back(fmt::format("attention of {} (sequence:layer) pairs, e.g. {}: the page's size cap ({} MB; "
                                       "--max-mb, --seq, --layers)", skipped.size(), skipped.front(), o.max_mb));
  if (!o.layers.empty() && layers.size() < pattern_sites.size())
    res.left_out.push_back(fmt::format("attention layers other than {} (--layers)", fmt::join(layers, ",")));
  if (!o.seqs.empty() && o.seqs.size() < f.n_sequences())
    res.left_out.push_back(fmt::format("sequences other than {} (--seq)", fmt::join(o.seqs, ",")));
  res.attention_maps = attention.size();
  data["attention"] = attention;
  data["left_out"] = res.left_out;

  std::string blob = dump(data);
  // Inside <script>, "</" would end the element early.
  for (std::size_t at = blob.find("</"); at != std::string::npos; at = blob.find("</", at + 3)) blob.replace(at, 2, "<\\/");
  std::string title;
  for (char c : "dmi capture " + file_name)
    title += c == '<' ? std::string("&lt;") : c == '&' ? std::string("&amp;") : std::string(1, c);
  const std::string tmp = output + ".partial";
  {
    std::ofstream out(tmp, std::ios::binary);
    DMI_CHECK(out, "{}: cannot write the report", output);
    out << kHead << title << kStyle << blob << kScript;
    out.close();
    DMI_CHECK(out, "{}: writing the report failed (disk full?)", output);
  }
  DMI_CHECK(std::rename(tmp.c_str(), output.c_str()) == 0, "{}: cannot rename the report into place", output);
  std::ifstream in(output, std::ios::binary | std::ios::ate);
  res.bytes = static_cast<std::uint64_t>(in.tellg());
  return res;
}

}  // namespace dmi::analysis
