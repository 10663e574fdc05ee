// Batched decode of a real model through the backend seam (not a timed test): `batch` sequences
// are prefilled to `ctx` tokens, then decoded greedily together, one token each per step, for every
// cache spec. A step is Engine::forward_sample (the whole model, a CUDA graph on the cuda backend,
// sampling on the backend, the ids back on the host), so its wall time is the step latency.
// Reports the median step time after warm-up, tokens/s and each spec's step time relative to bf16.
//
//   kvq_engine_bench [--model smollm2] [--backend cuda] [--batch 64] [--ctx 8192] [--steps 32]
//                    [--specs bf16,fp8,int8,fp8_fnuz,fp8:per_block_head,fp8:b32] [--sink 256] [--json FILE]
// Builds in every configuration (seam only); on the cpu backend use small shapes.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "kvq/backend/backend.h"
#include "kvq/eval/specs.h"
#include "kvq/model/engine.h"
#include "kvq/model/model.h"

namespace {

using namespace kvq;

struct Opts {
  std::string model = "smollm2", backend = "cuda", specs = "bf16,fp8,int8", json;
  int batch = 64, ctx = 8192, steps = 32, warmup = 4, sink = 256;
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Row {
  std::string spec;
  int block_size = 16;
  bool bf16 = false;
  double prefill_s = 0, step_ms_median = 0, step_ms_min = 0, step_ms_max = 0, tokens_per_s = 0, ratio = 0;
  double ratio_same_block = 0;  // vs the bf16 row of the same block size, when the run has one
};

int run(const Opts& o) {
  auto kind = backend::resolve_backend(o.backend);
  if (!kind.is_ok()) return std::fprintf(stderr, "--backend: %s\n", kind.status().to_string().c_str()), 2;
  auto be = backend::create_backend(kind.value());
  if (!be.is_ok()) return std::fprintf(stderr, "backend: %s\n", be.status().to_string().c_str()), 2;
  auto path = model::resolve_model_path(o.model);
  if (!path.is_ok()) return std::fprintf(stderr, "--model: %s\n", path.status().to_string().c_str()), 2;
  auto m = model::Model::load(path.value());
  if (!m.is_ok()) return std::fprintf(stderr, "load: %s\n", m.status().to_string().c_str()), 2;
  const model::Model& model = *m.value();
  const int V = model.config().vocab_size;
  std::printf("engine %s | model %s | batch %d, context up to %d, %d timed steps after %d warm-up\n",
              be.value()->describe().c_str(), model.config().name.c_str(), o.batch, o.ctx, o.steps, o.warmup);
  // Prompt tokens: a fixed pseudo-random walk over the vocabulary (the speed does not depend on them).
  std::vector<int32_t> prompt(static_cast<size_t>(o.ctx));
  uint64_t x = 88172645463325252ull;
  for (auto& t : prompt) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    t = static_cast<int32_t>(3 + x % static_cast<uint64_t>(V - 3));
  }
  std::vector<Row> rows;
  // The specs as `kvq eval --kv-cache-dtype` spells them (one parser: eval/specs.h), e.g. fp8:b32.
  eval::SpecListOptions so;
  so.kv_cache_dtypes = o.specs;
  so.sink_tokens = o.sink;
  so.distinct_block_sizes = true;  // bf16:b32 is its own row here
  auto requests = eval::parse_spec_list(so);
  if (!requests.is_ok()) return std::fprintf(stderr, "--specs: %s\n", requests.status().to_string().c_str()), 2;
  for (const eval::SpecRequest& req : requests.value()) {
    if (req.is_auto) return std::fprintf(stderr, "--specs: name a dtype, not auto\n"), 2;
    const std::string name = req.label;
    QuantSpec spec = req.spec;
    // The bf16 cache is the baseline: no separate sink, as in `kvq eval`.
    if (spec.format == Format::kBf16) spec.sink_tokens = 0;
    model::EngineOptions eo;
    eo.max_seqs = o.batch;
    // The last timed step runs at context `ctx` (capped by the model's context length).
    const int ctx = std::min(model.config().max_seq_len, o.ctx);
    const int prefill = ctx - o.steps - o.warmup;
    if (prefill < 1) return std::fprintf(stderr, "--ctx must exceed --steps + --warmup\n"), 2;
    eo.max_tokens = ctx;
    eo.chunk_tokens = 256;
    eo.max_step_tokens = 4096;
    auto e = model::Engine::create(model, spec, *be.value(), eo);
    if (!e.is_ok()) return std::fprintf(stderr, "%s: %s\n", name.c_str(), e.status().to_string().c_str()), 1;
    model::Engine& eng = *e.value();
    std::vector<cache::SeqId> seqs;
    std::vector<model::SeqStep> steps;
    for (int i = 0; i < o.batch; ++i) {
      auto s = eng.add_sequence();
      if (!s.is_ok()) return std::fprintf(stderr, "%s\n", s.status().to_string().c_str()), 1;
      seqs.push_back(s.value());
      steps.push_back({s.value(), prompt.data(), prefill, model::LogitsMode::kNone, nullptr});
    }
    Row r;
    r.spec = name;
    r.block_size = spec.block_size;
    r.bf16 = spec.format == Format::kBf16;
    double t0 = now_s();
    Status st = eng.forward(steps);
    if (st.is_ok()) st = be.value()->synchronize();
    if (!st.is_ok()) return std::fprintf(stderr, "%s prefill: %s\n", name.c_str(), st.to_string().c_str()), 1;
    r.prefill_s = now_s() - t0;
    // Greedy decode: contexts prefill + 1 .. ctx.
    std::vector<int32_t> cur(static_cast<size_t>(o.batch), prompt[static_cast<size_t>(prefill)]), next(cur.size());
    const std::vector<model::SampleParams> greedy(static_cast<size_t>(o.batch));
    std::vector<double> ms;
    for (int t = 0; t < o.warmup + o.steps; ++t) {
      for (int i = 0; i < o.batch; ++i) steps[i] = {seqs[i], &cur[i], 1, model::LogitsMode::kNone, nullptr};
      t0 = now_s();
      st = eng.forward_sample(steps, greedy, next.data());
      if (!st.is_ok()) return std::fprintf(stderr, "%s decode: %s\n", name.c_str(), st.to_string().c_str()), 1;
      const double dt = (now_s() - t0) * 1e3;
      if (t >= o.warmup) ms.push_back(dt);
      cur = next;
    }
    std::sort(ms.begin(), ms.end());
    r.step_ms_median = ms[ms.size() / 2];
    r.step_ms_min = ms.front();
    r.step_ms_max = ms.back();
    r.tokens_per_s = o.batch / (r.step_ms_median * 1e-3);
    rows.push_back(r);
    std::printf("  %-22s prefill %7.2f s   step median %8.3f ms (min %.3f, max %.3f)   %9.0f tokens/s\n", name.c_str(),
                r.prefill_s, r.step_ms_median, r.step_ms_min, r.step_ms_max, r.tokens_per_s);
    std::fflush(stdout);
  }
  double base = 0;
  std::map<int, double> base_by_block;
  for (const Row& r : rows) {
    if (r.spec == "bf16") base = r.step_ms_median;
    if (r.bf16 && !base_by_block.count(r.block_size)) base_by_block[r.block_size] = r.step_ms_median;
  }
  std::printf("\n| spec | block | step ms (median) | tokens/s | step time vs bf16 | vs bf16, same block |\n"
              "|---|---|---|---|---|---|\n");
  for (Row& r : rows) {
    r.ratio = base > 0 ? r.step_ms_median / base : 0;
    auto same = base_by_block.find(r.block_size);
    r.ratio_same_block = same != base_by_block.end() ? r.step_ms_median / same->second : 0;
    char same_text[32] = "-";
    if (same != base_by_block.end()) std::snprintf(same_text, sizeof same_text, "%.3f", r.ratio_same_block);
    std::printf("| %s | %d | %.3f | %.0f | %.3f | %s |\n", r.spec.c_str(), r.block_size, r.step_ms_median,
                r.tokens_per_s, r.ratio, same_text);
  }
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << "{\n  \"engine\": \"" << be.value()->describe() << "\",\n  \"model\": \"" << model.config().name
      << "\",\n  \"batch\": " << o.batch << ",\n  \"ctx\": " << o.ctx << ",\n  \"steps\": " << o.steps
      << ",\n  \"warmup\": " << o.warmup << ",\n  \"sink_tokens\": " << o.sink << ",\n  \"rows\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      f << "    {\"spec\": \"" << r.spec << "\", \"prefill_s\": " << r.prefill_s << ", \"step_ms_median\": "
        << r.step_ms_median << ", \"step_ms_min\": " << r.step_ms_min << ", \"step_ms_max\": " << r.step_ms_max
        << ", \"tokens_per_s\": " << r.tokens_per_s << ", \"step_vs_bf16\": " << r.ratio << ", \"block_size\": " << r.block_size
        << ", \"step_vs_bf16_same_block\": " << r.ratio_same_block << "}"
        << (i + 1 < rows.size() ? ",\n" : "\n");
    }
    f << "  ]\n}\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Opts o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--model") o.model = val();
    else if (a == "--backend") o.backend = val();
    else if (a == "--specs") o.specs = val();
    else if (a == "--json") o.json = val();
    else if (a == "--batch") o.batch = std::atoi(val().c_str());
    else if (a == "--ctx") o.ctx = std::atoi(val().c_str());
    else if (a == "--steps") o.steps = std::atoi(val().c_str());
    else if (a == "--warmup") o.warmup = std::atoi(val().c_str());
    else if (a == "--sink") o.sink = std::atoi(val().c_str());
    else {
      std::fprintf(stderr, "unknown argument %s (see the header of bench/engine_decode.cpp)\n", a.c_str());
      return 2;
    }
  }
  if (o.batch < 1 || o.ctx < 2 || o.steps < 1 || o.warmup < 3) {
    std::fprintf(stderr, "need --batch >= 1, --ctx >= 2, --steps >= 1, --warmup >= 3 (eager, capture, replay)\n");
    return 2;
  }
  return run(o);
}
