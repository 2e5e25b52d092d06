// Bash completion generated from a tool's CLI11 definition (`dmi-run
// --completion bash`): option names per subcommand, the allowed values of
// options that have a set of them (CLI::IsMember), file names for the other
// options that take a value and for positional arguments, and subcommand
// names where a tool has them. Nothing is written by hand, so it cannot drift
// from the flags.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace dmi::apps {

namespace detail {

// "{a,b,c}" (IsMember's description) -> "a b c"; anything else -> "".
inline std::string member_words(CLI::Option* opt) {
  for (int i = 0;; ++i) {
    CLI::Validator* v = nullptr;
    try {
      v = opt->get_validator(i);
    } catch (const CLI::OptionNotFound&) {
      return "";
    }
    std::string d = v->get_description();
    if (d.size() < 2 || d.front() != '{' || d.back() != '}') continue;
    d = d.substr(1, d.size() - 2);
    for (char& ch : d)
      if (ch == ',') ch = ' ';
    return d;
  }
}

struct Completion {
  std::string words;                   // option names, for "-" words
  std::vector<std::string> choices;    // "case" arms: prev word -> values
  std::vector<std::string> file_opts;  // prev words whose value is a file or free text
};

inline std::string quoted(const std::string& s) { return "\"" + s + "\""; }

// The options of app and of its option groups (nameless subcommands).
inline std::vector<CLI::Option*> all_options(CLI::App& app) {
  std::vector<CLI::Option*> out = app.get_options();
  for (CLI::App* g : app.get_subcommands({}))
    if (g->get_name().empty())
      for (CLI::Option* o : all_options(*g)) out.push_back(o);
  return out;
}

inline Completion options_of(CLI::App& app, const std::string& sub) {
  Completion c;
  for (CLI::Option* opt : all_options(app)) {
    std::vector<std::string> names;
    for (const auto& l : opt->get_lnames()) names.push_back("--" + l);
    for (const auto& s : opt->get_snames()) names.push_back("-" + s);
    if (names.empty()) continue;  // positional
    for (const auto& n : names) c.words += (c.words.empty() ? "" : " ") + n;
    if (opt->get_expected_max() == 0) continue;  // a flag
    std::string pattern;
    for (const auto& n : names) pattern += (pattern.empty() ? "" : "|") + quoted(sub + ":" + n);
    const std::string words = member_words(opt);
    if (!words.empty())
      c.choices.push_back("    " + pattern + ") COMPREPLY=($(compgen -W \"" + words + "\" -- \"$cur\")); return ;;");
    else
      c.file_opts.push_back(pattern);
  }
  return c;
}

struct Scope {
  std::string name;  // "" (the tool), "show", "steer-vector make"
  CLI::App* app;
  std::string children;  // its subcommands' names, space-separated
};

inline void collect(CLI::App& app, const std::string& name, std::vector<Scope>& out) {
  out.push_back({name, &app, ""});
  const std::size_t self = out.size() - 1;
  for (CLI::App* s : app.get_subcommands({})) {
    if (s->get_name().empty()) continue;  // an option group: its options are app's
    out[self].children += (out[self].children.empty() ? "" : " ") + s->get_name();
    collect(*s, name.empty() ? s->get_name() : name + " " + s->get_name(), out);
  }
}

}  // namespace detail

// The script for `source <(tool --completion bash)`.
inline std::string bash_completion(CLI::App& app, const std::string& tool) {
  using detail::quoted;
  std::string fn = "_";
  for (char ch : tool) fn += (ch == '-' || ch == '.') ? '_' : ch;
  std::vector<detail::Scope> scopes;
  detail::collect(app, "", scopes);
  // Which (sub)subcommand the words so far chose: "$sub/word" matches a child.
  std::string steps, choices, files, words, children;
  for (const auto& sc : scopes) {
    std::string w;
    for (std::size_t i = 0; i <= sc.children.size(); ++i) {
      if (i < sc.children.size() && sc.children[i] != ' ') {
        w += sc.children[i];
        continue;
      }
      if (!w.empty()) steps += (steps.empty() ? "" : "|") + quoted(sc.name + "/" + w);
      w.clear();
    }
    const detail::Completion c = detail::options_of(*sc.app, sc.name);
    for (const auto& line : c.choices) choices += line + "\n";
    for (const auto& p : c.file_opts) files += (files.empty() ? "" : "|") + p;
    words += "      " + quoted(sc.name) + ") COMPREPLY=($(compgen -W " + quoted(c.words) + " -- \"$cur\")) ;;\n";
    if (!sc.children.empty())
      children += "      " + quoted(sc.name) + ") COMPREPLY=($(compgen -W " + quoted(sc.children) + " -- \"$cur\")) ;;\n";
  }
  std::string s = "# bash completion for " + tool + ", generated from its command-line definition by `" + tool +
                  " --completion bash`.\n# Use: source <(" + tool + " --completion bash)\n";
  s += fn + "() {\n  local cur=\"${COMP_WORDS[COMP_CWORD]}\" prev=\"${COMP_WORDS[COMP_CWORD-1]}\" sub=\"\" i\n";
  if (!steps.empty())
    s += "  for ((i = 1; i < COMP_CWORD; i++)); do\n    case \"$sub/${COMP_WORDS[i]}\" in\n      " + steps +
         ") sub=\"${sub:+$sub }${COMP_WORDS[i]}\" ;;\n    esac\n  done\n";
  s += "  case \"$sub:$prev\" in\n" + choices;
  if (!files.empty()) s += "    " + files + ") COMPREPLY=(); return ;;  # a file or free text: bash's default\n";
  s += "  esac\n  if [[ \"$cur\" == -* ]]; then\n    case \"$sub\" in\n" + words + "    esac\n    return\n  fi\n";
  if (!children.empty()) s += "  case \"$sub\" in\n" + children + "  esac\n";
  s += "}\ncomplete -o default -F " + fn + " " + tool + "\n";
  return s;
}

}  // namespace dmi::apps
