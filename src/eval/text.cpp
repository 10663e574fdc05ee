#include "kvq/eval/text.h"

#include <sys/wait.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <algorithm>

#include "kvq/common/checked.h"
#include "kvq/common/file_io.h"

namespace kvq::eval {

uint64_t text_bytes_for_tokens(int64_t tokens) {
  if (tokens <= 0) return 0;
  uint64_t b = 0;
  if (!checked_mul(static_cast<uint64_t>(tokens), kTextBytesPerBudgetToken, &b) || b > kMaxTextBytes) return kMaxTextBytes;
  return std::max(b, kMinTextPrefixBytes);
}

Result<EvalText> read_text_file(const std::string& path, uint64_t max_bytes) {
  FilePrefix p;
  if (max_bytes == 0) {  // whole file: refused by its size before anything is read
    auto f = read_file(path, kMaxTextBytes, "text file");
    if (!f.is_ok()) return f.status();
    p.bytes = std::move(f).value();
    p.file_size = p.bytes.size();
  } else {
    auto f = read_file_prefix(path, std::min(max_bytes, kMaxTextBytes), "text file");
    if (!f.is_ok()) return f.status();
    p = std::move(f).value();
  }
  if (p.file_size == 0) return invalid_argument("text file '" + path + "' is empty");
  const bool truncated = p.truncated();
  EvalText t{std::move(p.bytes), path};
  if (truncated) {
    // Cut at a character boundary: drop the UTF-8 continuation bytes of a split last character,
    // and the lead byte they belong to.
    size_t end = t.text.size();
    while (end > 0 && (static_cast<unsigned char>(t.text[end - 1]) & 0xC0) == 0x80) --end;
    if (end > 0 && static_cast<unsigned char>(t.text[end - 1]) >= 0xC0) --end;
    if (end > 0) t.text.resize(end);
    t.source += " (first " + std::to_string(t.text.size()) + " of " + std::to_string(p.file_size) + " bytes)";
  }
  return t;
}

namespace {

// Single-quotes `s` for /bin/sh.
std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') q += "'\\''";
    else q += c;
  }
  return q + "'";
}

// The first line carries provenance (path, version); the text follows. Exit 3 = module missing,
// so the caller can tell that apart from a missing interpreter (127 from the shell).
constexpr const char* kScript =
    "import sys, platform\n"
    "try:\n"
    "    import pydoc_data.topics as t\n"
    "except Exception:\n"
    "    sys.exit(3)\n"
    "body = '\\n\\n'.join(t.topics[k].rstrip() for k in sorted(t.topics)) + '\\n'\n"
    "sys.stdout.buffer.write((t.__file__ + '\\t' + platform.python_version() + '\\n').encode('utf-8'))\n"
    "sys.stdout.buffer.write(body.encode('utf-8'))\n";

}  // namespace

Result<EvalText> pydoc_topics_text(const std::string& python) {
  if (python.empty()) return invalid_argument("no python interpreter given to read the pydoc topics from");
  const std::string cmd = shell_quote(python) + " -c " + shell_quote(kScript) + " 2>/dev/null";
  const std::string way_out = "; pass --text FILE to evaluate on another text";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return internal_error(std::string("cannot start a shell to run python: ") + std::strerror(errno));
  std::string out;
  char buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, got);
  int rc = pclose(p);
  if (rc == -1) return internal_error("waiting for '" + python + "' failed" + way_out);
  int code = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  if (code == 127)
    return Status(StatusCode::kNotFound,
                  "'" + python + "' was not found, so CPython's pydoc topics (the default text) cannot be read" +
                      way_out);
  if (code == 3)
    return Status(StatusCode::kNotFound,
                  "'" + python + "' has no module pydoc_data.topics (some distributions strip it)" + way_out);
  if (code != 0)
    return internal_error("'" + python + "' failed (exit status " + std::to_string(code) +
                          ") while dumping pydoc_data.topics" + way_out);
  size_t nl = out.find('\n');
  if (nl == std::string::npos || nl + 1 >= out.size())
    return internal_error("'" + python + "' returned no pydoc topics text" + way_out);
  std::string header = out.substr(0, nl);
  size_t tab = header.find('\t');
  std::string path = header.substr(0, tab);
  std::string version = tab == std::string::npos ? "?" : header.substr(tab + 1);
  return EvalText{out.substr(nl + 1), "pydoc topics (" + path + ", Python " + version + ")"};
}

uint64_t fnv1a64(std::string_view bytes) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace kvq::eval
