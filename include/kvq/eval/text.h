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

// A UTF-8 text file, read whole. kNotFound / kInvalidArgument (empty file) with the path named.
Result<EvalText> read_text_file(const std::string& path);

// Runs `python` (a command name or path) to import pydoc_data.topics and returns the values of its
// `topics` dict in sorted key order, each stripped of trailing whitespace, joined with one blank
// line, ending in a newline. Errors name the cause (python missing, module missing) and the way
// out (--text FILE).
Result<EvalText> pydoc_topics_text(const std::string& python = "python3");

// FNV-1a 64-bit hash, to identify the exact text a result was measured on.
uint64_t fnv1a64(std::string_view bytes);

}  // namespace kvq::eval
