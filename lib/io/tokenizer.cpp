#include "io/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "common/error.h"

namespace dmi::io {

namespace {
// Token ids index a table: an id far beyond any real vocabulary (the largest
// are ~260k) is a corrupt file, not a reason to allocate gigabytes.
constexpr std::int64_t kMaxTokenId = 1 << 24;
// Token ids are dense (0..n-1 in every released tokenizer); the id table is
// sized by the largest id, so at most this many ids may be missing.
constexpr std::int64_t kMaxIdGaps = 1 << 16;
}  // namespace

using nlohmann::json;

bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t n = static_cast<utf8proc_ssize_t>(s.size());
  while (n > 0) {
    utf8proc_int32_t cp;
    utf8proc_ssize_t k = utf8proc_iterate(p, n, &cp);
    if (k <= 0) return false;
    p += k;
    n -= k;
  }
  return true;
}

namespace {

// Splits UTF-8 into code points (as strings); input must be valid.
std::vector<std::string> chars_of(std::string_view s) {
  std::vector<std::string> out;
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t n = static_cast<utf8proc_ssize_t>(s.size()), i = 0;
  while (i < n) {
    utf8proc_int32_t cp;
    utf8proc_ssize_t k = utf8proc_iterate(p + i, n - i, &cp);
    if (k <= 0) k = 1;
    out.emplace_back(s.substr(i, k));
    i += k;
  }
  return out;
}

std::string encode_cp(std::int32_t cp) {
  utf8proc_uint8_t buf[4];
  auto n = utf8proc_encode_char(cp, buf);
  return std::string(reinterpret_cast<char*>(buf), n);
}

// Bytes -> printable characters, as GPT-2's byte-level BPE does it.
struct ByteMap {
  std::string to_char[256];
  std::unordered_map<std::string, std::uint8_t> to_byte;
  ByteMap() {
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
    for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
    for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
    std::vector<bool> direct(256, false);
    for (int b : bs) direct[b] = true;
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      int cp = direct[b] ? b : 256 + extra++;
      to_char[b] = encode_cp(cp);
      to_byte[to_char[b]] = static_cast<std::uint8_t>(b);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// UTF-8 with invalid sequences replaced by U+FFFD, as from_utf8_lossy.
std::string lossy_utf8(const std::string& bytes) {
  std::string out;
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(bytes.data());
  utf8proc_ssize_t n = static_cast<utf8proc_ssize_t>(bytes.size()), i = 0;
  while (i < n) {
    utf8proc_int32_t cp;
    utf8proc_ssize_t k = utf8proc_iterate(p + i, n - i, &cp);
    if (k <= 0) {
      out += "\xEF\xBF\xBD";
      ++i;
    } else {
      out.append(bytes, i, k);
      i += k;
    }
  }
  return out;
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  std::size_t i = 0;
  while (true) {
    std::size_t j = s.find(from, i);
    if (j == std::string::npos) break;
    out.append(s, i, j - i);
    out += to;
    i = j + from.size();
  }
  out.append(s, i, std::string::npos);
  s.swap(out);
}

// A compiled PCRE2 pattern (UTF + UCP, JIT when available).
class Regex {
 public:
  Regex(const std::string& pattern, const std::string& where) {
    int err = 0;
    PCRE2_SIZE off = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP,
                          &err, &off, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      DMI_FAIL("{}: regex does not compile at offset {}: {}", where, off, reinterpret_cast<char*>(msg));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // falls back to the interpreter on failure
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // All non-overlapping matches as [begin, end) byte ranges.
  std::vector<std::pair<std::size_t, std::size_t>> find_all(std::string_view s) const {
    std::vector<std::pair<std::size_t, std::size_t>> out;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    std::size_t pos = 0;
    while (pos <= s.size()) {
      int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos, PCRE2_NO_UTF_CHECK, md,
                           nullptr);
      if (rc < 0) break;
      PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      std::size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: step over one code point
        if (b >= s.size()) break;
        std::size_t step = 1;
        while (b + step < s.size() && (static_cast<unsigned char>(s[b + step]) & 0xC0) == 0x80) ++step;
        pos = b + step;
        continue;
      }
      out.emplace_back(b, e);
      pos = e;
    }
    pcre2_match_data_free(md);
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
};

std::string regex_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out += '\\';
    out += c;
  }
  return out;
}

// ---------------------------------------------------------------------------
// Pipeline pieces, parsed from tokenizer.json.

struct Normalizer {
  enum Kind { NFC, NFD, NFKC, NFKD, Lowercase, Prepend, Replace, Strip } kind;
  std::string a, b;
  bool left = false, right = false;
};

struct PreTokenizer {
  enum Kind { Split, ByteLevel, Metaspace, Digits } kind;
  std::shared_ptr<Regex> regex;
  std::string behavior = "Isolated";
  bool invert = false;
  bool add_prefix_space = false;
  std::string replacement = "\xE2\x96\x81";  // ▁
  std::string prepend_scheme = "always";
  bool split = true;
  bool individual_digits = false;
};

struct Decoder {
  enum Kind { ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace } kind;
  std::string a, b;
  int start = 0, stop = 0;
  bool prepend = true;
};

struct TemplatePiece {
  bool sequence;          // the input itself
  std::vector<std::int32_t> ids;  // or these special ids
};

const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string str_field(const json& j, const char* key, const std::string& where) {
  DMI_CHECK(j.is_object() && j.contains(key) && j.at(key).is_string(), "{}: missing string field '{}'", where, key);
  return j.at(key).get<std::string>();
}

// The members of a Sequence (normalizers, pretokenizers, decoders,
// processors): an array, nested at most kMaxSequenceDepth deep.
constexpr int kMaxSequenceDepth = 16;
const json& sequence_items(const json& j, const char* key, const std::string& where, int depth) {
  DMI_CHECK(j.contains(key) && j.at(key).is_array(), "{}: Sequence without a '{}' array", where, key);
  DMI_CHECK(depth < kMaxSequenceDepth, "{}: Sequences nested more than {} deep", where, kMaxSequenceDepth);
  return j.at(key);
}

std::string pattern_of(const json& j, const std::string& where, bool* is_regex) {
  DMI_CHECK(j.contains("pattern") && j["pattern"].is_object(), "{}: missing 'pattern'", where);
  const json& p = j.at("pattern");
  if (p.contains("Regex")) {
    *is_regex = true;
    return p.at("Regex").get<std::string>();
  }
  DMI_CHECK(p.contains("String"), "{}: pattern must be {{\"String\": ...}} or {{\"Regex\": ...}}", where);
  *is_regex = false;
  return p.at("String").get<std::string>();
}

}  // namespace

struct Tokenizer::Impl {
  std::string path;
  // model
  std::unordered_map<std::string, std::int32_t> vocab;
  std::vector<std::string> id_to_token;
  std::unordered_map<std::uint64_t, std::pair<std::int32_t, std::int32_t>> merges;  // (a,b) -> (rank, merged id)
  std::optional<std::int32_t> unk_id;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  std::int32_t byte_ids[256];
  // pipeline
  std::vector<Normalizer> normalizers;
  std::vector<PreTokenizer> pre_tokenizers;
  std::vector<Decoder> decoders;
  std::vector<TemplatePiece> template_single;
  // added tokens
  struct Added {
    std::string content;
    std::int32_t id;
    bool special, lstrip, rstrip;
  };
  std::vector<Added> added;
  std::unique_ptr<Regex> added_regex;
  std::unordered_map<std::string, std::size_t> added_index;
  std::vector<bool> special;
  bool clean_up_spaces = false;  // tokenizer_config.json's clean_up_tokenization_spaces
  // cache of BPE results per pre-token
  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<std::int32_t>> cache;

  void parse_model(const json& m);
  void parse_normalizer(const json& j, int depth = 0);
  void parse_pre_tokenizer(const json& j, int depth = 0);
  void parse_decoder(const json& j, int depth = 0);
  void parse_post_processor(const json& j, int depth = 0);

  std::string normalize(std::string s) const;
  std::vector<std::string> pre_tokenize(const std::string& s, bool first_segment) const;
  void bpe(const std::string& word, std::vector<std::int32_t>& out) const;
  void bpe_uncached(const std::string& word, std::vector<std::int32_t>& out) const;
};

void Tokenizer::Impl::parse_model(const json& m) {
  const std::string where = path + ": model";
  DMI_CHECK(m.is_object(), "{} is missing", where);
  std::string type = m.value("type", "BPE");
  DMI_CHECK(type == "BPE", "{}: type '{}' is not supported (supported: BPE)", where, type);
  DMI_CHECK(m.contains("vocab") && m["vocab"].is_object(), "{}.vocab is missing", where);
  std::int64_t max_id = -1;
  for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
    DMI_CHECK(it.value().is_number_integer() && it.value().get<std::int64_t>() >= 0,
              "{}.vocab['{}'] is not a non-negative id", where, it.key());
    DMI_CHECK(it.value().get<std::int64_t>() < kMaxTokenId, "{}.vocab['{}'] has id {}: implausibly large (limit {})",
              where, it.key(), it.value().get<std::int64_t>(), kMaxTokenId);
    max_id = std::max(max_id, it.value().get<std::int64_t>());
  }
  const auto entries = static_cast<std::int64_t>(m["vocab"].size());
  DMI_CHECK(max_id < entries + kMaxIdGaps, "{}.vocab has ids up to {} for {} entries: too sparse (token ids run from "
            "0 with at most {} missing)", where, max_id, entries, kMaxIdGaps);
  for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
    auto id = it.value().get<std::int32_t>();
    vocab[it.key()] = id;
    if (static_cast<std::size_t>(id) >= id_to_token.size()) id_to_token.resize(id + 1);
    id_to_token[id] = it.key();
  }
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    DMI_CHECK(!m.contains(k) || m[k].is_null() || m[k].get<std::string>().empty(), "{}.{} is not supported", where,
              k);
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    auto it = vocab.find(m["unk_token"].get<std::string>());
    DMI_CHECK(it != vocab.end(), "{}.unk_token '{}' is not in the vocabulary", where,
              m["unk_token"].get<std::string>());
    unk_id = it->second;
  }
  fuse_unk = m.value("fuse_unk", false);
  byte_fallback = m.value("byte_fallback", false);
  ignore_merges = m.contains("ignore_merges") && m["ignore_merges"].is_boolean() && m["ignore_merges"].get<bool>();
  for (int b = 0; b < 256; ++b) {
    auto it = vocab.find(fmt::format("<0x{:02X}>", b));
    byte_ids[b] = it == vocab.end() ? -1 : it->second;
    DMI_CHECK(!byte_fallback || byte_ids[b] >= 0, "{}: byte_fallback is set but token <0x{:02X}> is missing", where,
              b);
  }
  DMI_CHECK(m.contains("merges") && m["merges"].is_array(), "{}.merges is missing", where);
  std::int32_t rank = 0;
  for (const auto& e : m["merges"]) {
    std::string a, b;
    if (e.is_string()) {
      const std::string s = e.get<std::string>();
      auto sp = s.find(' ', 1);  // a space at 0 would be a token of its own
      DMI_CHECK(sp != std::string::npos, "{}.merges[{}] '{}' is not 'A B'", where, rank, s);
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      DMI_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(),
                "{}.merges[{}] is not a pair of strings", where, rank);
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    }
    auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    DMI_CHECK(ia != vocab.end() && ib != vocab.end() && iab != vocab.end(),
              "{}.merges[{}] ('{}', '{}') uses a token missing from the vocabulary", where, rank, a, b);
    std::uint64_t key = (static_cast<std::uint64_t>(ia->second) << 32) | static_cast<std::uint32_t>(ib->second);
    merges.emplace(key, std::make_pair(rank, iab->second));
    ++rank;
  }
}

void Tokenizer::Impl::parse_normalizer(const json& j, int depth) {
  if (j.is_null()) return;
  const std::string where = path + ": normalizer";
  std::string type = str_field(j, "type", where);
  if (type == "Sequence") {
    for (const auto& n : sequence_items(j, "normalizers", where, depth)) parse_normalizer(n, depth + 1);
    return;
  }
  Normalizer n{};
  if (type == "NFC") n.kind = Normalizer::NFC;
  else if (type == "NFD") n.kind = Normalizer::NFD;
  else if (type == "NFKC") n.kind = Normalizer::NFKC;
  else if (type == "NFKD") n.kind = Normalizer::NFKD;
  else if (type == "Lowercase") n.kind = Normalizer::Lowercase;
  else if (type == "Prepend") {
    n.kind = Normalizer::Prepend;
    n.a = str_field(j, "prepend", where);
  } else if (type == "Replace") {
    n.kind = Normalizer::Replace;
    bool is_regex = false;
    n.a = pattern_of(j, where, &is_regex);
    DMI_CHECK(!is_regex, "{}: Replace with a Regex pattern is not supported", where);
    n.b = str_field(j, "content", where);
  } else if (type == "Strip") {
    n.kind = Normalizer::Strip;
    n.left = j.value("strip_left", true);
    n.right = j.value("strip_right", true);
  } else {
    DMI_FAIL("{}: type '{}' is not supported (supported: Sequence, NFC, NFD, NFKC, NFKD, Lowercase, Prepend, "
             "Replace, Strip)", where, type);
  }
  normalizers.push_back(n);
}

void Tokenizer::Impl::parse_pre_tokenizer(const json& j, int depth) {
  if (j.is_null()) return;
  const std::string where = path + ": pre_tokenizer";
  std::string type = str_field(j, "type", where);
  if (type == "Sequence") {
    for (const auto& p : sequence_items(j, "pretokenizers", where, depth)) parse_pre_tokenizer(p, depth + 1);
    return;
  }
  PreTokenizer p{};
  if (type == "Split") {
    p.kind = PreTokenizer::Split;
    bool is_regex = false;
    std::string pat = pattern_of(j, where, &is_regex);
    p.regex = std::make_shared<Regex>(is_regex ? pat : regex_escape(pat), where + ".pattern");
    p.behavior = j.value("behavior", "Isolated");
    p.invert = j.value("invert", false);
    static const char* ok[] = {"Isolated", "Removed", "MergedWithPrevious", "MergedWithNext"};
    DMI_CHECK(std::find(std::begin(ok), std::end(ok), p.behavior) != std::end(ok),
              "{}: Split behavior '{}' is not supported", where, p.behavior);
  } else if (type == "ByteLevel") {
    p.kind = PreTokenizer::ByteLevel;
    p.add_prefix_space = j.value("add_prefix_space", true);
    // ByteLevel adds its prefix space, then splits with GPT-2's pattern.
    if (j.value("use_regex", true)) p.regex = std::make_shared<Regex>(kGpt2Pattern, where);
  } else if (type == "Metaspace") {
    p.kind = PreTokenizer::Metaspace;
    p.replacement = j.value("replacement", std::string("\xE2\x96\x81"));
    if (j.contains("prepend_scheme")) p.prepend_scheme = j.at("prepend_scheme").get<std::string>();
    else p.prepend_scheme = j.value("add_prefix_space", true) ? "always" : "never";
    p.split = j.value("split", true);
    p.regex = std::make_shared<Regex>(regex_escape(p.replacement), where);
  } else if (type == "Digits") {
    p.kind = PreTokenizer::Digits;
    p.individual_digits = j.value("individual_digits", false);
    p.regex = std::make_shared<Regex>(p.individual_digits ? "\\p{Nd}" : "\\p{Nd}+", where);
  } else {
    DMI_FAIL("{}: type '{}' is not supported (supported: Sequence, Split, ByteLevel, Metaspace, Digits)", where,
             type);
  }
  pre_tokenizers.push_back(p);
}

void Tokenizer::Impl::parse_decoder(const json& j, int depth) {
  if (j.is_null()) return;
  const std::string where = path + ": decoder";
  std::string type = str_field(j, "type", where);
  if (type == "Sequence") {
    for (const auto& d : sequence_items(j, "decoders", where, depth)) parse_decoder(d, depth + 1);
    return;
  }
  Decoder d{};
  if (type == "ByteLevel") d.kind = Decoder::ByteLevel;
  else if (type == "ByteFallback") d.kind = Decoder::ByteFallback;
  else if (type == "Fuse") d.kind = Decoder::Fuse;
  else if (type == "Replace") {
    d.kind = Decoder::Replace;
    bool is_regex = false;
    d.a = pattern_of(j, where, &is_regex);
    DMI_CHECK(!is_regex, "{}: Replace with a Regex pattern is not supported", where);
    d.b = str_field(j, "content", where);
  } else if (type == "Strip") {
    d.kind = Decoder::Strip;
    d.a = str_field(j, "content", where);
    d.start = j.value("start", 0);
    d.stop = j.value("stop", 0);
  } else if (type == "Metaspace") {
    d.kind = Decoder::Metaspace;
    d.a = j.value("replacement", std::string("\xE2\x96\x81"));
    std::string scheme = j.contains("prepend_scheme") ? j.at("prepend_scheme").get<std::string>()
                                                      : (j.value("add_prefix_space", true) ? "always" : "never");
    d.prepend = scheme != "never";
  } else {
    DMI_FAIL("{}: type '{}' is not supported (supported: Sequence, ByteLevel, ByteFallback, Fuse, Replace, Strip, "
             "Metaspace)", where, type);
  }
  decoders.push_back(d);
}

void Tokenizer::Impl::parse_post_processor(const json& j, int depth) {
  if (j.is_null()) return;
  const std::string where = path + ": post_processor";
  std::string type = str_field(j, "type", where);
  if (type == "Sequence") {
    for (const auto& p : sequence_items(j, "processors", where, depth)) parse_post_processor(p, depth + 1);
    return;
  }
  if (type == "ByteLevel") return;  // offsets only; ids unchanged
  DMI_CHECK(type == "TemplateProcessing", "{}: type '{}' is not supported (supported: TemplateProcessing, "
            "ByteLevel, Sequence)", where, type);
  DMI_CHECK(j.contains("single") && j["single"].is_array(), "{}.single is missing", where);
  const json& specials = j.value("special_tokens", json::object());
  for (const auto& piece : j["single"]) {
    if (piece.contains("Sequence")) {
      template_single.push_back({true, {}});
    } else {
      DMI_CHECK(piece.contains("SpecialToken"), "{}: template piece {} is neither Sequence nor SpecialToken", where,
                piece.dump());
      std::string name = piece.at("SpecialToken").at("id").get<std::string>();
      DMI_CHECK(specials.contains(name), "{}: special token '{}' is not in special_tokens", where, name);
      TemplatePiece t{false, {}};
      for (const auto& id : specials.at(name).at("ids")) t.ids.push_back(id.get<std::int32_t>());
      template_single.push_back(std::move(t));
    }
  }
}

std::string Tokenizer::Impl::normalize(std::string s) const {
  for (const auto& n : normalizers) {
    switch (n.kind) {
      case Normalizer::NFC:
      case Normalizer::NFD:
      case Normalizer::NFKC:
      case Normalizer::NFKD:
      case Normalizer::Lowercase: {
        int opts = UTF8PROC_STABLE;
        if (n.kind == Normalizer::NFC) opts |= UTF8PROC_COMPOSE;
        if (n.kind == Normalizer::NFD) opts |= UTF8PROC_DECOMPOSE;
        if (n.kind == Normalizer::NFKC) opts |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
        if (n.kind == Normalizer::NFKD) opts |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
        if (n.kind == Normalizer::Lowercase) opts = UTF8PROC_CASEFOLD;
        if (s.empty()) break;
        utf8proc_uint8_t* out = nullptr;
        auto len = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                static_cast<utf8proc_ssize_t>(s.size()), &out, static_cast<utf8proc_option_t>(opts));
        DMI_CHECK(len >= 0, "{}: normalizer failed: {}", path, utf8proc_errmsg(len));
        s.assign(reinterpret_cast<char*>(out), static_cast<std::size_t>(len));
        std::free(out);
        break;
      }
      case Normalizer::Prepend:
        if (!s.empty()) s = n.a + s;
        break;
      case Normalizer::Replace:
        replace_all(s, n.a, n.b);
        break;
      case Normalizer::Strip: {
        auto is_ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
        std::size_t b = 0, e = s.size();
        if (n.left) while (b < e && is_ws(s[b])) ++b;
        if (n.right) while (e > b && is_ws(s[e - 1])) --e;
        s = s.substr(b, e - b);
        break;
      }
    }
  }
  return s;
}

namespace {

// Splits pieces by a regex according to a tokenizers SplitDelimiterBehavior.
void split_by(const Regex& re, const std::string& behavior, bool invert, const std::string& s,
              std::vector<std::string>& out) {
  auto matches = re.find_all(s);
  // segments: (begin, end, is_delimiter)
  std::vector<std::tuple<std::size_t, std::size_t, bool>> segs;
  std::size_t prev = 0;
  for (auto [b, e] : matches) {
    if (b > prev) segs.emplace_back(prev, b, invert);
    segs.emplace_back(b, e, !invert);
    prev = e;
  }
  if (prev < s.size()) segs.emplace_back(prev, s.size(), invert);
  if (behavior == "Isolated") {
    for (auto [b, e, d] : segs) out.push_back(s.substr(b, e - b));
  } else if (behavior == "Removed") {
    for (auto [b, e, d] : segs)
      if (!d) out.push_back(s.substr(b, e - b));
  } else if (behavior == "MergedWithPrevious") {
    std::string cur;
    for (auto [b, e, d] : segs) {
      cur += s.substr(b, e - b);
      if (d) {
        out.push_back(cur);
        cur.clear();
      }
    }
    if (!cur.empty()) out.push_back(cur);
  } else {  // MergedWithNext
    std::string cur;
    for (auto [b, e, d] : segs) {
      if (d && !cur.empty()) {
        out.push_back(cur);
        cur.clear();
      }
      cur += s.substr(b, e - b);
    }
    if (!cur.empty()) out.push_back(cur);
  }
}

}  // namespace

std::vector<std::string> Tokenizer::Impl::pre_tokenize(const std::string& s, bool first_segment) const {
  std::vector<std::string> pieces{s};
  for (const auto& p : pre_tokenizers) {
    std::vector<std::string> next;
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      std::string piece = pieces[i];
      switch (p.kind) {
        case PreTokenizer::Split:
        case PreTokenizer::Digits:
          split_by(*p.regex, p.kind == PreTokenizer::Digits ? "Isolated" : p.behavior, p.invert, piece, next);
          break;
        case PreTokenizer::ByteLevel: {
          if (p.add_prefix_space && (piece.empty() || piece[0] != ' ')) piece = " " + piece;
          std::vector<std::string> parts;
          if (p.regex) split_by(*p.regex, "Isolated", false, piece, parts);
          else parts.push_back(piece);
          const auto& bm = byte_map();
          for (const auto& part : parts) {
            std::string mapped;
            for (unsigned char c : part) mapped += bm.to_char[c];
            next.push_back(std::move(mapped));
          }
          break;
        }
        case PreTokenizer::Metaspace: {
          replace_all(piece, " ", p.replacement);
          bool prepend = p.prepend_scheme == "always" || (p.prepend_scheme == "first" && first_segment && i == 0);
          if (prepend && piece.compare(0, p.replacement.size(), p.replacement) != 0) piece = p.replacement + piece;
          if (p.split) {
            split_by(*p.regex, "MergedWithNext", false, piece, next);
          } else {
            next.push_back(piece);
          }
          break;
        }
      }
    }
    pieces.swap(next);
  }
  pieces.erase(std::remove(pieces.begin(), pieces.end(), std::string()), pieces.end());
  return pieces;
}

void Tokenizer::Impl::bpe(const std::string& word, std::vector<std::int32_t>& out) const {
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    auto it = cache.find(word);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<std::int32_t> ids;
  bpe_uncached(word, ids);
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(cache_mu);
  if (cache.size() > 200000) cache.clear();
  cache.emplace(word, std::move(ids));
}

void Tokenizer::Impl::bpe_uncached(const std::string& word, std::vector<std::int32_t>& out) const {
  if (ignore_merges) {
    auto it = vocab.find(word);
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // Initial symbols: one per character, or its bytes (<0xNN>), or unk.
  std::vector<std::int32_t> sym;
  bool last_unk = false;
  for (const auto& ch : chars_of(word)) {
    auto it = vocab.find(ch);
    if (it != vocab.end()) {
      sym.push_back(it->second);
      last_unk = false;
    } else if (byte_fallback) {
      for (unsigned char c : ch) sym.push_back(byte_ids[c]);
      last_unk = false;
    } else if (unk_id) {
      if (!(fuse_unk && last_unk)) sym.push_back(*unk_id);
      last_unk = true;
    } else {
      DMI_FAIL("{}: character '{}' is not in the vocabulary and the model has neither unk_token nor byte_fallback",
               path, ch);
    }
  }
  // Merge by rank with a priority queue over adjacent pairs (lowest rank,
  // then leftmost), skipping entries made stale by earlier merges.
  const std::size_t n = sym.size();
  std::vector<std::int64_t> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (std::size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<std::int64_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<std::int64_t>(i + 1) : -1;
  }
  using Entry = std::tuple<std::int32_t, std::size_t, std::int32_t, std::int32_t>;  // rank, pos, left id, right id
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> pq;
  auto push = [&](std::size_t i) {
    if (next[i] < 0) return;
    std::uint64_t key = (static_cast<std::uint64_t>(sym[i]) << 32) | static_cast<std::uint32_t>(sym[next[i]]);
    auto it = merges.find(key);
    if (it != merges.end()) pq.emplace(it->second.first, i, sym[i], sym[next[i]]);
  };
  for (std::size_t i = 0; i + 1 < n; ++i) push(i);
  while (!pq.empty()) {
    auto [rank, i, l, r] = pq.top();
    pq.pop();
    if (!alive[i] || next[i] < 0 || sym[i] != l || sym[next[i]] != r) continue;
    std::size_t j = static_cast<std::size_t>(next[i]);
    std::uint64_t key = (static_cast<std::uint64_t>(l) << 32) | static_cast<std::uint32_t>(r);
    sym[i] = merges.at(key).second;
    alive[j] = false;
    next[i] = next[j];
    if (next[j] >= 0) prev[next[j]] = static_cast<std::int64_t>(i);
    if (prev[i] >= 0) push(static_cast<std::size_t>(prev[i]));
    push(i);
  }
  for (std::size_t i = 0; i < n; ++i)
    if (alive[i]) out.push_back(sym[i]);
}

// ---------------------------------------------------------------------------

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DMI_CHECK(f, "{}: cannot read tokenizer", path);
  std::stringstream ss;
  ss << f.rdbuf();
  Tokenizer t = parse(ss.str(), path);
  // Decoding options Hugging Face keeps in tokenizer_config.json beside it.
  const auto slash = path.rfind('/');
  const std::string cfg_path = (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) +
                               "tokenizer_config.json";
  std::ifstream cf(cfg_path, std::ios::binary);
  if (cf) {
    json c;
    try {
      c = json::parse(cf);
    } catch (const json::exception& e) {
      DMI_FAIL("{}: malformed JSON: {}", cfg_path, e.what());
    }
    if (c.is_object() && c.contains("clean_up_tokenization_spaces") && c["clean_up_tokenization_spaces"].is_boolean())
      t.impl_->clean_up_spaces = c["clean_up_tokenization_spaces"].get<bool>();
  }
  return t;
}

Tokenizer Tokenizer::parse(const std::string& text, const std::string& path) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    DMI_FAIL("{}: malformed tokenizer JSON: {}", path, e.what());
  }
  DMI_CHECK(j.is_object(), "{}: tokenizer.json must be a JSON object", path);
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  try {
    impl->parse_model(j.value("model", json()));
    impl->parse_normalizer(j.value("normalizer", json()));
    impl->parse_pre_tokenizer(j.value("pre_tokenizer", json()));
    impl->parse_decoder(j.value("decoder", json()));
    impl->parse_post_processor(j.value("post_processor", json()));
    if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
      for (const auto& a : j["added_tokens"]) {
        const std::string content = str_field(a, "content", path + ": added_tokens");
        DMI_CHECK(a.contains("id") && a["id"].is_number_integer() && a["id"].get<std::int64_t>() >= 0 &&
                      a["id"].get<std::int64_t>() < kMaxTokenId,
                  "{}: added token '{}' has no id, a negative one, or one beyond {}", path, content, kMaxTokenId);
        Impl::Added t{content, a["id"].get<std::int32_t>(), a.value("special", false), a.value("lstrip", false),
                      a.value("rstrip", false)};
        DMI_CHECK(t.id < static_cast<std::int64_t>(impl->id_to_token.size() + impl->added.size()) + kMaxIdGaps,
                  "{}: added token '{}' has id {}, far beyond the vocabulary's {} ids: too sparse", path, content, t.id,
                  impl->id_to_token.size());
        if (static_cast<std::size_t>(t.id) >= impl->id_to_token.size()) impl->id_to_token.resize(t.id + 1);
        impl->id_to_token[t.id] = t.content;
        impl->vocab[t.content] = t.id;
        impl->added_index[t.content] = impl->added.size();
        impl->added.push_back(t);
      }
    }
  } catch (const json::exception& e) {
    DMI_FAIL("{}: malformed tokenizer: {}", path, e.what());
  }
  impl->special.assign(impl->id_to_token.size(), false);
  for (const auto& a : impl->added)
    if (a.special) impl->special[a.id] = true;
  if (!impl->added.empty()) {
    std::vector<const Impl::Added*> by_len;
    for (const auto& a : impl->added) by_len.push_back(&a);
    std::stable_sort(by_len.begin(), by_len.end(),
                     [](auto* a, auto* b) { return a->content.size() > b->content.size(); });
    std::string pat;
    for (auto* a : by_len) {
      if (a->content.empty()) continue;
      if (!pat.empty()) pat += '|';
      pat += regex_escape(a->content);
    }
    if (!pat.empty()) impl->added_regex = std::make_unique<Regex>(pat, path + ": added_tokens");
  }
  return Tokenizer(std::move(impl));
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& m = *impl_;
  DMI_CHECK(valid_utf8(text), "text to encode is not valid UTF-8");
  std::vector<std::int32_t> ids;
  // Added tokens are matched first (leftmost, longest), on the raw text.
  std::vector<std::pair<std::size_t, std::size_t>> hits;
  if (m.added_regex) hits = m.added_regex->find_all(text);
  auto is_ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  std::size_t pos = 0;
  bool first = true;
  auto encode_segment = [&](std::size_t b, std::size_t e) {
    if (e <= b) return;
    std::string norm = m.normalize(std::string(text.substr(b, e - b)));
    for (const auto& piece : m.pre_tokenize(norm, first)) m.bpe(piece, ids);
    first = false;
  };
  for (auto [b, e] : hits) {
    const auto& a = m.added[m.added_index.at(std::string(text.substr(b, e - b)))];
    std::size_t seg_end = b, next_pos = e;
    if (a.lstrip)
      while (seg_end > pos && is_ws(text[seg_end - 1])) --seg_end;
    if (a.rstrip)
      while (next_pos < text.size() && is_ws(text[next_pos])) ++next_pos;
    if (b < pos) continue;  // swallowed by a previous rstrip
    encode_segment(pos, seg_end);
    ids.push_back(a.id);
    first = false;
    pos = next_pos;
  }
  encode_segment(pos, text.size());
  if (!add_special_tokens || m.template_single.empty()) return ids;
  std::vector<std::int32_t> out;
  for (const auto& t : m.template_single) {
    if (t.sequence) out.insert(out.end(), ids.begin(), ids.end());
    else out.insert(out.end(), t.ids.begin(), t.ids.end());
  }
  return out;
}

std::string Tokenizer::decode(const std::vector<std::int32_t>& ids, bool skip_special_tokens) const {
  const Impl& m = *impl_;
  std::vector<std::string> toks;
  for (auto id : ids) {
    // Models often have more embedding rows than the tokenizer has tokens;
    // like Hugging Face, ids without a token decode to nothing.
    if (id < 0 || static_cast<std::size_t>(id) >= m.id_to_token.size()) continue;
    if (skip_special_tokens && m.special[id]) continue;
    toks.push_back(m.id_to_token[id]);
  }
  for (const auto& d : m.decoders) {
    switch (d.kind) {
      case Decoder::ByteLevel: {
        const auto& bm = byte_map();
        std::string bytes;
        for (const auto& t : toks)
          for (const auto& ch : chars_of(t)) {
            auto it = bm.to_byte.find(ch);
            if (it != bm.to_byte.end()) bytes += static_cast<char>(it->second);
            else bytes += ch;
          }
        toks = {lossy_utf8(bytes)};
        break;
      }
      case Decoder::Replace:
        for (auto& t : toks) replace_all(t, d.a, d.b);
        break;
      case Decoder::ByteFallback: {
        std::vector<std::string> out;
        std::string pending;
        std::size_t pending_n = 0;
        auto flush = [&] {
          if (!pending_n) return;
          if (valid_utf8(pending)) out.push_back(pending);
          else
            for (std::size_t k = 0; k < pending_n; ++k) out.push_back("\xEF\xBF\xBD");
          pending.clear();
          pending_n = 0;
        };
        for (const auto& t : toks) {
          unsigned v = 0;
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
              std::sscanf(t.c_str() + 3, "%2x", &v) == 1) {
            pending += static_cast<char>(v);
            ++pending_n;
          } else {
            flush();
            out.push_back(t);
          }
        }
        flush();
        toks.swap(out);
        break;
      }
      case Decoder::Fuse: {
        std::string all;
        for (const auto& t : toks) all += t;
        toks = {all};
        break;
      }
      case Decoder::Strip:
        for (auto& t : toks) {
          std::size_t b = 0, e = t.size();
          for (int k = 0; k < d.start && b < e && t.compare(b, d.a.size(), d.a) == 0; ++k) b += d.a.size();
          for (int k = 0; k < d.stop && e >= b + d.a.size() && t.compare(e - d.a.size(), d.a.size(), d.a) == 0; ++k)
            e -= d.a.size();
          t = t.substr(b, e - b);
        }
        break;
      case Decoder::Metaspace:
        for (std::size_t i = 0; i < toks.size(); ++i) {
          replace_all(toks[i], d.a, " ");
          if (i == 0 && d.prepend && !toks[i].empty() && toks[i][0] == ' ') toks[i].erase(0, 1);
        }
        break;
    }
  }
  std::string out;
  for (const auto& t : toks) out += t;
  if (m.clean_up_spaces) {
    // transformers' clean_up_tokenization, in its order.
    static const std::pair<const char*, const char*> kCleanup[] = {
        {" .", "."}, {" ?", "?"}, {" !", "!"}, {" ,", ","}, {" ' ", "'"},
        {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"}, {" 've", "'ve"}, {" 're", "'re"}};
    for (const auto& [from, to] : kCleanup) replace_all(out, from, to);
  }
  return out;
}

std::int64_t Tokenizer::vocab_size() const { return static_cast<std::int64_t>(impl_->id_to_token.size()); }

std::optional<std::int32_t> Tokenizer::token_to_id(const std::string& token) const {
  auto it = impl_->vocab.find(token);
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

const std::string& Tokenizer::id_to_token(std::int32_t id) const {
  DMI_CHECK(id >= 0 && static_cast<std::size_t>(id) < impl_->id_to_token.size(), "token id {} is out of range", id);
  return impl_->id_to_token[id];
}

bool Tokenizer::is_special(std::int32_t id) const {
  return id >= 0 && static_cast<std::size_t>(id) < impl_->special.size() && impl_->special[id];
}

const std::string& Tokenizer::path() const { return impl_->path; }

}  // namespace dmi::io
