#include "kvq/cache_options.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "kvq/cli_support.h"
#include "kvq/quant/layer_config.h"

namespace kvq::tools {
namespace {

CacheFlagSet make_eval() {
  CacheFlagSet s;
  s.command = "eval";
  s.lists = true;
  s.defaults.kv_cache_dtype = "bf16,fp8,fp8_fnuz,int8";
  return s;
}

CacheFlagSet make_generate() {
  CacheFlagSet s;
  s.command = "generate";
  s.defaults.kv_cache_dtype = "auto";
  s.aliases = {{"--kv-block-size", "--block-size"}};
  return s;
}

CacheFlagSet make_serve() {
  CacheFlagSet s;
  s.command = "serve";
  s.defaults.kv_cache_dtype = "auto";
  return s;
}

CacheFlagSet make_bench_decode() {
  CacheFlagSet s;
  s.command = "bench decode";
  s.lists = true;
  s.defaults.kv_cache_dtype = "bf16,fp8_e4m3,fp8_fnuz,int8,int4";
  s.rotate = false;  // times the attention kernels alone; a rotation would not change them
  s.recent = false;
  s.kv_config = false;
  s.numerics = false;  // times the fast kernels
  s.aliases = {{"--formats", "--kv-cache-dtype"}, {"--granularity", "--kv-scale-granularity"},
               {"--sink", "--kv-sink-tokens"}};
  return s;
}

CacheFlagSet make_bench_write() {
  CacheFlagSet s;
  s.command = "bench write";
  s.lists = true;
  s.sink = false;  // the write benchmark has no sink
  s.rotate = s.recent = s.kv_config = s.numerics = false;
  s.defaults.kv_cache_dtype = "fp8_e4m3,fp8_fnuz,int8,bf16";
  s.defaults.kv_scale_granularity = "per_token_head,per_block_head";
  s.aliases = {{"--formats", "--kv-cache-dtype"}, {"--granularities", "--kv-scale-granularity"}};
  return s;
}

CacheFlagSet make_report() {
  CacheFlagSet s;
  s.command = "report";
  s.dtype = s.granularity = s.scale_dtype = s.backend = s.rotate = s.recent = s.kv_config = s.numerics = false;  // report sweeps every format itself, on the CPU
  s.defaults.sink_tokens = 0;
  s.aliases = {{"--sink", "--kv-sink-tokens"}};
  return s;
}

template <class T>
CLI::Option* add_alias(CLI::App* app, const CacheFlagSet& set, const CacheFlagSet::Alias& a, T& target) {
  const std::string old_name = a.old_name, new_name = a.new_name, cmd = set.command;
  CLI::Option* opt = app->add_option(old_name, target, "deprecated spelling of " + new_name);
  opt->group("");  // hidden from --help
  opt->each([old_name, new_name, cmd](const std::string&) {
    std::fprintf(stderr, "kvq %s: %s is deprecated; use %s (same meaning)\n", cmd.c_str(), old_name.c_str(),
                 new_name.c_str());
  });
  return opt;
}

std::string list_note(bool lists) { return lists ? " (comma-separated list)" : ""; }

}  // namespace

const CacheFlagSet& cache_flag_set(CacheCommand cmd) {
  static const CacheFlagSet eval = make_eval(), generate = make_generate(), decode = make_bench_decode(),
                            write = make_bench_write(), report = make_report(), serve = make_serve();
  switch (cmd) {
    case CacheCommand::kEval: return eval;
    case CacheCommand::kGenerate: return generate;
    case CacheCommand::kBenchDecode: return decode;
    case CacheCommand::kBenchWrite: return write;
    case CacheCommand::kReport: return report;
    case CacheCommand::kServe: return serve;
  }
  return eval;
}

void add_cache_options(CLI::App* app, CacheCliOptions& o, CacheCommand cmd) {
  const CacheFlagSet& set = cache_flag_set(cmd);
  o = set.defaults;
  const bool bench = cmd == CacheCommand::kBenchDecode || cmd == CacheCommand::kBenchWrite;
  const std::string lists = list_note(set.lists);
  if (set.dtype) {
    std::string what = std::string(bench ? "" : "auto|") + "bf16|fp16|fp8|fp8_e4m3|fp8_fnuz|int8|int4" + lists;
    if (cmd == CacheCommand::kEval)
      what += "; an entry may carry options after colons, e.g. fp8:per_tensor or int8:per_block_head:sink0:b32";
    app->add_option("--kv-cache-dtype", o.kv_cache_dtype, "KV cache storage: " + what)->capture_default_str();
  }
  if (set.granularity) {
    app->add_option("--kv-scale-granularity", o.kv_scale_granularity,
                    "scales of the quantized dtypes: per_tensor|per_token_head|per_block_head" +
                        list_note(set.lists && cmd != CacheCommand::kBenchDecode))
        ->capture_default_str();
  }
  if (set.scale_dtype)
    app->add_option("--kv-scale-dtype", o.kv_scale_dtype, "type of the stored scales: fp32, or fp16 (half the scale bytes; rounded up, see docs/ARCHITECTURE.md)")->capture_default_str();
  if (set.block_size) {
    refuse_empty_number(
        app->add_option("--block-size", o.block_size, "tokens per cache page: 16 or 32")->capture_default_str());
  }
  if (set.sink) {
    refuse_empty_number(app->add_option("--kv-sink-tokens", o.sink_tokens,
                                        "first N tokens of each sequence kept in bf16 (0 disables)")
                            ->capture_default_str());
  }
  if (set.rotate) {
    app->add_option("--kv-rotate", o.kv_rotate,
                    "rotate K and Q per head before K is stored: none|hadamard (Walsh-Hadamard; head size "
                    "must be a power of two)")
        ->check(CLI::IsMember(std::vector<std::string>{"none", "hadamard"}))
        ->capture_default_str();
  }
  if (set.recent) {
    refuse_empty_number(app->add_option("--kv-recent-tokens", o.recent_tokens,
                                        "last R tokens of each sequence attended in bf16 (KIVI's residual "
                                        "window; quantized dtypes only, 0 disables)")
                            ->capture_default_str());
  }
  if (set.kv_config) {
    app->add_option("--kv-config", o.kv_config,
                    "JSON file of per-layer K/V dtypes ({\"layers\": [{\"k\": \"int8\", \"v\": \"fp8\"}, ...]}, "
                    "as kvq eval --search writes); granularity, block, sink and rotation come from the flags" +
                        std::string(cmd == CacheCommand::kEval ? "; eval adds it to the specs it compares" : ""));
  }
  if (set.backend) {
    const char* what = bench ? "what to time: cuda or auto (= cuda); CPU kernels are timed by kvq_bench_cpu"
                           : "where the model runs: cpu, cuda or auto (cuda when a GPU is present)";
    app->add_option("--backend", o.backend, what)
        ->check(CLI::IsMember(std::vector<std::string>(std::begin(kBackendChoices), std::end(kBackendChoices))))
        ->capture_default_str();
  }
  if (set.numerics) {
    app->add_option("--numerics", o.numerics,
                    "fast, or reproducible: every op in one fixed fp32 order written once for CPU and GPU, so "
                    "--backend cuda gives the CPU's logits, codes and scales bit for bit (slower; fp32 weights)")
        ->check(CLI::IsMember(std::vector<std::string>{"fast", "reproducible"}))
        ->capture_default_str();
  }
  for (const CacheFlagSet::Alias& a : set.aliases) {
    const std::string n = a.new_name;
    if (n == "--kv-cache-dtype") add_alias(app, set, a, o.kv_cache_dtype);
    else if (n == "--kv-scale-granularity") add_alias(app, set, a, o.kv_scale_granularity);
    else if (n == "--block-size") refuse_empty_number(add_alias(app, set, a, o.block_size));
    else if (n == "--kv-sink-tokens") refuse_empty_number(add_alias(app, set, a, o.sink_tokens));
  }
}

Result<std::vector<eval::SpecRequest>> to_spec_requests(const CacheCliOptions& o, Format auto_first) {
  eval::SpecListOptions so;
  so.kv_cache_dtypes = o.kv_cache_dtype;
  so.granularities = o.kv_scale_granularity;
  so.scale_dtype = o.kv_scale_dtype;
  so.block_size = o.block_size;
  so.sink_tokens = o.sink_tokens;
  so.rotate = o.kv_rotate;
  so.recent_tokens = o.recent_tokens;
  so.auto_first = auto_first;
  auto reqs = eval::parse_spec_list(so);
  if (!reqs.is_ok() || o.kv_config.empty()) return reqs;
  // The config's spec takes its global settings from the flags (the first granularity listed).
  eval::SpecRequest r;
  r.label = "kv-config";
  r.spec = reqs.value().front().spec;
  if (auto g = parse_granularity(eval::split_csv(o.kv_scale_granularity).front()); g.is_ok())
    r.spec.granularity = g.value();
  r.spec.from_auto = false;
  KVQ_RETURN_IF_ERROR(apply_kv_config(o.kv_config, r.spec));
  reqs.value().push_back(std::move(r));
  return reqs;
}

Status apply_kv_config(const std::string& path, QuantSpec& spec) {
  auto cfg = read_kv_config(path);
  if (!cfg.is_ok()) return Status(cfg.status().code(), "--kv-config: " + cfg.status().message());
  spec.plane_formats = cfg.value().plane_formats;
  spec.format = spec.plane_formats.front();
  return Status::ok();
}

Result<QuantSpec> to_quant_spec(const CacheCliOptions& o, Format auto_format) {
  auto reqs = to_spec_requests(o, auto_format);
  if (!reqs.is_ok()) return reqs.status();
  if (eval::split_csv(o.kv_cache_dtype).size() > 1)
    return invalid_argument("--kv-cache-dtype takes one dtype here (got '" + o.kv_cache_dtype +
                            "'); kvq eval compares several");
  if (reqs.value().size() != (o.kv_config.empty() ? 1u : 2u))
    return invalid_argument("--kv-scale-granularity takes one granularity here (got '" + o.kv_scale_granularity +
                            "'); kvq eval compares several");
  const eval::SpecRequest& r = reqs.value().front();
  if (!o.kv_config.empty()) return reqs.value().back().spec;  // the config replaces the dtype
  if (!r.is_auto) return r.spec;
  // auto here means this machine's preferred format, with the settings the entry carries.
  QuantOptions qo;
  qo.kv_cache_dtype = "auto";
  qo.granularity = granularity_name(r.spec.granularity);
  qo.scale_dtype = o.kv_scale_dtype;
  qo.block_size = r.spec.block_size;
  qo.sink_tokens = r.spec.sink_tokens;
  qo.rotate = rotation_name(r.spec.rotation);
  qo.recent_tokens = r.spec.recent_tokens;
  return parse_quant_spec(qo, auto_format);
}

Result<QuantSpec> to_quant_spec(const CacheCliOptions& o, backend::BackendKind kind) {
  return to_quant_spec(o, backend::auto_cache_format(kind));
}

Result<ModelRun> open_model_run(const ModelRunFlags& flags,
                                const std::function<Status(backend::BackendKind)>& check_flags) {
  auto named = [](const std::string& flag, const Status& s) { return Status(s.code(), flag + ": " + s.message()); };
  ModelRun run;
  auto kind = backend::resolve_backend(flags.backend);
  if (!kind.is_ok()) return kind.status();  // names --backend itself
  run.kind = kind.value();
  if (check_flags)
    if (Status st = check_flags(run.kind); !st.is_ok()) return st;
  auto path = model::resolve_model_path(flags.model);
  if (!path.is_ok()) return named("--model", path.status());
  run.model_path = path.value();
  const auto t0 = std::chrono::steady_clock::now();
  backend::BackendOptions bo;
  bo.cpu_threads = flags.cpu_threads;
  auto numerics = backend::parse_numerics(flags.numerics);
  if (!numerics.is_ok()) return named("--numerics", numerics.status());
  bo.numerics = numerics.value();
  auto be = backend::create_backend(run.kind, bo);
  if (!be.is_ok()) return named("--backend " + flags.backend, be.status());
  run.backend = std::move(be).value();
  auto m = model::Model::load(run.model_path, flags.tokenizer);
  if (!m.is_ok()) return Status(m.status().code(), "loading " + run.model_path + ": " + m.status().message());
  run.model = std::move(m).value();
  run.load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return run;
}

Result<CacheGrid> to_cache_grid(const CacheCliOptions& o, CacheCommand cmd) {
  auto reqs = to_spec_requests(o, Format::kFp8E4m3);
  if (!reqs.is_ok()) return reqs.status();
  CacheGrid g;
  g.block_size = o.block_size;
  g.sink_tokens = o.sink_tokens;
  size_t unquantized = 0;
  for (const eval::SpecRequest& r : reqs.value()) {
    if (r.is_auto)
      return invalid_argument("--kv-cache-dtype auto is for eval and generate; the benchmarks time named dtypes "
                              "(bf16, fp16, fp8, fp8_fnuz, int8, int4)");
    if (r.spec.block_size != o.block_size || r.spec.sink_tokens != o.sink_tokens || r.spec.recent_tokens != 0)
      return invalid_argument("--kv-cache-dtype entry '" + r.label +
                              "': per-entry options are for kvq eval; set --block-size and --kv-sink-tokens");
    if (std::find(g.formats.begin(), g.formats.end(), r.spec.format) == g.formats.end()) {
      g.formats.push_back(r.spec.format);
      if (!r.spec.quantized()) ++unquantized;
    }
    if (r.spec.quantized() &&
        std::find(g.granularities.begin(), g.granularities.end(), r.spec.granularity) == g.granularities.end())
      g.granularities.push_back(r.spec.granularity);
  }
  if (g.granularities.empty()) {  // no quantized dtype: the list was checked by parse_spec_list
    for (const std::string& name : eval::split_csv(o.kv_scale_granularity)) {
      auto pg = parse_granularity(name);
      if (pg.is_ok()) g.granularities.push_back(pg.value());
    }
  }
  // A per-entry granularity (fp8:per_tensor) breaks the formats x granularities grid.
  const size_t expected = unquantized + (g.formats.size() - unquantized) * g.granularities.size();
  if (reqs.value().size() != expected)
    return invalid_argument("--kv-cache-dtype '" + o.kv_cache_dtype +
                            "': per-entry granularities are for kvq eval; the benchmarks run every dtype with "
                            "every --kv-scale-granularity");
  if (cmd == CacheCommand::kBenchDecode && g.granularities.size() != 1)
    return invalid_argument("--kv-scale-granularity takes one granularity here (got '" + o.kv_scale_granularity +
                            "'); run once per granularity");
  return g;
}

Result<QuantSpec> to_geometry(const CacheCliOptions& o) {
  QuantOptions qo;
  qo.kv_cache_dtype = "bf16";
  qo.block_size = o.block_size;
  qo.sink_tokens = o.sink_tokens;
  return parse_quant_spec(qo);
}

}  // namespace kvq::tools
