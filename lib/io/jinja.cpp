#include "io/jinja.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <cmath>
#include <ctime>
#include <initializer_list>
#include <map>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

#include "common/error.h"

namespace dmi::io {

using json = nlohmann::ordered_json;
using NodeP = std::shared_ptr<const JinjaTemplate::Node>;

struct JinjaTemplate::Node {
  enum Kind {
    // statements
    Block, Text, Output, If, For, Set, SetBlock, Break, Continue,
    // expressions
    Lit, Var, Attr, Item, Slice, Call, Kwarg, Filter, Test, Unary, Not, Binary, And, Or, Cond, List, Dict
  } kind;
  int line = 0;
  std::string s;                   // text, name, operator, attribute
  std::vector<std::string> names;  // for/set targets
  json lit;
  bool negated = false;            // "is not"
  int depth = 1;                   // of the tree below (bounded: evaluation recurses)
  std::vector<NodeP> c;            // children (null where optional and absent)
};
using Node = JinjaTemplate::Node;

namespace {

// ---------------------------------------------------------------- lexer --

enum class T { Text, Num, Str, Name, Op, OpenStmt, CloseStmt, OpenExpr, CloseExpr, End };
struct Tok {
  T type;
  std::string v;
  int line;
};

bool is_space(char ch) { return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\f' || ch == '\v'; }
bool is_word(char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; }
bool is_digit(char ch) { return ch >= '0' && ch <= '9'; }

// The template as Hugging Face renders it: one trailing newline dropped,
// lstrip_blocks (spaces and tabs before a block tag at a line's start) and
// trim_blocks (the newline after a block tag). line[i]: the source line of
// text[i], for error messages.
struct Source {
  std::string text;
  std::vector<int> line;
};

Source preprocess(std::string_view src) {
  std::vector<int> line(src.size());
  for (std::size_t i = 0, l = 1; i < src.size(); ++i) {
    line[i] = static_cast<int>(l);
    if (src[i] == '\n') ++l;
  }
  std::size_t n = src.size();
  if (n && src[n - 1] == '\n') --n;
  Source a;
  for (std::size_t i = 0; i < n;) {
    if (i == 0 || src[i - 1] == '\n' || src[i - 1] == '\r') {
      std::size_t j = i;
      while (j < n && (src[j] == ' ' || src[j] == '\t')) ++j;
      if (j + 1 < n && src[j] == '{' && (src[j + 1] == '%' || src[j + 1] == '#' || src[j + 1] == '-')) i = j;
    }
    a.text += src[i];
    a.line.push_back(line[i]);
    ++i;
  }
  Source b;
  for (std::size_t i = 0; i < a.text.size(); ++i) {
    if (a.text[i] == '\n' && i >= 2 && a.text[i - 1] == '}' &&
        (a.text[i - 2] == '#' || a.text[i - 2] == '%' || a.text[i - 2] == '-'))
      continue;
    b.text += a.text[i];
    b.line.push_back(a.line[i]);
  }
  return b;
}

void append_utf8(std::string& out, unsigned cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::vector<Tok> tokenize(const Source& src, const std::string& name) {
  const std::string& s = src.text;
  const std::size_t n = s.size();
  auto line_at = [&](std::size_t p) { return src.line.empty() ? 1 : src.line[std::min(p, n - 1)]; };
  auto fail = [&](std::size_t p, const std::string& what) -> void {
    DMI_FAIL("{} line {}: chat template syntax error: {}", name, line_at(p), what);
  };
  std::vector<Tok> toks;
  std::size_t i = 0;
  bool in_tag = false;
  int curly = 0;
  auto strip_trailing = [&] {
    if (!toks.empty() && toks.back().type == T::Text) {
      std::string& t = toks.back().v;
      while (!t.empty() && is_space(t.back())) t.pop_back();
      if (t.empty()) toks.pop_back();
    }
  };
  auto skip_space = [&] {
    while (i < n && is_space(s[i])) ++i;
  };
  auto at = [&](const char* lit) { return s.compare(i, std::strlen(lit), lit) == 0; };
  while (i < n) {
    if (!in_tag) {
      const std::size_t start = i;
      while (i < n && !(s[i] == '{' && i + 1 < n && (s[i + 1] == '%' || s[i + 1] == '{' || s[i + 1] == '#'))) ++i;
      if (i > start) {
        toks.push_back({T::Text, s.substr(start, i - start), line_at(start)});
        continue;
      }
      if (s[i + 1] == '#') {
        const std::size_t open = i;
        i += 2;
        const bool strip_before = i < n && s[i] == '-';
        const std::size_t end = s.find("#}", i);
        if (end == std::string::npos) fail(open, "a comment {# is never closed");
        const bool strip_after = end > i && s[end - 1] == '-';
        if (strip_before) strip_trailing();
        i = end + 2;
        if (strip_after) skip_space();
        continue;
      }
      const bool stmt = s[i + 1] == '%', dash = i + 2 < n && s[i + 2] == '-';
      if (dash) strip_trailing();
      toks.push_back({stmt ? T::OpenStmt : T::OpenExpr, stmt ? "{%" : "{{", line_at(i)});
      i += dash ? 3 : 2;
      in_tag = true;
      curly = 0;
      continue;
    }
    skip_space();
    if (i >= n) fail(n, "a {% or {{ tag is never closed");
    const int line = line_at(i);
    if (at("-%}") || at("%}") || at("-}}") || (at("}}") && curly == 0)) {
      const bool dash = s[i] == '-';
      const bool stmt = s[i + (dash ? 1 : 0)] == '%';
      toks.push_back({stmt ? T::CloseStmt : T::CloseExpr, stmt ? "%}" : "}}", line});
      i += dash ? 3 : 2;
      if (dash) skip_space();
      in_tag = false;
      continue;
    }
    const char ch = s[i];
    if (ch == '\'' || ch == '"') {
      std::string v;
      ++i;
      while (true) {
        if (i >= n) fail(i, "a string literal is never closed");
        if (s[i] == ch) break;
        if (s[i] != '\\') {
          v += s[i++];
          continue;
        }
        if (++i >= n) fail(i, "a string literal is never closed");
        const char e = s[i++];
        switch (e) {
          case 'n': v += '\n'; break;
          case 't': v += '\t'; break;
          case 'r': v += '\r'; break;
          case 'b': v += '\b'; break;
          case 'f': v += '\f'; break;
          case 'v': v += '\v'; break;
          case '\'': case '"': case '\\': v += e; break;
          case 'x': case 'u': {
            const std::size_t len = e == 'x' ? 2 : 4;
            const std::string hex = s.substr(i, len);
            if (hex.size() != len || hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
              fail(i, fmt::format("invalid escape \\{}{}", e, hex));
            append_utf8(v, static_cast<unsigned>(std::stoul(hex, nullptr, 16)));
            i += len;
            break;
          }
          default: fail(i, fmt::format("unknown escape \\{} in a string literal", e));
        }
      }
      ++i;
      toks.push_back({T::Str, v, line});
      continue;
    }
    if (is_digit(ch)) {
      const std::size_t start = i;
      while (i < n && is_digit(s[i])) ++i;
      if ((toks.empty() || toks.back().v != ".") && i + 1 < n && s[i] == '.' && is_digit(s[i + 1])) {
        ++i;
        while (i < n && is_digit(s[i])) ++i;
      }
      toks.push_back({T::Num, s.substr(start, i - start), line});
      continue;
    }
    if (is_word(ch)) {
      const std::size_t start = i;
      while (i < n && is_word(s[i])) ++i;
      toks.push_back({T::Name, s.substr(start, i - start), line});
      continue;
    }
    static const char* const ops[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">",
                                      "=",  "(",  ")",  "[",  "]",  "{",  "}", ",", ".", ":", "|"};
    bool matched = false;
    for (const char* op : ops)
      if (at(op)) {
        toks.push_back({T::Op, op, line});
        i += std::strlen(op);
        if (op[0] == '{' && !op[1]) ++curly;
        if (op[0] == '}' && !op[1]) --curly;
        matched = true;
        break;
      }
    if (!matched) fail(i, fmt::format("unexpected character '{}'", ch));
  }
  if (in_tag) fail(n, "a {% or {{ tag is never closed");
  toks.push_back({T::End, "", line_at(n)});
  return toks;
}

// --------------------------------------------------------------- parser --

class Parser {
 public:
  Parser(std::vector<Tok> toks, std::string name) : t_(std::move(toks)), name_(std::move(name)) {}

  NodeP program() {
    std::string end;
    NodeP body = block({}, end);
    return body;
  }

 private:
  std::vector<Tok> t_;
  std::size_t p_ = 0;
  std::string name_;

  const Tok& peek(std::size_t k = 0) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
  [[noreturn]] void fail(const std::string& what, int line = -1) const {
    DMI_FAIL("{} line {}: {}", name_, line < 0 ? peek().line : line, what);
  }
  bool is_op(const char* op, std::size_t k = 0) const { return peek(k).type == T::Op && peek(k).v == op; }
  bool is_name(const char* w, std::size_t k = 0) const { return peek(k).type == T::Name && peek(k).v == w; }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(fmt::format("chat template syntax error: expected '{}', got '{}'", op, peek().v));
    ++p_;
  }
  void expect(T type, const char* what) {
    if (peek().type != type) fail(fmt::format("chat template syntax error: expected {}, got '{}'", what, peek().v));
    ++p_;
  }
  std::string name() {
    if (peek().type != T::Name) fail(fmt::format("chat template syntax error: expected a name, got '{}'", peek().v));
    return t_[p_++].v;
  }
  // Templates come from model files: bound how deep the parser recurses and
  // how deep the tree it builds gets (evaluating and freeing it recurse).
  static constexpr int kMaxDepth = 200;
  int nesting_ = 0;
  void check_depth(int depth) const {
    if (depth > kMaxDepth)
      fail(fmt::format("the chat template nests too deeply (parser depth over {}: about 60 parentheses or 100 blocks)",
                       kMaxDepth));
  }
  struct Nested {
    Parser& p;
    explicit Nested(Parser& parser) : p(parser) { p.check_depth(++p.nesting_); }
    ~Nested() { --p.nesting_; }
  };
  NodeP done(std::shared_ptr<Node> n) {
    int d = 0;
    for (const auto& c : n->c)
      if (c) d = std::max(d, c->depth);
    n->depth = d + 1;
    check_depth(n->depth);
    return n;
  }
  static std::shared_ptr<Node> make(Node::Kind k, int line) {
    auto n = std::make_shared<Node>();
    n->kind = k;
    n->line = line;
    return n;
  }

  // Statements until one of `until` ({% endif %} ...), whose keyword is
  // consumed and returned in `end`; until empty: to the end of the template.
  NodeP block(const std::set<std::string>& until, std::string& end) {
    Nested guard(*this);
    auto b = make(Node::Block, peek().line);
    while (true) {
      const Tok& tok = peek();
      if (tok.type == T::End) {
        if (!until.empty()) fail(fmt::format("chat template syntax error: missing {{% {} %}}", *until.rbegin()));
        return done(b);
      }
      if (tok.type == T::Text) {
        auto n = make(Node::Text, tok.line);
        n->s = tok.v;
        b->c.push_back(n);
        ++p_;
      } else if (tok.type == T::OpenExpr) {
        ++p_;
        auto n = make(Node::Output, tok.line);
        n->c.push_back(expr());
        expect(T::CloseExpr, "'}}'");
        b->c.push_back(done(n));
      } else if (tok.type == T::OpenStmt) {
        ++p_;
        const int line = peek().line;
        const std::string kw = name();
        if (until.count(kw)) {
          end = kw;
          return done(b);
        }
        if (auto n = statement(kw, line)) b->c.push_back(done(n));
      } else {
        fail(fmt::format("chat template syntax error: unexpected '{}'", tok.v));
      }
    }
  }

  std::shared_ptr<Node> statement(const std::string& kw, int line) {
    std::string end;
    if (kw == "if") {
      auto n = make(Node::If, line);
      n->c.push_back(expr());
      expect(T::CloseStmt, "'%}'");
      n->c.push_back(block({"elif", "else", "endif"}, end));
      while (end == "elif") {
        n->c.push_back(expr());
        expect(T::CloseStmt, "'%}'");
        n->c.push_back(block({"elif", "else", "endif"}, end));
      }
      if (end == "else") {
        expect(T::CloseStmt, "'%}'");
        n->c.push_back(block({"endif"}, end));
      }
      expect(T::CloseStmt, "'%}'");
      return n;
    }
    if (kw == "for") {
      auto n = make(Node::For, line);
      n->names.push_back(name());
      while (is_op(",")) {
        ++p_;
        n->names.push_back(name());
      }
      if (!is_name("in")) fail("chat template syntax error: expected 'in' in {% for %}");
      ++p_;
      n->c.push_back(or_expr());
      NodeP filter;
      if (is_name("if")) {
        ++p_;
        filter = expr();
      }
      if (is_name("recursive")) fail("unsupported Jinja construct '{% for ... recursive %}'");
      expect(T::CloseStmt, "'%}'");
      n->c.push_back(block({"else", "endfor"}, end));
      NodeP otherwise;
      if (end == "else") {
        expect(T::CloseStmt, "'%}'");
        otherwise = block({"endfor"}, end);
      }
      expect(T::CloseStmt, "'%}'");
      n->c.push_back(otherwise);
      n->c.push_back(filter);
      return n;
    }
    if (kw == "set") {
      const std::string target = name();
      std::string attr;
      if (is_op(".")) {
        ++p_;
        attr = name();
      }
      if (is_op(",")) fail("unsupported Jinja construct '{% set a, b = ... %}'");
      if (is_op("=")) {
        ++p_;
        auto n = make(Node::Set, line);
        n->names = {target};
        n->s = attr;
        n->c.push_back(expr());
        expect(T::CloseStmt, "'%}'");
        return n;
      }
      if (!attr.empty()) fail("chat template syntax error: expected '=' after {% set name.attribute");
      expect(T::CloseStmt, "'%}'");
      auto n = make(Node::SetBlock, line);
      n->names = {target};
      n->c.push_back(block({"endset"}, end));
      expect(T::CloseStmt, "'%}'");
      return n;
    }
    if (kw == "break" || kw == "continue") {
      expect(T::CloseStmt, "'%}'");
      return make(kw == "break" ? Node::Break : Node::Continue, line);
    }
    if (kw == "generation" || kw == "endgeneration") {  // transformers' assistant-mask markers: no output
      expect(T::CloseStmt, "'%}'");
      return nullptr;
    }
    fail(fmt::format("unsupported Jinja construct '{{% {} %}}'", kw), line);
  }

  // Expressions, by Jinja's precedence (lowest first).
  NodeP expr() {
    Nested guard(*this);
    NodeP e = or_expr();
    if (!is_name("if")) return e;
    const int line = peek().line;
    ++p_;
    auto n = make(Node::Cond, line);
    n->c.push_back(e);
    n->c.push_back(or_expr());
    NodeP otherwise;
    if (is_name("else")) {
      ++p_;
      otherwise = expr();
    }
    n->c.push_back(otherwise);
    return done(n);
  }
  NodeP binary(Node::Kind k, const std::string& op, NodeP a, NodeP b, int line) {
    auto n = make(k, line);
    n->s = op;
    n->c = {std::move(a), std::move(b)};
    return done(n);
  }
  // One left-associative precedence level: operands from next(), joined by
  // any of ops (operator tokens, or the words "or" and "and").
  NodeP level(std::initializer_list<const char*> ops, Node::Kind kind, NodeP (Parser::*next)()) {
    NodeP a = (this->*next)();
    while (true) {
      const char* hit = nullptr;
      for (const char* op : ops)
        if (is_op(op) || is_name(op)) hit = op;
      if (!hit) return a;
      const int line = t_[p_++].line;
      a = binary(kind, hit, a, (this->*next)(), line);
    }
  }
  NodeP or_expr() { return level({"or"}, Node::Or, &Parser::and_expr); }
  NodeP and_expr() { return level({"and"}, Node::And, &Parser::not_expr); }
  NodeP not_expr() {
    Nested guard(*this);
    if (is_name("not")) {
      auto n = make(Node::Not, t_[p_++].line);
      n->c.push_back(not_expr());
      return done(n);
    }
    return compare();
  }
  NodeP compare() {
    NodeP a = math1();
    while (true) {
      const int line = peek().line;
      std::string op;
      if (peek().type == T::Op && (peek().v == "==" || peek().v == "!=" || peek().v == "<" || peek().v == ">" ||
                                   peek().v == "<=" || peek().v == ">=")) {
        op = t_[p_++].v;
      } else if (is_name("in")) {
        ++p_;
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        p_ += 2;
        op = "not in";
      } else {
        return a;
      }
      a = binary(Node::Binary, op, a, math1(), line);
    }
  }
  NodeP math1() { return level({"+", "-"}, Node::Binary, &Parser::concat); }
  NodeP concat() { return level({"~"}, Node::Binary, &Parser::math2); }
  NodeP math2() { return level({"*", "/", "//", "%"}, Node::Binary, &Parser::pow); }
  NodeP pow() { return level({"**"}, Node::Binary, &Parser::filtered_unary); }
  NodeP filtered_unary() { return unary(true); }
  NodeP unary(bool with_filter) {
    Nested guard(*this);
    NodeP n;
    if (is_op("-") || is_op("+")) {
      auto u = make(Node::Unary, peek().line);
      u->s = t_[p_++].v;
      u->c.push_back(unary(false));
      n = done(u);
    } else {
      n = primary();
    }
    n = postfix(n);
    return with_filter ? filters(n) : n;
  }
  NodeP primary() {
    const Tok tok = peek();
    if (tok.type == T::Name) {
      ++p_;
      auto n = make(Node::Lit, tok.line);
      if (tok.v == "true" || tok.v == "True") n->lit = true;
      else if (tok.v == "false" || tok.v == "False") n->lit = false;
      else if (tok.v == "none" || tok.v == "None") n->lit = nullptr;
      else {
        n->kind = Node::Var;
        n->s = tok.v;
      }
      return n;
    }
    if (tok.type == T::Str) {
      std::string v;
      while (peek().type == T::Str) v += t_[p_++].v;  // 'a' 'b' is 'ab'
      auto n = make(Node::Lit, tok.line);
      n->lit = v;
      return n;
    }
    if (tok.type == T::Num) {
      ++p_;
      auto n = make(Node::Lit, tok.line);
      try {
        if (tok.v.find('.') != std::string::npos) n->lit = std::stod(tok.v);
        else n->lit = static_cast<std::int64_t>(std::stoll(tok.v));
      } catch (const std::exception&) {
        fail(fmt::format("chat template syntax error: the number {} is out of range", tok.v));
      }
      return n;
    }
    if (is_op("(")) {
      ++p_;
      NodeP e = expr();
      if (is_op(",")) {  // a tuple: a list here
        auto l = make(Node::List, tok.line);
        l->c.push_back(e);
        while (is_op(",")) {
          ++p_;
          if (is_op(")")) break;
          l->c.push_back(expr());
        }
        e = done(l);
      }
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      ++p_;
      auto l = make(Node::List, tok.line);
      while (!is_op("]")) {
        l->c.push_back(expr());
        if (!is_op(",")) break;
        ++p_;
      }
      expect_op("]");
      return done(l);
    }
    if (is_op("{")) {
      ++p_;
      auto d = make(Node::Dict, tok.line);
      while (!is_op("}")) {
        d->c.push_back(expr());
        expect_op(":");
        d->c.push_back(expr());
        if (!is_op(",")) break;
        ++p_;
      }
      expect_op("}");
      return done(d);
    }
    fail(fmt::format("chat template syntax error: unexpected '{}' in an expression", tok.v));
  }
  void call_args(std::shared_ptr<Node>& n) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().type == T::Name && is_op("=", 1)) {
        auto kw = make(Node::Kwarg, peek().line);
        kw->s = t_[p_].v;
        p_ += 2;
        kw->c.push_back(expr());
        n->c.push_back(done(kw));
      } else {
        n->c.push_back(expr());
      }
      if (!is_op(",")) break;
      ++p_;
    }
    expect_op(")");
  }
  NodeP postfix(NodeP n) {
    while (true) {
      const int line = peek().line;
      if (is_op(".")) {
        ++p_;
        auto a = make(Node::Attr, line);
        a->c.push_back(n);
        if (peek().type == T::Num) {  // x.0 is x[0]
          a->kind = Node::Item;
          auto idx = make(Node::Lit, line);
          try {
            idx->lit = static_cast<std::int64_t>(std::stoll(t_[p_].v));
          } catch (const std::exception&) {
            fail(fmt::format("chat template syntax error: the index {} is out of range", t_[p_].v));
          }
          ++p_;
          a->c.push_back(idx);
        } else {
          a->s = name();
        }
        n = done(a);
      } else if (is_op("[")) {
        ++p_;
        NodeP start, stop, step;
        if (!is_op(":")) start = expr();
        if (is_op(":")) {
          ++p_;
          if (!is_op(":") && !is_op("]")) stop = expr();
          if (is_op(":")) {
            ++p_;
            if (!is_op("]")) step = expr();
          }
          auto sl = make(Node::Slice, line);
          sl->c = {n, start, stop, step};
          n = done(sl);
        } else {
          auto it = make(Node::Item, line);
          it->c = {n, start};
          n = done(it);
        }
        expect_op("]");
      } else if (is_op("(")) {
        auto c = make(Node::Call, line);
        c->c.push_back(n);
        call_args(c);
        n = done(c);
      } else {
        return n;
      }
    }
  }
  NodeP filters(NodeP n) {
    while (true) {
      const int line = peek().line;
      if (is_op("|")) {
        ++p_;
        auto f = make(Node::Filter, line);
        f->s = name();
        f->c.push_back(n);
        if (is_op("(")) call_args(f);
        n = done(f);
      } else if (is_name("is")) {
        ++p_;
        auto t = make(Node::Test, line);
        if (is_name("not")) {
          ++p_;
          t->negated = true;
        }
        t->s = name();
        t->c.push_back(n);
        if (is_op("(")) {
          call_args(t);
        } else {
          static const std::set<std::string> stop = {"else", "or", "and", "if", "in", "not", "is"};
          const Tok& nx = peek();
          if (nx.type == T::Num || nx.type == T::Str || (nx.type == T::Name && !stop.count(nx.v)) || is_op("[") ||
              is_op("{"))
            t->c.push_back(postfix(primary()));
        }
        n = done(t);
      } else if (is_op("(")) {
        auto c = make(Node::Call, line);
        c->c.push_back(n);
        call_args(c);
        n = done(c);
      } else {
        return n;
      }
    }
  }
};

// -------------------------------------------------------------- runtime --

// A value in a rendering. Values are immutable and shared: copying one, or
// taking an element or attribute of one, costs O(1) however large it is
// (an element shares ownership of the whole it came from), so a template
// that reads a long conversation in a loop stays linear.
class Val {
 public:
  Val() : p_(null_json()) {}
  explicit Val(json j) : p_(std::make_shared<json>(std::move(j))) {}
  static Val undefined() {
    Val v;
    v.undef = true;
    return v;
  }
  // An element or attribute of `whole`, without copying it.
  static Val part(const Val& whole, const json& element) {
    Val v;
    v.p_ = std::shared_ptr<json>(whole.p_, const_cast<json*>(&element));
    return v;
  }
  const json& j() const { return *p_; }
  // For namespace attributes: the value to change, copied first unless this
  // is its only holder (copy on write).
  json& own() {
    if (p_.use_count() > 1) p_ = std::make_shared<json>(*p_);
    return *p_;
  }

  bool undef = false;

 private:
  std::shared_ptr<json> p_;
  static const std::shared_ptr<json>& null_json() {
    static const auto null = std::make_shared<json>();
    return null;
  }
};

const char* kSpaces = " \t\n\r\f\v\x1c\x1d\x1e\x1f";

std::vector<std::string> code_points(const std::string& s) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i < s.size();) {
    std::size_t len = 1;
    const auto b = static_cast<unsigned char>(s[i]);
    if (b >= 0xF0) len = 4;
    else if (b >= 0xE0) len = 3;
    else if (b >= 0xC0) len = 2;
    out.push_back(s.substr(i, len));
    i += len;
  }
  return out;
}

std::size_t count_code_points(const std::string& s) {
  std::size_t count = 0;
  for (std::size_t i = 0; i < s.size(); ++count) {
    const auto b = static_cast<unsigned char>(s[i]);
    i += b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : b >= 0xC0 ? 2 : 1;
  }
  return count;
}

std::string py_float(double d) {
  if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 1e16) return fmt::format("{:.1f}", d);
  return fmt::format("{}", d);
}

std::string py_repr(const json& j) {
  if (j.is_string()) {
    std::string out = "'";
    for (char ch : j.get<std::string>()) {
      if (ch == '\'' || ch == '\\') out += '\\';
      if (ch == '\n') out += "\\n";
      else out += ch;
    }
    return out + "'";
  }
  if (j.is_array()) {
    std::string out = "[";
    for (std::size_t i = 0; i < j.size(); ++i) out += (i ? ", " : "") + py_repr(j[i]);
    return out + "]";
  }
  if (j.is_object()) {
    std::string out = "{";
    bool first = true;
    for (auto it = j.begin(); it != j.end(); ++it, first = false)
      out += (first ? "" : ", ") + py_repr(it.key()) + ": " + py_repr(it.value());
    return out + "}";
  }
  if (j.is_null()) return "None";
  if (j.is_boolean()) return j.get<bool>() ? "True" : "False";
  if (j.is_number_float()) return py_float(j.get<double>());
  return j.dump();
}

std::string to_text(const Val& v) {
  if (v.undef) return "";
  if (v.j().is_string()) return v.j().get<std::string>();
  return py_repr(v.j());
}

bool truthy(const Val& v) {
  if (v.undef || v.j().is_null()) return false;
  if (v.j().is_boolean()) return v.j().get<bool>();
  if (v.j().is_number_integer()) return v.j().get<std::int64_t>() != 0;
  if (v.j().is_number()) return v.j().get<double>() != 0.0;
  if (v.j().is_string() || v.j().is_array() || v.j().is_object()) return !v.j().empty();
  return true;
}

const char* type_name(const Val& v) {
  if (v.undef) return "undefined";
  switch (v.j().type()) {
    case json::value_t::null: return "none";
    case json::value_t::boolean: return "boolean";
    case json::value_t::string: return "string";
    case json::value_t::array: return "list";
    case json::value_t::object: return "dict";
    case json::value_t::number_float: return "float";
    default: return "integer";
  }
}

// How much work comparing or scanning j takes, in steps: its items, or a
// string's bytes / 64.
std::uint64_t extent(const json& j) {
  if (j.is_array() || j.is_object()) return j.size();
  if (j.is_string()) return j.get_ref<const std::string&>().size() / 64;
  return 0;
}

// json.dumps(x, ensure_ascii=False[, indent]) as transformers' tojson.
void dump_json(const json& j, int indent, int depth, std::string& out) {
  const std::string pad = indent > 0 ? "\n" + std::string(static_cast<std::size_t>(indent * (depth + 1)), ' ') : "";
  const std::string end_pad = indent > 0 ? "\n" + std::string(static_cast<std::size_t>(indent * depth), ' ') : "";
  const std::string sep = indent > 0 ? "," : ", ";
  if (j.is_array() && !j.empty()) {
    out += "[";
    for (std::size_t i = 0; i < j.size(); ++i) {
      out += (i ? sep : "") + pad;
      dump_json(j[i], indent, depth + 1, out);
    }
    out += end_pad + "]";
  } else if (j.is_object() && !j.empty()) {
    out += "{";
    bool first = true;
    for (auto it = j.begin(); it != j.end(); ++it, first = false) {
      out += (first ? "" : sep) + pad + json(it.key()).dump(-1, ' ', false, json::error_handler_t::replace) + ": ";
      dump_json(it.value(), indent, depth + 1, out);
    }
    out += end_pad + "}";
  } else if (j.is_number_float()) {
    out += py_float(j.get<double>());
  } else if (j.is_boolean()) {
    out += j.get<bool>() ? "true" : "false";
  } else {
    out += j.dump(-1, ' ', false, json::error_handler_t::replace);
  }
}

std::string strip(const std::string& s, const Val& chars, bool left, bool right) {
  const std::string set = chars.undef || chars.j().is_null() ? std::string(kSpaces) : chars.j().get<std::string>();
  std::size_t b = 0, e = s.size();
  if (left)
    while (b < e && set.find(s[b]) != std::string::npos) ++b;
  if (right)
    while (e > b && set.find(s[e - 1]) != std::string::npos) --e;
  return s.substr(b, e - b);
}

enum class Flow { Normal, Break, Continue };

class Renderer {
 public:
  Renderer(const std::string& name, const json& vars) : name_(name) {
    frames_.emplace_back();
    const Val all{vars};
    for (auto it = all.j().begin(); it != all.j().end(); ++it) frames_[0][it.key()] = Val::part(all, it.value());
  }
  std::string out;

  Flow exec(const Node& n) {
    step(n);
    switch (n.kind) {
      case Node::Block:
        for (const auto& c : n.c)
          if (Flow f = exec(*c); f != Flow::Normal) return f;
        return Flow::Normal;
      case Node::Text: out += n.s; return fits(n, out), Flow::Normal;
      case Node::Output: out += to_text(eval(*n.c[0])); return fits(n, out), Flow::Normal;
      case Node::If: {
        std::size_t i = 0;
        for (; i + 1 < n.c.size(); i += 2)
          if (truthy(eval(*n.c[i]))) return exec(*n.c[i + 1]);
        return i < n.c.size() ? exec(*n.c[i]) : Flow::Normal;
      }
      case Node::For: return exec_for(n);
      case Node::Set: {
        Val v = eval(*n.c[0]);
        if (n.s.empty()) {
          frames_.back()[n.names[0]] = v;
        } else {
          Val* ns = lookup(n.names[0]);
          if (!ns || !ns->j().is_object())
            fail(n, fmt::format("cannot set attribute '{}' of '{}' (not a namespace)", n.s, n.names[0]));
          ns->own()[n.s] = v.undef ? json() : v.j();
        }
        return Flow::Normal;
      }
      case Node::SetBlock: {
        std::string saved = std::move(out);
        out.clear();
        exec(*n.c[0]);
        frames_.back()[n.names[0]] = Val{json(out)};
        out = std::move(saved);
        return Flow::Normal;
      }
      case Node::Break: return Flow::Break;
      case Node::Continue: return Flow::Continue;
      default: fail(n, "internal error: an expression where a statement should be");
    }
  }

 private:
  const std::string& name_;
  std::vector<std::map<std::string, Val>> frames_;
  std::unordered_map<const Node*, Val> literals_;

  [[noreturn]] void fail(const Node& n, const std::string& what) const {
    DMI_FAIL("{} line {}: chat template error: {}", name_, n.line, what);
  }
  // Templates come from model files: a rendering may take at most so many
  // steps, and its strings and lists at most so much room.
  static constexpr std::uint64_t kMaxSteps = 5'000'000;
  static constexpr std::size_t kMaxBytes = 64u << 20, kMaxItems = 1'000'000;
  std::uint64_t steps_ = 0;
  void step(const Node& n) { work(n, 1); }
  // Operations whose cost grows with their operands (iterating, comparing,
  // per-character work) count as that many steps.
  void work(const Node& n, std::uint64_t steps) {
    steps_ += steps;
    if (steps_ > kMaxSteps) fail(n, fmt::format("the rendering takes more than {} steps", kMaxSteps));
  }
  bool equal(const Node& n, const Val& a, const Val& b) {
    if (a.undef || b.undef) return a.undef && b.undef;
    work(n, std::min(extent(a.j()), extent(b.j())));
    return a.j() == b.j();
  }
  // a in b, for b a list, dict or string.
  bool contains(const Node& n, const Val& a, const Val& b) {
    if (b.undef) return false;
    work(n, extent(b.j()));
    if (b.j().is_array())
      return !a.undef && std::any_of(b.j().begin(), b.j().end(), [&](const json& x) { return a.j() == x; });
    if (b.j().is_object()) return !a.undef && a.j().is_string() && b.j().contains(a.j().get<std::string>());
    if (b.j().is_string()) return b.j().get<std::string>().find(str(n, a, "'in' on a string")) != std::string::npos;
    fail(n, fmt::format("'in' on a {}", type_name(b)));
  }
  void fits(const Node& n, std::uint64_t bytes) const {
    if (bytes > kMaxBytes) fail(n, fmt::format("the rendering makes a string over {} MiB", kMaxBytes >> 20));
  }
  void fits(const Node& n, const std::string& s) const { fits(n, s.size()); }
  void fits_items(const Node& n, std::uint64_t count) const {
    if (count > kMaxItems) fail(n, fmt::format("the rendering makes a list of over {} items", kMaxItems));
  }
  // All strings and lists a rendering makes, together: at most kMaxMade bytes.
  static constexpr std::uint64_t kMaxMade = 1ull << 30;
  std::uint64_t made_ = 0;
  void made(const Node& n, std::uint64_t bytes) {
    made_ += bytes;
    if (made_ > kMaxMade) fail(n, fmt::format("the rendering makes more than {} MiB of strings and lists", kMaxMade >> 20));
  }
  static std::uint64_t weight(const json& j) {
    std::uint64_t w = 16;
    if (j.is_string()) w += j.get_ref<const std::string&>().size();
    if (j.is_array() || j.is_object())
      for (const auto& x : j) w += weight(x);
    return w;
  }
  Val text(const Node& n, std::string s) {
    fits(n, s);
    made(n, s.size());
    return Val{json(std::move(s))};
  }
  // A list or dict the rendering made, counted against the limits.
  Val value(const Node& n, json l) {
    fits_items(n, l.size());
    made(n, weight(l));
    return Val{std::move(l)};
  }
  // The code points of s, for per-character operations (iteration, slices,
  // indexing): strings up to kMaxItems bytes.
  std::vector<std::string> chars(const Node& n, const std::string& s) {
    if (s.size() > kMaxItems)
      fail(n, fmt::format("per-character operations take strings of at most {} bytes", kMaxItems));
    work(n, s.size() / 8);
    return code_points(s);
  }
  // p op q for op in + - *, failing on overflow instead of wrapping.
  std::int64_t checked(const Node& n, char op, std::int64_t p, std::int64_t q) const {
    std::int64_t r = 0;
    const bool overflow = op == '+'   ? __builtin_add_overflow(p, q, &r)
                          : op == '-' ? __builtin_sub_overflow(p, q, &r)
                                      : __builtin_mul_overflow(p, q, &r);
    if (overflow) fail(n, "integer overflow");
    return r;
  }
  Val* lookup(const std::string& name) {
    for (auto f = frames_.rbegin(); f != frames_.rend(); ++f)
      if (auto it = f->find(name); it != f->end()) return &it->second;
    return nullptr;
  }

  std::vector<Val> items_of(const Node& n, const Val& v) {
    std::vector<Val> items;
    if (v.undef) return items;
    if (v.j().is_array())
      for (const auto& x : v.j()) items.push_back(Val::part(v, x));
    else if (v.j().is_object())
      for (auto it = v.j().begin(); it != v.j().end(); ++it) items.push_back(Val{json(it.key())});
    else if (v.j().is_string())
      for (auto& cp : chars(n, v.j().get<std::string>())) items.push_back(Val{json(cp)});
    else
      fail(n, fmt::format("cannot iterate over a {}", type_name(v)));
    work(n, items.size());
    return items;
  }

  void bind(const Node& n, const Val& item) {
    auto& f = frames_.back();
    if (n.names.size() == 1) {
      f[n.names[0]] = item;
      return;
    }
    if (!item.j().is_array() || item.j().size() != n.names.size())
      fail(n, fmt::format("cannot unpack a {} into {} names", type_name(item), n.names.size()));
    for (std::size_t i = 0; i < n.names.size(); ++i) f[n.names[i]] = Val::part(item, item.j()[i]);
  }

  Flow exec_for(const Node& n) {
    std::vector<Val> items = items_of(n, eval(*n.c[0]));
    if (n.c[3]) {  // {% for x in xs if cond %}: filtered before the loop counts
      std::vector<Val> kept;
      for (const auto& it : items) {
        frames_.emplace_back();
        bind(n, it);
        const bool keep = truthy(eval(*n.c[3]));
        frames_.pop_back();
        if (keep) kept.push_back(it);
      }
      items = std::move(kept);
    }
    if (items.empty()) return n.c[2] ? exec(*n.c[2]) : Flow::Normal;
    const auto len = static_cast<std::int64_t>(items.size());
    for (std::int64_t i = 0; i < len; ++i) {
      frames_.emplace_back();
      bind(n, items[static_cast<std::size_t>(i)]);
      json loop = {{"index", i + 1},       {"index0", i},          {"revindex", len - i}, {"revindex0", len - i - 1},
                   {"first", i == 0},      {"last", i == len - 1}, {"length", len}};
      if (i > 0) loop["previtem"] = items[static_cast<std::size_t>(i - 1)].j();
      if (i + 1 < len) loop["nextitem"] = items[static_cast<std::size_t>(i + 1)].j();
      made(n, weight(loop));
      frames_.back()["loop"] = Val{std::move(loop)};
      const Flow f = exec(*n.c[1]);
      frames_.pop_back();
      if (f == Flow::Break) break;
    }
    return Flow::Normal;
  }

  struct Args {
    std::vector<Val> pos;
    std::map<std::string, Val> kw;
    Val get(std::size_t i, const char* key) const {
      if (i < pos.size()) return pos[i];
      if (auto it = kw.find(key); it != kw.end()) return it->second;
      return Val::undefined();
    }
  };
  Args args(const Node& n, std::size_t from) {
    Args a;
    for (std::size_t i = from; i < n.c.size(); ++i) {
      if (n.c[i]->kind == Node::Kwarg) a.kw[n.c[i]->s] = eval(*n.c[i]->c[0]);
      else a.pos.push_back(eval(*n.c[i]));
    }
    return a;
  }
  std::string str(const Node& n, const Val& v, const char* what) {
    if (v.undef || !v.j().is_string()) fail(n, fmt::format("{} needs a string, got a {}", what, type_name(v)));
    return v.j().get_ref<const std::string&>();
  }
  std::int64_t integer(const Node& n, const Val& v, const char* what) {
    if (v.undef || !v.j().is_number_integer()) fail(n, fmt::format("{} needs an integer, got a {}", what, type_name(v)));
    return v.j().get<std::int64_t>();
  }

  Val eval(const Node& n) {
    step(n);
    switch (n.kind) {
      case Node::Lit: {  // made once: a long string literal in a loop is not copied each time
        auto it = literals_.find(&n);
        if (it == literals_.end()) it = literals_.emplace(&n, Val{n.lit}).first;
        return it->second;
      }
      case Node::Var: {
        if (Val* v = lookup(n.s)) return *v;
        return Val::undefined();
      }
      case Node::Attr: {
        const Val o = eval(*n.c[0]);
        if (!o.undef && o.j().is_object())
          if (auto it = o.j().find(n.s); it != o.j().end()) return Val::part(o, *it);
        return Val::undefined();
      }
      case Node::Item: return item(n, eval(*n.c[0]), eval(*n.c[1]));
      case Node::Slice: return slice(n);
      case Node::Call: return call(n);
      case Node::Filter: return filter(n);
      case Node::Test: {
        const bool r = test(n);
        return Val{json(n.negated ? !r : r)};
      }
      case Node::Unary: {
        const Val v = eval(*n.c[0]);
        if (v.undef || !v.j().is_number()) fail(n, fmt::format("unary {} on a {}", n.s, type_name(v)));
        if (n.s == "+") return v;
        if (v.j().is_number_float()) return Val{json(-v.j().get<double>())};
        return Val{json(checked(n, '-', 0, v.j().get<std::int64_t>()))};
      }
      case Node::Not: return Val{json(!truthy(eval(*n.c[0])))};
      case Node::And: {
        Val a = eval(*n.c[0]);
        return truthy(a) ? eval(*n.c[1]) : a;
      }
      case Node::Or: {
        Val a = eval(*n.c[0]);
        return truthy(a) ? a : eval(*n.c[1]);
      }
      case Node::Cond:
        if (truthy(eval(*n.c[1]))) return eval(*n.c[0]);
        return n.c[2] ? eval(*n.c[2]) : Val::undefined();
      case Node::Binary: return binary(n);
      case Node::List: {
        json l = json::array();
        for (const auto& c : n.c) l.push_back(eval(*c).j());
        return value(n, std::move(l));
      }
      case Node::Dict: {
        json d = json::object();
        for (std::size_t i = 0; i + 1 < n.c.size(); i += 2) d[str(n, eval(*n.c[i]), "a dict key")] = eval(*n.c[i + 1]).j();
        return value(n, std::move(d));
      }
      default: fail(n, "internal error: a statement where an expression should be");
    }
  }

  Val item(const Node& n, const Val& o, const Val& k) {
    if (o.undef) return Val::undefined();
    if (o.j().is_object() && k.j().is_string()) {
      if (auto it = o.j().find(k.j().get<std::string>()); it != o.j().end()) return Val::part(o, *it);
      return Val::undefined();
    }
    if ((o.j().is_array() || o.j().is_string()) && k.j().is_number_integer()) {
      std::vector<std::string> cps;
      if (o.j().is_string()) cps = chars(n, o.j().get<std::string>());
      const auto len = static_cast<std::int64_t>(o.j().is_array() ? o.j().size() : cps.size());
      std::int64_t i = k.j().get<std::int64_t>();
      if (i < 0) i += len;
      if (i < 0 || i >= len) return Val::undefined();
      return o.j().is_array() ? Val::part(o, o.j()[static_cast<std::size_t>(i)]) : Val{json(cps[static_cast<std::size_t>(i)])};
    }
    if (o.j().is_object() || o.j().is_array() || o.j().is_string()) return Val::undefined();
    fail(n, fmt::format("cannot index a {}", type_name(o)));
  }

  Val slice(const Node& n) {
    const Val o = eval(*n.c[0]);
    if (o.undef || !(o.j().is_array() || o.j().is_string())) fail(n, fmt::format("cannot slice a {}", type_name(o)));
    std::vector<std::string> cps;
    if (o.j().is_string()) cps = chars(n, o.j().get<std::string>());
    const auto len = static_cast<std::int64_t>(o.j().is_array() ? o.j().size() : cps.size());
    auto opt = [&](const NodeP& e, std::int64_t dflt) {
      if (!e) return dflt;
      const Val v = eval(*e);
      return v.j().is_null() ? dflt : integer(n, v, "a slice bound");
    };
    const std::int64_t step = opt(n.c[3], 1);
    if (step == 0) fail(n, "slice step cannot be zero");
    auto clampi = [&](std::int64_t i) {  // Python's slice index adjustment
      if (i < 0) i += len;
      if (step > 0) return std::clamp<std::int64_t>(i, 0, len);
      return std::clamp<std::int64_t>(i, -1, len - 1);
    };
    std::int64_t start = n.c[1] ? clampi(opt(n.c[1], 0)) : (step > 0 ? 0 : len - 1);
    std::int64_t stop = n.c[2] ? clampi(opt(n.c[2], 0)) : (step > 0 ? len : -1);
    json l = json::array();
    std::string s;
    for (__int128 i = start; step > 0 ? i < stop : i > stop; i += step) {
      const auto k = static_cast<std::size_t>(i);
      if (o.j().is_array()) l.push_back(o.j()[k]);
      else s += cps[k];
    }
    if (!o.j().is_array()) return text(n, std::move(s));
    return value(n, std::move(l));
  }

  Val binary(const Node& n) {
    const Val a = eval(*n.c[0]), b = eval(*n.c[1]);
    const std::string& op = n.s;
    if (op == "==") return Val{json(equal(n, a, b))};
    if (op == "!=") return Val{json(!equal(n, a, b))};
    if (op == "in" || op == "not in") {
      const bool r = contains(n, a, b);
      return Val{json(op == "in" ? r : !r)};
    }
    if (op == "~") return text(n, to_text(a) + to_text(b));
    if (!a.undef && !b.undef && a.j().is_number() && b.j().is_number()) {
      const bool ints = a.j().is_number_integer() && b.j().is_number_integer();
      const double x = a.j().get<double>(), y = b.j().get<double>();
      if (op == "<") return Val{json(x < y)};
      if (op == ">") return Val{json(x > y)};
      if (op == "<=") return Val{json(x <= y)};
      if (op == ">=") return Val{json(x >= y)};
      if ((op == "/" || ((op == "//" || op == "%") && !ints)) && y == 0) fail(n, "division by zero");
      if (op == "/") return Val{json(x / y)};
      if (ints) {
        const std::int64_t p = a.j().get<std::int64_t>(), q = b.j().get<std::int64_t>();
        if (op == "+" || op == "-" || op == "*") return Val{json(checked(n, op[0], p, q))};
        if ((op == "//" || op == "%") && q == 0) fail(n, "division by zero");
        if ((op == "//" || op == "%") && q == -1) {  // INT64_MIN // -1 overflows
          if (op == "%") return Val{json(0)};
          return Val{json(checked(n, '-', 0, p))};
        }
        if (op == "//" || op == "%") {  // Python floors
          const std::int64_t fl = p / q - ((p % q != 0 && ((p < 0) != (q < 0))) ? 1 : 0);
          return Val{json(op == "//" ? fl : p - fl * q)};
        }
        if (op == "**" && q >= 0) {
          if (p == 0 || p == 1) return Val{json(q == 0 ? 1 : p)};
          if (p == -1) return Val{json(q % 2 ? -1 : 1)};
          std::int64_t acc = 1;
          for (std::int64_t e = 0; e < q; ++e) acc = checked(n, '*', acc, p);  // |p| >= 2: overflows within 63 steps
          return Val{json(acc)};
        }
      }
      if (op == "+") return Val{json(x + y)};
      if (op == "-") return Val{json(x - y)};
      if (op == "*") return Val{json(x * y)};
      if (op == "//") return Val{json(std::floor(x / y))};
      if (op == "%") return Val{json(x - std::floor(x / y) * y)};
      if (op == "**") return Val{json(std::pow(x, y))};
    }
    if (!a.undef && !b.undef && a.j().is_string() && b.j().is_string()) {
      const auto &x = a.j().get_ref<const std::string&>(), &y = b.j().get_ref<const std::string&>();
      if (op == "<") return Val{json(x < y)};
      if (op == ">") return Val{json(x > y)};
      if (op == "<=") return Val{json(x <= y)};
      if (op == ">=") return Val{json(x >= y)};
    }
    if (op == "+") {
      if (!a.undef && !b.undef && a.j().is_array() && b.j().is_array()) {
        json l = a.j();
        for (const auto& x : b.j()) l.push_back(x);
        return value(n, std::move(l));
      }
      if ((!a.undef && a.j().is_string()) || (!b.undef && b.j().is_string())) return text(n, to_text(a) + to_text(b));
    }
    if (op == "*" && !a.undef && !b.undef && a.j().is_string() && b.j().is_number_integer()) {
      const auto& unit = a.j().get_ref<const std::string&>();
      const std::int64_t times = b.j().get<std::int64_t>();
      if (times > 0 && !unit.empty() && static_cast<std::uint64_t>(times) > kMaxBytes / unit.size())
        fits(n, kMaxBytes + 1);
      std::string r;
      if (times > 0) r.reserve(unit.size() * static_cast<std::size_t>(times));
      for (std::int64_t i = 0; i < times; ++i) r.append(unit);
      return text(n, std::move(r));
    }
    fail(n, fmt::format("unsupported operand types for {}: {} and {}", op, type_name(a), type_name(b)));
  }

  Val call(const Node& n) {
    const Node& callee = *n.c[0];
    Args a = args(n, 1);
    if (callee.kind == Node::Attr) return method(n, eval(*callee.c[0]), callee.s, a);
    if (callee.kind != Node::Var) fail(n, "only functions and methods can be called");
    const std::string& f = callee.s;
    if (f == "namespace") {
      json ns = json::object();
      for (const auto& p : a.pos) {
        if (!p.j().is_object()) fail(n, "namespace() takes a dict or keyword arguments");
        for (auto it = p.j().begin(); it != p.j().end(); ++it) ns[it.key()] = it.value();
      }
      for (const auto& [k, v] : a.kw) ns[k] = v.j();
      return value(n, std::move(ns));
    }
    if (f == "range") {
      std::int64_t start = 0, stop = 0, step = 1;
      if (a.pos.size() == 1) stop = integer(n, a.pos[0], "range()");
      else if (a.pos.size() >= 2) {
        start = integer(n, a.pos[0], "range()");
        stop = integer(n, a.pos[1], "range()");
        if (a.pos.size() > 2) step = integer(n, a.pos[2], "range()");
      }
      if (step == 0) fail(n, "range() step cannot be zero");
      const __int128 span = step > 0 ? static_cast<__int128>(stop) - start : static_cast<__int128>(start) - stop;
      const __int128 count = span <= 0 ? 0 : (span + (step > 0 ? step : -static_cast<__int128>(step)) - 1) /
                                                  (step > 0 ? step : -static_cast<__int128>(step));
      fits_items(n, count > static_cast<__int128>(kMaxItems) ? kMaxItems + 1 : static_cast<std::uint64_t>(count));
      json l = json::array();
      for (__int128 k = 0; k < count; ++k) l.push_back(static_cast<std::int64_t>(start + k * step));
      return value(n, std::move(l));
    }
    if (f == "raise_exception") DMI_FAIL("{}: the chat template refused the conversation: {}", name_, to_text(a.get(0, "message")));
    if (f == "strftime_now") {
      const std::time_t t = std::time(nullptr);
      std::tm tm{};
      localtime_r(&t, &tm);
      char buf[256];
      const std::size_t len = std::strftime(buf, sizeof buf, str(n, a.get(0, "format"), "strftime_now()").c_str(), &tm);
      return Val{json(std::string(buf, len))};
    }
    fail(n, fmt::format("unsupported Jinja function '{}()'", f));
  }

  Val method(const Node& n, const Val& o, const std::string& m, const Args& a) {
    if (!o.undef && o.j().is_string()) {
      const std::string& s = o.j().get_ref<const std::string&>();
      if (m == "startswith" || m == "endswith") {
        const Val p = a.get(0, "prefix");
        std::vector<std::string> pats;
        if (p.j().is_array())
          for (const auto& x : p.j()) pats.push_back(str(n, Val::part(p, x), m.c_str()));
        else
          pats.push_back(str(n, p, m.c_str()));
        for (const auto& x : pats)
          if (x.size() <= s.size() && (m == "startswith" ? s.compare(0, x.size(), x) == 0
                                                         : s.compare(s.size() - x.size(), x.size(), x) == 0))
            return Val{json(true)};
        return Val{json(false)};
      }
      if (m == "strip") return text(n, strip(s, a.get(0, "chars"), true, true));
      if (m == "lstrip") return text(n, strip(s, a.get(0, "chars"), true, false));
      if (m == "rstrip") return text(n, strip(s, a.get(0, "chars"), false, true));
      if (m == "upper" || m == "lower") {
        std::string r = s;
        for (char& ch : r) ch = static_cast<char>(m == "upper" ? std::toupper(static_cast<unsigned char>(ch))
                                                                : std::tolower(static_cast<unsigned char>(ch)));
        return text(n, std::move(r));
      }
      if (m == "title" || m == "capitalize") return filter_string(n, m, s);
      if (m == "split") return split(n, s, a.get(0, "sep"), a.get(1, "maxsplit"));
      if (m == "replace") return replace(n, s, a);
      if (m == "join") {
        std::string r;
        const Val l = a.get(0, "iterable");
        bool first = true;
        for (const auto& x : items_of(n, l)) {
          r += (first ? "" : s) + to_text(x);
          fits(n, r);
          first = false;
        }
        return text(n, std::move(r));
      }
    }
    if (!o.undef && o.j().is_object()) {
      if (m == "items") {
        json l = json::array();
        for (auto it = o.j().begin(); it != o.j().end(); ++it) l.push_back(json::array({it.key(), it.value()}));
        return value(n, std::move(l));
      }
      if (m == "keys" || m == "values") {
        json l = json::array();
        for (auto it = o.j().begin(); it != o.j().end(); ++it) l.push_back(m == "keys" ? json(it.key()) : it.value());
        return value(n, std::move(l));
      }
      if (m == "get") {
        const Val k = a.get(0, "key");
        if (k.j().is_string())
          if (auto it = o.j().find(k.j().get<std::string>()); it != o.j().end()) return Val::part(o, *it);
        const Val d = a.get(1, "default");
        return d.undef ? Val{json()} : d;
      }
    }
    fail(n, fmt::format("unsupported Jinja method '{}()' on a {}", m, type_name(o)));
  }

  Val split(const Node& n, const std::string& s, const Val& sep, const Val& maxsplit_v) {
    std::int64_t maxsplit = maxsplit_v.undef || maxsplit_v.j().is_null() ? -1 : integer(n, maxsplit_v, "split()");
    json l = json::array();
    if (sep.undef || sep.j().is_null()) {
      std::size_t i = s.find_first_not_of(kSpaces);
      while (i != std::string::npos) {
        if (maxsplit >= 0 && static_cast<std::int64_t>(l.size()) >= maxsplit) {
          l.push_back(s.substr(i));
          break;
        }
        const std::size_t e = s.find_first_of(kSpaces, i);
        l.push_back(s.substr(i, e == std::string::npos ? std::string::npos : e - i));
        i = e == std::string::npos ? e : s.find_first_not_of(kSpaces, e);
      }
      return value(n, std::move(l));
    }
    const std::string d = str(n, sep, "split()");
    if (d.empty()) fail(n, "split(): empty separator");
    std::size_t i = 0;
    while (true) {
      const std::size_t e = s.find(d, i);
      if (e == std::string::npos || (maxsplit >= 0 && static_cast<std::int64_t>(l.size()) >= maxsplit)) {
        l.push_back(s.substr(i));
        return value(n, std::move(l));
      }
      l.push_back(s.substr(i, e - i));
      i = e + d.size();
    }
  }

  Val replace(const Node& n, const std::string& s, const Args& a) {
    const std::string from = str(n, a.get(0, "old"), "replace()");
    const std::string to = str(n, a.get(1, "new"), "replace()");
    const Val cv = a.get(2, "count");
    std::int64_t count = cv.undef || cv.j().is_null() ? -1 : integer(n, cv, "replace()");
    std::string r;
    std::size_t i = 0;
    if (from.empty()) {  // Python inserts `to` between characters
      for (const auto& cp : chars(n, s)) {
        if (count-- != 0) r += to;
        r += cp;
        fits(n, r);
      }
      if (count != 0) r += to;
      return text(n, std::move(r));
    }
    while (count != 0) {
      const std::size_t e = s.find(from, i);
      if (e == std::string::npos) break;
      r += s.substr(i, e - i) + to;
      fits(n, r);
      i = e + from.size();
      --count;
    }
    return text(n, r + s.substr(i));
  }

  Val filter_string(const Node& n, const std::string& f, const std::string& s) {
    std::string r = s;
    bool start = true;
    for (std::size_t i = 0; i < r.size(); ++i) {
      auto ch = static_cast<unsigned char>(r[i]);
      if (f == "capitalize") {
        r[i] = static_cast<char>(i == 0 ? std::toupper(ch) : std::tolower(ch));
      } else {
        r[i] = static_cast<char>(start ? std::toupper(ch) : std::tolower(ch));
        start = !std::isalpha(ch);
      }
    }
    return text(n, std::move(r));
  }

  Val filter(const Node& n) {
    const Val v = eval(*n.c[0]);
    const Args a = args(n, 1);
    const std::string& f = n.s;
    if (f == "length" || f == "count") {
      if (v.undef) return Val{json(0)};
      if (v.j().is_string()) return Val{json(count_code_points(v.j().get<std::string>()))};
      if (v.j().is_array() || v.j().is_object()) return Val{json(v.j().size())};
      fail(n, fmt::format("a {} has no length", type_name(v)));
    }
    if (f == "trim") return text(n, strip(str(n, v, "trim"), a.get(0, "chars"), true, true));
    if (f == "tojson") {
      const Val ind = a.get(0, "indent");
      std::string r;
      dump_json(v.undef ? json() : v.j(), ind.undef || ind.j().is_null() ? 0 : static_cast<int>(integer(n, ind, "tojson")),
                0, r);
      return text(n, std::move(r));
    }
    if (f == "string") return text(n, to_text(v));
    if (f == "safe") return v;
    if (f == "upper" || f == "lower" || f == "title" || f == "capitalize") {
      if (f == "title" || f == "capitalize") return filter_string(n, f, str(n, v, f.c_str()));
      return method(n, v, f, {});
    }
    if (f == "replace") return replace(n, str(n, v, "replace"), a);
    if (f == "default" || f == "d") {
      const bool boolean = truthy(a.get(1, "boolean"));
      if (v.undef || (boolean && !truthy(v))) {
        const Val d = a.get(0, "default_value");
        return d.undef ? Val{json("")} : d;
      }
      return v;
    }
    if (f == "first" || f == "last") {
      const auto items = items_of(n, v);
      if (items.empty()) return Val::undefined();
      return f == "first" ? items.front() : items.back();
    }
    if (f == "list") {
      json l = json::array();
      for (const auto& x : items_of(n, v)) l.push_back(x.j());
      return value(n, std::move(l));
    }
    if (f == "reverse") {
      if (v.j().is_string()) {
        auto cps = chars(n, v.j().get<std::string>());
        std::string r;
        for (auto it = cps.rbegin(); it != cps.rend(); ++it) r += *it;
        return text(n, std::move(r));
      }
      json l = json::array();
      const auto items = items_of(n, v);
      for (auto it = items.rbegin(); it != items.rend(); ++it) l.push_back(it->j());
      return value(n, std::move(l));
    }
    if (f == "join") {
      const Val sep = a.get(0, "d");
      const Val attr = a.get(1, "attribute");
      std::string r;
      bool first = true;
      for (const auto& x : items_of(n, v)) {
        r += (first ? "" : (sep.undef ? "" : to_text(sep))) +
             to_text(attr.undef ? x : item(n, x, attr));
        fits(n, r);
        first = false;
      }
      return text(n, std::move(r));
    }
    if (f == "items") return method(n, v, "items", {});
    if (f == "int") {
      if (v.j().is_number()) return Val{json(static_cast<std::int64_t>(v.j().get<double>()))};
      try {
        return Val{json(static_cast<std::int64_t>(std::stoll(to_text(v))))};
      } catch (const std::exception&) {
        return Val{json(0)};
      }
    }
    if (f == "abs") {
      if (v.j().is_number_integer()) return Val{json(std::llabs(v.j().get<std::int64_t>()))};
      if (v.j().is_number()) return Val{json(std::fabs(v.j().get<double>()))};
      fail(n, fmt::format("abs of a {}", type_name(v)));
    }
    if (f == "map") {
      const Val attr = a.get(99, "attribute");
      if (attr.undef) fail(n, "unsupported Jinja construct 'map' without attribute=");
      json l = json::array();
      for (const auto& x : items_of(n, v)) {
        const Val r = item(n, x, attr);
        l.push_back(r.undef ? json() : r.j());
      }
      return value(n, std::move(l));
    }
    if (f == "selectattr" || f == "rejectattr") {
      const Val attr = a.get(0, "attribute");
      json l = json::array();
      for (const auto& x : items_of(n, v)) {
        const Val field = item(n, x, attr);
        bool r;
        if (a.pos.size() < 2) {
          r = truthy(field);
        } else {
          std::vector<Val> rest(a.pos.begin() + 2, a.pos.end());
          r = apply_test(n, str(n, a.pos[1], f.c_str()), field, rest);
        }
        if (r == (f == "selectattr")) l.push_back(x.j());
      }
      return value(n, std::move(l));
    }
    fail(n, fmt::format("unsupported Jinja filter '{}'", f));
  }

  bool test(const Node& n) {
    const Val v = eval(*n.c[0]);
    std::vector<Val> rest;
    for (std::size_t i = 1; i < n.c.size(); ++i) rest.push_back(eval(*n.c[i]));
    return apply_test(n, n.s, v, rest);
  }

  bool apply_test(const Node& n, const std::string& t, const Val& v, const std::vector<Val>& rest) {
    const json& j = v.j();
    if (t == "defined") return !v.undef;
    if (t == "undefined") return v.undef;
    if (t == "none") return !v.undef && j.is_null();
    if (t == "string") return !v.undef && j.is_string();
    if (t == "number") return !v.undef && j.is_number();
    if (t == "integer") return !v.undef && j.is_number_integer();
    if (t == "float") return !v.undef && j.is_number_float();
    if (t == "boolean") return !v.undef && j.is_boolean();
    if (t == "mapping") return !v.undef && j.is_object();
    if (t == "sequence" || t == "iterable") return !v.undef && (j.is_array() || j.is_string() || j.is_object());
    if (t == "true") return !v.undef && j.is_boolean() && j.get<bool>();
    if (t == "false") return !v.undef && j.is_boolean() && !j.get<bool>();
    if (t == "odd" || t == "even") return integer(n, v, t.c_str()) % 2 == (t == "odd" ? 1 : 0) ||
                                          integer(n, v, t.c_str()) % 2 == (t == "odd" ? -1 : 0);
    if (t == "lower" || t == "upper") {
      const std::string& s = str(n, v, t.c_str());
      return std::none_of(s.begin(), s.end(), [&](char ch) {
        return t == "lower" ? std::isupper(static_cast<unsigned char>(ch)) : std::islower(static_cast<unsigned char>(ch));
      });
    }
    if (rest.empty() && (t == "equalto" || t == "eq" || t == "==" || t == "sameas" || t == "ne" || t == "!=" ||
                         t == "in" || t == "divisibleby"))
      fail(n, fmt::format("the test '{}' needs an argument", t));
    if (t == "equalto" || t == "eq" || t == "==" || t == "sameas") return equal(n, v, rest[0]);
    if (t == "ne" || t == "!=") return !equal(n, v, rest[0]);
    if (t == "divisibleby") return integer(n, v, t.c_str()) % integer(n, rest[0], t.c_str()) == 0;
    if (t == "in") return (rest[0].j().is_array() || rest[0].j().is_object() || rest[0].j().is_string()) &&
                          contains(n, v, rest[0]);
    fail(n, fmt::format("unsupported Jinja test '{}'", t));
  }
};

}  // namespace

JinjaTemplate::JinjaTemplate(std::string_view source, std::string name) : name_(std::move(name)) {
  root_ = Parser(tokenize(preprocess(source), name_), name_).program();
}

std::string JinjaTemplate::render(const nlohmann::ordered_json& variables) const {
  DMI_CHECK(variables.is_object(), "{}: chat template variables must be a JSON object", name_);
  Renderer r(name_, variables);
  try {
    r.exec(*root_);
  } catch (const nlohmann::json::exception& e) {  // a value the template mishandles, never a crash
    DMI_FAIL("{}: chat template error: {}", name_, e.what());
  }
  return std::move(r.out);
}

}  // namespace dmi::io
