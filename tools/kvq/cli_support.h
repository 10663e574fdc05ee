#pragma once
// Command-line plumbing shared by every `kvq` command (and tested in tests/tools/): the version
// text, the answer to a mistyped command, the refusal of empty numeric values, the sampling
// checks, and the one-line form of a parse error. Nothing here exits; main.cpp does.
#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "kvq/common/status.h"

namespace kvq::tools {

// "kvq 0.1.0 (commit 1a2b3c4, Release build, CUDA on: 90a-real;80-virtual)"
std::string version_text();

// Adds a check to `opt` that refuses an empty value ("--block-size ''", "--kv-sink-tokens=") and a
// value that is not a number of the option's type, naming the flag. Idempotent.
void refuse_empty_number(CLI::Option* opt);
// refuse_empty_number on every numeric option (INT, UINT, FLOAT) of `app` and its subcommands.
void refuse_empty_numbers(CLI::App& app);

// When `args` (argv without argv[0]) name a command that `app` does not have, or name none where
// one is required, the one-line message to print ("unknown command 'evl'; commands: probe, ...");
// empty when the words are fine (options are left to CLI11).
std::string check_command_words(CLI::App& app, const std::vector<std::string>& args);

// The one-line message for a parse error: "kvq eval: --block-size: needs a value ...".
std::string parse_error_line(CLI::App& app, const CLI::ParseError& e);

// Sampling values of `kvq generate`, checked before the model loads. Messages name the flags.
Status check_sampling(float temperature, float top_p, int max_new_tokens);

}  // namespace kvq::tools
