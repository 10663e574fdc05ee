#include "kvq/cli_support.h"

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#ifndef KVQ_VERSION
#define KVQ_VERSION "unknown"
#endif
#ifndef KVQ_GIT_COMMIT
#define KVQ_GIT_COMMIT "unknown"
#endif
#ifndef KVQ_BUILD_TYPE
#define KVQ_BUILD_TYPE "unknown"
#endif
#ifndef KVQ_BUILD_CUDA
#define KVQ_BUILD_CUDA 0
#endif
#ifndef KVQ_CUDA_ARCHS
#define KVQ_CUDA_ARCHS ""
#endif

namespace kvq::tools {
namespace {

constexpr const char* kNumberCheck = "kvq-number";

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

std::string flag_name(const CLI::Option& opt) {
  if (!opt.get_lnames().empty()) return "--" + opt.get_lnames().front();
  if (!opt.get_snames().empty()) return "-" + opt.get_snames().front();
  return opt.get_name(true);
}

enum class NumberKind { kInt, kUint, kFloat };

// Empty when `v` is, in its entirety, a number of the kind.
std::string number_problem(const std::string& v, NumberKind kind) {
  const bool integer = kind != NumberKind::kFloat;
  if (v.empty()) return integer ? "needs an integer value (got an empty one)" : "needs a number (got an empty value)";
  // (parse_error_line words CLI11's "--flag=" refusal the same way.)
  const char* s = v.c_str();
  char* end = nullptr;
  errno = 0;
  if (kind == NumberKind::kInt) {
    (void)std::strtoll(s, &end, 10);
  } else if (kind == NumberKind::kUint) {
    (void)std::strtoull(s, &end, 10);
    if (v.front() == '-') end = const_cast<char*>(s);  // strtoull would wrap it
  } else {
    (void)std::strtod(s, &end);
  }
  if (end == s || *end != '\0' || std::isspace(static_cast<unsigned char>(v.front())))
    return std::string(integer ? "needs an integer" : "needs a number") + " (got '" + v + "')";
  if (errno == ERANGE) return "value '" + v + "' is out of range";
  return {};
}

void collect_numeric(CLI::App& app) {
  for (CLI::Option* opt : app.get_options()) {
    if (opt->get_type_size() == 0) continue;  // a flag
    refuse_empty_number(opt);
  }
  for (CLI::App* sub : app.get_subcommands({})) collect_numeric(*sub);
}

// A bound as CLI11's range check prints it ("1", "0.000000"), without the float's trailing zeros.
std::string trim_bound(std::string b) {
  if (b.find('.') == std::string::npos) return b;
  while (!b.empty() && b.back() == '0') b.pop_back();
  if (!b.empty() && b.back() == '.') b.pop_back();
  return b;
}

// CLI11's range refusal "--flag: Value X not in range A to B" in kvq's words: a value that is no number
// is named as such (CLI11 says "not in range" for "abc" too), a number out of range gets the range.
std::string reword_range_refusal(const std::string& what) {
  const size_t v = what.find(": Value ");
  const size_t nir = what.find(" not in range ", v == std::string::npos ? 0 : v);
  const size_t to = what.find(" to ", nir == std::string::npos ? 0 : nir);
  if (v == std::string::npos || nir == std::string::npos || to == std::string::npos) return what;
  const std::string flag = what.substr(0, v), value = what.substr(v + 8, nir - v - 8);
  const std::string lo = what.substr(nir + 14, to - nir - 14), hi = what.substr(to + 4);
  const bool integer = lo.find('.') == std::string::npos && hi.find('.') == std::string::npos;
  const std::string problem = number_problem(value, integer ? NumberKind::kInt : NumberKind::kFloat);
  if (!problem.empty()) return flag + ": " + problem;
  return flag + " " + value + " is out of range; accepted: " + trim_bound(lo) + " to " + trim_bound(hi);
}

std::string command_list(CLI::App& app) {
  std::string out;
  for (CLI::App* sub : app.get_subcommands({})) {
    if (sub->get_group().empty()) continue;  // hidden
    out += (out.empty() ? "" : ", ") + sub->get_name();
  }
  return out;
}

std::string fmt(float v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
  return buf;
}

}  // namespace

std::string version_text() {
  std::string s = std::string("kvq ") + KVQ_VERSION + " (commit " + KVQ_GIT_COMMIT + ", " + KVQ_BUILD_TYPE + " build, ";
  if (KVQ_BUILD_CUDA) {
    s += std::string("CUDA on, arch ") + KVQ_CUDA_ARCHS + ")";
  } else {
    s += "CUDA off)";
  }
  return s;
}

void refuse_empty_number(CLI::Option* opt) {
  const std::string type = opt->get_type_name();
  NumberKind kind;
  if (starts_with(type, "INT")) kind = NumberKind::kInt;
  else if (starts_with(type, "UINT")) kind = NumberKind::kUint;
  else if (starts_with(type, "FLOAT")) kind = NumberKind::kFloat;
  else return;
  try {
    (void)opt->get_validator(kNumberCheck);
    return;  // already checked
  } catch (const CLI::OptionNotFound&) {
  }
  // A hidden option has no name in CLI11's messages, so the check names it itself.
  const std::string prefix = opt->get_group().empty() ? flag_name(*opt) + ": " : "";
  CLI::Validator v([kind, prefix](std::string& value) {
    std::string problem = number_problem(value, kind);
    return problem.empty() ? problem : prefix + problem;
  }, "", kNumberCheck);
  // Added right after the option is created, it runs before the option's own range or membership check.
  opt->check(v);
}

void refuse_empty_numbers(CLI::App& app) { collect_numeric(app); }

std::string check_command_words(CLI::App& app, const std::vector<std::string>& args) {
  CLI::App* cur = &app;
  std::string path = "kvq";
  for (const std::string& a : args) {
    if (cur->get_subcommands({}).empty()) return {};
    if (!a.empty() && a.front() == '-') return {};  // options (--help, --version) are CLI11's
    CLI::App* next = nullptr;
    for (CLI::App* sub : cur->get_subcommands({}))
      if (sub->check_name(a)) next = sub;
    if (next == nullptr)
      return path + ": unknown command '" + a + "'; commands: " + command_list(*cur) + " (" + path + " --help)";
    path += " " + next->get_name();
    cur = next;
  }
  if (!cur->get_subcommands({}).empty() && cur->get_require_subcommand_min() > 0)
    return path + ": no command given; commands: " + command_list(*cur) + " (" + path + " --help)";
  return {};
}

std::string parse_error_line(CLI::App& app, const CLI::ParseError& e) {
  std::string path = "kvq";
  for (CLI::App* cur = &app;;) {
    std::vector<CLI::App*> parsed = cur->get_subcommands();
    if (parsed.empty()) break;
    cur = parsed.front();
    path += " " + cur->get_name();
  }
  std::string what = e.what();
  if (starts_with(what, ": ")) what.erase(0, 2);  // a hidden option's check names the flag itself
  // "--kv-sink-tokens=" (nothing after '='): CLI11 says "1 required INT missing".
  const size_t missing = what.find(": 1 required ");
  if (missing != std::string::npos && what.size() >= 8 && what.compare(what.size() - 8, 8, " missing") == 0) {
    const std::string type = what.substr(missing + 13);
    const char* need = starts_with(type, "INT") || starts_with(type, "UINT") ? "needs an integer value (got an empty one)"
                       : starts_with(type, "FLOAT")                          ? "needs a number (got an empty value)"
                                                                             : "needs a value (got an empty one)";
    what = what.substr(0, missing) + ": " + need;
  }
  return path + ": " + reword_range_refusal(what);
}

Status check_sampling(float temperature, float top_p, int max_new_tokens) {
  if (!std::isfinite(temperature) || temperature < 0.f)
    return invalid_argument("--temperature " + fmt(temperature) +
                            " is not valid; use 0 (greedy) or a positive number such as 0.7");
  if (!std::isfinite(top_p) || !(top_p > 0.f && top_p <= 1.f))
    return invalid_argument("--top-p " + fmt(top_p) + " is not valid; use a value in (0, 1], e.g. 0.9");
  if (max_new_tokens < 1)
    return invalid_argument("--max-new-tokens " + std::to_string(max_new_tokens) + " is not valid; use 1 or more");
  return Status::ok();
}

}  // namespace kvq::tools
