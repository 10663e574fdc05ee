#pragma once
// The one owner of the KV cache options on the command line. Every command that builds a cache
// registers its flags here, spelled the same everywhere, and turns the strings into QuantSpec /
// eval::SpecRequest through the functions below (which reuse parse_quant_spec and
// eval::parse_spec_list); no command parses a cache option by hand.
//
//   --kv-cache-dtype        auto|bf16|fp16|fp8|fp8_e4m3|fp8_fnuz|int8 (lists: comma-separated)
//   --kv-scale-granularity  per_tensor|per_token_head|per_block_head (lists: comma-separated)
//   --kv-scale-dtype        fp32
//   --block-size            16|32
//   --kv-sink-tokens        N (0 disables)
//   --kv-rotate             none|hadamard (eval, generate, serve: the commands that run the engine)
//   --kv-recent-tokens      R: the last R tokens attended in bf16, 0 disables (eval, generate, serve)
//   --kv-config             FILE: per-layer, per-K/V dtypes (quant/layer_config.h; eval, generate, serve).
//                           generate and serve use it in place of --kv-cache-dtype; eval adds it to
//                           the specs it compares (label "kv-config")
//   --backend               cpu|cuda|auto
//   --numerics              fast|reproducible (eval, generate, serve; backend.h's Numerics)
//
// Old spellings (bench's --formats, --granularity, --granularities, --sink; generate's
// --kv-block-size; report's --sink) stay as hidden aliases that print a one-line deprecation
// notice on stderr.
#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvq/backend/backend.h"
#include "kvq/common/status.h"
#include "kvq/eval/specs.h"
#include "kvq/model/model.h"
#include "kvq/quant/spec.h"

namespace kvq::tools {

// The commands that take cache options (the test parses the same arguments for each).
enum class CacheCommand { kEval, kGenerate, kBenchDecode, kBenchWrite, kReport, kServe };
inline constexpr CacheCommand kAllCacheCommands[] = {CacheCommand::kEval,        CacheCommand::kGenerate,
                                                      CacheCommand::kBenchDecode, CacheCommand::kBenchWrite,
                                                      CacheCommand::kReport,      CacheCommand::kServe};

// The strings and numbers as typed. `add_cache_options` sets the command's defaults.
struct CacheCliOptions {
  std::string kv_cache_dtype = "auto";
  std::string kv_scale_granularity = "per_token_head";
  std::string kv_scale_dtype = "fp32";
  int block_size = 16;
  int sink_tokens = 256;
  std::string kv_rotate = "none";
  int recent_tokens = 0;
  std::string kv_config;  // "" = none
  std::string backend = "auto";  // validated: cpu | cuda | auto
  std::string numerics = "fast";  // validated: fast | reproducible
};

inline constexpr const char* kBackendChoices[] = {"cpu", "cuda", "auto"};

// Which flags a command has, its defaults, and whether dtype/granularity take comma-separated lists.
struct CacheFlagSet {
  const char* command = "";  // as typed after `kvq`: "eval", "bench decode"
  bool dtype = true, granularity = true, scale_dtype = true, block_size = true, sink = true, backend = true;
  bool rotate = true;  // only commands whose cache goes through the engine (the rotation is an engine step)
  bool recent = true;  // likewise: the window needs the engine's bf16 recent pages
  bool kv_config = true;  // likewise: per-layer formats need the engine's per-layer geometry
  bool numerics = true;   // commands that run the model
  bool lists = false;
  CacheCliOptions defaults;
  struct Alias {
    const char* old_name;  // hidden, deprecated
    const char* new_name;
  };
  std::vector<Alias> aliases;
};

const CacheFlagSet& cache_flag_set(CacheCommand cmd);

// Sets `o` to the command's defaults and registers its cache flags (and deprecated aliases) on
// `app`. Integer flags refuse an empty value; --backend refuses anything but cpu, cuda, auto.
void add_cache_options(CLI::App* app, CacheCliOptions& o, CacheCommand cmd);

// One spec (generate, serve). `auto` resolves to `auto_format`, what this machine prefers. A list, or a
// granularity list that expands a quantized dtype to several specs, is refused.
Result<QuantSpec> to_quant_spec(const CacheCliOptions& o, Format auto_format);

// What a command that runs a model builds from its flags, in the order every such command follows:
// --backend resolved, the command's own checks of the flags (which may need the backend kind: the
// cache spec, output files) before anything is created, then the backend and the model.
struct ModelRun {
  backend::BackendKind kind = backend::BackendKind::kCpu;
  std::unique_ptr<backend::Backend> backend;
  std::string model_path;  // --model resolved (aliases, the cached download)
  std::unique_ptr<model::Model> model;
  double load_seconds = 0;  // backend creation and model load
};
struct ModelRunFlags {
  std::string backend = "auto", model, tokenizer;
  int cpu_threads = 0;  // BLAS threads (0: the BLAS default)
  std::string numerics = "fast";
};
// A refusal names the flag it comes from ("--backend: ...", "--model: ...").
Result<ModelRun> open_model_run(const ModelRunFlags& flags,
                                const std::function<Status(backend::BackendKind)>& check_flags);

// One spec for a model running on `kind` (generate, serve): to_quant_spec with `auto` resolved to
// what that backend prefers, checked inside open_model_run's `check_flags`.
Result<QuantSpec> to_quant_spec(const CacheCliOptions& o, backend::BackendKind kind);

// The specs one eval compares (eval::parse_spec_list: per-entry options after colons, auto runs
// its fallback chain starting at `auto_first`).
Result<std::vector<eval::SpecRequest>> to_spec_requests(const CacheCliOptions& o, Format auto_first);

// What the benchmarks sweep: every format x every granularity (granularities apply to quantized
// formats), one block size and sink. `auto` and per-entry options are refused; kBenchDecode takes
// one granularity.
struct CacheGrid {
  std::vector<Format> formats;
  std::vector<ScaleGranularity> granularities;
  int block_size = 16;
  int sink_tokens = 256;
};
Result<CacheGrid> to_cache_grid(const CacheCliOptions& o, CacheCommand cmd);

// Reads --kv-config into `spec` (plane_formats; spec.format becomes layer 0's K dtype, so a
// uniform file is the uniform spec on every backend). Errors start with "--kv-config: ".
Status apply_kv_config(const std::string& path, QuantSpec& spec);

// Block size and sink only (report, which sweeps every format and granularity itself).
Result<QuantSpec> to_geometry(const CacheCliOptions& o);

}  // namespace kvq::tools
