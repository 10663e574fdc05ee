// CPU reference decode per storage format on a mid-size shape (Llama-3-8B-like attention:
// Hkv 8, Hq 32, D 128; 4 sequences of 2048 tokens, block 16, no sink).
//   kvq_bench_cpu --benchmark_filter=CpuDecode --benchmark_out=cpu.json --benchmark_out_format=json
#include <benchmark/benchmark.h>

#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "kvq/attention/bind.h"
#include "kvq/attention/cpu.h"
#include "kvq/attention/synthetic.h"
#include "kvq/cache/layout.h"

namespace {

using namespace kvq;

constexpr int kHkv = 8, kHq = 32, kD = 128, kSeqs = 4, kLen = 2048;

struct Fixture {
  attention::SyntheticCache sc;
  cache::PagedKvCache::BatchTables tables;
  std::vector<float> q, out;
};

// Built once per format and granularity: filling the cache costs more than many decode calls.
Fixture* fixture(Format f, ScaleGranularity g) {
  static std::map<std::pair<int, int>, std::unique_ptr<Fixture>> cache;
  auto& slot = cache[{static_cast<int>(f), static_cast<int>(g)}];
  if (slot) return slot.get();
  attention::SyntheticCacheOptions o;
  o.spec.format = f;
  o.spec.granularity = g;
  o.spec.block_size = 16;
  o.spec.sink_tokens = 0;
  o.kv.num_kv_heads = kHkv;
  o.kv.head_dim = kD;
  o.seq_lens.assign(kSeqs, kLen);
  o.seed = 1;
  o.max_chunk = 256;
  auto built = attention::build_synthetic_cache(o);
  if (!built.is_ok()) return nullptr;
  auto fx = std::make_unique<Fixture>();
  fx->sc = std::move(built).value();
  fx->tables = fx->sc.cache->batch_tables(fx->sc.seqs);
  fx->q.resize(static_cast<size_t>(kSeqs) * kHq * kD);
  fx->out.resize(fx->q.size());
  std::mt19937_64 rng(2);
  attention::sample_queries(fx->sc.profiles[0], kHq, kSeqs, 1.f / std::sqrt(float{kD}), 2.f, rng, fx->q.data());
  slot = std::move(fx);
  return slot.get();
}

void CpuDecode(benchmark::State& state, Format f, ScaleGranularity g) {
  Fixture* fx = fixture(f, g);
  if (fx == nullptr) {
    state.SkipWithError("could not build the synthetic cache");
    return;
  }
  const attention::DecodeArgs args = attention::bind_decode(*fx->sc.cache, 0, fx->tables, fx->q.data(),
                                                            fx->out.data(), kHq, 1.f / std::sqrt(float{kD}));
  for (auto _ : state) {
    const Status st = attention::cpu::decode(args);
    if (!st.is_ok()) {
      state.SkipWithError(st.message().c_str());
      return;
    }
    benchmark::DoNotOptimize(fx->out.data());
    benchmark::ClobberMemory();
  }
  QuantSpec spec;
  spec.format = f;
  spec.granularity = g;
  spec.block_size = 16;
  const double tokens = static_cast<double>(kSeqs) * kLen;
  state.counters["kv_tokens/s"] = benchmark::Counter(tokens, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["cache_bytes/s"] = benchmark::Counter(
      tokens * static_cast<double>(cache::bytes_per_token(spec, 1, kHkv, kD)), benchmark::Counter::kIsIterationInvariantRate,
      benchmark::Counter::kIs1024);
}

BENCHMARK_CAPTURE(CpuDecode, bf16, Format::kBf16, ScaleGranularity::kPerTokenHead)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(CpuDecode, fp8_e4m3_per_token_head, Format::kFp8E4m3, ScaleGranularity::kPerTokenHead)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(CpuDecode, fp8_e4m3_fnuz_per_token_head, Format::kFp8E4m3Fnuz, ScaleGranularity::kPerTokenHead)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(CpuDecode, int8_per_token_head, Format::kInt8, ScaleGranularity::kPerTokenHead)
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(CpuDecode, int8_per_block_head, Format::kInt8, ScaleGranularity::kPerBlockHead)
    ->Unit(benchmark::kMillisecond);

}  // namespace
