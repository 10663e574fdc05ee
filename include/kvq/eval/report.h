#pragma once
// Rendering of an EvalReport: a fixed-width (or Markdown) table for people, JSON for tools.
#include <string>

#include "kvq/eval/results.h"

namespace kvq::eval {

struct ReportContext {
  std::string model_path;
  std::string text_source;
  uint64_t text_hash = 0;  // fnv1a64 of the text
  size_t text_bytes = 0;
  std::string command;     // the command line, for reproduction
};

std::string format_table(const EvalReport& rep, bool markdown = false);
std::string report_json(const EvalReport& rep, const ReportContext& ctx, int indent = 2);

}  // namespace kvq::eval
