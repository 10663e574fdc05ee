#pragma once
// The evaluation text. The default is CPython's pydoc topics (pydoc_data/topics.py): ~465 KB of
// English technical prose that is present wherever python3 is, so every machine evaluates on the
// same text without a download.
#include <cstdint>
#include <string>
#include <string_view>

#include "kvq/common/status.h"

namespace kvq::eval {

struct EvalText {
  std::string text;
  std::string source;  // what to print: a file path, or "pydoc topics (<path>, Python <version>)"
};

// Largest text file read whole (kvq tokenizes what it reads in memory).
inline constexpr uint64_t kMaxTextBytes = 256ull << 20;
// A window budget of N tokens reads at most max(kMinTextPrefixBytes, N * kTextBytesPerBudgetToken)
// bytes: tokens of English text average ~4 bytes, so this leaves a wide margin while a 50 MB text
// is no longer tokenized in full to score 128 tokens. Texts under 1 MiB (CPython's pydoc topics:
// ~465 KB) are always read whole, so recorded results do not change.
inline constexpr uint64_t kMinTextPrefixBytes = 1ull << 20;
inline constexpr uint64_t kTextBytesPerBudgetToken = 64;
// Bytes worth reading for a budget of `tokens` window tokens; 0 (no limit) for tokens <= 0.
uint64_t text_bytes_for_tokens(int64_t tokens);

// A UTF-8 text file. max_bytes = 0: read whole (refused beyond kMaxTextBytes); otherwise only its
// first min(max_bytes, kMaxTextBytes) bytes, cut at a character boundary, and `source` says so.
// Directories, FIFOs and devices are refused. kNotFound / kInvalidArgument (empty, not a regular
// file, too large) with the path named.
Result<EvalText> read_text_file(const std::string& path, uint64_t max_bytes = 0);

// Runs `python` (a command name or path) to import pydoc_data.topics and returns the values of its
// `topics` dict in sorted key order, each stripped of trailing whitespace, joined with one blank
// line, ending in a newline. Errors name the cause (python missing, module missing) and the way
// out (--text FILE).
Result<EvalText> pydoc_topics_text(const std::string& python = "python3");

// FNV-1a 64-bit hash, to identify the exact text a result was measured on.
uint64_t fnv1a64(std::string_view bytes);

}  // namespace kvq::eval
